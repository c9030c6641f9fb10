"""Timing statistics and the final choice, replayed from recorded timings (no GPU needed but for
one check of the stream's hold on a real device)."""

import pytest

from autofuse.tuning import timing
from autofuse.tuning.outcome import Outcome, TrialResult
from autofuse.tuning.selection import Row, pick_simplest_within_noise
from autofuse.tuning.timing import Timing, time_callable, time_interleaved

# Recorded on an NVIDIA H200 (torch 2.11, fp32) by `autofuse tune` at the default shapes.
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


# Recorded on an NVIDIA H100 (torch 2.11, fp32) by `autofuse bench gemm_bn` (1024, 8192, 8192), train.
H100_39 = {"eager": Timing(2.7646, 2.7632, 2.7651, 30), "cublas_epilogue": Timing(2.7364, 2.7357, 2.7382, 30)}


def test_a_small_win_beyond_the_noise_is_taken():
    rows = [_row("eager", 0, H100_39["eager"]), _row("cublas_epilogue", 2, H100_39["cublas_epilogue"])]
    assert pick_simplest_within_noise(rows).variant == "cublas_epilogue"  # 1.0% faster, spreads 0.1%
    rows = [_row("eager", 0, H200_22["eager"]), _row("simplified", 1, H200_22["simplified"])]
    assert pick_simplest_within_noise(rows).variant == "simplified"  # 0.9% faster, spreads 0.7%


def test_a_win_within_the_noise_keeps_the_simpler_variant():
    eager = _row("eager", 0, Timing(2.730, 2.729, 2.731, 30))
    epilogue = _row("cublas_epilogue", 2, Timing(2.722, 2.721, 2.723, 30))  # 0.3%: below the 0.5% floor
    assert pick_simplest_within_noise([eager, epilogue]).variant == "eager"
    wide = _row("simplified", 1, Timing(2.700, 2.650, 2.750, 30))  # 1.1% faster, but 3.7% spread
    assert pick_simplest_within_noise([eager, wide]).variant == "eager"


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


def test_a_long_upper_tail_does_not_hide_a_large_win():
    # Re-timed in the tuning worker on an H100, 51 at (2048, 8192, 8192), fp32.
    simplified = _row("simplified", 1, Timing(0.09621, 0.09552, 0.0968, 150))
    epilogue = _row("cublas_epilogue", 2, Timing(0.08245, 0.08083, 0.1274, 150))
    tiled = _row("cuda_tiled", 4, Timing(0.05392, 0.05312, 0.0736, 150))
    assert pick_simplest_within_noise([simplified, epilogue, tiled]).variant == "cuda_tiled"
    # p80 0.127 > 0.096, but the lower half (0.0808-0.0841) clears simplified's p20 (0.0955):
    # the tail is the host's, and 14% is a real win.
    assert pick_simplest_within_noise([simplified, epilogue]).variant == "cublas_epilogue"


def test_sleep_calibration_reads_the_working_clock_not_the_idle_one():
    # H100: the first 10⁶-cycle sleep of a process read 3.1 ms (idle clock), later ones 0.5 ms.
    readings = iter([3.1, 0.9, 0.52, 0.5, 0.51])
    rate = timing._sleep_rate(lambda: next(readings))
    assert rate == pytest.approx(timing.SLEEP_CALIBRATION_CYCLES / 0.5)


def test_a_large_win_with_a_host_stalled_tail_is_taken():
    # A training step is host-bound: 51's single_pass step (H100, fp32 tune) had a
    # median of 0.347 ms against simplified's 0.451 but a tail past it, and simplified was kept.
    simplified = _row("simplified", 1, Timing(0.4506, 0.4460, 0.4580, 50))
    single_pass = _row("single_pass", 5, Timing(0.3467, 0.3420, 0.4600, 50))
    assert pick_simplest_within_noise([simplified, single_pass]).variant == "single_pass"
    # Its lower half must clear the incumbent's fast calls: a wide lower spread does not.
    wide = _row("single_pass", 5, Timing(0.4200, 0.3600, 0.4600, 50))
    assert pick_simplest_within_noise([simplified, wide]).variant == "simplified"


