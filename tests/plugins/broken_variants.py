"""Deliberately broken variants of matmul_gelu_softmax, loaded through AUTOFUSE_PLUGINS.

Each fails in its own way inside the worker; the tuner must record it and carry on.
"""

import os
import signal
import time

import torch
import torch.nn.functional as F

import autofuse
from autofuse.core.variant import Variant


class _Broken(Variant):
    problem = "matmul_gelu_softmax"
    kind = "cuda_naive"  # ranked above eager/simplified: it would be preferred if it were right


class Segfault(_Broken):
    name = "segfault"
    description = "dies with SIGSEGV"

    def forward(self, model, x):
        os.kill(os.getpid(), signal.SIGSEGV)


class Abort(_Broken):
    name = "abort"
    description = "calls abort()"

    def forward(self, model, x):
        os.abort()


class Hang(_Broken):
    name = "hang"
    description = "never returns"

    def forward(self, model, x):
        time.sleep(3600)


class Raises(_Broken):
    name = "raises"
    description = "raises a RuntimeError like a failed launch"

    def forward(self, model, x):
        raise RuntimeError("kernel launch failed: invalid configuration argument")


class WrongAnswer(_Broken):
    name = "wrong"
    description = "tanh-approximate GELU"

    def forward(self, model, x):
        return F.softmax(F.gelu(model.linear(x), approximate="tanh"), dim=1)


class _DoubleGradient(torch.autograd.Function):
    """Its input unchanged; the gradient passed back twice what it should be."""

    @staticmethod
    def forward(ctx, out):
        return out.clone()

    @staticmethod
    def backward(ctx, grad):
        return 2 * grad


class WrongGradientWhenFastest(_Broken):
    name = "wrong_gradient_when_fastest"
    description = "right forward at both configurations; at the faster one, gradients twice too large"
    supports_autograd = True

    @classmethod
    def configs(cls, shape, device):
        return [{"fast": True}, {"fast": False}]

    def forward(self, model, x):
        out = F.softmax(F.gelu(model.linear(x)), dim=1)
        if not self.params["fast"]:
            time.sleep(0.05)  # slower, so the fast configuration is the forward's best
            return out
        return _DoubleGradient.apply(out)


class CompileError(_Broken):
    name = "compile_error"
    description = "fails to build"

    def build(self, device):
        raise autofuse.errors.BuildError("nvcc: error: expected ';' (simulated)")


BROKEN = [Segfault, Abort, Hang, Raises, WrongAnswer, CompileError, WrongGradientWhenFastest]


@autofuse.hookimpl
def autofuse_register_variants():
    return BROKEN
