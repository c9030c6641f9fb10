"""The Triton GEMM main loop every ``triton`` variant shares (imported only when one is built).

``persistent_gemm`` is the loop over output tiles: it calls ``tile_coords`` and
``tile_accumulator``, then the problem's epilogue (a ``@triton.jit`` function of
``variants/<problem>/triton_kernels.py``, passed in as a constant) on the float32 accumulator
while it is still in registers. One kernel serves both schedules: launched with one program per
tile it is the classic grid; launched with one program per SM it is persistent, each program
walking tiles ``num_programs`` apart.

- Grouped ordering (``tile_coords``): GROUP_M row-blocks of x sweep every column block before
  the next group starts, so a band of x stays in L2 while W streams through.
- Operands: x (M×K) and W (N×K) are both K-major, as Hopper's tensor cores want them. With
  TMA they arrive through tensor descriptors (the copy engine, zero padding past the edges; x's
  operand pass writes whole row tiles, zeros included, as a box past x's rows slowed the GEMM:
  ``host._WHOLE_TILES``);
  otherwise through pointer loads whose rows past M or N are clamped to valid ones (their
  results are never stored) and whose K tail is masked only when K % BLOCK_K != 0.
- Precision (``operand_dot``, MODE): "3xtf32" is float32 accuracy from tensor cores: x = hi + lo
  and W = hi + lo, lo·hi + hi·lo + hi·hi per k-slice added to a float32 running sum
  (``split_dot``). W's parts are rounded to TF32 to nearest (cached). x's come two ways: both
  parts rounded to nearest by one pass per call (``tf32_parts``), or hi = x itself, which the
  tensor cores truncate to TF32 as they read it, and lo = x − trunc(x) rounded to nearest
  (``tf32_low_part``): the pass then writes lo alone, a third less traffic. Either way every
  part the tensor cores see stands for an exact TF32 number. "tf32" multiplies x and W rounded
  to TF32 to nearest on the host (W once, x by a pass per call: the tensor cores would truncate
  them, a bias the tf32 gate rejected).
  "tf32_round" is "tf32" with x rounded inside the kernel, after its tile's load (``round_tf32``:
  integer arithmetic on the bits), so no pass over x. Its products are bit for bit the pass's; it
  costs the main loop 3.5-5.7% where the pass costs 7.8-13% (H100, 1024×8192² and 16384×4096²;
  benchmarks/gpu/operand_paths.py --precision tf32). Pointer loads only: after a TMA load, Triton 3.6 gave
  sums that changed from run to run at some tiles (``triton_variant.OPERANDS``).
  "3xfp16" and "fp16" are "3xtf32" and "tf32" on float16 tensor cores (twice TF32's rate, half
  its bytes): ``fp16_row_parts`` scales each row of x (a pass per call) and of W (cached) by a
  power of two into float16's range and splits it (3xfp16) or rounds it (fp16) to float16, which
  keeps TF32's 11 significant bits; the tile's sum is unscaled exactly before the epilogue.
  Float16's range bounds each element's accuracy at its row's max·2⁻³⁹ (docs/precision.md).
  "bf16" multiplies bfloat16 operands (x cast by a pass, W's copy cached) and accumulates in
  float32; "ieee" is float32 FMA. No other mode changes an operand in registers between its load
  and the dot: on an H100 with Triton 3.6, splitting x in registers before a TF32 dot, or
  converting a float32 x tile of 64 columns to bfloat16 there, gave wrong sums (errors of 1e-5 to
  5e-2 and NaN where the interpreter and the host-side splits are exact).
- The fp32 backward (``triton_backward.Fp16Gemms``) multiplies with ``persistent_gemm`` and a
  plain float32 store for an epilogue (``store_tile``), on the float16 parts of dy's rows
  (``fp16_row_parts``) and of the columns of W, dy and x (``column_max`` over chunks of rows,
  then ``fp16_col_parts``,
  which merges the chunks' maxima and writes the parts transposed, K-major).
- Triton's interpreter (TRITON_INTERPRET=1, the CPU tests) multiplies bfloat16 blocks wrongly
  (numpy sees their raw bits), so under it (INTERPRET) bf16 operands are multiplied as float32:
  the same products, float32 sums. It multiplies float32 blocks exactly, so under it TF32
  products truncate their operands first, as the tensor cores do (``tensor_core_tf32``): a
  split that counted on the rounding (hi = x above) would be wrong on the GPU and right here.
"""

import triton
import triton.language as tl

from autofuse.kernels.triton.epilogue import bfloat16_round


