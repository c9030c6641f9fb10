"""The triton kind's search space and operand preparation, without running a kernel."""

import pytest
import torch

from autofuse.core import registry
from autofuse.kernels.triton import variant as tv


def test_each_precision_searches_its_own_operand_paths_its_default_first():
    configs = tv.gemm_configs(8192)
    for precision, default in tv.DEFAULTS.items():
        mine = tv.precision_configs(configs, precision)
        assert mine[0] == default
        assert {tv.OPERANDS[c["operands"]][0] for c in mine} == {precision}


def test_no_configuration_overflows_shared_memory_or_registers():
    for c in tv.gemm_configs(8192):
        _, _, x_bytes, w_bytes = tv.OPERANDS[c["operands"]]
        assert c["stages"] * (c["block_m"] * x_bytes + c["block_n"] * w_bytes) * c["block_k"] <= tv.STAGE_BYTES
        accumulators = 2 if c["operands"] in ("split_host", "split_trunc") else 1
        assert accumulators * c["block_m"] * c["block_n"] <= tv.MAX_ACC_PER_THREAD * 32 * c["warps"]


def test_tma_only_where_rows_are_16_byte_aligned():
    assert not any(c["tma"] for c in tv.gemm_configs(1000 + 4))  # K % 8 != 0: bfloat16 rows misaligned
    assert any(c["tma"] for c in tv.gemm_configs(1000))


def test_the_interpreter_space_has_small_tiles():
    assert {(c["block_m"], c["block_n"]) for c in tv.gemm_configs(40, "cpu")} <= {(16, 16), (32, 16)}


def test_tf32_rounding_is_to_nearest_ties_away_and_keeps_inf_and_nan():
    one_ulp = 2.0 ** -10  # TF32 keeps 10 mantissa bits
    values = torch.tensor([1.0 + one_ulp * 0.49, 1.0 + one_ulp * 0.5, -(1.0 + one_ulp * 0.51), float("inf"), float("nan")])
    got = tv.round_tf32(values)
    assert got[:3].tolist() == [1.0, 1.0 + one_ulp, -(1.0 + one_ulp)]
    assert got[3] == float("inf") and got[4].isnan()
    assert (got[:3].view(torch.int32) & 0x1FFF == 0).all()


def test_the_3xtf32_split_represents_the_weight_to_float32_accuracy():
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0)) * 10
    hi, lo, _ = tv.weight_operands(w, "split_host")
    assert ((hi.view(torch.int32) & 0x1FFF) == 0).all() and ((lo.view(torch.int32) & 0x1FFF) == 0).all()
    assert ((hi.double() + lo.double() - w.double()).abs() <= w.double().abs() * 2.0 ** -21).all()


def test_a_configuration_of_another_precision_is_refused_by_name():
    cls = registry.get_variant("matmul_gelu_softmax", "triton")
    variant = cls("tf32", **tv.DEFAULTS["bf16"])
    with pytest.raises(Exception, match="cast_pass.*serve precision 'bf16', not 'tf32'"):
        variant.mode()


