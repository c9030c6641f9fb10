"""One small, odd-shaped run of every CUDA variant (default and a small templated config), for
``compute-sanitizer --tool memcheck python3 benchmarks/gpu/sanitize.py [problem ...] [--all-configs]``
(``--all-configs``: every configuration a variant offers at that shape, not one or two)."""

import sys

import torch

from autofuse.core import registry
from autofuse.tuning.gate import CheckCase, build_case

all_configs = "--all-configs" in sys.argv
problems = [a for a in sys.argv[1:] if a != "--all-configs"] or sorted(registry.problems())
for name in problems:
    prob = registry.get_problem(name)
    shape = dict(zip(prob.dims, (37, 100, 77)))
    for mode in ("train", "eval") if prob.mode_sensitive else ("train",):
        model, x = build_case(prob, CheckCase(shape, "randn", 1, True), "cuda", torch.float32, mode)
        for vname, cls in registry.variants(name).items():
            if cls.admits("cuda", torch.float32, "fp32", False) is not None or "cuda" not in cls.devices or cls.devices == ("cpu", "cuda"):
                continue
            configs = cls.configs(shape, "cuda")
            # bf16 takes other paths in the epilogue kernels (the bias added there, not by cuBLAS)
            precisions = [p for p in ("fp32", "bf16") if cls.admits("cuda", torch.float32, p, False) is None]
            chosen = configs if all_configs else configs[:1] + [c for c in configs[1:] if c.get("bm") == 32 and c.get("vec") == 1][:1]
            for params in chosen:
                for precision in precisions:
                    variant = cls(precision, **params)
                    variant.build("cuda")
                    with torch.no_grad():
                        variant(model, x)
                    torch.cuda.synchronize()
                    print(f"ran {name}/{vname} {mode} {precision} {params}")
