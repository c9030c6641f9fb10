"""Build every CUDA extension a dispatch table names, all at once (nvcc is one core per build), so
the benchmarks that follow time kernels, not compilers.

    python3 tests/device/prebuild.py benchmarks/table.json [--problems a,b]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys

from autofuse.serve.table import DispatchKey, DispatchTable


def build(job) -> str:
    from autofuse.core import registry
    from autofuse.kernels.cuda_variant import CudaVariant

    problem, name, precision, params = job
    cls = registry.get_variant(problem, name)
    if not issubclass(cls, CudaVariant):
        return f"{problem}/{name}: not a CUDA extension"
    cls(precision, **params).build("cuda")
    return f"{problem}/{name} {params}: built"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("table")
    ap.add_argument("--problems")
    args = ap.parse_args()
    wanted = set(args.problems.split(",")) if args.problems else None
    jobs = {}
    for _, problem, _, dkey, entry in DispatchTable(args.table).entries():
        if "variant" in entry and (wanted is None or problem in wanted):
            job = (problem, entry["variant"], DispatchKey.from_str(dkey).precision, entry.get("params", {}))
            jobs[json.dumps(job, sort_keys=True)] = job
    with concurrent.futures.ProcessPoolExecutor(max_workers=16) as pool:
        for done in pool.map(build, jobs.values()):
            print(done, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