@triton.jit
def tile_coords(tile, num_m, num_n, GROUP_M: tl.constexpr):
    """(row block, column block) of the ``tile``-th tile in grouped order."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % rows
    pid_n = (tile % per_group) // rows
    return pid_m, pid_n


@triton.jit
def split_dot(a, a_lo, b, b_lo, acc, TF32: tl.constexpr = True):
    """acc + (lo·hi + hi·lo + hi·hi) for one k-slice: 3xtf32 (TF32), or 3xfp16 on float16 parts.
    The slice's three products go into a fresh accumulator and that is added to the running sum by
    ordinary float32 additions. Chained through the tensor cores' own accumulator, the sum lost
    ~2⁻²³ of its magnitude at every step: 1e-5 to 5e-5 relative error at K = 1000 to 8192 on an
    H100 (a separate accumulator for the small terms alone left 1.9e-5), where 3xTF32 should give
    ~1e-7."""
    if TF32:
        part = tl.dot(a_lo, b, tl.zeros_like(acc), input_precision="tf32")
        part = tl.dot(a, b_lo, part, input_precision="tf32")
        part = tl.dot(a, b, part, input_precision="tf32")
    else:
        part = tl.dot(a_lo, b, tl.zeros_like(acc))
        part = tl.dot(a, b_lo, part)
        part = tl.dot(a, b, part)
    return acc + part


@triton.jit
def tensor_core_tf32(v):
    """``v`` (float32) as a TF32 tensor core reads it: the low 13 mantissa bits dropped (truncation).
    The interpreter's model of the hardware; the GPU does it in the multiply itself."""
    return (v.to(tl.uint32, bitcast=True) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def round_tf32(v):
    """``v`` (float32) rounded to TF32 to nearest, ties away from zero (as cvt.rna.tf32.f32), in
    bits: inf stays inf, a quiet NaN a NaN. The passes (``tf32_parts``, ``tf32_low_part``) round
    x's parts with it, "tf32_round" x's tile in the main loop."""
    return ((v.to(tl.uint32, bitcast=True) + 0x1000) & 0xFFFFE000).to(tl.float32, bitcast=True)


@triton.jit
def operand_dot(a, a_lo, b, b_lo, acc, MODE: tl.constexpr, INTERPRET: tl.constexpr):
    """acc + a·b (a: BM×BK, b: BK×BN) in MODE; a_lo and b_lo are read under 3xtf32 and 3xfp16 only."""
    if MODE == "fp16" or MODE == "3xfp16":
        if INTERPRET:  # numpy would sum float16 blocks in float16; their products are exact in float32
            a = a.to(tl.float32)
            b = b.to(tl.float32)
            if MODE == "3xfp16":
                return split_dot(a, a_lo.to(tl.float32), b, b_lo.to(tl.float32), acc)
            return tl.dot(a, b, acc, input_precision="ieee")
        if MODE == "3xfp16":
            return split_dot(a, a_lo, b, b_lo, acc, TF32=False)
        return tl.dot(a, b, acc)
    if MODE == "tf32_round":
        a = round_tf32(a)
    if INTERPRET and (MODE == "3xtf32" or MODE == "tf32" or MODE == "tf32_round"):
        a = tensor_core_tf32(a)
        b = tensor_core_tf32(b)
        if MODE == "3xtf32":
            a_lo = tensor_core_tf32(a_lo)
            b_lo = tensor_core_tf32(b_lo)
    if MODE == "3xtf32":
        return split_dot(a, a_lo, b, b_lo, acc)
    elif MODE == "bf16":
        if INTERPRET:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        return tl.dot(a, b, acc)
    elif MODE == "tf32" or MODE == "tf32_round":
        return tl.dot(a, b, acc, input_precision="tf32")
    else:
        return tl.dot(a, b, acc, input_precision="ieee")


@triton.jit
def load_k_slice(ptr, offsets, k_ok, EVEN_K: tl.constexpr):
    """A tile of a K-major operand; the K tail masked only where K % BLOCK_K != 0."""
    if EVEN_K:
        return tl.load(ptr + offsets)
    return tl.load(ptr + offsets, mask=k_ok, other=0.0)


@triton.jit
def tile_accumulator(x_ptr, x_lo_ptr, w_ptr, w_lo_ptr, x_desc, x_lo_desc, w_desc, w_lo_desc, x_scale_ptr, w_scale_ptr,
                     M, N, K, pid_m, pid_n,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     MODE: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                     INTERPRET: tl.constexpr):
    """x[rows]·W[cols]ᵀ for one BLOCK_M × BLOCK_N tile, accumulated in float32.

    x and W (and under 3xtf32 their low parts) are row-major with row strides K (contiguous).
    With TMA the descriptors (block shapes [BLOCK_M, BLOCK_K] and [BLOCK_N, BLOCK_K]) are read
    and the pointers are unused; otherwise the reverse. The low parts are read under 3xtf32 and
    3xfp16 only; under fp16 and 3xfp16 the sum is of scaled operands (``fp16_row_parts``), and the
    rows' and columns' inverse scales (x_scale_ptr, w_scale_ptr: powers of two) undo that exactly.
    A negative scale marks a row the float16 parts cannot carry (the range check: ``fp16_row_parts``);
    its tile is multiplied here all the same, and ``persistent_gemm`` multiplies it again from the
    float32 originals. Skipping such a tile's main loop here made the loop's trip count depend on
    a load at every tile, which cost ordinary inputs up to 6% of tf32's forward (gemm_bn training
    at 16384: 1.323 ms against 1.248 without the check; without the skip 1.251 against 1.234;
    H100), to save time on tiles that are rare.
    """
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_tiles = tl.cdiv(K, BLOCK_K)
    if TMA:
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        for kt in range(0, k_tiles):
            a = x_desc.load([off_m, kt * BLOCK_K])
            b = w_desc.load([off_n, kt * BLOCK_K]).T
            a_lo = a
            b_lo = b
            if MODE == "3xtf32" or MODE == "3xfp16":
                a_lo = x_lo_desc.load([off_m, kt * BLOCK_K])
                b_lo = w_lo_desc.load([off_n, kt * BLOCK_K]).T
            acc = operand_dot(a, a_lo, b, b_lo, acc, MODE, INTERPRET)
    else:
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.where(rm < M, rm, 0)  # rows past the edge read row 0; their results are never stored
        rn = tl.where(rn < N, rn, 0)
        rk = tl.arange(0, BLOCK_K)
        a_offsets = rm[:, None].to(tl.int64) * K + rk[None, :]
        b_offsets = rn[:, None].to(tl.int64) * K + rk[None, :]
        for kt in range(0, k_tiles):
            k_ok = rk[None, :] < K - kt * BLOCK_K
            a = load_k_slice(x_ptr, a_offsets, k_ok, EVEN_K)
            b = load_k_slice(w_ptr, b_offsets, k_ok, EVEN_K).T
            a_lo = a
            b_lo = b
            if MODE == "3xtf32" or MODE == "3xfp16":
                a_lo = load_k_slice(x_lo_ptr, a_offsets, k_ok, EVEN_K)
                b_lo = load_k_slice(w_lo_ptr, b_offsets, k_ok, EVEN_K).T
            acc = operand_dot(a, a_lo, b, b_lo, acc, MODE, INTERPRET)
            a_offsets += BLOCK_K
            b_offsets += BLOCK_K
    if MODE == "fp16" or MODE == "3xfp16":
        rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=0.0)
        acc = acc * x_scale[:, None] * w_scale[None, :]  # powers of two, one at a time: exact
    return acc


