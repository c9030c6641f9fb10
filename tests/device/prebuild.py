"""Build every CUDA extension a dispatch table names, all at once (nvcc is one core per build), so
the benchmarks that follow time kernels, not compilers.

    python3 tests/device/prebuild.py benchmarks/table.json [--problems a,b]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import sys


def entries(node, path=()):
    """(problem, variant, precision, params) of every entry under ``node``."""
    if isinstance(node, dict) and "variant" in node and "params" in node:
        problem = path[path.index("problems") + 1] if "problems" in path else None
        precision = next((p.split("=")[1] for p in path[-1].split(",") if p.startswith("precision=")), "fp32")
        yield problem, node["variant"], precision, node["params"]
    elif isinstance(node, dict):
        for key, value in node.items():
            yield from entries(value, path + (key,))


def build(job) -> str:
    from autofuse import registry
    from autofuse.cuda_variant import CudaVariant

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
    jobs = {json.dumps(e, sort_keys=True): e for e in entries(json.load(open(args.table)))
            if wanted is None or e[0] in wanted}
    with concurrent.futures.ProcessPoolExecutor(max_workers=16) as pool:
        for job, done in zip(jobs.values(), pool.map(build, jobs.values())):
            print(done, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
