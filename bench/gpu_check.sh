#!/usr/bin/env bash
# One prepared GPU check, run from anywhere in the repository on a machine with one CUDA GPU:
#   1. kernel tests natively (pytest tests/kernels)
#   2. `kvmesh bench transfer --json` (skipped in a dry run)
#   3. bench/gpu_check.py: copy bandwidth, paged decode sweep, KV write timing
# Prints a summary table; with $OUT set, writes $OUT/gpu_check.json (+ pytest and transfer logs).
# Usage: bench/gpu_check.sh [--dry-run]   (--dry-run: CPU, TRITON_INTERPRET=1, tiny shapes)
set -euo pipefail
cd "$(dirname "$0")/.."

dry=""
if [ "${1:-}" = "--dry-run" ]; then dry="--dry-run"; fi
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"

# Interpreter: the project venv, else a system python that has torch and triton, else a new venv.
if [ -x .venv/bin/python ]; then
    py=.venv/bin/python
elif python3 -c "import torch, triton, pytest" >/dev/null 2>&1; then
    py=python3
    export PYTHONPATH=".:kernels${PYTHONPATH:+:$PYTHONPATH}"
else
    python3 -m venv .venv
    .venv/bin/pip install -q -e '.[dev]'
    py=.venv/bin/python
fi
"$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.cuda.is_available())"

if [ -n "$dry" ]; then
    export TRITON_INTERPRET=1
    pytest_args=(tests/kernels/test_triton_cache_ops.py)
else
    unset TRITON_INTERPRET
    pytest_args=(tests/kernels tests/kv_transfer/test_kvt_cuda_ipc.py)
fi

echo "== kernel tests"
set +e
timeout 240 "$py" -m pytest "${pytest_args[@]}" -q -p no:cacheprovider 2>&1 | tee "$out/pytest.txt"
pytest_rc=${PIPESTATUS[0]}
set -e

echo "== transfer benchmark"
transfer_json="$out/transfer.json"
: >"$transfer_json"
if [ -z "$dry" ] && "$py" -m kvmesh.cli.main bench transfer --help >/dev/null 2>&1; then
    timeout 120 "$py" -m kvmesh.cli.main bench transfer --json >"$transfer_json" \
        || echo "transfer benchmark failed (rc $?)"
else
    echo "skipped (dry run or no 'kvmesh bench transfer')"
fi

echo "== kernel timings"
timeout 300 "$py" bench/gpu_check.py $dry --json "$out/gpu_check.json" \
    --transfer-json "$transfer_json" --pytest-rc "$pytest_rc"
echo "results: $out/gpu_check.json"
exit "$pytest_rc"
