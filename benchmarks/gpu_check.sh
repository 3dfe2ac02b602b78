#!/usr/bin/env bash
# GPU check of lightning-skrull on one NVIDIA GPU, in under 8 minutes.
#
# Needs only PyTorch (a CUDA build) and this package (installed, or the checkout on PYTHONPATH);
# the flash backend runs flash-attn when it is installed, else PyTorch's own varlen kernel.
# Checks that the flash and SDPA attention backends agree, measures tokens/s of a
# Qwen2.5-0.5B-shaped random model under the skrull and static policies at CP=1, compares peak
# CUDA memory with the fitted per-token memory model, fits peak memory per token with the dense
# loss against the chunked one (the "auto" bucket of each, beside the analytical estimate),
# times one attention layer under autocast(bf16) at an emulated CP=4 with sdpa against the
# backend "auto" picks, and runs a few bf16-mixed steps of SkrullFSDPStrategy on one GPU through
# a Lightning Trainer (peak memory against the analytical model states), tests the fused loss
# kernels against a float64 loss and times them beside the dense and chunked losses at
# Qwen2.5's head, and splits the fixed cost of a small micro-batch into plain HF's host time,
# Skrull's own and the kernels' (also with compiled decoder layers when time is left). Prints
# one summary block and writes JSON to $OUT/gpu_check.json (or benchmarks/out/gpu_check.json,
# or --json PATH), also after each check, so a check that hangs does not lose the ones before it.
#
#   bash benchmarks/gpu_check.sh                     # on a GPU machine
#   bash benchmarks/gpu_check.sh --json /tmp/g.json  # other arguments go to benchmarks.gpu_check
#   bash benchmarks/gpu_check.sh --device cpu --tiny # every code path on CPU, in seconds
#
# The fused loss kernels are tested only when their packages are importable here:
# pip install "lightning-skrull[fused]" (Liger Kernel) and pip install cut-cross-entropy
# beforehand; one that is missing is reported as not installed, not failed.
#
# The Python interpreter is $PYTHON when set (e.g. PYTHON=/path/to/venv/bin/python: no need to
# activate the environment), else python3 from PATH.
#
# Exit status: 0 all checks passed, 1 a check failed, 2 no CUDA device, 124 time limit hit.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"

device=cuda
prev_arg=""
for arg in "$@"; do
    case "$prev_arg${arg}" in
        --devicecpu | --device=cpu) device=cpu ;;
    esac
    prev_arg="$arg"
done

if [ "$device" != cpu ]; then
    if ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
        echo "gpu_check: no CUDA device visible to torch; run on a GPU machine" \
            "(or pass --device cpu --tiny to try the code paths on CPU)" >&2
        exit 2
    fi
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
fi
"$PYTHON" - <<'EOF'
from importlib.metadata import PackageNotFoundError, version

import torch

from lightning_skrull.attention.backends import flash_kernel

try:
    mine = version("lightning-skrull")
except PackageNotFoundError:  # run from a checkout on PYTHONPATH
    mine = "from source"
print("torch", torch.__version__, "| lightning-skrull", mine, "| flash kernel:", flash_kernel())
EOF

# The Python side stops measuring at --budget-s (360 s by default; the throughput loop stops
# early to leave the later checks their share) and reports what ran; the outer limit only
# catches a hang.
exec timeout 470 "$PYTHON" -m benchmarks.gpu_check "$@"
