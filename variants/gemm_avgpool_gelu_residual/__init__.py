"""``gemm_avgpool_gelu_residual``'s variants: one entry point, ``gemm_avgpool_gelu_residual = "autofuse.variants.gemm_avgpool_gelu_residual"``.

Each module in ``PLUGIN_MODULES`` registers as the plugin ``gemm_avgpool_gelu_residual.<module>``, which
AUTOFUSE_BLOCK_PLUGINS can name (``autofuse.core.plugins``); the others
(gradients.py, triton_kernels.py) hold what those share.
"""

PLUGIN_MODULES = ("simplified", "cublas_epilogue", "cuda_fused")