@triton.jit
def any_flagged(scale_ptr, rows, BLOCK: tl.constexpr = 1024):
    """Whether any of ``rows`` inverse scales is negative (a flagged row: ``fp16_row_parts``)."""
    offsets = tl.arange(0, BLOCK)
    least = tl.full((BLOCK,), 1.0, tl.float32)
    for start in range(0, rows, BLOCK):
        least = tl.minimum(least, tl.load(scale_ptr + start + offsets, mask=start + offsets < rows, other=1.0))
    return tl.min(least, axis=0) < 0


@triton.jit
def tile_flagged(x_scale_ptr, w_scale_ptr, M, N, pid_m, pid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Whether a row of the tile's x or W is flagged (a negative inverse scale: ``fp16_row_parts``)."""
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    x_scale = tl.load(x_scale_ptr + rows, mask=rows < M, other=1.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < N, other=1.0)
    return (tl.min(x_scale, axis=0) < 0) | (tl.min(w_scale, axis=0) < 0)


@triton.jit
def exact_tile(x_ptr, w_ptr, x_strides, w_strides, M, N, K, pid_m, pid_n, BLOCK_M: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, TF32: tl.constexpr = False):
    """x[rows]·W[cols]ᵀ from the float32 originals, for the range check's flagged tiles (the main
    loop's launch with EXACT_PASS): in float32 FMA, each k-slice summed apart and added, as
    ``split_dot`` does; or (TF32, the tf32 precision's "fp16" mode) on TF32 tensor cores, the
    originals rounded to TF32 to nearest (``round_tf32``): float32's range at the precision's 11
    bits, what cuBLAS's TF32 multiplies. A launch of its own: inside the fast kernel this path's
    registers (a slice accumulator beside the tile's, its FMA operands) raised ptxas's spill stores
    of the fp32 128×128 kernels (sm_90) from 264-300 to 592-724 bytes and cost the training step
    2-7% (gemm_bn, 99; H100), for tiles that are rare; apart, gemm_bn's fast kernels spill 0-28
    bytes and 99's forward 688 (1256 with the chained path inside). The originals are read through
    their (row, k) strides, so a transposed view serves (the backward's dyᵀ, Wᵀ and xᵀ; a stride of
    1 is a constant to Triton, so the forward's loads stay contiguous)."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    carry = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # what acc's additions rounded off (fp32)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.where(rm < M, rm, 0)
    rn = tl.where(rn < N, rn, 0)
    rk = tl.arange(0, BLOCK_K)
    a_offsets = rm[:, None].to(tl.int64) * x_strides[0] + rk[None, :].to(tl.int64) * x_strides[1]
    b_offsets = rn[:, None].to(tl.int64) * w_strides[0] + rk[None, :].to(tl.int64) * w_strides[1]
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk[None, :] < K - kt * BLOCK_K
        a = tl.load(x_ptr + a_offsets, mask=k_ok, other=0.0)
        b = tl.load(w_ptr + b_offsets, mask=k_ok, other=0.0).T
        if TF32:
            acc = tl.dot(round_tf32(a), round_tf32(b), acc, input_precision="tf32")
        else:
            # The slice's sum added by fma(part, 1, acc): Triton folds acc + dot(a, b, 0) into
            # dot(a, b, acc), one FMA chain over all of K (3-5x cuBLAS fp32's error at K = 1000, H100).
            part = tl.dot(a, b, tl.zeros_like(acc), input_precision="ieee")
            total = tl.fma(part, 1.0, acc)
            # The addition's rounding error, exactly (TwoSum), summed apart: a row carried by a few
            # large terms keeps a large running sum, and adding every later slice to it rounded at
            # its scale (99, W rows 1e6 wide: 2.1x cuBLAS fp32's error, H100).
            back = total - acc
            carry += (acc - (total - back)) + (part - back)
            acc = total
        a_offsets += BLOCK_K * x_strides[1]
        b_offsets += BLOCK_K * w_strides[1]
    return acc + carry


@triton.jit
def fp16_scale(largest):
    """(s, 1/s) for a largest |value| (a float32 scalar or block): s = 2^e puts it in [2¹⁴, 2¹⁵),
    |e| ≤ 126 so both stay normal. The row and column passes share it, so their parts agree bit
    for bit (``fp16_row_parts`` says why these bounds)."""
    biased = (largest.to(tl.int32, bitcast=True) >> 23) & 0xFF  # the exponent, 127-biased
    e = tl.minimum(tl.maximum(14 - (biased - 127), -126), 126)
    return ((e + 127) << 23).to(tl.float32, bitcast=True), ((127 - e) << 23).to(tl.float32, bitcast=True)


@triton.jit
def fp16_row_parts(src_ptr, hi_ptr, lo_ptr, inv_scale_ptr, K, n_rows, SPLIT: tl.constexpr, BLOCK: tl.constexpr,
                   col_weight_ptr=None, col_max_ptr=None, FLAG: tl.constexpr = False,
                   STATS: tl.constexpr = False):
    """One row of a float32 operand (K long, contiguous) per program, for the fp16 modes: s = 2^e
    puts the row's largest |value| in [2¹⁴, 2¹⁵), hi = float16(v·s) rounded to nearest (even),
    with SPLIT lo = float16(v·s − hi), and 1/s to inv_scale_ptr.

    v·s is exact, so hi is v rounded to 11 significant bits, as TF32 to nearest would round it,
    for every |v| down to the row's max·2⁻²⁸ (float16's normal range); below that the float16
    spacing 2⁻²⁴ (of the scaled row) bounds the error at max·2⁻³⁹. hi + lo is v to 2⁻²² of its
    magnitude likewise (lo underflows below max·2⁻¹⁷, to the same absolute bound). e keeps s
    and 1/s normal (|e| ≤ 126), so an all-zero or denormal row is scaled less; a row holding inf
    gets s = 2⁻¹¹⁴ (inf·s stays inf). A NaN stays NaN: on an H100 the max passes over it and the
    row is scaled by its other values; the interpreter's max returns NaN and scales it as for inf
    (benchmarks/gpu/fp16_parts_edges.py: the GPU equals torch's arithmetic bit for bit otherwise,
    denormal rows included).

    The range check (docs/precision.md; FLAG or STATS) measures each element's loss beyond the
    parts' normal relative accuracy (2⁻²² of |v| split, 2⁻¹¹ not). FLAG (x, per call): the row's
    losses weighted by col_weight_ptr (W's column maxima, what a loss can reach) against the
    precision's own error on the row (``flag_row``); a flagged row's 1/s is stored negated. STATS
    (W, once per W, its parts cached): each column's max |value| into col_max_ptr (atomically, over
    rows), and 1/s negated where the range loses at least 1 element in WIDE_CANDIDATE. W's flag
    does not depend on x, so no pass over x per call: a per-call test weighted by x's column
    maxima took atomics over all of x, 0.12 ms at 1024×8192 on an H100 (benchmarks/gpu/wide_rows.py).
    Either way a split row whose sum rests on a few entries is flagged too (``few_terms``).

    Programs past ``n_rows`` write zero rows into hi and lo and nothing else: the rows that make
    x's parts whole TMA row tiles (``host.fp16_parts``)."""
    row = tl.program_id(0).to(tl.int64)
    real = row < n_rows
    loaded = tl.where(real, K, 0)  # a padding row reads nothing: its parts are zeros
    offsets = tl.arange(0, BLOCK)
    largest = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in range(0, K, BLOCK):
        v = tl.load(src_ptr + row * K + k + offsets, mask=k + offsets < loaded, other=0.0)
        largest = tl.maximum(largest, tl.abs(v))
        if STATS:
            column_max_update(col_max_ptr + k + offsets, tl.abs(v), k + offsets < K)
    s, inv_s = fp16_scale(tl.max(largest))
    tl.store(inv_scale_ptr + row, inv_s, mask=real)
    excess = tl.zeros((BLOCK,), dtype=tl.float32)
    budget = tl.zeros((BLOCK,), dtype=tl.float32)
    lost = tl.zeros((BLOCK,), dtype=tl.float32)
    terms = tl.zeros((BLOCK,), dtype=tl.float32)
    floor = tl.max(largest) * s * 5.9604644775390625e-08  # 2⁻²⁴ of the scaled row's max: ``few_terms``
    for k in range(0, K, BLOCK):
        ok = k + offsets < K
        v = tl.load(src_ptr + row * K + k + offsets, mask=k + offsets < loaded, other=0.0) * s
        hi = v.to(tl.float16)
        tl.store(hi_ptr + row * K + k + offsets, hi, mask=ok)
        if SPLIT:
            tl.store(lo_ptr + row * K + k + offsets, (v - hi.to(tl.float32)).to(tl.float16), mask=ok)
        if FLAG or STATS:
            loss = parts_loss(v, hi, SPLIT)
            if FLAG:
                c = tl.load(col_weight_ptr + k + offsets, mask=ok, other=0.0)
                excess += loss * c
                budget += tl.abs(v) * c
            if STATS:
                lost += (loss > 0).to(tl.float32)
            terms += (ok & (tl.abs(v) >= floor)).to(tl.float32)
    if FLAG or STATS:
        if FLAG:
            flagged = flag_row(tl.sum(excess), tl.sum(budget), SPLIT)
        else:
            flagged = tl.sum(lost) * WIDE_CANDIDATE >= K
        flagged = flagged | few_terms(tl.sum(terms), SPLIT)
        tl.store(inv_scale_ptr + row, tl.where(flagged, -inv_s, inv_s), mask=real)


