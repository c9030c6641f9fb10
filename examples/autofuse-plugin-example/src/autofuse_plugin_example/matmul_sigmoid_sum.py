"""KernelBench level 2, problem 56: Matmul → Sigmoid → Sum, as a new autofuse problem.

``sum(sigmoid(linear(x)), dim=1, keepdim=True)``: a (batch, 1) output. Two variants:

- ``eager``: the reference forward, verbatim (the baseline, and the fallback for any call).
- ``fused_bias``: the bias rides in the GEMM (addmm's epilogue) and the sigmoid runs in
  place on its output, so the (batch × hidden) logits are written once and read once instead
  of being written by the GEMM, read and written by the bias add, then by the sigmoid, then
  read by the sum. The same function, fewer passes; autograd works (addmm's backward does
  not need its output; sigmoid's needs only its own result). No preconditions.
"""

import torch
from torch import nn

from autofuse import hookimpl
from autofuse.core.precision import linear
from autofuse.core.problem import Problem, Tolerance
from autofuse.core.variant import EagerVariant, Variant


class Model(nn.Module):
    """KernelBench's reference, verbatim."""

    def __init__(self, input_size, hidden_size):
        super().__init__()
        self.linear = nn.Linear(input_size, hidden_size)

    def forward(self, x):
        x = self.linear(x)
        x = torch.sigmoid(x)
        x = torch.sum(x, dim=1, keepdim=True)
        return x


PROBLEM = Problem(
    name="matmul_sigmoid_sum",
    description="sum(sigmoid(linear(x)), dim=1, keepdim=True)",
    model=Model,
    dims=("batch_size", "input_size", "hidden_size"),
    default_shapes=({"batch_size": 1024, "input_size": 8192, "hidden_size": 8192},),
    # The sum of `hidden` values in (0, 1): relative errors are the GEMM's, damped by sigmoid.
    tolerances={
        "fp32": Tolerance(rel_l2=1e-5, atol=1e-4, rtol=1e-5),
        "tf32": Tolerance(rel_l2=2e-3, atol=1e-2, rtol=2e-3),
        "bf16": Tolerance(rel_l2=1e-2, atol=5e-2, rtol=1e-2),
    },
    linear_attr="linear",
    aliases=("kb2-56", "56_Matmul_Sigmoid_Sum"),
)


class EagerMatmulSigmoidSum(EagerVariant):
    name = "eager"
    problem = "matmul_sigmoid_sum"
    description = "the reference forward, verbatim (autocast under bf16)"


class FusedBiasMatmulSigmoidSum(Variant):
    name = "fused_bias"
    problem = "matmul_sigmoid_sum"
    kind = "simplified"
    description = "addmm (bias in the GEMM) → sigmoid_ in place → row sum"
    supports_autograd = True

    def forward(self, model, x):
        lin = model.linear
        y = linear(x, self.gemm_weight(lin.weight), lin.bias, self.precision)
        return y.sigmoid_().sum(dim=1, keepdim=True)


@hookimpl
def autofuse_register_problems():
    return [PROBLEM]


@hookimpl
def autofuse_register_variants():
    return [EagerMatmulSigmoidSum, FusedBiasMatmulSigmoidSum]
