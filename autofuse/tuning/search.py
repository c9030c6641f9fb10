"""One shape's search: ask Optuna for candidates, compile them together, measure them one at a time.

Trials are asked in batches (TPE's constant liar keeps a batch diverse); the batch's kernels
compile in parallel on the host while the device measures candidates one at a time in the
worker subprocess. Other processes tuning the same study are seen through
``autofuse.tuning.shared_study``: nothing they measured or are measuring is measured again.
"""

from __future__ import annotations

import os
import time

from autofuse.core import registry
from autofuse.kernels.build import build_many
from autofuse.tuning import study as studies
from autofuse.tuning.outcome import Candidate, Job, Outcome, TrialResult
from autofuse.tuning.progress import TrialProgress
from autofuse.tuning.shared_study import SharedStudy

# Suggestions asked per distinct candidate before the search stops looking for new ones.
MAX_ASKS_PER_TRIAL = 5
# Trials asked at once: their kernels compile in parallel (one nvcc per core, at most 8).
ASK_BATCH = max(1, min(8, os.cpu_count() or 1))


def search(study, spaces, job, worker, total, timeout, trial_timeout, progress, label) -> dict:
    """Measure candidates until ``total`` distinct ones are measured (by any process, earlier
    sessions' included), the space is exhausted or ``timeout`` passes; return every result.

    A repeated suggestion is told its earlier result and does not count: on small categorical
    spaces TPE repeats itself often, and a trial budget spent on repeats measures nothing.
    While other processes' trials are in flight and the budget is not met, this one waits
    for them, so every process makes its final choice from the same results.
    """
    total = min(total, sum(len(c) for c in spaces.values()))
    asks_left = MAX_ASKS_PER_TRIAL * total
    deadline = None if timeout is None else time.monotonic() + timeout
    with SharedStudy(study) as shared, TrialProgress(total, 0, label, enabled=progress) as bar:
        view = shared.view()
        while True:
            bar.show(view.results)
            room = total - len(view.results) - len(view.claims)
            expired = deadline is not None and time.monotonic() >= deadline
            if room > 0 and asks_left > 0 and not expired:
                size = min(ASK_BATCH, room)
                asks_left -= size
                _measure_batch(shared, spaces, job, worker, total, size, trial_timeout, bar)
            elif view.claims and len(view.results) < total and not expired:
                shared.wait()  # their results may end the search, or their failure free room
            else:
                return view.results
            view = shared.view()


def _measure_batch(shared, spaces, job, worker, total, size, trial_timeout, bar) -> None:
    """Ask ``size`` trials, compile their kernels together, measure what nobody has or does."""
    batch = []
    for _ in range(size):
        trial = shared.ask()
        name, config = studies.suggest(trial, spaces)
        # The claim other processes read (a configuration spans several params); at once, since
        # they wait for it before deciding about their higher-numbered trials.
        trial.set_user_attr("config", studies.config_label(config))
        batch.append((trial, name, config))
    view = shared.view()
    _prebuild([(name, config) for _, name, config in batch
               if (name, studies.config_label(config)) not in view.results | view.claims], job)
    for trial, name, config in batch:
        key = (name, studies.config_label(config))
        view = shared.view(settled_below=trial.number)  # re-read: others may have measured or claimed it meanwhile
        bar.show(view.results)
        if key in view.results:  # a repeat: told the earlier result, measures nothing
            _tell(shared, trial, key, view.results[key], repeat=True)
        elif view.claims.get(key, trial.number) < trial.number:
            shared.drop(trial, f"trial {view.claims[key]} of another process measures {key}")
        elif view.ahead_of(trial.number) >= total:
            shared.drop(trial, f"the trial budget ({total}) was reached")
        else:
            _tell(shared, trial, key, worker.call("evaluate", (job, Candidate(name, config)), trial_timeout))


def _tell(shared, trial, key, result: TrialResult, repeat: bool = False) -> None:
    attrs = {"config": key[1], "outcome": result.outcome.value, "result": result.to_dict(), "repeat": repeat}
    shared.tell(trial, result.timing.median_ms if result.outcome is Outcome.OK else studies.FAILED_VALUE_MS, attrs)


def _prebuild(candidates: list[tuple[str, dict]], job: Job) -> None:
    """Compile the candidates' kernels in parallel; a failure is left for the worker to record."""
    builds = []
    for name, config in candidates:
        variant = registry.get_variant(job.problem, name)(job.precision, **config)
        try:
            builds.extend(variant.kernel_builds(job.device))
        except Exception:  # noqa: BLE001 - e.g. no nvcc: the worker records why
            continue
    if builds:
        build_many(builds)