# The range check's threshold: a row (or a column of the output) is flagged where the loss beyond the
# parts' normal accuracy could exceed WIDE_RHO of the precision's own error bound on it (unit roundoff
# ·Σ|x|·|W|: 2⁻²⁴ for fp32, 2⁻¹¹ for tf32). 1/4 keeps the excess, bounded worst case (every loss
# aligned, weighted by the column's largest |W|), under a quarter of what float32 itself may lose;
# ordinary rows sit ~2⁻¹⁵ below it (tests/interpreted/check_triton.py, wide_rows_flags).
WIDE_RHO = tl.constexpr(0.25)
# W's flagged rows: those where at least 1 element in WIDE_CANDIDATE loses more than the parts'
# normal accuracy, whatever x (the flag is made once, with W's cached parts). A randn row has
# ~K·2.4e-5 such elements (below max·2⁻¹⁷): never flagged; a row whose largest entries are over 2¹⁷
# (tf32: 2²⁸) times the rest has all the rest. A flagged row whose small entries x never reaches
# costs the exact path for nothing, never accuracy (tests/interpreted/check_triton.py, wide_rows_flags).
WIDE_CANDIDATE = tl.constexpr(64)
# The few-terms rule (split_fp16 only): a row with at most FEW_TERMS entries of 2⁻²⁴ of its max or
# more is flagged. hi + lo carries ~22 of float32's 24 bits, so each product errs up to ~2⁻²³ where
# float32's are exact; float32's rounding of its running sum outweighs that wherever many terms are
# added (0.6-0.9x cuBLAS fp32's error at K = 777-1024, a softmax-like dy included), but entries
# below 2⁻²⁴ of the sum leave float32's sum unchanged, so a row carried by a few entries M ≥ 2²⁴
# times the rest is all but exactly rounded there: dx and dW erred 1.6-3.6x cuBLAS fp32's on such
# rows, and at batch 1 (dW = dyᵀ·x: one product an element) 2.4-6.5x, on an H100. Ordinary rows
# longer than FEW_TERMS are never flagged. TF32's own products round to 11 bits, as the tf32 parts
# do: no rule there.
FEW_TERMS = tl.constexpr(16)


