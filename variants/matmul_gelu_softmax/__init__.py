"""``matmul_gelu_softmax``'s variants: one entry point, ``matmul_gelu_softmax = "autofuse.variants.matmul_gelu_softmax"``.

Each module in ``PLUGIN_MODULES`` registers as the plugin ``matmul_gelu_softmax.<module>``, which
AUTOFUSE_BLOCK_PLUGINS can name (``autofuse.core.plugins``); the others
(gradients.py, triton_kernels.py) hold what those share.
"""

PLUGIN_MODULES = ("simplified", "cublas_epilogue", "cuda_fused", "triton_gemm")
