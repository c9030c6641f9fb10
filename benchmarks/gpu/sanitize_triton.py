"""Every operand path and schedule of the ``triton`` kind at small odd shapes, forward and backward,
for ``compute-sanitizer --tool memcheck python3 benchmarks/gpu/sanitize_triton.py [problem ...]``.

Shapes: K = 1000 (TMA, a K tail no BLOCK_K divides) and K = 1004 (pointer loads only), partial
row and column tiles, batch 1 where the mode allows it (training BatchNorm needs 2), and batch 16
with 80 columns: the fp32 backward's GEMMs contract over those (``triton_backward``), by TMA there.
"""

import sys

import torch

from autofuse.core import registry
from autofuse.tuning.gate import CheckCase, build_case

sys.path.insert(0, str(__import__("pathlib").Path(__file__).parents[2] / "tests"))
from test_triton_gpu import representative_configs  # noqa: E402

problems = sys.argv[1:] or ["matmul_gelu_softmax", "matmul_clamp_lse_mish", "gemm_bn"]
for name in problems:
    prob = registry.get_problem(name)
    cls = registry.get_variant(name, "triton")
    for sizes in ((3, 1000, 77), (1, 1004, 53), (16, 1000, 80)):
        shape = dict(zip(prob.dims, sizes))
        for mode in ("train", "eval") if prob.mode_sensitive else ("train",):
            if mode == "train" and prob.mode_sensitive and sizes[0] < 2:
                continue
            for precision in ("fp32", "tf32", "bf16"):
                for params in representative_configs(cls, shape, precision):
                    model, x = build_case(prob, CheckCase(shape, "randn", 1, True), "cuda", torch.float32, mode)
                    variant = cls(precision, **params)
                    variant.build("cuda")
                    x.requires_grad_(True)
                    variant(model, x).sum().backward()
                    torch.cuda.synchronize()
                    print(f"ran {name}/triton {sizes} {mode} {precision} {params}", flush=True)
