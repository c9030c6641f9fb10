#!/usr/bin/env bash
# GPU tests, one pytest process per argument (a node id or a file), all at once. The GPU tests are
# bound by compilers (Triton, nvcc, Inductor: one CPU core per process), not by the GPU, so they
# take the time of the slowest instead of their sum. Each process's full output (tracebacks
# included) goes to LOG; one summary line per argument to stdout.
#   bash benchmarks/gpu/pytest_parallel.sh LOG tests/test_triton_gpu.py::test_x[a] tests/test_build.py ...
#   bash benchmarks/gpu/pytest_parallel.sh LOG @nodes.txt    # node ids, one per line
#   bash benchmarks/gpu/pytest_parallel.sh LOG all    # every gpu-marked test, one process per test
# At most $JOBS (default 16) at once: each process holds a CUDA context and its compilers.
set -uo pipefail
log=${1:?usage: pytest_parallel.sh LOG NODE...}; shift
if [[ ${1:-} == all ]]; then
    mapfile -t nodes < <(python3 -m pytest -m gpu tests/ --collect-only -q -p no:cacheprovider | grep '::')
elif [[ ${1:-} == @* ]]; then  # @FILE: node ids, one per line
    mapfile -t nodes < "${1#@}"
else
    nodes=("$@")
fi
tmp=$(mktemp -d)
for i in "${!nodes[@]}"; do
    while (( $(jobs -rp | wc -l) >= ${JOBS:-16} )); do wait -n; done
    python3 -m pytest -q -rfE --tb=short -p no:cacheprovider "${nodes[$i]}" > "$tmp/$i.txt" 2>&1 &
done
wait
for i in "${!nodes[@]}"; do
    { echo "===== ${nodes[$i]}"; cat "$tmp/$i.txt"; } >> "$log"
    printf '%-100s %s\n' "${nodes[$i]}" "$(tail -n 1 "$tmp/$i.txt")"
done
