"""The search space of the register-blocked GEMM (``autofuse/kernels/csrc/gemm.cuh``), valid points only.

Constraints, each one the kernel's own: the TX = BN/TN threads sharing a row must be a power
of two ≤ 32 (row reductions are warp shuffles of that width); 64 to 1024 threads, a whole
number of warps; each BM×BK and BN×BK slice splits evenly into VEC-wide loads over the
threads; STAGES buffers of (BM + BN)·BK floats fit in 48 KB of static shared memory; at most
64 accumulators per thread (more spills registers).
"""

from __future__ import annotations

import itertools

DEFAULT = {"bm": 128, "bn": 128, "bk": 8, "tm": 8, "tn": 8, "vec": 4, "stages": 2}
CHOICES = {
    "bm": (32, 64, 128, 256),
    "bn": (32, 64, 128, 256),
    "bk": (8, 16, 32),
    "tm": (4, 8),
    "tn": (4, 8),
    "vec": (1, 4),
    "stages": (1, 2),
}
SHARED_LIMIT = 48 * 1024


def invalid_reason(c: dict) -> str | None:
    """Why configuration ``c`` cannot be built or launched, or None."""
    tx, ty = c["bn"] // c["tn"], c["bm"] // c["tm"]
    threads = tx * ty
    if tx > 32 or tx & (tx - 1):
        return f"BN/TN = {tx} threads per row must be a power of two <= 32"
    if not 64 <= threads <= 1024 or threads % 32:
        return f"{threads} threads per block: need a multiple of 32 in [64, 1024]"
    for rows in (c["bm"], c["bn"]):
        if (rows * c["bk"]) % (c["vec"] * threads):
            return f"{rows}x{c['bk']} slice does not split into {c['vec']}-wide loads over {threads} threads"
    if c["stages"] * (c["bm"] + c["bn"]) * c["bk"] * 4 > SHARED_LIMIT:
        return "shared memory over 48 KB"
    if c["tm"] * c["tn"] > 64:
        return "more than 64 accumulators per thread"
    return None


def blocked_gemm_configs() -> list[dict]:
    """Every valid configuration, the default (the classic 128×128×8, 8×8 per thread) first."""
    keys = list(CHOICES)
    valid = [dict(zip(keys, values)) for values in itertools.product(*CHOICES.values())]
    valid = [c for c in valid if invalid_reason(c) is None and c != DEFAULT]
    return [DEFAULT] + valid
