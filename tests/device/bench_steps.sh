#!/usr/bin/env bash
# Training-step tables (forward+backward) of the GEMM-bound problems at tf32 and bf16, for issue
# 13's target (a step ≥ 1.10x faster than torch.compile at the same precision):
#   bash tests/device/bench_steps.sh [precisions]    # default "tf32 bf16"
# The table's CUDA extensions are built first, all at once; the SIMT CUDA variants (far from the
# floor at these shapes) and `compiled` (its own compiles) are left out; torch.compile default
# is the row compared with. Each bench is bounded (STEP_TIMEOUT seconds, default 85), so one
# slow compile costs its own row, not the session. Reports: $OUT/bench (JSON and PNG).
set -uo pipefail
out=${OUT:-bench-out}/bench
mkdir -p "$out"
python3 tests/device/prebuild.py benchmarks/table.json
skip=cuda_naive,cuda_tiled,cuda_templated,compiled
for precision in ${1:-tf32 bf16}; do
    for args in "matmul_clamp_lse_mish" "matmul_gelu_softmax" \
                "gemm_bn --mode train --shape batch_size=1024,in_features=8192,out_features=8192"; do
        echo "== autofuse bench $args --precision $precision --step backward"
        # shellcheck disable=SC2086 # $args holds several arguments
        timeout "${STEP_TIMEOUT:-85}" autofuse bench $args --precision "$precision" --step backward \
            --compile-modes default --skip-variants "$skip" --table benchmarks/table.json --out "$out" \
            --rounds 10 2>&1 | grep -v "^$" | tail -n 16
    done
done
