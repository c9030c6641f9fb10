#!/usr/bin/env bash
# One GPU session's checks, run on the device machine from the repository root:
#   bash tests/device/gpu_session.sh [pytest|tune-fast|tune-bn|all]
# Writes logs and the dispatch table under $OUT (or ./gpu-out).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export AUTOFUSE_HOME="$OUT/home" PYTHONUNBUFFERED=1
what=${1:-all}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$OUT/device.txt"
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())" | tee -a "$OUT/device.txt"

if [[ $what == pytest || $what == all ]]; then
    python3 -m pytest -q -m gpu tests/ -p no:cacheprovider 2>&1 | tee "$OUT/pytest_gpu.log" | tail -n 15
fi
tune() { echo "== autofuse tune $*"; autofuse tune "$@" --no-progress 2>&1 | tee -a "$OUT/tune.log" | grep -v "^$"; }
if [[ $what == tune-fast || $what == all ]]; then
    tune gemm_avgpool_gelu_residual
    tune matmul_gelu_softmax
    tune matmul_clamp_lse_mish
fi
if [[ $what == tune-bn || $what == all ]]; then
    tune gemm_bn --mode train
    tune gemm_bn --mode eval
fi
autofuse show > "$OUT/show.txt" 2>&1; cp "$AUTOFUSE_HOME/table.json" "$OUT/" 2>/dev/null
true
