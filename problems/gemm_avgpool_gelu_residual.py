"""KernelBench level 2, problem 51: Gemm → Subtract → GlobalAvgPool → LogSumExp → GELU → ResidualAdd.

``gelu(logsumexp(mean(linear(x) - subtract, 1, keepdim), 1, keepdim)) + x``: one scalar
per row added to every element of the row, so the output has the input's shape
(batch, in_features). The residual is ``x.clone().detach()``: no gradient flows to
``x`` through it, only through the GEMM path. ``subtract`` has shape (out,): the mean
removes ``mean(subtract)``. GELU is the exact erf form.
"""

import torch
from torch import nn

from autofuse.core.problem import Problem, Tolerance
from autofuse.hookspecs import hookimpl


class Model(nn.Module):
    """KernelBench's reference, verbatim."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features, bias=bias)
        self.subtract = nn.Parameter(torch.randn(out_features))

    def forward(self, x):
        original_x = x.clone().detach()
        x = self.gemm(x)
        x = x - self.subtract
        x = torch.mean(x, dim=1, keepdim=True)
        x = torch.logsumexp(x, dim=1, keepdim=True)
        x = torch.nn.functional.gelu(x)
        x = x + original_x
        return x


class GemmAvgPoolGeluResidual(Problem):
    @torch.no_grad()
    def randomize_parameters(self, model, generator, distribution="randn"):
        super().randomize_parameters(model, generator, distribution)
        # The row scalar is about -mean(subtract): shift it so GELU is exercised where
        # its exact and tanh forms differ (|z| ~ 1..3), and for "large" inputs far past
        # float32's exp() overflow (z ~ 100), where logsumexp needs its max subtracted.
        if distribution == "large":
            shift = -100.0 * (0.9 + 0.2 * torch.rand((), generator=generator, dtype=torch.float64))
        else:
            shift = 6.0 * torch.rand((), generator=generator, dtype=torch.float64) - 3.0
        model.subtract.add_(shift.to(model.subtract.dtype))

    def memory_floor_bytes(self, shape):
        # The output has the input's shape: read x once, write it once.
        return 2 * 4 * shape["batch_size"] * shape["in_features"]


PROBLEM = GemmAvgPoolGeluResidual(
    name="gemm_avgpool_gelu_residual",
    description="gelu(logsumexp(mean(linear(x) - subtract, 1))) + x; the mean turns the GEMM into a GEMV",
    model=Model,
    dims=("batch_size", "in_features", "out_features"),
    default_shapes=({"batch_size": 2048, "in_features": 8192, "out_features": 8192},),
    tolerances={
        "fp32": Tolerance(rel_l2=1e-5, atol=1e-4, rtol=1e-4),
        "tf32": Tolerance(rel_l2=2e-3, atol=2e-2, rtol=1e-2),
        "bf16": Tolerance(rel_l2=1.5e-2, atol=1e-1, rtol=5e-2),
    },
    linear_attr="gemm",
    aliases=("kb2-51", "51_Gemm_Subtract_GlobalAvgPool_LogSumExp_GELU_ResidualAdd"),
    floor="memory",
)


@hookimpl
def autofuse_register_problems():
    return [PROBLEM]
