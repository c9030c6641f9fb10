"""``gemm_bn``, Triton: a tensor-core GEMM with BatchNorm's eval affine or training statistics inside.

Eval (running statistics): out = z·k + shift per column, k = s·γ/√(running_var + eps) and
shift = (b·s − running_mean)·γ/√(running_var + eps) + β (``cuda_fused.eval_coefficients``,
cached until a parameter or running statistic changes), applied to the accumulator in registers
(the epilogue ``affine``): the GEMM and nothing else.

Training (batch statistics): with z = x·Wᵀ the bias cancels and out = (z − μ)·coef + β, coef =
s·γ/√(s²σ² + eps) (see cuda_fused.py). The GEMM's epilogue (``column_partials``) computes per
column and row tile the tile's (mean, M2), a two-pass over the accumulator, and stores z less the
tile's mean; ``bn_finish`` merges a column's tiles with Chan's update (stable at any mean),
updates the running statistics exactly as nn.BatchNorm1d does (num_batches_tracked here on the
host, ``momentum_factor``) and leaves each tile's shift to z − μ; ``bn_normalize`` writes the
output. z is written once, read once, and the output written once, as cuBLAS + the strip
epilogue does where a strip fits (its two-kernel path reads z twice). With a gradient needed
the output goes to a fresh buffer and z, its shifts and σ² stay for the backward (gradients.py).
Needs batch ≥ 2.

Under bf16 z is stored in bfloat16 (``z_dtype``). Stored less its tile's mean, its rounding is
2⁻⁹ of z's spread, whatever z's common offset: a plain bfloat16 z (eager's under autocast) puts
2⁻⁹·|z| into z − μ, which an offset much larger than the spread turns into a large error in the
normalised output.

The main loop is the shared one (``autofuse.kernels.triton.gemm``). Kernels: triton_kernels.py.
A bfloat16 model (under bf16): its parameters and running statistics are loaded as float32, every
statistic and coefficient is float32 (eval's k and shift computed in float32 from them), the
output is written in bfloat16, and the running statistics are updated in float32 and stored back
rounded to bfloat16, as PyTorch's BatchNorm does with bfloat16 ones. In training its z is taken
as its reference stores linear's output and x·s, rounded to bfloat16 (``bfloat16_model_z``), so the
output is the reference's, not one 2 bfloat16 steps from it (39's size, KernelBench's inputs).

Preconditions: float32 tensors, or a bfloat16 model's under bf16 (made contiguous; running
statistics contiguous, updated in place) on CUDA, or on the CPU under TRITON_INTERPRET=1; any sizes.
"""

import torch

from autofuse.core.variant import FoldCache
from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import fused_call, needs_grad
from autofuse.kernels.cuda_variant import operand
from autofuse.kernels.triton.variant import TritonVariant

from . import gradients
from .cuda_fused import (TrainOperands, eval_coefficients, eval_dependencies, kernel_counted_factor, momentum_factor,
                         uses_batch_statistics)

FINISH_COLUMNS = 128  # columns per program of the statistics merge
NORMALIZE_BLOCK = (32, 128)  # rows × columns per program of the normalising pass (512-byte rows)


