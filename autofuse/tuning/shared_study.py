"""One study, several tuning processes (``--workers``, or machines sharing ``--storage``).

Every trial a process asks carries who runs it (user attr ``worker``, "host:pid") and when
that process last showed it is alive (``alive``, refreshed by a heartbeat thread). Before
each measurement the search re-reads the study: finished trials, anyone's, are results;
running trials of other processes are claims. A configuration claimed by a lower-numbered
trial is left to its owner, and claims count against the trial budget, so N processes
measure no configuration twice and overshoot the budget by at most about N trials.

A trial is asked first and labelled with its configuration a moment later, so a process
deciding about trial m waits until every other process's live trial numbered below m has
its label (``view(settled_below=m)``). Without that wait, two processes can both measure
one configuration: B reads before A has labelled its lower-numbered trial and sees no
claim, A reads B's claim but it is numbered higher, so neither gives way.

A running trial whose process died does not block anyone for long: it is failed when its
pid is gone on this host, or when it has shown no sign of life for ``GRACE_S`` seconds
(hosts sharing a study must have distinct hostnames). A process failing or interrupted
with trials open fails them on its way out.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import threading
import time

import optuna
from optuna.trial import TrialState

from autofuse.tuning.outcome import TrialResult

HEARTBEAT_S = 20.0
GRACE_S = 180.0  # far above HEARTBEAT_S and any clock skew between machines
POLL_S = 1.0
LABEL_POLL_S = 0.02  # labelling follows asking within milliseconds
HOST = socket.gethostname()


def me() -> str:
    return f"{HOST}:{os.getpid()}"


def key_of(trial: optuna.trial.FrozenTrial) -> tuple[str, str] | None:
    """(variant, configuration label) of a trial, None before it was suggested."""
    variant = trial.params.get("variant")
    label = trial.user_attrs.get("config", trial.params.get(f"{variant}.config"))  # the latter: older studies
    return None if variant is None or label is None else (variant, label)


def measured(study: optuna.Study) -> dict[tuple[str, str], TrialResult]:
    """Every configuration measured in the study, by any process: (variant, label) -> result."""
    return {(t.params["variant"], t.user_attrs["config"]): TrialResult.from_dict(t.user_attrs["result"])
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if "outcome" in t.user_attrs}


@dataclasses.dataclass
class View:
    results: dict  # (variant, label) -> TrialResult, measured by anyone
    claims: dict  # (variant, label) -> lowest number of a live trial of another process measuring it
    unlabelled: list  # numbers of other processes' live trials not yet labelled

    def ahead_of(self, number: int) -> int:
        """Configurations measured or being measured by trials numbered below ``number``."""
        return len(self.results) + sum(1 for n in self.claims.values() if n < number)


class SharedStudy:
    """This process's side of a study that others may be tuning at the same time."""

    def __init__(self, study: optuna.Study):
        self.study = study
        self._mine: dict[int, optuna.Trial] = {}  # open trials, by number
        self._lock = threading.Lock()  # a heartbeat never writes to a trial being told
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="autofuse-heartbeat", daemon=True)

    def __enter__(self) -> SharedStudy:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        for trial in list(self._mine.values()):
            self.drop(trial, "its process stopped before measuring it")

    def ask(self) -> optuna.Trial:
        trial = self.study.ask()
        trial.set_user_attr("worker", me())
        trial.set_user_attr("alive", time.time())
        with self._lock:
            self._mine[trial.number] = trial
        return trial

    def tell(self, trial: optuna.Trial, value: float, attrs: dict) -> None:
        with self._lock:
            self._mine.pop(trial.number, None)
            try:
                for name, attr in attrs.items():
                    trial.set_user_attr(name, attr)
                self.study.tell(trial, value, skip_if_finished=True)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass  # another process took this trial for dead: its result is lost to the study

    def drop(self, trial: optuna.Trial, why: str) -> None:
        """End ``trial`` unmeasured; a FAIL state is ignored by TPE and counts toward nothing."""
        with self._lock:
            self._mine.pop(trial.number, None)
            try:
                trial.set_user_attr("skipped", why)
                self.study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)
            except optuna.exceptions.UpdateFinishedTrialError:
                pass

    def view(self, settled_below: int | None = None) -> View:
        """Results and other processes' live claims, now; a dead process's trials are failed on the way.

        With ``settled_below``, waits until no other process's live trial numbered below it is
        still unlabelled, so that every claim that could outrank that trial is in the view.
        """
        while True:
            view = self._read()
            if settled_below is None or all(n >= settled_below for n in view.unlabelled):
                return view
            time.sleep(LABEL_POLL_S)

    def _read(self) -> View:
        # Running trials first, results second: a trial that finishes between the two reads is
        # then a result. In the other order it was in neither, and another process measured its
        # configuration again (seen once in CI: test_two_tuner_processes_share_one_postgresql_study).
        running = self.study.get_trials(deepcopy=False, states=(TrialState.RUNNING,))
        results, claims, unlabelled = measured(self.study), {}, []
        now = time.time()
        for trial in running:
            if trial.number in self._mine:
                continue
            if _dead(trial, now):
                self.study.tell(trial.number, state=TrialState.FAIL, skip_if_finished=True)
                continue
            key = key_of(trial)
            if key is None:
                unlabelled.append(trial.number)
            elif key not in results:
                claims[key] = min(claims.get(key, trial.number), trial.number)
        return View(results, claims, unlabelled)

    def wait(self) -> None:
        time.sleep(POLL_S)

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            with self._lock:
                for trial in self._mine.values():
                    try:
                        trial.set_user_attr("alive", time.time())
                    except Exception:  # noqa: BLE001 - a missed beat is harmless; a dead thread is not
                        pass


def _dead(trial: optuna.trial.FrozenTrial, now: float) -> bool:
    host, _, pid = str(trial.user_attrs.get("worker", "")).rpartition(":")
    if host == HOST and pid.isdigit() and not _pid_alive(int(pid)):
        return True
    alive = trial.user_attrs.get("alive")
    if not isinstance(alive, (int, float)):  # asked a moment ago, or by an autofuse from before heartbeats
        alive = trial.datetime_start.timestamp()
    return now - alive > GRACE_S


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True
