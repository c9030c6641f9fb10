#!/usr/bin/env bash
# BENCHMARKS.md from scratch on a GPU: at each precision, tune every problem at its default
# shapes (both BatchNorm modes), bench them side by side, then render one Markdown report.
#
#   bash tests/device/benchmarks.sh [fp32] [tf32] [bf16]      (default: all three)
#   autofuse bench --from-out --out benchmarks --markdown BENCHMARKS.md
#
# The lent GPU runs 10 minutes a command: there, split the work with STEPS and UNITS, e.g.
#   STEPS=tune bash tests/device/benchmarks.sh fp32 tf32
#   STEPS=bench UNITS="51 99 22" bash tests/device/benchmarks.sh fp32
# (BENCH_FLAGS=--no-compile leaves torch.compile out), keeping $OUT/benchmarks (the table,
# reports, charts and logs) from one command to the next (each command leaves
# $OUT/benchmarks.tgz); then unpack it into benchmarks/, add the
# hand-written benchmarks/analysis.md, and run the second line. Elsewhere the first line does all.
#
# GEMM-bound problems are tuned over eager, simplified and cublas_epilogue (GEMM_VARIANTS):
# the naive, tiled and templated GEMMs run 1.3-56x cuBLAS's time at these shapes and would
# spend minutes of trials; the bench still times each at its default configuration (for the
# templated GEMM that is the exhaustive sweep's best, tests/data/sweep-matmul_gelu_softmax.json).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
TRIALS=${TRIALS:-12}; ROUNDS=${ROUNDS:-10}; STEPS=${STEPS:-tune bench}; UNITS=${UNITS:-51 99 22 bn-train bn-eval}
GEMM_VARIANTS=${GEMM_VARIANTS:-eager,simplified,cublas_epilogue}
BENCH_FLAGS=${BENCH_FLAGS:-}  # e.g. --no-compile where the device time is short
VARIANTS_51=${VARIANTS_51:-}  # 51's tune: every variant unless named here
export AUTOFUSE_HOME=${AUTOFUSE_HOME:-$OUT/home} PYTHONUNBUFFERED=1
work=$OUT/benchmarks; mkdir -p "$work"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee "$work/device.txt"
args_of() {  # the problem (and mode) of a unit
    case $1 in
        51) echo gemm_avgpool_gelu_residual ;; 99) echo matmul_gelu_softmax ;; 22) echo matmul_clamp_lse_mish ;;
        bn-train) echo gemm_bn --mode train ;; bn-eval) echo gemm_bn --mode eval ;;
        *) echo "unknown unit $1" >&2; return 1 ;;
    esac
}
tune() {
    local variants=(--variants "$GEMM_VARIANTS"); [ "$1" = 51 ] && variants=(${VARIANTS_51:+--variants "$VARIANTS_51"})
    autofuse tune $(args_of "$1") --precision "$2" "${variants[@]}" --trials "$TRIALS" --table "$work/table.json" \
        --no-progress --no-autograd-entry 2>&1 | tee -a "$work/tune.log" | grep -E "^(winner|no variant|.* on cuda)"
}
bench() {
    autofuse bench $(args_of "$1") --precision "$2" --table "$work/table.json" --out "$work" --rounds "$ROUNDS" \
        $BENCH_FLAGS 2>&1 | tee -a "$work/bench-$2.log" | grep -E "^(eager|torch.compile|simplified|cublas_epilogue|single_pass|cuda_tiled|cuda_templated|autofuse|floor|cast|[a-z_]+ batch)"
}
for precision in ${@:-fp32 tf32 bf16}; do
    for step in $STEPS; do
        echo "== $step $precision"
        for unit in $UNITS; do $step "$unit" "$precision"; done
    done
done
tar czf "$OUT/benchmarks.tgz" -C "$OUT" benchmarks
