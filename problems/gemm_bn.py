"""KernelBench level 2, problem 39: Gemm → Scale → BatchNorm1d.

``bn(linear(x) * scale)``. A fresh module is in training mode: BatchNorm normalises
with the batch mean and the biased batch variance, and updates the running mean and
the running variance (unbiased) with momentum 0.1. In eval mode it uses the running
statistics. Training needs batch >= 2, as in PyTorch.
"""


import torch
from torch import nn

from autofuse.core.problem import Problem, Tolerance, wide_rows
from autofuse.hookspecs import hookimpl


class Model(nn.Module):
    """KernelBench's reference, verbatim (parameter names included, so state_dicts load)."""

    def __init__(self, in_features, out_features, scale_shape, eps=1e-5, momentum=0.1):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.scale = nn.Parameter(torch.randn(scale_shape))
        self.bn = nn.BatchNorm1d(out_features, eps=eps, momentum=momentum)

    def forward(self, x):
        x = self.gemm(x)
        x = x * self.scale
        x = self.bn(x)
        return x


class GemmBatchNorm(Problem):
    def init_args(self, shape):
        n_in, n_out = shape["in_features"], shape["out_features"]
        return (n_in, n_out, (n_out,)), {}

    @torch.no_grad()
    def randomize_parameters(self, model, generator, distribution="randn"):
        super().randomize_parameters(model, generator, distribution)
        # Running variances must be positive; keep them around 1 like real statistics.
        model.bn.running_var.copy_(0.5 + torch.rand(model.bn.running_var.shape, generator=generator))
        model.bn.num_batches_tracked.fill_(int(torch.randint(0, 1000, (1,), generator=generator)))


    def gradients_well_conditioned(self, shape, mode):
        # With two samples, training-mode BN outputs ±γ whatever the input: the gradient
        # is ~eps/var, i.e. rounding noise.
        return mode != "train" or shape["batch_size"] > 2

    def quiet_wide_cotangent(self, cotangent):
        # BatchNorm keeps features apart: a zero cotangent column is a zero column of ∂L/∂y.
        super().quiet_wide_cotangent(cotangent)
        if cotangent.shape[1] > 1:
            cotangent[:, wide_rows(cotangent.shape[1])] = 0.0

    def invariant_parameters(self, mode):
        # Training-mode BN removes the batch mean (the GEMM bias cancels) and divides by
        # the batch std (the scale's magnitude cancels but for eps).
        return frozenset({"gemm.bias", "scale"}) if mode == "train" else frozenset()


PROBLEM = GemmBatchNorm(
    name="gemm_bn",
    description="bn(linear(x) * scale), BatchNorm1d in training (batch stats + running-stat update) or eval mode",
    model=Model,
    dims=("batch_size", "in_features", "out_features"),
    default_shapes=(
        {"batch_size": 16384, "in_features": 4096, "out_features": 4096},
        {"batch_size": 1024, "in_features": 8192, "out_features": 8192},
    ),
    tolerances={
        "fp32": Tolerance(rel_l2=1e-5, atol=1e-4, rtol=1e-4),
        "tf32": Tolerance(rel_l2=2e-3, atol=2e-2, rtol=1e-2),
        "bf16": Tolerance(rel_l2=1.5e-2, atol=1e-1, rtol=5e-2),
    },
    linear_attr="gemm",
    aliases=("kb2-39", "39_Gemm_Scale_BatchNorm"),
    mode_sensitive=True,
    min_train_batch=2,
    training_updates=("bn.running_mean", "bn.running_var", "bn.num_batches_tracked"),
)


@hookimpl
def autofuse_register_problems():
    return [PROBLEM]
