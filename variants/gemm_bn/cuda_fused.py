"""``gemm_bn``, CUDA GEMM with the BatchNorm epilogue fused: naive, tiled and templated.

Training (batch statistics). With z = x·Wᵀ (no bias), y = (z + b)·s has batch mean
s·(μ_z + b) and biased variance s²·σ²_z, so the bias cancels and
    out = (z − μ_z)·coef + β,   coef = s·γ/√(s²·σ²_z + eps).
The GEMM epilogue stores z and leaves, per column and block of rows, (count, mean, M2) from a
two-pass over the accumulators still in registers (block mean, then Σ(z − mean)²); a finalize
kernel merges a column's partials with Chan's parallel update (never E[z²] − E[z]²), writes
μ_z and coef and updates the running statistics in place; a normalize kernel rewrites z.
Running statistics as nn.BatchNorm1d: num_batches_tracked += 1 (here, on the int64 buffer),
factor = momentum, or 1/num_batches_tracked when momentum is None; running_mean is lerped
towards s·(μ_z + b), running_var towards the unbiased s²·σ²_z·n/(n − 1). Needs batch >= 2.

Eval (running statistics). out = z·k + shift per column, k = s·γ/√(running_var + eps),
shift = (b·s − running_mean)·γ/√(running_var + eps) + β: k and shift are computed once with
torch, cached until a parameter or running statistic changes, and applied in the epilogue.

fp32 FMA only: these run under every precision. Preconditions: float32 CUDA tensors (made
contiguous; the running statistics must already be contiguous, they are updated in place);
any sizes. Kernel: csrc/gemm_bn.cu. Autograd: the kernels keep neither z nor its statistics, so
the backward recomputes z with one cuBLAS GEMM (gradients.py); eval-mode k and shift are then
computed from the parameters each call, and the backward maps their gradients on to the
parameters (``gradients.eval_op``).
"""

from __future__ import annotations

import dataclasses

import torch
from autofuse.variants.gemm_bn import gradients

from autofuse.core.variant import FoldCache
from autofuse.errors import InputError
from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import fused_call, needs_grad
from autofuse.kernels.cuda_variant import GemmKernelVariant, input_operand, operand
from autofuse.kernels.gemm_space import SHARED_LIMIT


def uses_batch_statistics(bn) -> bool:
    """nn.BatchNorm's rule: batch statistics in training, or in eval when it keeps no running ones."""
    return bn.training or (bn.running_mean is None and bn.running_var is None)


def updates_running_stats(bn) -> bool:
    """Whether a call updates running_mean and running_var (the kernels' update, in place)."""
    return bn.training and bn.track_running_stats and bn.running_mean is not None and bn.running_var is not None


def batch_counter(bn) -> torch.Tensor | None:
    """num_batches_tracked where the kernel that updates the running statistics may add this batch
    to it itself, or None: a call then makes one launch less (the increment was a kernel of its
    own between the GEMM and the statistics, 1.3 µs and its gap beside a 50 µs GEMM on an H100;
    triton's and cublas_epilogue's kernels take it). Not with ``momentum=None``, whose factor is
    read from the count on the host."""
    counts = bn.training and bn.track_running_stats and bn.num_batches_tracked is not None
    return bn.num_batches_tracked if counts and bn.momentum is not None else None


def kernel_counted_factor(bn) -> tuple[torch.Tensor | None, float]:
    """(``batch_counter``'s tensor, ``momentum_factor``) for a kernel that adds the batch to the
    count itself where it may: whether it does is derived here from the tensor it is handed, so no
    caller can hand it the count and count on the host too. The last step before launching."""
    count = batch_counter(bn)
    return count, momentum_factor(bn, counted_by_kernel=count is not None)


def momentum_factor(bn, counted_by_kernel: bool = False) -> float:
    """Count this batch (num_batches_tracked += 1) and return the averaging factor, as nn.BatchNorm
    does; called just before the kernel that updates the running statistics, which it marks written.
    ``counted_by_kernel``: that kernel adds the 1 (it was handed ``batch_counter``'s tensor), so the
    count is marked written here, not incremented."""
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.training and bn.track_running_stats and bn.num_batches_tracked is not None:
        if counted_by_kernel:
            torch.autograd.graph.increment_version(bn.num_batches_tracked)
        else:
            bn.num_batches_tracked.add_(1)
        if bn.momentum is None:  # cumulative moving average
            factor = 1.0 / float(bn.num_batches_tracked)
    if updates_running_stats(bn):
        # The kernel writes them through their pointers, which no version counter sees: without
        # this, eval mode's cached (k, shift) (a FoldCache keyed on versions) and a CUDA graph's
        # state check would keep the statistics of before the training calls.
        for stat in (bn.running_mean, bn.running_var):
            torch.autograd.graph.increment_version(stat)
    return float(factor)