class _SimulatedGpu:
    """A host and a device stream on one simulated clock (ms): each call costs the host ``host_ms``,
    then its kernel runs ``device_ms`` once the stream is free; a sleep kernel holds the stream."""

    def __init__(self, host_ms, device_ms):
        self.host_ms, self.device_ms = host_ms, device_ms
        self.host = self.free = 0.0

    def _enqueue(self, ms):
        self.free = max(self.free, self.host) + ms

    def call(self):
        self.host += self.host_ms
        self._enqueue(self.device_ms)

    def install(self, monkeypatch):
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = max(gpu.free, gpu.host)

            def elapsed_time(self, end):
                return end.at - self.at

        clock = type("clock", (), {"perf_counter": staticmethod(lambda: gpu.host / 1e3),
                                   "perf_counter_ns": staticmethod(lambda: int(gpu.host * 1e6))})
        monkeypatch.setattr(timing, "time", clock)
        monkeypatch.setattr(timing.torch.cuda, "Event", Event)
        monkeypatch.setattr(timing.torch.cuda, "_sleep", lambda cycles: gpu._enqueue(float(cycles)))
        monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(timing, "_cycles_per_ms", {0: 1.0})  # a cycle a millisecond


@pytest.mark.parametrize("host_ms", [0.05, 0.8, 3.0])
def test_the_stream_is_held_for_as_long_as_the_host_takes_to_enqueue_the_calls(monkeypatch, host_ms):
    """A training step whose backward runs Python took the device's host longer than its 0.43 ms
    of GPU work: a flat hold (0.5 ms a call, at most 50 ms) ran out, and the samples read the
    host's time (kb2-99's bfloat16 step on an H100: cublas_epilogue 0.4286-0.8556 ms p20-p80)."""
    gpu = _SimulatedGpu(host_ms, device_ms=0.43)
    gpu.install(monkeypatch)
    device = timing.torch.device("cuda", 0)
    measured = time_callable(gpu.call, device, flush=False)
    assert measured.reps == 200 and measured.p80_ms == pytest.approx(0.43)
    rounds = time_interleaved({"a": gpu.call, "b": gpu.call}, device, rounds=5, flush=False)
    assert all(t.p80_ms == pytest.approx(0.43) for t in rounds.values())


