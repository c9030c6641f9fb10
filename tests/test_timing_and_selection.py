"""Timing statistics and the final choice, replayed from recorded timings (no GPU needed)."""

import pytest

from autofuse.outcome import Outcome, TrialResult
from autofuse.selection import Row, pick_simplest_within_noise
from autofuse.timing import Timing, time_callable, time_interleaved

# Recorded on an NVIDIA H200 (torch 2.11, fp32) by `autofuse tune` at the default shapes, 2026-11-22.
H200_51 = {"eager": Timing(5.614, 5.574, 5.783, 90), "simplified": Timing(0.0802, 0.0792, 0.0926, 90)}
H200_22 = {"eager": Timing(2.844, 2.839, 2.858, 90), "simplified": Timing(2.819, 2.811, 2.829, 90)}


def _row(variant, rank, timing):
    return Row(variant, rank, {}, TrialResult(Outcome.OK, None, 1e-7, timing), 1)


def test_percentiles_and_spread():
    timing = Timing.from_samples([float(v) for v in range(1, 11)])
    assert (timing.median_ms, timing.p20_ms, timing.p80_ms, timing.reps) == (5.5, 3.0, 8.0, 10)
    assert timing.spread == pytest.approx(5.0 / 5.5)


def test_a_clear_win_is_taken():
    rows = [_row("eager", 0, H200_51["eager"]), _row("simplified", 1, H200_51["simplified"])]
    assert pick_simplest_within_noise(rows).variant == "simplified"


def test_a_win_within_the_noise_keeps_the_simpler_variant():
    rows = [_row("eager", 0, H200_22["eager"]), _row("simplified", 1, H200_22["simplified"])]
    assert pick_simplest_within_noise(rows).variant == "eager"  # 0.9% faster: below the 2% floor


def test_a_noisy_challenger_must_beat_its_own_spread():
    base = _row("simplified", 1, Timing(1.00, 0.99, 1.01, 30))
    noisy = _row("cuda_tiled", 4, Timing(0.90, 0.70, 1.10, 30))  # 10% faster, 40% spread
    clear = _row("cuda_templated", 5, Timing(0.50, 0.49, 0.51, 30))
    assert pick_simplest_within_noise([noisy, base]).variant == "simplified"
    assert pick_simplest_within_noise([noisy, base, clear]).variant == "cuda_templated"


def test_cpu_timing_measures_what_it_runs():
    import time

    timing = time_callable(lambda: time.sleep(0.002), "cpu", warmup=1, budget_ms=40, min_reps=5)
    assert 1.9 <= timing.median_ms <= 20 and timing.reps >= 5
    both = time_interleaved({"fast": lambda: None, "slow": lambda: time.sleep(0.002)}, "cpu", rounds=4)
    assert both["slow"].median_ms > both["fast"].median_ms and both["fast"].reps == 12