def _running(t: torch.Tensor, name: str, n_out: int, device, dtype: torch.dtype) -> torch.Tensor:
    """A running statistic the kernel updates in place: a copy would silently drop the update."""
    checked = operand(t, name, (n_out,), device, dtype)
    if checked.data_ptr() != t.data_ptr():
        raise InputError(f"{name}: expected a contiguous buffer (updated in place), got strides {t.stride()}")
    return checked


@dataclasses.dataclass
class TrainOperands:
    """What the training kernels read besides x and W; γ, β, b default to ones/zeros when absent."""

    bias: torch.Tensor
    scale: torch.Tensor
    gamma: torch.Tensor
    beta: torch.Tensor
    running_mean: torch.Tensor | None  # None with running_var: this call updates no running statistics
    running_var: torch.Tensor | None
    eps: float

    @classmethod
    def of(cls, model, x: torch.Tensor, dtype: torch.dtype = torch.float32) -> TrainOperands:
        """Check everything (InputError naming expected and got) before any side effect; every
        tensor of ``dtype`` (a bfloat16 model's stay bfloat16 for the triton kernels, which load
        them as float32 and store the running statistics back in bfloat16)."""
        if x.shape[0] < 2:
            raise InputError(f"Expected more than 1 value per channel when training, got input size {tuple(x.shape)}")
        gemm, bn, dev = model.gemm, model.bn, x.device
        n_out = gemm.weight.shape[0]

        def vector(t, name, default):
            if t is None:
                return torch.full((n_out,), default, dtype=dtype, device=dev)
            return operand(t, name, (n_out,), dev, dtype)

        stats = None, None
        if updates_running_stats(bn):
            stats = (_running(bn.running_mean, "bn.running_mean", n_out, dev, dtype),
                     _running(bn.running_var, "bn.running_var", n_out, dev, dtype))  # fmt: skip
        scale = operand(model.scale, "scale", (n_out,), dev, dtype)
        gamma, beta = vector(bn.weight, "bn.weight", 1.0), vector(bn.bias, "bn.bias", 0.0)
        return cls(vector(gemm.bias, "gemm.bias", 0.0), scale, gamma, beta, *stats, float(bn.eps))