@pytest.mark.gpu
def test_on_the_gpu_a_call_the_host_takes_longer_to_enqueue_is_timed_at_its_device_work():
    import time

    import torch

    device = torch.device("cuda")
    timing._prime(device, 0.0)  # calibrates the sleep kernel's clock
    cycles = int(timing._cycles_per_ms[torch.cuda.current_device()] * 0.2)

    def call():  # 0.2 ms of device work, 1 ms of the host's between its two halves
        torch.cuda._sleep(cycles // 2)
        time.sleep(0.001)
        torch.cuda._sleep(cycles // 2)
    measured = time_callable(call, device, flush=False)
    assert measured.p80_ms < 0.3, measured


def test_a_long_hold_is_split_into_sleeps_each_under_the_cap():
    for reps, host_ms in [(200, 0.0), (200, 0.8), (3, 0.8), (7, 100.0)]:
        holds = timing._holds(reps, host_ms)
        assert sum(calls for calls, _ in holds) == reps
        assert all(hold <= timing.PRIME_MAX_MS for _, hold in holds)
        per_call = max(timing.PRIME_MS_PER_CALL, timing.HOST_MARGIN * host_ms)
        if per_call < timing.PRIME_MAX_MS:
            assert all(hold >= calls * per_call for calls, hold in holds)


def test_the_l2_flush_reads_its_buffer_and_writes_nothing_the_next_call_would_write_back(monkeypatch):
    # A flush that wrote its buffer left the L2 dirty, and the timed call paid the write-back
    # (~10 µs on an H100: benchmarks/gpu/flush_cost.py). Run on the CPU with a 1 MB "L2".
    class Properties:
        L2_cache_size = 1 << 20

    monkeypatch.setattr(timing.torch.cuda, "get_device_properties", lambda index: Properties())
    monkeypatch.setattr(timing, "_flush_buffers", {})
    device = timing.torch.device("cpu", 0)
    timing._flush_l2(device)
    buffer, total = timing._flush_buffers[0]
    assert buffer.numel() * buffer.element_size() == 2 * Properties.L2_cache_size  # twice the cache, read whole
    version = buffer._version
    timing._flush_l2(device)
    timing._flush_l2(device)
    assert buffer._version == version and not buffer.any()  # read, never written again
    assert timing._flush_buffers[0][0] is buffer  # made once per device


class _Retimer:
    """A worker whose interleaved re-timing returns recorded timings, by candidate label."""

    def __init__(self, timings: dict):
        self.timings, self.asked = timings, []

    def call(self, op, payload, timeout):
        assert op == "retime"
        _, candidates, _ = payload
        self.asked = [c.label() for c in candidates]
        return {label: self.timings[label] for label in self.asked}


def _config_row(variant, rank, params, trial):
    return Row(variant, rank, params, TrialResult(Outcome.OK, None, 1e-7, trial), 1)


def test_a_configuration_near_its_variants_best_is_re_timed_beside_it_and_can_win():
    """One trial's timing drifts with its moment (kb2-99 fp32, H200: the persistent TMA tile measured
    first, while the compile pool started, and lost the search by 3%): the final choice re-times the
    near ones too, without taking another variant's place."""
    from autofuse.tuning.outcome import Candidate, Job
    from autofuse.tuning.selection import choose

    job = Job("matmul_gelu_softmax", {"batch_size": 16}, "cpu", "float32", "fp32", "any", 1)
    best = _config_row("triton", 7, {"persistent": False}, Timing(0.748, 0.747, 0.749, 30))
    near = [_config_row("triton", 7, {"persistent": True}, Timing(0.760, 0.759, 0.761, 30)),
            _config_row("triton", 7, {"stages": 4}, Timing(0.770, 0.769, 0.771, 30)),
            _config_row("triton", 7, {"stages": 5}, Timing(0.780, 0.779, 0.781, 30)),
            _config_row("cuda_tiled", 4, {"tile": 16}, Timing(0.9, 0.89, 0.91, 30))]  # its variant is not in the race
    simplified = _config_row("simplified", 1, {}, Timing(2.75, 2.74, 2.76, 30))
    label = lambda row: Candidate(row.variant, row.params).label()  # noqa: E731
    retimed = {label(best): Timing(0.750, 0.749, 0.751, 50), label(near[0]): Timing(0.727, 0.726, 0.728, 50),
               label(near[1]): Timing(0.771, 0.770, 0.772, 50), label(simplified): Timing(2.75, 2.74, 2.76, 50),
               "eager-baseline": Timing(2.75, 2.74, 2.76, 50)}
    worker = _Retimer(retimed)
    entry = choose(job, [simplified, best], worker, 60, autograd=False, near=near)
    assert entry["params"] == {"persistent": True} and entry["median_ms"] == 0.727
    # Both rows are re-timed, and the two nearest configurations (not the third, nor cuda_tiled's).
    assert sorted(worker.asked) == sorted([label(simplified), label(best), label(near[0]), label(near[1])])
    # Without them the trial's order stands.
    worker = _Retimer(retimed)
    assert choose(job, [simplified, best], worker, 60, autograd=False)["params"] == {"persistent": False}


def test_the_re_timing_spends_its_rounds_counting_eager_and_a_lone_candidate_takes_the_fewest():
    """A lone candidate's re-timing chooses nothing (it records its time beside eager's); a race's
    rounds count eager's calls too (kb2-99 at batch 2048, H200: a lone training step re-timed for
    50 rounds beside eager's, 3.3x slower, took 4.3 s)."""
    from autofuse.tuning.selection import MAX_ROUNDS, MIN_ROUNDS, RETIME_BUDGET_MS, retime_rounds

    step = _row("triton", 7, Timing(3.3, 3.2, 3.4, 30))
    eager = Row("eager", 0, {}, TrialResult(Outcome.OUT_OF_REACH, "timed only", timing=Timing(11.0, 10.9, 11.1, 30)), 1)
    assert retime_rounds([step], [step, eager]) == MIN_ROUNDS
    # Long calls (gemm_bn's training steps at 16384 rows) take fewer rounds, eager's counted.
    slow = [_row("triton", 7, Timing(30.0, 29.0, 31.0, 30)), _row("cublas_epilogue", 3, Timing(35.0, 34.0, 36.0, 30))]
    eager = Row("eager", 0, {}, TrialResult(Outcome.OUT_OF_REACH, "timed only", timing=Timing(100.0, 99.0, 101.0, 30)), 1)
    assert retime_rounds(slow, slow + [eager]) == int(RETIME_BUDGET_MS / (30 + 35 + 100))
    # Without eager's time the slowest candidate stands in for it.
    assert retime_rounds(slow, slow) == int(RETIME_BUDGET_MS / (30 + 35 + 35))
    fast = [_row("triton", 7, Timing(0.1, 0.1, 0.1, 30)), _row("cuda_tiled", 4, Timing(0.2, 0.2, 0.2, 30))]
    assert retime_rounds(fast, fast) == MAX_ROUNDS


def test_a_training_steps_re_timing_times_eagers_training_step_and_not_its_forward():
    from autofuse.tuning import evaluate
    from autofuse.tuning.outcome import Candidate, Job

    job = Job("matmul_gelu_softmax", {"batch_size": 4, "in_features": 16, "out_features": 8}, "cpu", "float32",
              "fp32", "any", 1)
    timed = evaluate.retime({}, job, [Candidate("simplified", {}, autograd=True)], 2)
    assert set(timed) == {"simplified[] +grad", evaluate.BASELINE + " +grad"}
    timed = evaluate.retime({}, job, [Candidate("simplified", {})], 2)
    assert set(timed) == {"simplified[]", evaluate.BASELINE}
