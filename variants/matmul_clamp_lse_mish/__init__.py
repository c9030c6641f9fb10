"""``matmul_clamp_lse_mish``'s variants: one entry point, ``matmul_clamp_lse_mish = "autofuse.variants.matmul_clamp_lse_mish"``.

Each module in ``PLUGIN_MODULES`` registers as the plugin ``matmul_clamp_lse_mish.<module>``, which
AUTOFUSE_BLOCK_PLUGINS can name (``autofuse.core.plugins``); the others
(gradients.py, triton_kernels.py) hold what those share.
"""

PLUGIN_MODULES = ("simplified", "cublas_epilogue", "cuda_fused", "triton_gemm")
