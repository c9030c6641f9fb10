#!/usr/bin/env bash
# One 10-minute device command that measures what a session's tune left in benchmarks/table.json,
# most important first, each step bounded so that a slow one never costs the rest:
#   1. KernelBench's harness on the exported ModelNew (grad mode on, as the harness calls it)
#   2. the dispatch's per-call overhead (tests/device/hot_path.py)
#   3. forward benches against torch.compile (COMPILE_MODES, default: default) for UNITS_FWD
#   4. the forward+backward bench for UNITS_GRAD
# Results in $OUT/benchmarks (copy to benchmarks/, then `autofuse bench --from-out`).
#   bash tests/device/last_pass.sh [precisions...]       (default: fp32 tf32 bf16)
set -uo pipefail
OUT=${OUT:-gpu-out}; export OUT PYTHONUNBUFFERED=1 AUTOFUSE_HOME=${AUTOFUSE_HOME:-/tmp/autofuse-home}
PRECISIONS=${*:-fp32 tf32 bf16}
UNITS_FWD=${UNITS_FWD:-22 99}; UNITS_GRAD=${UNITS_GRAD:-22}; GRAD_PRECISIONS=${GRAD_PRECISIONS:-tf32}
HARNESS_PRECISIONS=${HARNESS_PRECISIONS:-fp32}
export BENCH_SKIP=${BENCH_SKIP:-cuda_naive,cuda_tiled,cuda_templated} COMPILE_MODES=${COMPILE_MODES:-default} TABLE=${TABLE:-benchmarks/table.json} ROUNDS=${ROUNDS:-5}
step() { local limit=$1; shift; timeout "$limit" "$@" || echo "(step ended with status $?: $*)"; }
mkdir -p "$OUT/benchmarks"
for p in $HARNESS_PRECISIONS; do
    STEPS=harness UNITS="51 99 22 bn-train" step 130 bash tests/device/benchmarks.sh "$p"
done
step 40 python3 tests/device/hot_path.py --json "$OUT/benchmarks/hot_path.json" | tail -12
for p in $PRECISIONS; do STEPS=bench UNITS="$UNITS_FWD" step 105 bash tests/device/benchmarks.sh "$p"; done
for p in $GRAD_PRECISIONS; do STEPS=grad UNITS="$UNITS_GRAD" step 75 bash tests/device/benchmarks.sh "$p"; done
