"""Base class of the ``triton`` variants: a tensor-core GEMM with the problem's epilogue inside.

Triton is imported lazily: where it is missing the variant is not admitted and ``autofuse
list`` says why. The kernels run on CUDA, and on the CPU under Triton's interpreter
(``TRITON_INTERPRET=1``), which is how CI checks their masks, partial tiles and odd shapes.

The search space (``gemm_configs``) is the main loop's: tile sizes, k-slice, pipeline depth
(``stages``), warps, group size of the grouped ordering, persistence (one program per SM
walking the tiles, or one per tile) and TMA (tensor descriptors; only where the rows are
16-byte aligned). Configurations that cannot run are projected away: too much shared memory
for the stages, or more accumulator registers per thread than a warp group can hold.
Warp specialization is not a knob. Triton 3.6 runs a Hopper pass for loops marked
``tl.range(warp_specialize=True)``, but on an H100 it did not give a working GEMM: with 8 warps
it left the kernel as it was, and with 4 it failed to compile (a descriptor store) or compiled
a kernel that faulted (illegal address), persistent or not (a bf16 GEMM at 1024×8192×8192).
Split-K is not a knob either. At the default shapes there are 64+ tiles for 132 SMs. At small
batches it was built and measured (each tile's K in 2-8 ranges, the last program adding them in a
fixed order), and it lost or tied everywhere on an H100: at 8192² bf16, batch 8, split 2 gave
50.6 µs against 48.8 for one program per tile (cuBLAS 47.9). At batch 64, 64×64 split 2 and 4 gave
56.2 and 59.8 µs against 50.3. fp32 (split_fp16) at batch 64 gave 124.6 against 107.7. One
program per 64-128 columns already keeps W's read near cuBLAS's (graph-replayed, no L2 flush).
Nor is flattening a persistent program's tile and k loops into one pipelined loop
(``tl.range(flatten=True)``, Triton's persistent-matmul tutorial). On an H100 it made
matmul_clamp_lse_mish's forward 1.3-1.5% faster at tf32 and bf16; the kernels of
matmul_gelu_softmax and gemm_bn, whose epilogues store a tile, ran out of shared memory (278 of
227 KB) at the 128×256 tiles they are fastest with: the stages stay live through the epilogue,
beside the tile's staging buffer (tests/test_triton_compiles_for_hopper.py keeps such configurations out).
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, ClassVar

import torch

from autofuse.core.variant import FoldCache, Variant
from autofuse.errors import InputError
from autofuse.kernels.autograd import CUBLAS
from autofuse.kernels.cuda_variant import operand
from autofuse.kernels.triton.host import (
    Arrivals,
    Operand,
    bfloat16_whole_tiles,
    descriptors,
    fp16_input_parts,
    fp16_parts,  # noqa: F401 - the float16 parts' kernel, as tests/interpreted/check_triton.py reaches it
    fp16_weight_parts,
    gemm_kernels,
    interpreting,
    kernel_module,
    launch_grid,
    launch_main_loop,
    loop_operands,
    round_tf32,
    split_tf32,
    triton_missing,
)

# (BLOCK_M, BLOCK_N) pairs; BLOCK_K, stages, warps, group size, persistence and TMA are searched per pair.
TILES = ((128, 128), (128, 256), (64, 128), (128, 64), (256, 128), (64, 256))
BLOCK_KS = (32, 64)
STAGES = (3, 4, 2, 5)
WARPS = (8, 4)
GROUPS = (8, 16)
# How the operands reach the tensor cores, by precision: (precision served, kernel MODE, bytes of x
# and of W per element in shared memory). See autofuse/kernels/triton/gemm.py. Triton's own in-kernel
# split (input_precision="tf32x3") is not offered: 0.63-0.73x cuBLAS fp32 where split_host is
# 0.48, and it failed the fp32 gate where split_host passed (x's gradient of matmul_gelu_softmax at
# 37×1004×777, large inputs: 2.9e-5 > 2.15e-5; H100), though its logits alone were as accurate.
# Under tf32, x is not left for the tensor cores to truncate (W rounded, no pass over x): it won
# 22's tf32 tune (0.330 ms, cuBLAS + epilogue 0.360), but truncation is biased, and 22's gradient
# missed the tf32 gate by 20x on plain randn inputs at batch 37 (0.089 > 0.0046; H100). Under
# 3xTF32 it may be (split_trunc): the low part x − trunc(x) undoes the truncation, and x's pass
# writes one tensor instead of two. round_kernel rounds x's tiles in the main loop instead of by a
# pass: the same products, the pass's 7.8-13% of the GEMM traded for 3.5-5.7% in the loop (H100,
# 1024×8192² and 16384×4096²; benchmarks/gpu/operand_paths.py); the tuner weighs the two per key. By pointer loads
# only: with x's tile loaded through a tensor descriptor, Triton 3.6 gave sums that changed from
# run to run, 1e-5 to 1e-1 off, at 128×256×32 and 128×128×64 (benchmarks/gpu/round_kernel_sweep.py).
# W alone through its descriptor beside x by pointers was 3% faster at 22 but broke the kernels
# that also store a tile (22's logits for its backward, gemm_bn's z: 0.2-0.8 off at the default
# shapes on an H100, caught by the gradient gate), so W comes by pointers too.
OPERANDS = {
    "split_host": ("fp32", "3xtf32", 8, 8),  # hi and lo parts of x (a pass per call) and W (cached)
    "split_trunc": ("fp32", "3xtf32", 8, 8),  # x itself as hi, its low part by a pass; W's parts cached
    "round_host": ("tf32", "tf32", 4, 4),  # W rounded to nearest once, x by a pass per call
    "round_kernel": ("tf32", "tf32_round", 4, 4),  # W rounded once, x's tiles in the main loop: no pass
    "cast_pass": ("bf16", "bf16", 2, 2),  # x cast by a pass, W's copy cached; a bfloat16 model's as they are
    # float16 tensor cores (twice TF32's rate) on rows scaled by powers of two (fp16_row_parts); at
    # the default shapes on an H100 0.26-0.30x cuBLAS fp32's time (the TF32 splits: 0.47-0.51x)
    # and 0.65-0.92x cuBLAS tf32's (round_host: 1.07-1.36x; benchmarks/gpu/operand_paths.py):
    "split_fp16": ("fp32", "3xfp16", 4, 4),  # hi and lo in float16, x's by a pass per call, W's cached
    "scaled_fp16": ("tf32", "fp16", 2, 2),  # x and W rounded to 11 significant bits, as TF32 rounds them
}
# Under bf16, x converted inside the kernel (float32 x loaded, rounded in registers: commit
# ea4a20f, "convert") is not offered: it passed the gates but was 4-12% slower than the cast
# pass plus the bfloat16 main loop at every triton key's tuned configuration, with TMA or
# pointer loads (22: 0.2218 against 0.2056 ms; gemm_bn train 16384: 1.1642 against 1.1008; H100,
# benchmarks/gpu/operand_paths.py). Reading float32 x once per column tile costs more than one
# pass that writes it in bfloat16.
SPLIT_MODES = ("3xtf32", "3xfp16")  # kernel MODEs that read the low parts
# The first configuration of each precision (the tuner tries it first): the fastest at the default
# shapes on an H100 (benchmarks/gpu/operand_paths.py times each operand path at the tabled tiles).
DEFAULTS = {
    "fp32": {"block_m": 128, "block_n": 128, "block_k": 64, "stages": 3, "warps": 8, "group_m": 8,
             "persistent": True, "tma": True, "operands": "split_fp16"},
    "tf32": {"block_m": 128, "block_n": 256, "block_k": 64, "stages": 3, "warps": 8, "group_m": 8,
             "persistent": True, "tma": True, "operands": "scaled_fp16"},
    "bf16": {"block_m": 128, "block_n": 256, "block_k": 64, "stages": 3, "warps": 8, "group_m": 8,
             "persistent": True, "tma": True, "operands": "cast_pass"},
}
# Shared memory the stages may take (H100: 227 KB per block); the rest is the epilogue's.
STAGE_BYTES = 200 * 1024
# Accumulator floats per thread: 128 keeps a 128×256 tile at 8 warps; 3xTF32's two accumulators
# at that tile spilled (4.25 ms where 128×128 took 1.09, H100).
MAX_ACC_PER_THREAD = 128
# Under the interpreter (the CPU tests): tiles of 16, so small odd shapes cross several tiles in
# every dimension and the edges (partial tiles, the K tail, clamped rows) are exercised.
INTERPRETER_SPACE = {"tiles": ((16, 16), (32, 16)), "small_tiles": ((16, 32),), "block_ks": (16,),
                     "small_block_ks": (16,), "stages": (2,), "warps": (4,), "groups": (2, 8)}
# At a batch up to SMALL_BATCH the GEMM is memory-bound: the weight's read is the floor, and a
# 128-row tile would multiply mostly rows past the batch. Tiles of 16-64 rows (tl.dot's smallest M
# is 16) with narrow columns give one program per 64-128 columns of W, enough to keep the SMs
# reading (8192 columns: 64-128 programs); such a tile holds one warp group's accumulator at 4 warps.
# A small tile's program walks all of K for few rows and columns, so it takes deeper k-slices (up
# to 256) to keep enough of W in flight. In the order the rungs race them: at batch 1 and 32 on
# an H100 (1024×8192², non-persistent, the tuned operand paths) 16×64 and 16×32 with k-slices of
# 128-256 were the fastest (bf16 22: 68.8-69.3 µs, gemm_bn's bfloat16 model 61.6-62.0, fp32 22
# 116.9-117.9; the 1024-tuned tile 111, 94 and 192), 32×64 next, the wider ones slower.
SMALL_BATCH = 256
SMALL_TILES = ((16, 64), (16, 32), (32, 64), (32, 128), (64, 64), (16, 128))
SMALL_BLOCK_KS = (64, 128, 256)
# Up to this batch a batch class's small-tile seeds put the finish inside the GEMM's launch first
# (``TritonVariant.finishes_inside``), so rung 1 races it under the quick budget, which takes one
# seed. Its finish is one program's, walking the rows in turn, where a launch of its own reads them
# in parallel. H200, 8192², the 16×64 seed replayed (benchmarks/gpu/finish_inside.py), inside
# against apart: at batch 1 1-5% faster (22 fp32 1.214x the weight read against 1.227, bf16 1.253
# against 1.283, bfloat16 model 1.301 against 1.371; 99's bfloat16 model 1.286 against 1.326); at
# batch 8 3-77% slower (22's bfloat16 model 2.43 against 1.37: about 4 µs a row), at 32 slower still.
FINISH_INSIDE_BATCH = 1


def small_tiles(device: str) -> tuple[tuple[int, int], ...]:
    """The small-batch tiles (BLOCK_M, BLOCK_N) of ``device``'s space (the interpreter's on the CPU)."""
    return INTERPRETER_SPACE["small_tiles"] if device == "cpu" else SMALL_TILES


def gemm_configs(n_in: int, device: str = "cuda", batch: int | None = None) -> list[dict[str, Any]]:
    """Every valid main-loop configuration for a K of ``n_in`` on ``device``, at any precision; at a
    ``batch`` up to ``SMALL_BATCH`` the small-batch tiles too. Fresh dicts in a fresh list: a
    caller may keep or change them."""
    small = batch is not None and batch <= SMALL_BATCH
    return [dict(c) for c in _gemm_space(n_in % 8 == 0, device == "cpu", small)]


@functools.cache
def _gemm_space(tma_ok: bool, interpreter: bool, small: bool) -> tuple[dict[str, Any], ...]:
    """``gemm_configs``, made once per (16-byte rows, the interpreter's space, small tiles). Walking
    the product took 10-80 ms a call on the CPU (~5,000 configurations at a small batch), paid by
    the runtime at each key's first call (``check_params``) and by the gaps scan at every batch."""
    space = INTERPRETER_SPACE if interpreter else {
        "tiles": TILES, "small_tiles": SMALL_TILES, "block_ks": BLOCK_KS, "small_block_ks": SMALL_BLOCK_KS,
        "stages": STAGES, "warps": WARPS, "groups": GROUPS}
    tiles = space["tiles"] + (space["small_tiles"] if small else ())
    tiled = [(tile, bk) for tile in tiles
             for bk in (space["small_block_ks"] if tile in space["small_tiles"] else space["block_ks"])]
    configs = []
    for ((bm, bn), bk), stages, warps, group, persistent, tma, operands in itertools.product(
            tiled, space["stages"], space["warps"], space["groups"], (True, False), (True, False), OPERANDS):
        if tma and not tma_ok:  # 16-byte row strides for float32 x and a bfloat16 W
            continue
        if (bm, bn) in space["small_tiles"] and warps != min(space["warps"]):
            continue  # 8 warps over a 16-row tile leave each warp a sliver of the tile
        if tma and operands == "round_kernel":
            continue  # x's tile rounded after a TMA load: wrong sums, run to run (see OPERANDS)
        config = {"block_m": bm, "block_n": bn, "block_k": bk, "stages": stages, "warps": warps,
                  "group_m": group, "persistent": persistent, "tma": tma, "operands": operands}
        accumulators = 2 if OPERANDS[operands][1] in SPLIT_MODES else 1  # split_dot: a k-slice's sum beside the total
        if stage_bytes(config) > STAGE_BYTES:
            continue
        if accumulators * bm * bn > MAX_ACC_PER_THREAD * 32 * warps:
            continue
        configs.append(config)
    return tuple(configs)


def stage_bytes(config: dict[str, Any]) -> int:
    """Shared memory the main loop's pipeline stages take: a BLOCK_M × BLOCK_K slice of x and a
    BLOCK_N × BLOCK_K slice of W per stage, at the operands' bytes per element."""
    _, _, x_bytes, w_bytes = OPERANDS[config["operands"]]
    return config["stages"] * (config["block_m"] * x_bytes + config["block_n"] * w_bytes) * config["block_k"]


def precision_configs(configs: list[dict[str, Any]], precision: str) -> list[dict[str, Any]]:
    """``configs`` whose operands serve ``precision``, its default first where valid."""
    mine = [c for c in configs if OPERANDS[c["operands"]][0] == precision]
    default = DEFAULTS.get(precision)
    return sorted(mine, key=lambda c: c != default)


def weight_operands(w: torch.Tensor, operands: str) -> Operand:
    """W's ``Operand`` for ``operands``: made once per weight and cached by the variant."""
    if operands in ("split_host", "split_trunc"):
        return (*split_tf32(w), None)
    if operands in ("round_host", "round_kernel"):
        hi = round_tf32(w)
        return hi, hi, None
    if operands == "cast_pass":
        wb = w.bfloat16()
        return wb, wb, None
    if operands in ("split_fp16", "scaled_fp16"):  # with the range check's WideCheck (``fp16_weight_parts``)
        parts, check = fp16_weight_parts(w.contiguous(), split=operands == "split_fp16")
        return (*parts, check)
    w = w.contiguous()
    return w, w, None


def input_operands(x: torch.Tensor, operands: str, weights: tuple | None = None,
                   tma_rows: int | None = None) -> Operand:
    """x's ``Operand`` for ``operands``: one pass over x where they need one (a Triton kernel for
    the TF32 parts: torch's bit operations took four passes, 0.046 ms at 1024×8192). The float16
    paths take W's cached operand and return (x's, W's for this call): the range check flags rows
    of both that the float16 parts cannot carry (``fp16_input_parts``). ``tma_rows``: the rows of
    x's TMA box, which bf16's cast and the float16 parts write whole (``host._WHOLE_TILES``)."""
    block = 4096
    if operands == "split_trunc":  # hi is x: the tensor cores truncate it
        lo = torch.empty_like(x)
        gemm_kernels().tf32_low_part[(-(-x.numel() // block),)](x, lo, x.numel(), BLOCK=block, num_warps=8)
        return x, lo, None
    if operands in ("split_host", "round_host"):
        split = operands == "split_host"
        hi = torch.empty_like(x)
        lo = torch.empty_like(x) if split else hi
        gemm_kernels().tf32_parts[(-(-x.numel() // block),)](x, hi, lo, x.numel(), SPLIT=split, BLOCK=block,
                                                              num_warps=8)
        return hi, lo, None
    if operands == "cast_pass":
        xb = x.bfloat16() if tma_rows is None else bfloat16_whole_tiles(x, tma_rows)
        return xb, xb, None
    if operands in ("split_fp16", "scaled_fp16"):
        return fp16_input_parts(x, operands == "split_fp16", weights[:3], weights[3], tma_rows)
    return x, x, None


def backward_gemms_for(params: dict[str, Any], precision: str):
    """How a triton variant's backward multiplies (``autograd.CublasGemms``): on float16 parts as
    its forward does under split_fp16 (``triton_backward.Fp16Gemms``), else through cuBLAS at the
    precision (scaled_fp16's tf32 included: see triton_backward)."""
    if params.get("operands") == "split_fp16" and precision == "fp32":
        from autofuse.kernels.triton.backward import Fp16Gemms

        return Fp16Gemms(params)
    return CUBLAS


class TritonVariant(Variant):
    """A problem's Triton kernels (``kernels``: the module, relative to the variant's package)."""

    kind = "triton"
    devices = ("cpu", "cuda")  # the CPU only under TRITON_INTERPRET=1: see unavailable_reason
    # A bfloat16 model (bfloat16 x, weights, biases, BN parameters and statistics) under bf16 only:
    # its x and W go to the bf16 main loop as they are, the epilogues compute in float32.
    dtypes = (torch.float32, torch.bfloat16)
    precisions = ("fp32", "tf32", "bf16")  # fp32 through a compensated split, so not ieee
    supports_autograd = True
    capturable = True  # launches on torch's current stream; W's copies are cached before a capture
    kernels: ClassVar[str] = ".triton_kernels"
    # (epilogue, MODE) pairs whose range-checked GEMM takes its exact pass in a launch of its own
    # even on a persistent grid (``gemm.persistent_gemm``: inline, its code can raise the kernel's spills).
    EXACT_APART: ClassVar[tuple[tuple[str, str], ...]] = ()

    @classmethod
    def admits(cls, device, dtype, precision, autograd):
        if dtype == torch.bfloat16 and precision != "bf16":
            return f"a bfloat16 model runs on bfloat16 operands: precision bf16 only, not {precision}"
        return super().admits(device, dtype, precision, autograd)

    @classmethod
    def unavailable_reason(cls, device: str) -> str | None:
        reason = super().unavailable_reason(device) or triton_missing()
        if reason is None and device == "cpu" and not interpreting():
            reason = "runs on cuda (on the CPU only under TRITON_INTERPRET=1, Triton's interpreter)"
        old_gpu = device == "cuda" and torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0)
        if reason is None and old_gpu:
            reason = f"needs tensor cores with TF32 (compute capability 8.0+), got {torch.cuda.get_device_capability()}"
        return reason

    in_dim: ClassVar[str] = "in_features"  # the shape parameter that is K
    batch_dim: ClassVar[str] = "batch_size"  # the one that is M: small batches add small tiles
    # Whether the forward's row finish can run inside the GEMM's launch: then each small tile also
    # comes with ``finish_inside`` (the last program to arrive finishes: ``gemm.persistent_gemm``'s
    # FINISH), where a second launch and the gap before it are a few µs of a call the weight's
    # read sets. The batch classes' seeds race it first up to FINISH_INSIDE_BATCH rows.
    finishes_inside: ClassVar[bool] = False

    def __init__(self, precision="fp32", **params):
        super().__init__(precision, **params)
        self._weights = FoldCache()
        self._arrivals = Arrivals()
        self.gemms = backward_gemms_for(self.params, precision)

    @classmethod
    def configs(cls, shape, device):
        configs = gemm_configs(shape[cls.in_dim], device, shape.get(cls.batch_dim))
        if not cls.finishes_inside:
            return configs
        small = small_tiles(device)
        return configs + [{**c, "finish_inside": True} for c in configs if (c["block_m"], c["block_n"]) in small]

    @classmethod
    def small_batch_seeds(cls, shape, device, precision, like):
        # One configuration per small tile: one program per tile (more programs), the deepest
        # k-slice that fits 3 stages or more, 4 stages where they fit, ``like``'s operand path and
        # TMA where valid. Tiles at least as tall as the batch first (the smallest such), so W is
        # read once: at batch 64 a 16-row tile read it four times and lost to the 128-row winner
        # (fp32 22, H100: 0.195 ms), which then served batch 32 at twice the small tiles' time.
        small = small_tiles(device)
        rows = min(shape.get(cls.batch_dim) or 1, max(bm for bm, _ in small))
        small = sorted(small, key=lambda tile: (tile[0] < rows, abs(tile[0] - rows), small.index(tile)))
        configs = [c for c in cls.configs_for(shape, device, precision) if (c["block_m"], c["block_n"]) in small]
        same = [c for c in configs if c["operands"] == like.get("operands") and c["tma"] == like.get("tma")]
        seeds = {}
        for config in sorted(same or configs, key=lambda c: (c["persistent"], c["stages"] < 3, -c["block_k"],
                                                             c["stages"] != 4)):
            if not config.get("finish_inside"):
                seeds.setdefault((config["block_m"], config["block_n"]), config)
        seeds = [seeds[tile] for tile in small if tile in seeds]
        if not cls.finishes_inside:
            return seeds
        inside_first = (shape.get(cls.batch_dim) or 1) <= FINISH_INSIDE_BATCH
        pairs = [({**c, "finish_inside": True}, c) if inside_first else (c, {**c, "finish_inside": True})
                 for c in seeds]
        return [config for pair in pairs for config in pair]

    @classmethod
    def configs_for(cls, shape, device, precision):
        return precision_configs(cls.configs(shape, device), precision)

    @classmethod
    def rows_per_tile(cls, params):
        return params.get("block_m")

    @classmethod
    def params_elsewhere(cls, params):
        # x left for the tensor cores to truncate (split_trunc) is 0.7-1% faster than split_host but
        # less accurate in its low parts (2⁻²² of x against 2⁻²³): it failed the fp32 gate where
        # split_host passed (matmul_gelu_softmax, 37×1004×777, large inputs: x's gradient 3.04e-5 >
        # 2.15e-5, 4× eager's; H100). So it serves the shapes it was gated at, split_host the rest.
        if params.get("operands") == "split_trunc":
            return {**params, "operands": "split_host"}
        return dict(params)

    @classmethod
    def only_where_gated(cls, params):
        # TF32 products: at batch 1 (and K = 1) cuBLAS's own TF32 mode evidently multiplies in
        # float32 (eager's error there was under 5e-4 where TF32 products gave 0.08 on 99's
        # gradient), so the tf32 gate's floor is float32's and large inputs failed it at batch 1
        # (22's gradient 0.0166; gemm_bn eval 2 of 777 outputs; H100), while batches 37 and up
        # passed. The tuner gates them at each shape it tunes; the nearest-batch fallback must
        # not carry them to shapes nobody checked.
        if OPERANDS[params.get("operands", "split_host")][0] == "tf32":
            return f"operands={params['operands']!r} (11-bit products) passes the tf32 gate only at some shapes"
        return None

    def build(self, device: str) -> None:
        self.module()

    def module(self):
        """The variant's kernel module (``kernels``, relative to its package; see ``kernel_module``)."""
        return kernel_module(self.kernels, type(self).__module__.rpartition(".")[0])

    def main_loop(self, xs: Operand, weights: Operand) -> dict[str, Any]:
        """The keyword arguments every kernel's main loop takes (``loop_operands``, W's descriptors
        made once per cached W), its constants, and the launch's warps and stages. ``xs`` and
        ``weights`` are ``operands()``'s (the operand, its low part, the float16 rows' scales)."""
        p, constants = self.params, self._loop_constants()
        split = constants["MODE"] in SPLIT_MODES
        w_descs = None
        if p["tma"]:
            cached = self.__dict__.get("_w_descs")
            if cached is None or cached[0] is not weights[0]:  # W's parts; the float16 paths' scales vary per call
                w_parts = (weights[0], weights[1] if split else None)
                cached = self._w_descs = (weights[0], descriptors(w_parts, p["block_n"], p["block_k"]))
            w_descs = cached[1]
        blocks = (p["block_m"], p["block_n"], p["block_k"]) if p["tma"] else None
        operands = loop_operands(xs, weights, split, blocks, w_descs)
        operands.update(constants, EVEN_K=xs[0].shape[1] % p["block_k"] == 0)
        return operands

    def _loop_constants(self) -> dict[str, Any]:
        """The main loop's constants and launch options: the same at every call."""
        constants = self.__dict__.get("_constants")
        if constants is None:
            p = self.params
            constants = self._constants = {
                "BLOCK_M": p["block_m"], "BLOCK_N": p["block_n"], "BLOCK_K": p["block_k"], "GROUP_M": p["group_m"],
                "MODE": self.mode(), "TMA": p["tma"], "INTERPRET": interpreting(), "num_warps": p["warps"],
                "num_stages": p["stages"]}
        return constants

    def mode(self) -> str:
        """The kernel's MODE for these operands (``OPERANDS``)."""
        served, mode, _, _ = OPERANDS[self.params["operands"]]
        if served != self.precision:
            raise InputError(f"{self.problem}/{self.name}: operands={self.params['operands']!r} serve "
                             f"precision {served!r}, not {self.precision!r}")
        return mode

    def operands(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, name: str):
        """(x, x's ``Operand``, W's ``Operand``, bias), checked and contiguous, errors naming
        expected and got. The first x is what the backward's GEMMs take: x itself, or
        under bf16 the bfloat16 copy made here (``backward_gemms`` would cast x again, a pass of
        0.13 ms at 16384×4096; eager under autocast keeps that copy too). W's operands derive from
        the parameter once and are cached until it changes; x's are made per call
        (``input_operands``). A bfloat16 model's x and W are the bf16 main loop's operands as they
        are (no pass, no copy); its bias stays bfloat16, which the epilogues load as float32. A
        missing bias is zeros of the model's dtype (an epilogue may read a bfloat16 model off it)."""
        n_out, n_in = weight.shape
        if not isinstance(x, torch.Tensor) or x.dim() != 2 or x.shape[1] != n_in:
            raise InputError(f"expected a 2-D input (batch, {n_in}), got {getattr(x, 'shape', type(x).__name__)}")
        dtype = self.model_dtype(weight)
        x_dtype = torch.bfloat16 if self.precision == "bf16" and x.dtype == torch.bfloat16 else dtype
        x = operand(x, "input", tuple(x.shape), x.device, x_dtype)
        w = operand(weight, f"{name}.weight", (n_out, n_in), x.device, dtype)
        operands = self.params["operands"]
        weights = self._weights.get([weight], lambda: weight_operands(w, operands), extra=(operands,))
        b = (torch.zeros(n_out, device=x.device, dtype=dtype) if bias is None
             else operand(bias, f"{name}.bias", (n_out,), x.device, dtype))
        x = x.detach().contiguous()
        tma_rows = self.params["block_m"] if self.params["tma"] else None
        if operands in ("split_fp16", "scaled_fp16"):
            xs, weights = input_operands(x, operands, weights, tma_rows)
        else:
            xs = input_operands(x, operands, tma_rows=tma_rows)
        return (xs[0] if xs[0].dtype == torch.bfloat16 else x), xs, weights, b

    def model_dtype(self, weight: torch.Tensor) -> torch.dtype:
        """The dtype of the model's tensors and of the output: bfloat16 for a bfloat16 model under
        bf16, else float32 (``operand`` then names any other dtype it gets)."""
        return torch.bfloat16 if self.precision == "bf16" and weight.dtype == torch.bfloat16 else torch.float32

    @staticmethod
    def backward_weight(weight: torch.Tensor, weights: Operand) -> torch.Tensor:
        """The weight the backward's cuBLAS GEMMs take: the bfloat16 copy under bf16, else the
        parameter itself (cuBLAS applies tf32 or fp32 to it as the precision says)."""
        return weights[0] if weights[0].dtype == torch.bfloat16 else weight.detach()

    def finish_counter(self, device: torch.device, save: bool) -> torch.Tensor | None:
        """The counter of a call whose row finish runs inside the GEMM's launch (``finish_inside``,
        ``host.Arrivals``), or None: the finish then takes a launch of its own, as it does for a
        call that keeps what a backward reads (the finish inside keeps nothing)."""
        return self._arrivals.counter(device) if self.params.get("finish_inside") and not save else None

    def launch_gemm(self, epilogue: str, xs: Operand, weights: Operand, args: tuple,
                    finish: tuple[str, tuple] | None = None) -> None:
        """x·Wᵀ through the shared main loop (``gemm.persistent_gemm``), each tile handed to
        ``epilogue`` (a ``@triton.jit`` function of the variant's kernel module) with ``args``, its
        own pointers and scalars; M, N and K are the operands' (``operands()``), the grid
        ``launch_grid``'s. ``finish``: (a function of the module, its arguments, a zeroed counter
        first: ``host.Arrivals``), run in the same launch after every tile (its FINISH)."""
        p, (m, k), n = self.params, xs[0].shape, weights[0].shape[0]
        grid = launch_grid(m, n, p["block_m"], p["block_n"], p["persistent"], xs[0].device)
        inline = p["persistent"] and (epilogue, self._loop_constants()["MODE"]) not in self.EXACT_APART
        extra = {} if finish is None else {"FINISH": self.module().epilogue(finish[0]), "finish_args": finish[1]}
        launch_main_loop(grid, inline, **self.main_loop(xs, weights), M=m, N=n, K=k, epilogue_args=args,
                         EPILOGUE=self.module().epilogue(epilogue), **extra)


