"""``matmul_gelu_softmax``, cuBLAS + one fused epilogue kernel.

y = x·Wᵀ + b is one cuBLAS call through torch (addmm: the bias rides in the GEMM; under
tf32 or bf16 the GEMM uses what that precision admits, see ``autofuse.precision.linear``;
under bf16 the weight's bfloat16 copy is cached and the bias is added by the kernel below).
Then one kernel, one block of AF_BLOCK threads per row, does everything after it in place:
exact GELU and the running (max, Σ exp) pair in one read of y, then the rescale from L2.
So the time is the GEMM's plus one pass over the (batch × out) logits.
Kernel: csrc/gelu_softmax_rows.cu.
"""

from autofuse.cuda_variant import CudaVariant, linear_operands
from autofuse.hookspecs import hookimpl
from autofuse.precision import linear_deferring_bias


class CublasEpilogueGeluSoftmax(CudaVariant):
    name = "cublas_epilogue"
    problem = "matmul_gelu_softmax"
    kind = "cublas_epilogue"
    description = "addmm through cuBLAS, then one row kernel: GELU + stable softmax in place"
    source = "csrc/gelu_softmax_rows.cu"
    launchers = {"af_gelu_softmax_rows": ("ptr", "ptr", "ptr", "int", "int")}

    @classmethod
    def configs(cls, shape, device):
        return [{"block": b} for b in (256, 128, 512, 1024)]

    def forward(self, model, x):
        lin = model.linear
        n_out, n_in = lin.weight.shape
        x, w, b = linear_operands(x, lin, "linear")
        y, bias = linear_deferring_bias(x, self.gemm_weight(lin.weight), b, self.precision)
        y = y.contiguous()
        self.launch("af_gelu_softmax_rows", y, bias, y, x.shape[0], n_out, device=x.device)
        return y


@hookimpl
def autofuse_register_variants():
    return [CublasEpilogueGeluSoftmax]
