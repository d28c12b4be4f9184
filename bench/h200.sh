#!/usr/bin/env bash
# The H200 checklist in one device call (device time is scarce: one call, every GPU figure):
#
#   mkdir -p .gpu && cp .venv/lib/python3*/site-packages/pynvml.py .gpu/    # NVML binding for the device
#   run (carry [".gpu"]):  bash bench/h200.sh                               # outputs under $OUT
#
# The GPU tests (worker + kernels), the worker step waterfall (floor, every switch, profile, telemetry
# on/off, the saturation probe's cost, the full model), the kernel bench and the chains' bench, each with
# a time limit so the whole fits one 600 s call; each step's output goes to $OUT/<step>.txt, a failing step is reported
# and the next one runs. Record what it prints in docs/PERFORMANCE.md with the code's commit.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/h200-out}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # never multicast
export PYTHONPATH="$PWD/.gpu:$PWD${PYTHONPATH:+:$PYTHONPATH}"

step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name ($(date -u +%H:%M:%S) UTC, limit ${limit} s): $*"
    timeout "$limit" "$@" >"$OUT/$name.txt" 2>&1
    echo "   rc=$? | $(tail -n 1 "$OUT/$name.txt")"
}

echo "code $(git rev-parse --short HEAD 2>/dev/null || echo '?'); $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null)"
step gputests 170 python3 -m pytest -q -m gpu tests/worker/test_gpu.py tests/kernels/
step waterfall 300 python3 bench/worker_step.py --steps 5 --telemetry-steps 20 --telemetry-rounds 2 --floor-rounds 3 --profile --deadline-s 200
step kernels 80 python3 bench/kernels.py
step chains 50 python3 bench/chains.py
