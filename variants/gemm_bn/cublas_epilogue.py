"""``gemm_bn``, cuBLAS + a BatchNorm epilogue.

Training (batch statistics). z = x·Wᵀ without the bias is one cuBLAS call through torch (the
bias cancels in z − μ; under tf32 or bf16 the GEMM uses what that precision admits, see
``autofuse.precision.linear``). Then two kernels: column statistics (Welford per thread,
Chan's merge across threads and chunks of rows: stable at any mean), which also writes
coef = s·γ/√(s²·σ²_z + eps) and updates the running statistics exactly as nn.BatchNorm1d
does (see ``cuda_gemm``'s docstring), and the normalize pass out = (z − μ_z)·coef + β in
place. So the time is the GEMM's plus two passes over z. Needs batch >= 2.

Eval (running statistics). The whole block is one linear layer: W' = W·k[:, None], b' = shift
with k, shift as in ``cuda_gemm``; folded once (cached until a parameter or running statistic
changes) and run as one addmm, no extra kernel.

Preconditions: float32 CUDA tensors (running statistics contiguous: updated in place); any
sizes. Kernel: csrc/bn_epilogue.cu.
"""

import hashlib
import pathlib

import torch

from autofuse.cuda_variant import CudaVariant, input_operand, operand
from autofuse.hookspecs import hookimpl
from autofuse.precision import linear
from autofuse.variant import FoldCache
from autofuse.variants.gemm_bn import cuda_gemm
from autofuse.variants.gemm_bn.cuda_gemm import (
    TrainOperands,
    eval_coefficients,
    eval_dependencies,
    momentum_factor,
    uses_batch_statistics,
)


class CublasEpilogueGemmBn(CudaVariant):
    name = "cublas_epilogue"
    problem = "gemm_bn"
    kind = "cublas_epilogue"
    description = "train: cuBLAS GEMM, column statistics + running stats, normalize in place; eval: folded addmm"
    source = "csrc/bn_epilogue.cu"
    launchers = {"af_bn_train": ("ptr",) * 13 + ("float", "float", "int", "int")}

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._folded = FoldCache()

    @classmethod
    def configs(cls, shape, device):
        return [{"block": b} for b in (256, 128, 512)]

    @classmethod
    def source_hash(cls) -> str:
        # The running-statistics and folding rules live in cuda_gemm.py: a change there changes this variant.
        digest = hashlib.sha256(super().source_hash().encode())
        digest.update(pathlib.Path(cuda_gemm.__file__).read_bytes())
        return digest.hexdigest()[:16]

    def forward(self, model, x):
        n_out, n_in = model.gemm.weight.shape
        x = input_operand(x, n_in)
        w = operand(model.gemm.weight, "gemm.weight", (n_out, n_in), x.device)
        if uses_batch_statistics(model.bn):
            return self._train(model, x, w)
        return self._eval(model, x, w)

    def _train(self, model, x, w):
        ops = TrainOperands.of(model, x)
        batch, n_out = x.shape[0], w.shape[0]
        lib = self.library(x.device)
        chunks, strips = lib.af_bn_chunks(batch), lib.af_bn_strips(n_out)
        z = linear(x, self.gemm_weight(model.gemm.weight), None, self.precision).contiguous()
        part_count, part_mean, part_m2 = torch.empty(3, chunks, n_out, device=x.device)
        col_mean, col_coef = torch.empty(2, n_out, device=x.device)
        arrivals = torch.zeros(strips, dtype=torch.int32, device=x.device)  # per-strip arrival counters
        factor = momentum_factor(model.bn)  # the last step before launching: every check has passed
        self.launch("af_bn_train", z, ops.bias, ops.scale, ops.gamma, ops.beta, ops.running_mean, ops.running_var,
                    part_count, part_mean, part_m2, arrivals, col_mean, col_coef, ops.eps, factor, batch, n_out,
                    device=x.device)  # fmt: skip
        return z

    def _eval(self, model, x, w):
        weight, bias = self._folded.get(
            [model.gemm.weight, *eval_dependencies(model)],
            lambda: self._fold(model, w, x.device),
            extra=(float(model.bn.eps),),
        )
        return linear(x, self.gemm_weight(weight), bias, self.precision)

    @staticmethod
    def _fold(model, w, device):
        k, shift = eval_coefficients(model, device)
        return w * k[:, None], shift


@hookimpl
def autofuse_register_variants():
    return [CublasEpilogueGemmBn]
