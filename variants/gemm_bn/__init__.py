"""``gemm_bn``'s variants: one entry point, ``gemm_bn = "autofuse.variants.gemm_bn"``.

Each module in ``PLUGIN_MODULES`` registers as the plugin ``gemm_bn.<module>``, which
AUTOFUSE_BLOCK_PLUGINS can name (``autofuse.core.plugins``); the others
(gradients.py, triton_kernels.py) hold what those share.
"""

PLUGIN_MODULES = ("simplified", "cublas_epilogue", "cuda_fused", "triton_gemm")