@triton.jit
def parts_loss(v, hi, SPLIT: tl.constexpr):
    """|v − parts| beyond the parts' normal relative accuracy (2⁻²² split, 2⁻¹¹ not), ≥ 0: what the
    float16 range (not its precision) loses of the scaled v."""
    rest = v - hi.to(tl.float32)
    if SPLIT:
        rest = rest - rest.to(tl.float16).to(tl.float32)
        return tl.maximum(tl.abs(rest) - 2.3841857910156250e-07 * tl.abs(v), 0.0)  # 2⁻²²
    return tl.maximum(tl.abs(rest) - 4.8828125e-04 * tl.abs(v), 0.0)  # 2⁻¹¹


@triton.jit
def few_terms(terms, SPLIT: tl.constexpr):
    """Under SPLIT, whether a row's count of entries within 2⁻²⁴ of its max (``terms``) is at most
    FEW_TERMS (an all-zero row counts every entry)."""
    if SPLIT:
        return terms <= FEW_TERMS
    return terms < 0  # never: the same shape as the rule's


@triton.jit
def flag_row(excess, budget, SPLIT: tl.constexpr):
    """excess > WIDE_RHO · unit roundoff · budget (fp32's 2⁻²⁴ under SPLIT, else tf32's 2⁻¹¹)."""
    if SPLIT:
        return excess > WIDE_RHO * 5.9604644775390625e-08 * budget
    return excess > WIDE_RHO * 4.8828125e-04 * budget


@triton.jit
def column_max_update(ptr, a, ok):
    """ptr[i] = max(ptr[i], a[i]) over every program, for non-negative a; the atomic only where a
    exceeds what is already there (a max only grows, so a stale read costs an atomic, never a value)."""
    current = tl.load(ptr, mask=ok, other=0.0)
    tl.atomic_max(ptr, a, mask=ok & (a > current))


