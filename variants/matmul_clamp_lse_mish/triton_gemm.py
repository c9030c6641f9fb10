"""``matmul_clamp_lse_mish``, Triton: a tensor-core GEMM whose epilogue reduces each row to a pair.

y = clamp(t·(x·Wᵀ + b), lo, hi) with t = 2s (``x * s`` then ``x + x``; doubling is exact), then
z = logsumexp(y) per row and z·mish(z). The GEMM's epilogue (``clamp_lse_partials``) takes
the float32 accumulator in registers, adds the bias, scales, clamps and leaves per row and column
tile the pair (max, Σ exp(v − max)); ``lse_mish_finish`` merges a row's pairs with the max
subtracted (no overflow at any clamp bound) and writes z·mish(z). The (batch × hidden) logits
never reach memory, so the time is the GEMM's plus a (batch × tiles) merge. With a gradient
needed the kernel stores the logits (the backward needs them), under bf16 their softmax factors
in bfloat16 instead (half the bytes; ``gradients.SoftmaxParts``), and the finish keeps z
(gradients.py). A bfloat16 model is the exception: its output must round where its bfloat16
reference does, which rounds each exp(v − max) against the row's max, so the epilogue also stores
the clamped logits in bfloat16 and ``lse_mish_finish_bf16`` sums them again per row (from the
pairs alone z was one bfloat16 step off in 3 of 1024 rows on an H100 at 1024×8192², z·mish(z)
then past KernelBench's 1e-2). That costs a bfloat16 write and read of the logits, 16 MB each at
1024×8192, for bfloat16 models only. A small tile's configuration may take the finish inside the
GEMM's launch (``finish_inside``, without a gradient): the last program to finish its tiles
merges every row (``lse_mish_finish_inside``), so a call is one launch. The main loop is the shared one
(``autofuse.kernels.triton.gemm``). Kernels: triton_kernels.py. Preconditions: float32 tensors,
or a bfloat16 model's under bf16 (its output bfloat16, every sum float32), made contiguous, on
CUDA, or on the CPU under TRITON_INTERPRET=1; any sizes; s, lo, hi read from the model at every
call.
"""

import torch

from autofuse.hookspecs import hookimpl
from autofuse.kernels.autograd import fused_call
from autofuse.kernels.triton.variant import TritonVariant

from . import gradients
from .cuda_fused import clamp_lse_scalars

FINISH_ROWS = 16  # rows per program of the merge: (16 × tiles) pairs, a few KB
# Logits per program and pass of a bfloat16 model's finish: 4 KB of bfloat16, one row's 2048 columns
# or up to 16 shorter rows. 1024 rows of 8192 are then 1024 programs (~8 per SM of an H100) of 4
# passes each, and a row's sum stays in one program (no merge across programs).
FINISH_BF16_BLOCK = 2048


def finish_bf16_blocks(n_out: int) -> tuple[int, int]:
    """(rows, columns) per program and pass of ``lse_mish_finish_bf16``: powers of two, at least 16
    columns, a row's n_out columns in one pass where they fit FINISH_BF16_BLOCK."""
    cols = min(max(1 << (n_out - 1).bit_length(), 16), FINISH_BF16_BLOCK)
    return min(FINISH_ROWS, FINISH_BF16_BLOCK // cols), cols


class TritonClampLseMish(TritonVariant):
    name = "triton"
    problem = "matmul_clamp_lse_mish"
    description = ("tensor-core GEMM (TMA, persistent, grouped) with bias + scale + clamp + row LSE partials "
                   "inside; logits never stored")
    in_dim = "input_size"

    # Under bf16 a gradient's forward saves the softmax factors in bfloat16, not the float32 logits
    # (H100, 1024×8192², saving the factors against the logits: the grad-mode forward 0.2119 against
    # 0.2151 ms, the training step 0.4593 against 0.4688).
    saves_softmax_parts = True
    finishes_inside = True

    def forward(self, model, x):
        scalars = clamp_lse_scalars(model)
        parts = None
        if self.saves_softmax_parts and self.precision == "bf16":
            parts = gradients.SoftmaxParts(self.params["block_n"])
        op = gradients.fused_op(lambda *a, save: self._fused(*a, scalars, parts, save=save), self.precision, scalars,
                                parts, self.gemms)
        return fused_call(op, x, model.matmul.weight, model.matmul.bias)

    def _fused(self, x, weight, bias, scalars, parts, save):
        x, xs, weights, b = self.operands(x, weight, bias, "matmul")
        w = self.backward_weight(weight, weights)
        batch, n_out = x.shape[0], w.shape[0]
        kernels = self.module()
        tiles = -(-n_out // self.params["block_n"])
        dtype = self.model_dtype(weight)
        save_y, save_q = save and parts is None, save and parts is not None
        y = torch.empty(batch, n_out, device=x.device) if save_y else None  # None: not stored
        q = torch.empty(batch, n_out, device=x.device, dtype=torch.bfloat16) if save_q else None
        # a bfloat16 model's clamped logits, which its finish sums again (``lse_mish_finish_bf16``)
        v = torch.empty(batch, n_out, device=x.device, dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
        part_max = torch.empty(batch, tiles, device=x.device)
        part_sum = torch.empty_like(part_max)
        t, lo, hi = scalars
        partials = (b, y, q, v, part_max, part_sum, t, lo, hi)
        arrivals = self.finish_counter(x.device, save)
        if arrivals is not None:  # one launch: its last program finishes (no z: nothing saved)
            out = torch.empty(batch, 1, device=x.device, dtype=dtype)
            self.launch_gemm("clamp_lse_partials", xs, weights, partials,
                             finish=("lse_mish_finish_inside", (arrivals, part_max, part_sum, v, out)))
            return out, ()
        self.launch_gemm("clamp_lse_partials", xs, weights, partials)
        z = torch.empty(batch, 1, device=x.device)
        out = torch.empty(batch, 1, device=x.device, dtype=dtype)
        if v is None:
            kernels.lse_mish_finish[(-(-batch // FINISH_ROWS),)](part_max, part_sum, z, out, batch, tiles,
                                                                  BLOCK_R=FINISH_ROWS,
                                                                  BLOCK_P=kernels.parts_block(tiles))
        else:
            rows, cols = finish_bf16_blocks(n_out)
            kernels.lse_mish_finish_bf16[(-(-batch // rows),)](v, part_max, part_sum, z, out, batch, n_out, tiles,
                                                               BLOCK_R=rows, BLOCK_C=cols,
                                                               BLOCK_P=kernels.parts_block(tiles))
        if not save:
            return out, ()
        return out, ((x, w, b, q, part_max, z) if save_q else (x, w, b, y, None, z))


@hookimpl
def autofuse_register_variants():
    return [TritonClampLseMish]
