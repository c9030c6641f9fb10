#!/usr/bin/env bash
# How long a tune takes from an empty $AUTOFUSE_HOME (no shipped table, no earlier study), and
# whether the quick budget's winners match the long search's:
#   bash benchmarks/gpu/tuning_time.sh [key99] [gemm_bn] [untabled] [bf16-22] [bf16-99] [bf16-gemm_bn]
#   key99     kb2-99 fp32 at its default shape: wall time, first provisional entry, winners
#   bf16-22, bf16-99  kb2-22 / kb2-99 of a bfloat16 model (--dtype bfloat16 --precision bf16)
#   bf16-gemm_bn      gemm_bn train at batch 1024, bfloat16 model
#   gemm_bn   autofuse tune gemm_bn: every default shape, train (forward and autograd entries)
#   untabled  kb2-99 fp32 at in/out 6144 (in no table), --budget quick then --budget full
#   untabled-quick  the same, --budget quick only
# Each part prints autofuse tune's own summary (wall time per key, first entry, winners) and where
# each phase's seconds went (python -m autofuse.tuning.timeline). Logs,
# tables and each tune's timeline ($AUTOFUSE_TIMELINE: every phase, worker call and pool wait, with
# its seconds) go under $OUT (or ./tuning-time-out). The search's length varies with its seed:
# compare two trees with one seed, e.g. SEED=7 (passed as --seed). Every tune is cold: its own
# empty $AUTOFUSE_HOME, Triton cache and inductor cache (a warm Triton cache hid 5-10 s of
# compiles a key, H100).
set -uo pipefail
OUT=${OUT:-tuning-time-out}; mkdir -p "$OUT"
parts=("$@"); [[ ${#parts[@]} -gt 0 ]] || parts=(key99 gemm_bn untabled)
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee "$OUT/device.txt"

tune() {  # NAME ARGS...: a tune in a fresh $AUTOFUSE_HOME, its summary and wall time
    local name=$1; shift
    export AUTOFUSE_HOME="$OUT/home-$name"; rm -rf "$AUTOFUSE_HOME"
    export TRITON_HOME="$OUT/triton-$name" TORCHINDUCTOR_CACHE_DIR="$OUT/inductor-$name"
    rm -rf "$TRITON_HOME" "$TORCHINDUCTOR_CACHE_DIR"; unset TRITON_CACHE_DIR
    [[ -n ${SEED:-} ]] && set -- "$@" --seed "$SEED"
    local start=$SECONDS
    AUTOFUSE_TIMELINE="$OUT/$name.timeline" autofuse tune "$@" --no-progress > "$OUT/$name.txt" 2>&1
    echo "== $name: autofuse tune $* ($((SECONDS - start)) s wall, process start included)"
    grep -E "^(winner|autograd winner|tuned in)" "$OUT/$name.txt"
    python3 -m autofuse.tuning.timeline "$OUT/$name.timeline"  # where each phase's seconds went
}
for part in "${parts[@]}"; do
    case $part in
        key99) tune key99 kb2-99 --precision fp32 ;;
        gemm_bn) tune gemm_bn gemm_bn ;;
        bf16-22|bf16-99) tune "$part" "kb2-${part#bf16-}" --dtype bfloat16 --precision bf16 ;;
        bf16-gemm_bn) tune "$part" gemm_bn --shape batch_size=1024,in_features=8192,out_features=8192 \
                          --mode train --dtype bfloat16 --precision bf16 ;;
        untabled|untabled-quick)
            shape=batch_size=1024,in_features=6144,out_features=6144
            tune untabled-quick kb2-99 --precision fp32 --shape $shape
            [[ $part == untabled ]] && tune untabled-full kb2-99 --precision fp32 --shape $shape --budget full ;;
        *) echo "unknown part $part" >&2; exit 2 ;;
    esac
done
