"""``matmul_clamp_lse_mish``, eager: the reference model's own forward, verbatim.

The baseline every speedup is measured against, and the fallback that serves any
shape, dtype, device and autograd need. No preconditions.
"""

from autofuse.core.variant import EagerVariant
from autofuse.hookspecs import hookimpl


class EagerMatmulClampLseMish(EagerVariant):
    name = "eager"
    problem = "matmul_clamp_lse_mish"
    description = "the reference forward, verbatim (autocast under bf16)"


@hookimpl
def autofuse_register_variants():
    return [EagerMatmulClampLseMish]