def eval_coefficients(model, device, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """(k, shift) with out = z·k + shift per column in eval mode (see the module docstring), in
    float32 from the model's tensors of ``dtype`` (a bfloat16 model's for the triton kernels)."""
    gemm, bn = model.gemm, model.bn
    n_out = gemm.weight.shape[0]

    def vector(t, name):
        return operand(t, name, (n_out,), device, dtype).float()

    inv_std = 1.0 / torch.sqrt(vector(bn.running_var, "bn.running_var") + bn.eps)
    if bn.weight is not None:
        inv_std = inv_std * vector(bn.weight, "bn.weight")  # γ/√(var + eps)
    k = vector(model.scale, "scale") * inv_std
    shift = -vector(bn.running_mean, "bn.running_mean") * inv_std
    if gemm.bias is not None:
        shift = shift + vector(gemm.bias, "gemm.bias") * k
    if bn.bias is not None:
        shift = shift + vector(bn.bias, "bn.bias")
    return k.contiguous(), shift.contiguous()


def eval_dependencies(model) -> list[torch.Tensor]:
    """The tensors (k, shift) derive from: the FoldCache key."""
    gemm, bn = model.gemm, model.bn
    return [t for t in (gemm.bias, model.scale, bn.weight, bn.bias, bn.running_mean, bn.running_var) if t is not None]


class GemmBn(GemmKernelVariant):
    problem = "gemm_bn"
    source = "csrc/gemm_bn.cu"
    launchers = {
        "af_gemm_bn_train": ("ptr",) * 14 + ("float", "float", "int", "int", "int"),
        "af_gemm_bn_eval": ("ptr",) * 5 + ("int", "int", "int"),
    }

    supports_autograd = True

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._coefficients = FoldCache()

    def forward(self, model, x):
        if uses_batch_statistics(model.bn):
            ops = TrainOperands.of(model, input_operand(x, model.gemm.in_features))
            op = gradients.train_op(lambda x, weight, *_, save: self._train(model, ops, x, weight, save),
                                    self.precision, ops.eps)  # fmt: skip
            return fused_call(op, x, model.gemm.weight, model.gemm.bias, model.scale, model.bn.weight, model.bn.bias)
        if needs_grad(x, *model.parameters()):
            return gradients.eval_call(self._eval, self.precision, model, x)
        k, shift = self._coefficients.get(
            eval_dependencies(model), lambda: eval_coefficients(model, x.device), extra=(float(model.bn.eps),)
        )
        return self._eval(x, model.gemm.weight, k, shift, save=False)[0]

    def _operands(self, x, weight):
        n_out, n_in = weight.shape
        x = input_operand(x, n_in)
        return x, operand(weight, "gemm.weight", (n_out, n_in), x.device)

    def _train(self, model, ops, x, weight, save):
        x, w = self._operands(x, weight)
        (batch, n_in), n_out = x.shape, w.shape[0]
        row_blocks = self.library(x.device).af_row_blocks(batch)  # blocks along M in this build: a plain int query
        out = torch.empty(batch, n_out, device=x.device)
        part_count, part_mean, part_m2 = torch.empty(3, row_blocks, n_out, device=x.device)
        col_mean, col_coef = torch.empty(n_out, device=x.device), torch.empty(n_out, device=x.device)
        factor = momentum_factor(model.bn)  # the last step before launching: every check has passed
        self.launch("af_gemm_bn_train", x, w, ops.bias, ops.scale, ops.gamma, ops.beta, ops.running_mean,
                    ops.running_var, out, part_count, part_mean, part_m2, col_mean, col_coef, ops.eps, factor,
                    batch, n_out, n_in, device=x.device)  # fmt: skip
        return out, ((x, w, None, None, None, ops.scale, ops.gamma) if save else ())

    def _eval(self, x, weight, k, shift, save):
        x, w = self._operands(x, weight)
        (batch, n_in), n_out = x.shape, w.shape[0]
        k, shift = (operand(t, name, (n_out,), x.device) for t, name in ((k, "k"), (shift, "shift")))
        out = torch.empty(batch, n_out, device=x.device)
        self.launch("af_gemm_bn_eval", x, w, k, shift, out, batch, n_out, n_in, device=x.device)
        return out, ((x, w, None, k) if save else ())


class CudaNaiveGemmBn(GemmBn):
    name = "cuda_naive"
    kind = "cuda_naive"
    description = "one thread per output (dot product from global memory); BN statistics or eval affine fused"


class CudaTiledGemmBn(GemmBn):
    name = "cuda_tiled"
    kind = "cuda_tiled"
    description = "shared-memory tiled GEMM (16 or 32 square tiles); BN column partials or eval affine fused"


def _epilogue_shared_bytes(c: dict) -> int:
    """Static shared memory of the training epilogue (gemm_bn.cu's ``red``): 2·(threads/32)·TX floats."""
    tx = c["bn"] // c["tn"]
    threads = tx * (c["bm"] // c["tm"])
    return 2 * (threads // 32) * tx * 4


class CudaTemplatedGemmBn(GemmBn):
    name = "cuda_templated"
    kind = "cuda_templated"
    description = "register-blocked GEMM (tile, k-slice, per-thread block, vector width, stages searched), BN fused"

    @classmethod
    def configs(cls, shape, device):
        # The epilogue's reduction buffer shares the 48 KB of static shared memory with the
        # GEMM's tiles; the few configurations whose tiles fill all of it cannot hold both.
        def fits(c):
            return c["stages"] * (c["bm"] + c["bn"]) * c["bk"] * 4 + _epilogue_shared_bytes(c) <= SHARED_LIMIT

        return [c for c in super().configs(shape, device) if fits(c)]


@hookimpl
def autofuse_register_variants():
    return [CudaNaiveGemmBn, CudaTiledGemmBn, CudaTemplatedGemmBn]