@triton.jit
def column_max(src_ptr, part_ptr, R, C, CHUNK, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, row_max_ptr=None):
    """Per column of a float32 src (R × C, contiguous), max |value| over one CHUNK of rows (the
    launch's second axis) into part_ptr (chunks × C): the first half of ``fp16_col_parts``, split
    over rows so a tall src keeps every SM busy (one program per column block read 1.1 TB/s at
    16384×4096 on an H100). With row_max_ptr (R + 1 floats, zeroed) each row's max |value| goes
    there too and src's max into its last slot, by ``column_max_update`` (an atomic only where a
    value beats what is stored): the range check's weights for the other operand of dW = dyᵀ·x."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    first = tl.program_id(1) * CHUNK
    rows = tl.arange(0, BLOCK_R)
    largest = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    for r in range(first, tl.minimum(first + CHUNK, R), BLOCK_R):
        mask = ((r + rows) < R)[:, None] & col_ok[None, :]
        v = tl.abs(tl.load(src_ptr + (r + rows)[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0))
        largest = tl.maximum(largest, v)
        if row_max_ptr is not None:
            column_max_update(row_max_ptr + r + rows, tl.max(v, axis=1), (r + rows) < R)
    block_max = tl.max(largest, axis=0)
    tl.store(part_ptr + tl.program_id(1) * C + cols, block_max, mask=col_ok)
    if row_max_ptr is not None:
        tl.atomic_max(row_max_ptr + R, tl.max(block_max))


@triton.jit
def fp16_col_parts(src_ptr, part_ptr, hi_ptr, lo_ptr, inv_scale_ptr, R, C, CHUNK, CHUNKS, SPLIT: tl.constexpr,
                   BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr, row_weight_ptr=None,
                   loss_ptr=None, FLAG: tl.constexpr = False, STATS: tl.constexpr = False):
    """``fp16_row_parts`` of srcᵀ, without a transposed copy: src is float32 (R × C, contiguous),
    hi and lo are float16 (C × R, contiguous), scaled per column of src by the max of its CHUNKS
    partial maxima (``column_max``); one program per column block and CHUNK of rows. The
    backward's GEMMs contract over the batch for dW = dyᵀ·x and over W's rows for dx = dy·W: those
    operands' K-major forms (``triton_backward``). A max is a max in any order, so the scales and
    parts are ``fp16_row_parts``'s of the transposed copy, bit for bit, and so are its bounds.

    The range check, in halves: this pass writes each chunk's share to loss_ptr and ``column_flags``
    merges the chunks. FLAG (dy's and x's columns, per call): the column's losses and |values|
    weighted by the other operand's row maxima (row_weight_ptr, R + 1 floats, their max last:
    ``column_max``); STATS (W's columns, once per W): the count of losing elements. Both with the
    count of entries within 2⁻²⁴ of the column's max (``few_terms``): (3 or 2 × CHUNKS × C)
    sums. The rules are ``fp16_row_parts``'s."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    chunks = tl.arange(0, BLOCK_P)
    parts = tl.load(part_ptr + chunks[:, None] * C + cols[None, :], mask=(chunks < CHUNKS)[:, None] & col_ok[None, :],
                    other=0.0)
    s, inv_s = fp16_scale(tl.max(parts, axis=0))
    if tl.program_id(1) == 0:
        tl.store(inv_scale_ptr + cols, inv_s, mask=col_ok)
    first = tl.program_id(1) * CHUNK
    rows = tl.arange(0, BLOCK_R)
    excess = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    budget = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    terms = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
    floor = tl.max(parts, axis=0) * s * 5.9604644775390625e-08  # 2⁻²⁴ of the scaled column's max
    if FLAG:  # the weights over their max, so the sums stay finite at any range
        norm = 1.0 / tl.maximum(tl.load(row_weight_ptr + R), 1.1754943508222875e-38)
    for r in range(first, tl.minimum(first + CHUNK, R), BLOCK_R):
        mask = ((r + rows) < R)[:, None] & col_ok[None, :]
        v = tl.load(src_ptr + (r + rows)[:, None].to(tl.int64) * C + cols[None, :], mask=mask, other=0.0) * s[None, :]
        hi = v.to(tl.float16)
        out = cols[:, None].to(tl.int64) * R + (r + rows)[None, :]
        tl.store(hi_ptr + out, tl.trans(hi), mask=tl.trans(mask))
        if SPLIT:
            tl.store(lo_ptr + out, tl.trans((v - hi.to(tl.float32)).to(tl.float16)), mask=tl.trans(mask))
        if FLAG or STATS:
            loss = parts_loss(v, hi, SPLIT)
            if FLAG:
                weight = tl.load(row_weight_ptr + r + rows, mask=(r + rows) < R, other=0.0) * norm
                excess += loss * weight[:, None]
                budget += tl.abs(v) * weight[:, None]
            else:
                excess += (loss > 0).to(tl.float32)
            terms += (mask & (tl.abs(v) >= floor[None, :])).to(tl.float32)
    if FLAG or STATS:
        tl.store(loss_ptr + tl.program_id(1) * C + cols, tl.sum(excess, axis=0), mask=col_ok)
        tl.store(loss_ptr + (CHUNKS + tl.program_id(1)) * C + cols, tl.sum(terms, axis=0), mask=col_ok)
    if FLAG:
        tl.store(loss_ptr + (2 * CHUNKS + tl.program_id(1)) * C + cols, tl.sum(budget, axis=0), mask=col_ok)


@triton.jit
def column_flags(loss_ptr, inv_scale_ptr, R, C, CHUNKS, SPLIT: tl.constexpr, FLAG: tl.constexpr,
                 BLOCK_C: tl.constexpr, BLOCK_P: tl.constexpr):
    """The range check's second half for ``fp16_col_parts``: each column's chunk sums merged, and its
    inverse scale negated where the column is flagged, by ``flag_row``'s rule (FLAG) or by the count
    rule of W's rows (1 element in WIDE_CANDIDATE), or by ``few_terms``. One program per column
    block; it reads (3 or 2) × CHUNKS × C floats, at most a 128th of the elements the parts pass
    reads (a chunk is 256+ rows)."""
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_ok = cols < C
    chunks = tl.arange(0, BLOCK_P)
    mask = (chunks < CHUNKS)[:, None] & col_ok[None, :]
    excess = tl.sum(tl.load(loss_ptr + chunks[:, None] * C + cols[None, :], mask=mask, other=0.0), axis=0)
    terms = tl.sum(tl.load(loss_ptr + (CHUNKS + chunks[:, None]) * C + cols[None, :], mask=mask, other=0.0), axis=0)
    if FLAG:
        budget = tl.sum(tl.load(loss_ptr + (2 * CHUNKS + chunks[:, None]) * C + cols[None, :], mask=mask, other=0.0),
                        axis=0)
        flagged = flag_row(excess, budget, SPLIT)
    else:
        flagged = excess * WIDE_CANDIDATE >= R
    flagged = flagged | few_terms(terms, SPLIT)
    inv_s = tl.load(inv_scale_ptr + cols, mask=col_ok, other=1.0)
    tl.store(inv_scale_ptr + cols, tl.where(flagged, -inv_s, inv_s), mask=col_ok)


@triton.jit
def persistent_gemm(x_ptr, x_lo_ptr, w_ptr, w_lo_ptr, x_desc, x_lo_desc, w_desc, w_lo_desc, x_scale_ptr, w_scale_ptr,
                    epilogue_args, M, N, K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    GROUP_M: tl.constexpr, MODE: tl.constexpr, TMA: tl.constexpr, EVEN_K: tl.constexpr,
                    INTERPRET: tl.constexpr, EPILOGUE: tl.constexpr, x32_ptr=None, w32_ptr=None,
                    EXACT_K: tl.constexpr = 0, x32_strides=None, w32_strides=None, EXACT_PASS: tl.constexpr = False,
                    EXACT_INLINE: tl.constexpr = False, FINISH: tl.constexpr = None, finish_args=None):
    """x·Wᵀ (M × N) tile by tile, each tile's float32 accumulator handed to EPILOGUE in registers:
    the main loop of every ``triton`` variant's forward and of the fp32 backward's GEMMs, written once.

    EPILOGUE is a ``@triton.jit`` function ``(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N,
    args)``: the tile's rows and columns, which of them lie inside the output, the tile's block
    coordinates and the column block count (for per-tile partial results), and ``epilogue_args``, a
    tuple of the epilogue's own pointers and scalars. Triton specializes each item of that tuple as
    it would an argument (a None is a constant, so ``if ptr is not None`` is decided at compile
    time) and inlines EPILOGUE, so a kernel is what it was when each problem wrote this loop out
    (tests/test_triton_compiles_for_hopper.py compiles each one for sm_90). The operands stay
    separate arguments: Triton 3.6's CUDA launcher unpacks tensor descriptors at the top level only.
    The arguments keep the order the per-problem kernels had (operands, the epilogue's, M, N, K):
    with M, N, K before the epilogue's, ptxas allocated registers otherwise and a tf32
    clamp_lse_partials kernel at 255 registers spilled where it had not.

    The range check's exact path (EXACT_K > 0; ``host.launch_main_loop``): the main loop takes every
    tile as it is; then the flagged tiles (``tile_flagged``) are multiplied again from the float32
    originals ``x32_ptr`` and ``w32_ptr`` through their (row, k) strides (tuples; ``exact_tile``)
    and handed to EPILOGUE again, which overwrites what the first wrote (an epilogue writes each
    tile's outputs and partials whole, never accumulating). With EXACT_INLINE each program does so
    for its own tiles after its main loop, in the same launch; with EXACT_PASS a second launch
    does it. Where programs hold several tiles, one look at all the scales first ends the exact
    part on ordinary inputs. None and 0 where the check is off.

    The second launch, even when it found nothing, cost ordinary inputs 1.2-4.0% of the tf32
    forward (22, 99, gemm_bn eval) and 1.7-2.1% of the fp32 training step (22, 99, gemm_bn at
    1024); inline, the tf32 forward costs 0.2-2.0% over no check and the fp32 forward and step
    none (H100, benchmarks/gpu/wide_rows.py). Its code raises the kernel's spills, though: gemm_bn's
    tf32 training epilogue lost 3.0-5.4% with it, so a variant keeps the second launch there
    (``TritonVariant.EXACT_APART``). Written as the second launch's part is (a where on the tile
    count, the barrier inside each flagged tile's branch), the inline part cost 99's tf32 forward
    4.7%; as below, 2.0%.

    FINISH (a ``@triton.jit`` function ``(M, N, num_n, args)``, or None): what the call does after
    the GEMM, run by the program that arrives last at the counter ``finish_args[0]``
    (``last_to_arrive``: each program arrives once, after its tiles and their exact redo), with
    ``finish_args``: a row merge that would otherwise take a launch of its own. Where the exact
    path takes a second launch, that launch finishes.
    """
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    tiles = num_m * num_n
    if not EXACT_PASS:
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
            rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            acc = tile_accumulator(x_ptr, x_lo_ptr, w_ptr, w_lo_ptr, x_desc, x_lo_desc, w_desc, w_lo_desc,
                                   x_scale_ptr, w_scale_ptr, M, N, K, pid_m, pid_n, BLOCK_M, BLOCK_N, BLOCK_K, MODE,
                                   TMA, EVEN_K, INTERPRET)
            EPILOGUE(acc, rm, rn, rm < M, rn < N, pid_m, pid_n, num_n, M, N, epilogue_args)
    if EXACT_INLINE:  # a persistent grid: one look at all the scales ends it on ordinary inputs
        if any_flagged(x_scale_ptr, M) | any_flagged(w_scale_ptr, N):
            tl.debug_barrier()  # this program's fast stores, by other threads, land before its exact ones
            for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
                redo_if_flagged(tile, x32_ptr, w32_ptr, x32_strides, w32_strides, x_scale_ptr, w_scale_ptr,
                                epilogue_args, M, N, K, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M, EXACT_K,
                                MODE == "fp16", EPILOGUE)
    if EXACT_PASS:
        if tl.num_programs(0) < tiles:  # several tiles a program: the same look first
            tiles = tl.where(any_flagged(x_scale_ptr, M) | any_flagged(w_scale_ptr, N), tiles, 0)
        for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
            redo_if_flagged(tile, x32_ptr, w32_ptr, x32_strides, w32_strides, x_scale_ptr, w_scale_ptr,
                            epilogue_args, M, N, K, num_m, num_n, BLOCK_M, BLOCK_N, GROUP_M, EXACT_K,
                            MODE == "fp16", EPILOGUE)
    if FINISH is not None and (EXACT_K == 0 or EXACT_INLINE or EXACT_PASS):  # this launch ends the call
        if last_to_arrive(finish_args[0], tl.num_programs(0)):
            FINISH(M, N, num_n, finish_args)


@triton.jit
def redo_if_flagged(tile, x32_ptr, w32_ptr, x32_strides, w32_strides, x_scale_ptr, w_scale_ptr, epilogue_args,
                    M, N, K, num_m, num_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr,
                    EXACT_K: tl.constexpr, TF32: tl.constexpr, EPILOGUE: tl.constexpr):
    """``tile`` again from the float32 originals (``exact_tile``) through EPILOGUE, if flagged."""
    pid_m, pid_n = tile_coords(tile, num_m, num_n, GROUP_M)
    if tile_flagged(x_scale_ptr, w_scale_ptr, M, N, pid_m, pid_n, BLOCK_M, BLOCK_N):
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        acc = exact_tile(x32_ptr, w32_ptr, x32_strides, w32_strides, M, N, K, pid_m, pid_n, BLOCK_M, BLOCK_N,
                         EXACT_K, TF32)
        EPILOGUE(acc, rm, rn, rm < M, rn < N, pid_m, pid_n, num_n, M, N, epilogue_args)


@triton.jit
def last_to_arrive(arrivals_ptr, arrivals):
    """Whether this program is the ``arrivals``-th to arrive at the int32 counter ``arrivals_ptr``
    (0 when the launch starts): the one program that may then read what every other stored before
    arriving, and so finish the launch's work in it (``persistent_gemm``'s FINISH: one launch a call
    where a second kernel would cost its launch and the gap before it). That program sets the
    counter back to 0 for the next launch (``host.Arrivals`` hands out the counters).

    The atomic is one thread's: the barrier before it puts the stores of every warp of this program
    ahead of its release, and the barrier after it every warp's loads behind its acquire (the
    pattern of CUTLASS's semaphore). Under the interpreter the programs run one after another and
    the last one finishes."""
    tl.debug_barrier()
    ticket = tl.atomic_add(arrivals_ptr, 1, sem="acq_rel", scope="gpu")
    tl.debug_barrier()
    last = ticket == arrivals - 1
    tl.store(arrivals_ptr, 0, mask=last)
    return last


@triton.jit
def store_tile(acc, rm, rn, row_ok, col_ok, pid_m, pid_n, num_n, M, N, args):
    """The epilogue of a GEMM and nothing else: out = x·Wᵀ (args: ``(out_ptr,)``, M × N float32).
    The backward's GEMMs on float16 parts (``triton_backward``) take it."""
    out_ptr = args[0]
    tl.store(out_ptr + rm[:, None].to(tl.int64) * N + rn[None, :], acc, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def tf32_parts(src_ptr, hi_ptr, lo_ptr, n, SPLIT: tl.constexpr, BLOCK: tl.constexpr):
    """hi = src rounded to TF32 to nearest (ties away, as cvt.rna.tf32.f32), and with SPLIT
    lo = (src − hi) rounded likewise: x's operands for "tf32"/"3xtf32", one pass over x. In bits
    (inf and NaN stay what they are), so the interpreter runs it too."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    v = tl.load(src_ptr + offsets, mask=ok, other=0.0)
    hi = round_tf32(v)
    tl.store(hi_ptr + offsets, hi, mask=ok)
    if SPLIT:
        tl.store(lo_ptr + offsets, round_tf32(v - hi), mask=ok)


@triton.jit
def bfloat16_padded(src_ptr, out_ptr, n, n_out, BLOCK: tl.constexpr):
    """out[:n] = src (float32) rounded to bfloat16 as torch rounds it (``bfloat16_round``) and
    out[n:n_out] = 0, in one pass: bf16's x in whole row tiles (``host.bfloat16_whole_tiles``)."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    v = tl.load(src_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(out_ptr + offsets, bfloat16_round(v).to(tl.bfloat16), mask=offsets < n_out)


@triton.jit
def tf32_low_part(src_ptr, lo_ptr, n, BLOCK: tl.constexpr):
    """lo = (src − trunc(src)) rounded to TF32 to nearest: x's low part when its high part is x
    itself, truncated by the tensor cores (``tensor_core_tf32``). One pass writing lo alone.
    trunc(src) + lo is src to 2⁻²² of its magnitude (lo has up to 13 significant bits, of which
    TF32 keeps 11); inf and NaN give a NaN lo, as src − src does."""
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offsets < n
    v = tl.load(src_ptr + offsets, mask=ok, other=0.0)
    tl.store(lo_ptr + offsets, round_tf32(v - tensor_core_tf32(v)), mask=ok)


@triton.jit
def transpose(src_ptr, dst_ptr, rows, cols, BLOCK: tl.constexpr):
    """dst = srcᵀ for a contiguous float32 src (rows × cols) into a contiguous dst (cols × rows),
    one BLOCK × BLOCK tile per program: a K-major operand for the backward's GEMMs (autograd.py)."""
    r = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = (r[:, None] < rows) & (c[None, :] < cols)
    tile = tl.load(src_ptr + r[:, None] * cols + c[None, :], mask=inside)
    tl.store(dst_ptr + c[:, None] * rows + r[None, :], tl.trans(tile), mask=tl.trans(inside))
