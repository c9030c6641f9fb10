"""Why do small kernels read slower in the tuning worker than in `autofuse bench`? (NOTES.md, open)

    python3 tests/device/worker_timing.py [--precision fp32]

Times 51's candidates at its default shape three ways in one run, each with
``time_interleaved`` and the same rounds: (1) in this process, as `autofuse bench` does;
(2) in the tuning worker's ``retime``, as the final choice does; (3) in this process again,
after the worker ran. Prints median and p20-p80 per candidate and the `_prime` calibration
of each process, so a difference between (1) and (2) that (3) does not share points at the
worker process, and one that (3) shares points at the order or the device's state.
"""

import argparse

import torch

from autofuse.core import registry
from autofuse.core.variant import EagerVariant
from autofuse.tuning import timing
from autofuse.tuning.evaluate import retime
from autofuse.tuning.gate import CheckCase, build_case
from autofuse.tuning.worker import Candidate, Job, Worker

PROBLEM = "gemm_avgpool_gelu_residual"
CANDIDATES = (("simplified", {}), ("cublas_epilogue", {"block": 512}), ("cuda_tiled", {"block": 1024}),
              ("single_pass", {"block": 128, "items": 16, "vec": 4}))


def in_process(job, rounds):
    prob = registry.get_problem(job.problem)
    model, x = build_case(prob, CheckCase(job.shape, "rand", job.seed, False), "cuda", torch.float32, job.mode)
    calls = {"eager-baseline": lambda: EagerVariant(job.precision)(model, x)}
    for name, params in CANDIDATES:
        variant = registry.get_variant(job.problem, name)(job.precision, **params)
        variant.build("cuda")
        calls[Candidate(name, params).label()] = lambda v=variant: v(model, x)
    with torch.no_grad():
        return timing.time_interleaved(calls, "cuda", rounds=rounds)


def show(title, timings):
    print(f"== {title}")
    for label, t in timings.items():
        print(f"  {label:55s} {t.median_ms:.4f} [{t.p20_ms:.4f}-{t.p80_ms:.4f}] n={t.reps}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", default="fp32")
    ap.add_argument("--rounds", type=int, default=50)
    args = ap.parse_args()
    shape = dict(registry.get_problem(PROBLEM).default_shapes[0])
    job = Job(PROBLEM, shape, "cuda", "float32", args.precision, "any", seed=0)
    show("in process (as autofuse bench)", in_process(job, args.rounds))
    print(f"  _prime calibration here: {timing._cycles_per_ms}")
    with Worker() as worker:
        candidates = [Candidate(name, params) for name, params in CANDIDATES]
        show("tuning worker's retime (as the final choice)", worker.call("retime", (job, candidates, args.rounds), 600.0))
        show("worker retime, in this process's evaluate state", retime({}, job, candidates, args.rounds))
    show("in process again", in_process(job, args.rounds))


if __name__ == "__main__":
    main()
