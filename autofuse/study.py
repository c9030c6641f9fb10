"""The Optuna side of tuning: one persistent study per (device, problem, shape, key, search space).

The variant is a categorical choice and each variant's configuration a categorical
conditional on it (only valid configurations are listed, so no trial is spent on an
impossible one). Every applicable variant's default configuration is enqueued first.
Studies live in a journal file under ``$AUTOFUSE_HOME`` (safe for concurrent processes),
so an interrupted tune resumes where it stopped.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib

import optuna

from autofuse.variant import Variant

# Failed candidates are told to Optuna as this many milliseconds, so TPE learns to avoid
# them (a FAIL state would be ignored and the same broken configuration drawn again).
FAILED_VALUE_MS = 1e9


def studies_path() -> pathlib.Path:
    home = pathlib.Path(os.environ.get("AUTOFUSE_HOME") or "~/.cache/autofuse").expanduser()
    home.mkdir(parents=True, exist_ok=True)
    return home / "studies.journal"


def config_label(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


def space_hash(variants: dict[str, type[Variant]], spaces: dict[str, list[dict]]) -> str:
    """Changes when the searched variants, their sources or their spaces change: old results then don't apply."""
    digest = hashlib.sha256()
    for name in sorted(spaces):
        digest.update(name.encode())
        digest.update(variants[name].source_hash().encode())
        digest.update(json.dumps(spaces[name], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]


def open_study(name: str, seed: int, storage: str | None = None) -> optuna.Study:
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    if storage is None:
        backend = optuna.storages.journal.JournalFileBackend(str(studies_path()))
        storage = optuna.storages.JournalStorage(backend)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5)
    return optuna.create_study(study_name=name, storage=storage, sampler=sampler,
                               direction="minimize", load_if_exists=True)


def enqueue_defaults(study: optuna.Study, spaces: dict[str, list[dict]]) -> None:
    """Enqueue each variant's default configuration, once per study (not again on resume)."""
    if study.trials:
        return
    for name, configs in spaces.items():
        study.enqueue_trial({"variant": name, f"{name}.config": config_label(configs[0])})


def suggest(trial: optuna.Trial, spaces: dict[str, list[dict]]) -> tuple[str, dict]:
    """The variant and configuration this trial evaluates."""
    name = trial.suggest_categorical("variant", sorted(spaces))
    configs = {config_label(c): c for c in spaces[name]}
    label = trial.suggest_categorical(f"{name}.config", list(configs))
    return name, configs[label]


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