def test_on_the_cpu_the_variant_says_it_needs_cuda_or_the_interpreter(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    reason = registry.get_variant("gemm_bn", "triton").unavailable_reason("cpu")
    assert ("triton cannot be imported" if tv.triton_missing() else "TRITON_INTERPRET=1") in reason


def test_the_listing_says_why_a_variant_cannot_run_here(monkeypatch):
    import autofuse

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    listed = {v["name"]: v for v in autofuse.list_variants("gemm_bn", "cpu")}
    assert listed["eager"]["unavailable"] is None
    assert "cuda" in listed["cublas_epilogue"]["unavailable"]
    assert ("triton cannot be imported" if tv.triton_missing() else "TRITON_INTERPRET=1") in listed["triton"]["unavailable"]


def test_small_batches_add_narrow_tiles_with_deep_k_slices_and_large_batches_do_not():
    small = tv.gemm_configs(8192, batch=1)
    narrow = {c["block_k"] for c in small if (c["block_m"], c["block_n"]) == (16, 32)}
    assert narrow == set(tv.SMALL_BLOCK_KS) and max(narrow) == 256
    assert {c["block_k"] for c in small if (c["block_m"], c["block_n"]) in tv.TILES} == set(tv.BLOCK_KS)
    assert not any((c["block_m"], c["block_n"]) in tv.SMALL_TILES for c in tv.gemm_configs(8192, batch=tv.SMALL_BATCH + 1))
    cls = registry.get_variant("matmul_gelu_softmax", "triton")
    shape = {"batch_size": 1, "in_features": 8192, "out_features": 8192}
    seeds = [s for s in cls.small_batch_seeds(shape, "cuda", "bf16", tv.DEFAULTS["bf16"]) if "finish_inside" not in s]
    assert [(s["block_m"], s["block_n"]) for s in seeds][:3] == [(16, 64), (16, 32), (16, 128)]
    assert sorted((s["block_m"], s["block_n"]) for s in seeds) == sorted(tv.SMALL_TILES) and all(s["stages"] >= 3 for s in seeds)
    for batch, rows in ((32, 32), (37, 64), (64, 64), (200, 64)):  # a tile as tall as the batch reads W once
        at = cls.small_batch_seeds({**shape, "batch_size": batch}, "cuda", "bf16", tv.DEFAULTS["bf16"])
        assert at[0]["block_m"] == rows, (batch, at[0])  # with the finish inside or not: the same tile
    assert all(s["block_k"] == max(b for b in tv.SMALL_BLOCK_KS if tv.stage_bytes({**s, "block_k": b}) <= tv.STAGE_BYTES)
               for s in seeds)


def test_the_space_is_made_once_and_each_caller_gets_its_own_copy():
    first = tv.gemm_configs(8192, batch=1)
    expected = [dict(c) for c in first]
    first[0]["block_m"] = -1  # a caller that changes what it got
    first.append({"block_m": 0})
    again = tv.gemm_configs(8192, batch=1)
    assert again == expected and again[0] is not first[0]
    assert tv.gemm_configs(8192, batch=2) == expected  # one cached space for every small batch
    assert tv.gemm_configs(8192, batch=tv.SMALL_BATCH + 1) != expected


@pytest.mark.parametrize("problem", ["matmul_clamp_lse_mish", "matmul_gelu_softmax"])
def test_small_tiles_also_come_with_the_finish_inside_and_rung_1_races_it_first(problem):
    """``finish_inside`` (one launch: the last program merges the rows) is a knob of the small tiles
    of the variants whose row finish can run in the GEMM's launch (22, 99), so the large-batch space
    and gemm_bn's are as they were; a batch class's seeds hold each small tile with it and without,
    with it first up to FINISH_INSIDE_BATCH rows."""
    cls = registry.get_variant(problem, "triton")
    prob = registry.get_problem(problem)
    shape = dict(zip(prob.dims, (1, 8192, 8192)))
    configs = cls.configs(shape, "cuda")
    inside = [c for c in configs if c.get("finish_inside")]
    assert inside and all((c["block_m"], c["block_n"]) in tv.SMALL_TILES and c["finish_inside"] is True for c in inside)
    assert [{k: v for k, v in c.items() if k != "finish_inside"} for c in inside] == [
        c for c in configs if "finish_inside" not in c and (c["block_m"], c["block_n"]) in tv.SMALL_TILES]
    assert not any("finish_inside" in c for c in cls.configs({**shape, "batch_size": tv.SMALL_BATCH + 1}, "cuda"))
    bn = registry.get_variant("gemm_bn", "triton")
    assert not bn.finishes_inside and not any("finish_inside" in c for c in bn.configs(
        dict(zip(registry.get_problem("gemm_bn").dims, (1, 8192, 8192))), "cuda"))
    for batch in (1, tv.FINISH_INSIDE_BATCH, tv.FINISH_INSIDE_BATCH + 1, 32):
        seeds = cls.small_batch_seeds({**shape, "batch_size": batch}, "cuda", "bf16", tv.DEFAULTS["bf16"])
        first = batch <= tv.FINISH_INSIDE_BATCH
        assert [bool(s.get("finish_inside")) for s in seeds] == [first, not first] * (len(seeds) // 2), batch
        assert all({**a, "finish_inside": True} == {**b, "finish_inside": True} for a, b in zip(seeds[::2], seeds[1::2]))
        assert all(s in cls.configs_for({**shape, "batch_size": batch}, "cuda", "bf16") for s in seeds)
