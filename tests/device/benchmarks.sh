#!/usr/bin/env bash
# BENCHMARKS.md from scratch on a GPU: at each precision, tune every problem at its default
# shapes (both BatchNorm modes), bench them side by side, then render one Markdown report.
#
#   bash tests/device/benchmarks.sh [fp32] [tf32] [bf16]      (default: all three)
#   autofuse bench --from-out --out benchmarks --markdown BENCHMARKS.md
#
# The lent GPU runs 10 minutes a command: there, one precision per command, each leaving
# $OUT/benchmarks.tgz (the reports, charts, table and logs); unpack them into one benchmarks/
# folder and run the second line. Elsewhere the first line does everything.
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
TRIALS=${TRIALS:-12}; ROUNDS=${ROUNDS:-10}
export AUTOFUSE_HOME=${AUTOFUSE_HOME:-$OUT/home} PYTHONUNBUFFERED=1
work=$OUT/benchmarks; mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$work/device.txt"
tune() { autofuse tune "$@" --trials "$TRIALS" --table "$work/table.json" --no-progress --no-autograd-entry 2>&1 | tee -a "$work/tune.log" | grep -E "^(winner|no variant|.* on cuda)"; }
for precision in ${@:-fp32 tf32 bf16}; do
    echo "== $precision"
    for problem in gemm_avgpool_gelu_residual matmul_gelu_softmax matmul_clamp_lse_mish; do
        tune "$problem" --precision "$precision"
    done
    tune gemm_bn --mode train --precision "$precision"
    tune gemm_bn --mode eval --precision "$precision"
    autofuse bench --all --precision "$precision" --table "$work/table.json" --out "$work" --rounds "$ROUNDS" \
        2>&1 | tee -a "$work/bench-$precision.log" | grep -E "^(eager|torch.compile|simplified|cublas_epilogue|single_pass|cuda_tiled|cuda_templated|autofuse|floor|[a-z_]+ batch)"
done
tar czf "$OUT/benchmarks.tgz" -C "$OUT" benchmarks
