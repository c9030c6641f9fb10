"""``matmul_gelu_softmax``, Triton: a tensor-core GEMM with GELU and the softmax partials inside.

softmax(gelu(x·Wᵀ + b)) needs every logit of a row before any output is final. The GEMM's
epilogue (``gelu_partials``) takes the float32 accumulator while it is in registers,
adds the bias, applies the exact erf GELU, stores the logit once and leaves per row and column
tile the online-softmax pair (max, Σ exp(v − max)); ``softmax_normalize`` merges a row's pairs
with the max subtracted (no overflow at any magnitude) and rescales the row in place: the
logits are written once, read once and written once more (a bfloat16 model's output: the float32
logits normalised into a bfloat16 tensor, so exp(v − max) sees v unrounded). The main loop is the shared one
(``autofuse.kernels.triton.gemm``); a small tile's configuration may normalise inside the GEMM's
launch (``finish_inside``, without a gradient: its last program to arrive does it, one launch a
call). fp32 is 3xTF32, tf32 TF32 with W rounded to nearest, bf16 the
cached bfloat16 weight with x cast by a pass. With a gradient needed the pre-GELU logits y are stored
too (the backward needs them; gradients.py). Kernels: triton_kernels.py. Preconditions: float32
tensors, or a bfloat16 model's under bf16, made contiguous, on CUDA, or on the CPU under
TRITON_INTERPRET=1; any sizes.
"""

import torch

from autofuse.hookspecs import hookimpl
from autofuse.kernels.triton.variant import TritonVariant

from . import gradients


class TritonGeluSoftmax(gradients.FusedGeluSoftmax, TritonVariant):
    name = "triton"
    problem = "matmul_gelu_softmax"
    description = ("tensor-core GEMM (TMA, persistent, grouped) with bias + GELU + softmax partials inside; "
                   "one normalising pass")
    finishes_inside = True

    def _fused(self, x, weight, bias, save):
        x, xs, weights, b = self.operands(x, weight, bias, "linear")
        w = self.backward_weight(weight, weights)
        batch, n_out = x.shape[0], w.shape[0]
        kernels = self.module()
        parts = -(-n_out // self.params["block_n"])
        logits = torch.empty(batch, n_out, device=x.device)
        y = torch.empty(batch, n_out, device=x.device) if save else None  # None: not stored
        part_max = torch.empty(batch, parts, device=x.device)
        part_sum = torch.empty_like(part_max)
        partials = (b, logits, y, part_max, part_sum)
        dtype = self.model_dtype(weight)
        arrivals = self.finish_counter(x.device, save)
        if arrivals is not None:  # one launch: its last program normalizes the rows
            out = logits if dtype == logits.dtype else torch.empty(batch, n_out, device=x.device, dtype=dtype)
            self.launch_gemm("gelu_partials", xs, weights, partials,
                             finish=("softmax_finish_inside", (arrivals, logits, out, part_max, part_sum)))
            return out, ()
        self.launch_gemm("gelu_partials", xs, weights, partials)
        out = logits if dtype == logits.dtype else torch.empty(batch, n_out, device=x.device, dtype=dtype)
        kernels.softmax_normalize[(batch,)](logits, out, part_max, part_sum, n_out, parts,
                                            BLOCK_N=kernels.row_block(n_out), BLOCK_P=kernels.parts_block(parts))
        return out, ((x, w, b, y, None, out) if save else ())


@hookimpl
def autofuse_register_variants():
    return [TritonGeluSoftmax]