class TritonGemmBn(TritonVariant):
    name = "triton"
    problem = "gemm_bn"
    description = ("tensor-core GEMM (TMA, persistent, grouped); eval: BN affine in the epilogue; "
                   "train: z + column (mean, M2) partials in the epilogue, Chan merge, one normalising pass")
    # The tf32 training kernel with the exact pass inline: 1.303 ms against 1.244 with a second
    # launch at 16384×4096², 0.261 against 0.258 at 1024×8192² (H100; ordinary inputs).
    EXACT_APART = (("column_partials", "fp16"),)

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._coefficients = FoldCache()

    @property
    def z_dtype(self) -> torch.dtype:
        """The dtype training stores z in: bfloat16 under bf16, which halves the four passes over
        z (the GEMM's store, the normalising read, the backward's two reads; about 0.17 ms of a
        2.3 ms step at 16384×4096²). The statistics come from the float32 accumulator all the
        same; the normalised output and the gradients see z's rounding, 2⁻⁹ of its spread about
        the tile mean, as they see the bfloat16 operands'."""
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def forward(self, model, x):
        gemm, bn = model.gemm, model.bn
        dtype = self.model_dtype(gemm.weight)
        if uses_batch_statistics(bn):
            ops = TrainOperands.of(model, x.detach() if isinstance(x, torch.Tensor) else x, dtype)
            op = gradients.train_op(lambda x, weight, *_, save: self._train(model, ops, x, weight, save),
                                    self.precision, ops.eps, tile_rows=self.params["block_m"], gemms=self.gemms)
            return fused_call(op, x, gemm.weight, gemm.bias, model.scale, bn.weight, bn.bias)
        if needs_grad(x, *model.parameters()):
            return gradients.eval_call(self._eval_fused, self.precision, model, x, self.gemms)
        k, shift = self._coefficients.get(eval_dependencies(model), lambda: eval_coefficients(model, x.device, dtype),
                                          extra=(float(bn.eps),))  # fmt: skip
        return self._eval_fused(x, gemm.weight, k, shift, save=False)[0]

    def _eval_fused(self, x, weight, k, shift, save):
        x, xs, weights, _ = self.operands(x, weight, None, "gemm")
        w = self.backward_weight(weight, weights)
        batch, n_out = x.shape[0], w.shape[0]
        k, shift = (operand(t, name, (n_out,), x.device) for t, name in ((k, "k"), (shift, "shift")))
        out = torch.empty(batch, n_out, device=x.device, dtype=self.model_dtype(weight))
        z = torch.empty(batch, n_out, device=x.device) if save else None  # None: not stored
        self.launch_gemm("affine", xs, weights, (k, shift, out, z))
        return out, ((x, w, z, k) if save else ())

    def _train(self, model, ops, x, weight, save):
        x, xs, weights, _ = self.operands(x, weight, None, "gemm")
        w = self.backward_weight(weight, weights)
        batch, n_out = x.shape[0], w.shape[0]
        kernels, tile_m = self.module(), self.params["block_m"]
        row_tiles = -(-batch // tile_m)
        if row_tiles == 1 and len(xs) <= 3:  # the whole batch in one row tile, no exact pass: one launch
            return self._train_one_tile(model, ops, x, w, xs, weights, self.model_dtype(weight), save)
        z = torch.empty(batch, n_out, device=x.device, dtype=self.z_dtype)
        part_mean = torch.empty(row_tiles, n_out, device=x.device)
        part_m2 = torch.empty_like(part_mean)
        dtype = self.model_dtype(weight)  # a bfloat16 model rounds y as its reference stores it
        rounding = (ops.bias, ops.scale) if dtype == torch.bfloat16 else (None, None)
        self.launch_gemm("column_partials", xs, weights, (z, part_mean, part_m2, *rounding))
        var, coef = torch.empty(2, n_out, device=x.device)
        update = ops.running_mean is not None
        factor = momentum_factor(model.bn)  # the last step before launching: every check has passed
        kernels.bn_finish[(-(-n_out // FINISH_COLUMNS),)](
            part_mean, part_m2, var, coef, ops.bias, ops.scale, ops.gamma, ops.running_mean, ops.running_var,
            ops.eps, factor, batch, n_out, tile_m, row_tiles, BLOCK_C=FINISH_COLUMNS, UPDATE=update)
        shift = part_mean  # bn_finish's: z − μ = z + shift[row // tile_m]
        # in place where z has the output's dtype and is not saved
        out = torch.empty(batch, n_out, device=x.device, dtype=dtype) if save or z.dtype != dtype else z
        rows, cols = NORMALIZE_BLOCK
        rows = gradients.row_block(rows, shift, tile_m)
        kernels.bn_normalize[(-(-batch // rows), -(-n_out // cols))](z, out, shift, coef, ops.beta, batch, n_out,
                                                                      tile_m, BLOCK_R=rows, BLOCK_C=cols)
        return out, ((x, w, z, shift, var, ops.scale, ops.gamma) if save else ())

    def _train_one_tile(self, model, ops, x, w, xs, weights, dtype, save):
        """``_train`` where one row tile holds the batch (``column_batchnorm``): statistics, running
        statistics and output in the GEMM's epilogue, and with a gradient needed z − μ, zero shifts
        and σ² as the backward reads them."""
        batch, n_out = x.shape[0], w.shape[0]
        out = torch.empty(batch, n_out, device=x.device, dtype=dtype)
        z = torch.empty(batch, n_out, device=x.device, dtype=self.z_dtype) if save else None
        shift, var = (torch.empty(1, n_out, device=x.device), torch.empty(n_out, device=x.device)) if save else (None, None)
        count, factor = kernel_counted_factor(model.bn)  # the epilogue counts the batch: no launch for it
        self.launch_gemm("column_batchnorm", xs, weights, (out, z, shift, var, ops.bias, ops.scale, ops.gamma, ops.beta,
                                                           ops.running_mean, ops.running_var, ops.eps, factor, count))
        return out, ((x, w, z, shift, var, ops.scale, ops.gamma) if save else ())


@hookimpl
def autofuse_register_variants():
    return [TritonGemmBn]
