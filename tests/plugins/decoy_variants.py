"""Decoys: variants whose answers look right but that no caller could drop in, loaded through
AUTOFUSE_PLUGINS. Each must fail the gate with a reason that says why
(tests/test_gate_catches_wrong_answers.py); each is ranked above eager, so one that passed
could win a tune.
"""

import torch
import torch.nn.functional as F

import autofuse
from autofuse.core.variant import Variant


def gelu_softmax(model, x):
    """matmul_gelu_softmax's reference forward."""
    return F.softmax(F.gelu(model.linear(x)), dim=1)


class _Decoy(Variant):
    problem = "matmul_gelu_softmax"
    kind = "cuda_naive"  # ranked above eager/simplified: it would be preferred if it passed


class Float64Output(_Decoy):
    name = "float64_output"
    description = "the right values, more accurate even, returned as float64"

    def forward(self, model, x):
        lin = model.linear
        return F.softmax(F.gelu(F.linear(x.double(), lin.weight.double(), lin.bias.double())), dim=1)


class TransposedOutput(_Decoy):
    name = "transposed_output"
    description = "the right values in column-major (transposed) storage: a non-contiguous tensor"

    def forward(self, model, x):
        return gelu_softmax(model, x).t().contiguous().t()


class MetaOutput(_Decoy):
    name = "meta_output"
    description = "the right shape and dtype on another device (meta: the only other one a CPU has)"

    def forward(self, model, x):
        return torch.empty(x.shape[0], model.linear.out_features, dtype=x.dtype, device="meta")


class DropsBiasGradient(_Decoy):
    name = "drops_bias_gradient"
    description = "the right output and input gradient, the bias detached: its .grad stays None"
    supports_autograd = True

    def forward(self, model, x):
        lin = model.linear
        return F.softmax(F.gelu(F.linear(x, lin.weight, lin.bias.detach())), dim=1)


class RightOnlyForNonNegative(_Decoy):
    name = "nonnegative_only"
    description = "right for KernelBench's torch.rand inputs (x >= 0), ReLU in place of GELU otherwise"

    def forward(self, model, x):
        if (x >= 0).all():
            return gelu_softmax(model, x)
        return F.softmax(F.relu(model.linear(x)), dim=1)


class CachedByShape(_Decoy):
    name = "cached_by_shape"
    description = "computes once per input shape and returns that output again"

    def forward(self, model, x):
        cache = self.__dict__.setdefault("cache", {})
        if x.shape not in cache:
            cache[x.shape] = gelu_softmax(model, x)
        return cache[x.shape]


class CachedByDataPtr(_Decoy):
    name = "cached_by_data_ptr"
    description = "computes once per input address and returns that output again"

    def forward(self, model, x):
        cache = self.__dict__.setdefault("cache", {})
        if x.data_ptr() not in cache:
            cache[x.data_ptr()] = gelu_softmax(model, x)
        return cache[x.data_ptr()]


class MutatesInput(_Decoy):
    name = "mutates_input"
    description = "the right output, then x scaled in place (a scratch buffer reused)"

    def forward(self, model, x):
        out = gelu_softmax(model, x)
        x.mul_(0.5)
        return out


class Noisy(_Decoy):
    name = "noisy"
    description = "the right output with 1e-3 relative noise"

    def forward(self, model, x):
        out = gelu_softmax(model, x)
        return out * (1 + 1e-3 * torch.randn_like(out))


class WrongOneCallInFour(_Decoy):
    name = "wrong_one_call_in_four"
    description = "right three calls in four; the tanh-approximate GELU on every fourth"

    def forward(self, model, x):
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls % 4:
            return gelu_softmax(model, x)
        return F.softmax(F.gelu(model.linear(x), approximate="tanh"), dim=1)


class WeightsSnapshotted(_Decoy):
    name = "weights_snapshotted"
    description = "copies weight and bias at the first call and uses the copies ever after"

    def forward(self, model, x):
        if not hasattr(self, "snapshot"):
            self.snapshot = (model.linear.weight.detach().clone(), model.linear.bias.detach().clone())
        return F.softmax(F.gelu(F.linear(x, *self.snapshot)), dim=1)


class FlatLseMish(_Decoy):
    problem = "matmul_clamp_lse_mish"
    name = "flat_output"
    description = "the right values with shape (N,) where the reference returns (N, 1)"

    def forward(self, model, x):
        y = torch.clamp(model.matmul(x) * (2 * model.scale_factor), model.clamp_min, model.clamp_max)
        z = torch.logsumexp(y, dim=1)
        return z * F.mish(z)


DECOYS = [Float64Output, TransposedOutput, MetaOutput, RightOnlyForNonNegative, CachedByShape, CachedByDataPtr,
          MutatesInput, Noisy, WrongOneCallInFour, WeightsSnapshotted, FlatLseMish, DropsBiasGradient]


@autofuse.hookimpl
def autofuse_register_variants():
    return DECOYS
