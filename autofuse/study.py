"""The Optuna side of tuning: one persistent study per (device, problem, shape, key, search space).

The variant is a categorical choice and each variant's configuration a categorical
conditional on it (only valid configurations are listed, so no trial is spent on an
impossible one). Every applicable variant's default configuration is enqueued first.
Studies live in a journal file under ``$AUTOFUSE_HOME`` or in a storage that several
processes and machines share (``autofuse.storage``), so an interrupted tune resumes where it
stopped. The study's name holds nothing process-specific (no seed), so cooperating processes
open the same study; each samples with its own seed.
"""

from __future__ import annotations

import hashlib
import json

import optuna

from autofuse.storage import default_journal as studies_path  # noqa: F401 - the name callers know
from autofuse.storage import open_storage
from autofuse.variant import Variant

# Failed candidates are told to Optuna as this many milliseconds, so TPE learns to avoid
# them (a FAIL state would be ignored and the same broken configuration drawn again).
FAILED_VALUE_MS = 1e9


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


def open_study(name: str, seed: int, storage=None) -> optuna.Study:
    """``storage``: None, a URL (``autofuse.storage``) or an Optuna storage.

    TPE's constant liar counts other processes' running trials as bad, so cooperating
    processes (and one process's batch) spread over the space instead of asking alike.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=5, constant_liar=True)
    return optuna.create_study(study_name=name, storage=open_storage(storage), sampler=sampler,
                               direction="minimize", load_if_exists=True)


def enqueue_defaults(study: optuna.Study, spaces: dict[str, list[dict]]) -> None:
    """Enqueue each variant's default configuration, once per study (not again on resume).

    Two processes opening a new study at once may both enqueue: the search skips a
    configuration that is measured or being measured elsewhere, so nothing is measured twice.
    """
    if study.trials:
        return
    for name, configs in spaces.items():
        study.enqueue_trial({"variant": name, f"{name}.config": config_label(configs[0])}, skip_if_exists=True)


def suggest(trial: optuna.Trial, spaces: dict[str, list[dict]]) -> tuple[str, dict]:
    """The variant and configuration this trial evaluates."""
    name = trial.suggest_categorical("variant", sorted(spaces))
    configs = {config_label(c): c for c in spaces[name]}
    label = trial.suggest_categorical(f"{name}.config", list(configs))
    return name, configs[label]


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
