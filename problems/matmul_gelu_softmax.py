"""KernelBench level 2, problem 99: Matmul → GELU → Softmax.

``softmax(gelu(linear(x)), dim=1)`` with the exact erf GELU. Softmax needs the row
maximum subtracted: "large" check inputs give logits in the hundreds, past float32's
exp() overflow at ~88.7.
"""

import torch
from torch import nn

from autofuse.core.problem import Problem, Tolerance
from autofuse.hookspecs import hookimpl


class Model(nn.Module):
    """KernelBench's reference, verbatim."""

    def __init__(self, in_features, out_features):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        x = self.linear(x)
        x = torch.nn.functional.gelu(x)
        x = torch.nn.functional.softmax(x, dim=1)
        return x


PROBLEM = Problem(
    name="matmul_gelu_softmax",
    description="softmax(gelu(linear(x)), dim=1)",
    model=Model,
    dims=("batch_size", "in_features", "out_features"),
    default_shapes=({"batch_size": 1024, "in_features": 8192, "out_features": 8192},),
    tolerances={
        "fp32": Tolerance(rel_l2=1e-5, atol=1e-5, rtol=1e-4),
        "tf32": Tolerance(rel_l2=2e-3, atol=1e-3, rtol=1e-2),
        "bf16": Tolerance(rel_l2=1.5e-2, atol=1e-2, rtol=5e-2),
    },
    linear_attr="linear",
    aliases=("kb2-99", "99_Matmul_GELU_Softmax"),
)


@hookimpl
def autofuse_register_problems():
    return [PROBLEM]
