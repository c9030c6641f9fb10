#!/usr/bin/env bash
# BENCHMARKS.md on a GPU: at each precision, tune every problem at its default shapes (both
# BatchNorm modes; the forward and the autograd entry), bench the forward and the training step
# side by side, run KernelBench's harness on the exported ModelNew, then render one report.
#
#   bash benchmarks/gpu/benchmarks.sh [ieee] [fp32] [tf32] [bf16]       (default: all four)
#   autofuse bench --from-out --out benchmarks --markdown BENCHMARKS.md
#
# STEPS (default "tune bench grad harness") and UNITS (default "51 99 22 bn-train bn-eval") pick
# a slice, so that each lent-GPU command stays under its 10 minutes; e.g.
#   STEPS=tune UNITS="99 22" bash benchmarks/gpu/benchmarks.sh tf32 bf16
#   STEPS="bench grad" TABLE=benchmarks/table.json UNITS="99 22" bash benchmarks/gpu/benchmarks.sh tf32 bf16
#   STEPS=harness TABLE=benchmarks/table.json bash benchmarks/gpu/benchmarks.sh fp32 bf16
# Steps: tune (forward and autograd entries), bench (forward table), grad (forward+backward
# table), harness (benchmarks/gpu/kernelbench_harness.py on 51, 99, 22 and bn-train's 39),
# sweep (the batch sweep at BATCHES with wall times per call; not in the default STEPS).
# DTYPE=bfloat16 (with precision bf16) tunes and benches a bfloat16 model (model.bfloat16()),
# whose reports and sections keep apart from the float32 model's, e.g.
#   DTYPE=bfloat16 STEPS="tune bench grad sweep" bash benchmarks/gpu/benchmarks.sh bf16
# Everything lands in $OUT/benchmarks (the table it used and updated, reports, charts, logs,
# the harness's JSON and ModelNew files). Copy the table, reports and charts (*.json, *.png) and
# harness/ to benchmarks/ (the logs stay out of git) and pass TABLE=benchmarks/table.json to the
# next command, so a bench-only command never tunes again; BENCHMARKS.md's "Reproduce" section
# has the commands.
#
# Device time (H100 estimates, not yet measured with these defaults): a tune of one unit at one
# precision ~30-60 s; its forward bench ~30 s without torch.compile, plus ~20-40 s per compile
# mode cold (max-autotune autotunes the GEMM: the slowest); the grad bench about the same; the
# harness ~15 s per problem and precision. COMPILE_MODES=default halves the compile cost,
# BENCH_FLAGS=--no-compile removes it (the summary then says "not compared with torch.compile").
#
# GEMM-bound problems are tuned over eager, simplified, cublas_epilogue and triton
# (GEMM_VARIANTS; a variant a precision does not admit, such as triton's 3xTF32 under ieee, is
# passed over; keys whose entry `compiled` holds must be retuned with compiled added, or the tune
# replaces it with its own slower winner, and says so) and the bench leaves out cuda_naive and
# cuda_tiled (BENCH_SKIP): they ran 7.5-450x the floor at these
# shapes (20-600 ms a call on an H100). ieee is tuned with TRIALS_IEEE trials:
# its variants are the float32-FMA ones that fp32 also tunes.
#
# On a CPU, to check the script itself (~1 minute a unit): DEVICE=cpu SMALL=1 TRIALS=2 ROUNDS=1
# BENCH_FLAGS=--no-compile bash benchmarks/gpu/benchmarks.sh fp32 (SMALL: the harness's --small sizes).
set -uo pipefail
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
PRECISIONS=${*:-ieee fp32 tf32 bf16}
TRIALS=${TRIALS:-10}; TRIALS_IEEE=${TRIALS_IEEE:-4}; ROUNDS=${ROUNDS:-5}
STEPS=${STEPS:-tune bench grad harness}; UNITS=${UNITS:-51 99 22 bn-train bn-eval}
GEMM_VARIANTS=${GEMM_VARIANTS:-eager,simplified,cublas_epilogue,triton}
VARIANTS_51=${VARIANTS_51:-}  # 51's tune: every variant unless named here
BENCH_SKIP=${BENCH_SKIP:-cuda_naive,cuda_tiled}; BENCH_SKIP_51=${BENCH_SKIP_51:-}
COMPILE_MODES=${COMPILE_MODES:-default,max-autotune-no-cudagraphs}
BENCH_FLAGS=${BENCH_FLAGS:-}  # e.g. --no-compile where the device time is short
HARNESS_FLAGS=${HARNESS_FLAGS:-}  # e.g. --trials 10
DEVICE=${DEVICE:-cuda}; SMALL=${SMALL:-}; DTYPE=${DTYPE:-float32}
BATCHES=${BATCHES:-1,8,32,37,100,512,1023,1025,2048}; SWEEP_FLAGS=${SWEEP_FLAGS:---wall}
at=(--device "$DEVICE" --dtype "$DTYPE" ${SMALL:+--shape batch_size=16,in_features=32,out_features=24})
# Outside $OUT: the CUDA build cache and studies stay on the machine between commands, not shipped back.
export AUTOFUSE_HOME=${AUTOFUSE_HOME:-/tmp/autofuse-home} PYTHONUNBUFFERED=1
work=$OUT/benchmarks; mkdir -p "$work"
table=$work/table.json
if [ -n "${TABLE:-}" ] && [ "$TABLE" != "$table" ]; then cp "$TABLE" "$table" || exit 1; fi
[ "$DEVICE" = cpu ] || nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv | tee -a "$work/device.txt"
args_of() {  # the problem (and mode) of a unit
    case $1 in
        51) echo gemm_avgpool_gelu_residual ;; 99) echo matmul_gelu_softmax ;; 22) echo matmul_clamp_lse_mish ;;
        bn-train) echo gemm_bn --mode train ;; bn-eval) echo gemm_bn --mode eval ;;
        *) echo "unknown unit $1" >&2; return 1 ;;
    esac
}
tune() {
    local variants=(--variants "$GEMM_VARIANTS") trials=$TRIALS
    [ "$1" = 51 ] && variants=(${VARIANTS_51:+--variants "$VARIANTS_51"})
    [ "$2" = ieee ] && trials=$TRIALS_IEEE
    autofuse tune $(args_of "$1") "${at[@]}" --precision "$2" "${variants[@]}" --trials "$trials" --table "$table" \
        --no-progress 2>&1 | tee -a "$work/tune.log" | grep -E "^(winner|autograd winner|no variant|.* on cuda|autofuse: .* replaced by)"
}
bench_step() {  # $1: forward or backward
    local skip=$BENCH_SKIP; [ "$2" = 51 ] && skip=$BENCH_SKIP_51
    autofuse bench $(args_of "$2") "${at[@]}" --precision "$3" --step "$1" --table "$table" --out "$work" --rounds "$ROUNDS" \
        --compile-modes "$COMPILE_MODES" ${skip:+--skip-variants "$skip"} $BENCH_FLAGS 2>&1 \
        | tee -a "$work/bench-$3.log" | grep -vE "^(autofuse: |  warnings.warn|$|-)"
}
sweep() {  # the batch sweep (compiles torch.compile per batch: BENCH_FLAGS=--no-compile leaves that out)
    autofuse bench $(args_of "$1") "${at[@]}" --precision "$2" --batches "$BATCHES" $SWEEP_FLAGS --table "$table" \
        --out "$work" --rounds "$ROUNDS" $BENCH_FLAGS 2>&1 | tee -a "$work/sweep-$2.log" | grep -E "^(\||###)"
}
bench() { bench_step forward "$@"; }
grad() { bench_step backward "$@"; }
harness() {  # once per precision, over the units KernelBench has (a fresh 39 is in train mode)
    local problems=()
    for unit in $UNITS; do
        case $unit in 51|99|22) problems+=("kb2-$unit") ;; bn-train) problems+=(kb2-39) ;; esac
    done
    [ ${#problems[@]} -eq 0 ] && return
    python3 benchmarks/gpu/kernelbench_harness.py --table "$table" --precision "$1" --out "$work/harness" \
        --device "$DEVICE" --dtype "$DTYPE" ${SMALL:+--small} --problems "$(IFS=,; echo "${problems[*]}")" $HARNESS_FLAGS 2>&1 | tee -a "$work/harness-$1.log" | grep -E "^(\||wrote|## )"
}
for precision in $PRECISIONS; do
    for step in $STEPS; do
        echo "== $step $precision"
        if [ "$step" = harness ]; then harness "$precision"; continue; fi
        for unit in $UNITS; do $step "$unit" "$precision"; done
    done
done
