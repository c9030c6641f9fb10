#!/usr/bin/env bash
# 51 (gemm_avgpool_gelu_residual) on the GPU after a change to its kernels or backward, in one
# bounded command: the backward probe (blocks, step, profile), its gpu-marked tests, a retune of
# its three precisions (the row variants: torch.compile runs the whole GEMM and is ~100x slower
# here), and one bench of forward and training step against eager and both torch.compile modes.
#   OUT=... bash tests/device/check_51.sh [precisions]    # default "fp32 tf32 bf16"; bench at the first
# Logs and reports (benchmarks.tgz) under $OUT; the table it updated is $OUT/table.json (from benchmarks/table.json).
set -uo pipefail
out=${OUT:-check-51-out}; mkdir -p "$out/benchmarks"
export AUTOFUSE_HOME=${AUTOFUSE_HOME:-/tmp/autofuse-home} PYTHONUNBUFFERED=1
precisions=${*:-fp32 tf32 bf16}
cp benchmarks/table.json "$out/table.json"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/device.txt"
echo "== probe"; timeout 240 python3 tests/device/probe_51_backward.py > "$out/probe-51-backward.jsonl" 2>&1
grep -E '"(floor|best|step|torch formulas|step speedup over eager|step kernels \(ms per step\))"' "$out/probe-51-backward.jsonl" | cut -c1-400
echo "== gpu tests"
mapfile -t nodes < <(python3 -m pytest -m gpu tests/ --collect-only -q -p no:cacheprovider | grep '::' | grep avgpool)
timeout 240 bash tests/device/pytest_parallel.sh "$out/gpu-tests.log" "${nodes[@]}" | cut -c1-170
for precision in $precisions; do
    echo "== tune $precision"
    timeout 150 autofuse tune gemm_avgpool_gelu_residual --precision "$precision" --variants single_pass,simplified,cuda_tiled \
        --trials 4 --table "$out/table.json" --no-progress 2>&1 | tee -a "$out/tune.log" | grep -E "^(winner|autograd winner|no variant)"
done
first=${precisions%% *}
echo "== bench $first"
timeout 240 autofuse bench gemm_avgpool_gelu_residual --precision "$first" --step both --table "$out/table.json" \
    --out "$out/benchmarks" --rounds 10 --skip-variants cuda_naive 2>&1 | tee "$out/bench.log" | grep -vE "^(autofuse: |  warnings.warn|$|-|E1)" | tail -40
tar -C "$out" -czf "$out/benchmarks.tgz" benchmarks && rm -r "$out/benchmarks"  # the device returns a bounded number of files
