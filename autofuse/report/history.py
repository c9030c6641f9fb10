"""Tuning histories for ``autofuse report``, read from the tuner's Optuna journal.

The journal is only read: a report must not create studies, and a table copied from
another machine usually comes without its journal, which the page then says.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib

from autofuse.errors import AutofuseError


@dataclasses.dataclass
class Trial:
    number: int
    variant: str
    value_ms: float | None  # None: the candidate failed (outcome says how) or never finished
    outcome: str


class Histories:
    """Trials per study name, from one journal file, loaded once."""

    def __init__(self, journal: pathlib.Path) -> None:
        self.journal = journal
        self._storage = None
        self._cache: dict[str, tuple] = {}

    def get(self, study: str | None) -> tuple[list | None, dict]:
        """(the study's trials in order, or None if it is not in the journal;
        {(variant, config label): error} of its finished trials)."""
        if study is None:
            return None, {}
        if study not in self._cache:
            self._cache[study] = self._load(study)
        return self._cache[study]

    def _load(self, study: str) -> tuple[list | None, dict]:
        import optuna

        storage = self._open()
        if storage is None:
            return None, {}
        try:
            trials = optuna.load_study(study_name=study, storage=storage).get_trials(deepcopy=False)
        except KeyError:  # optuna: "Record does not exist."
            return None, {}
        return [_trial(t) for t in trials], _errors(trials)

    def _open(self):
        if self._storage is None and self.journal.is_file():
            import optuna

            optuna.logging.set_verbosity(optuna.logging.WARNING)
            try:
                backend = optuna.storages.journal.JournalFileBackend(str(self.journal))
                self._storage = optuna.storages.JournalStorage(backend)
            except Exception as exc:  # noqa: BLE001 - optuna raises several kinds for a bad journal
                raise AutofuseError(f"tuning journal {self.journal} cannot be read ({exc}); "
                                    f"pass another with --studies, or move it aside") from None
        return self._storage


def _trial(t) -> Trial:
    outcome = t.user_attrs.get("outcome") or t.state.name.lower()
    value = t.value if outcome == "ok" and t.value is not None and math.isfinite(t.value) else None
    return Trial(t.number, str(t.params.get("variant", "?")), value, str(outcome))


def _errors(trials) -> dict:
    errors = {}
    for t in trials:
        result = t.user_attrs.get("result")
        if isinstance(result, dict) and result.get("error") is not None:
            errors[(t.params.get("variant"), t.user_attrs.get("config"))] = result["error"]
    return errors
