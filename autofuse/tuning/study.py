"""The Optuna side of tuning: one persistent study per (device, problem, shape, key, search space).

The variant is a categorical choice, and each of its parameters (tile sizes, threads, vector
width...) a categorical of its own conditional on it, so TPE can learn which values of which
parameter pay off (one categorical over a 430-point space is no better than random search).
A suggested combination that is not a valid configuration is projected onto the nearest valid
one (fewest steps along each parameter's sorted values), so no trial is spent on an impossible
configuration. The configurations the table already holds for the key are enqueued first, then
every applicable variant's default configuration.
Studies live in a journal file under ``$AUTOFUSE_HOME`` or in a storage that several
processes and machines share (``autofuse.tuning.storage``), so an interrupted tune resumes where it
stopped. The study's name holds nothing process-specific (no seed), so cooperating processes
open the same study; each samples with its own seed.
"""

from __future__ import annotations

import hashlib
import json
import warnings

import optuna

from autofuse.core.variant import Variant
from autofuse.tuning.storage import default_journal as studies_path  # noqa: F401 - the name callers know
from autofuse.tuning.storage import open_storage

# Failed candidates are told to Optuna as this many milliseconds, so TPE learns to avoid
# them (a FAIL state would be ignored and the same broken configuration drawn again).
FAILED_VALUE_MS = 1e9
# Part of every study name: studies suggested another way are not resumed by this code.
SUGGEST_SCHEME = "per-parameter-v2"
# Random trials before TPE models the space (after the enqueued defaults).
STARTUP_TRIALS = 10


def config_label(config: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in config.items()) or "default"


def space_labels(spaces: dict[str, list[dict]]) -> dict[tuple[str, str], dict]:
    """(variant, configuration label) -> configuration, for every configuration ``spaces`` holds:
    a study's results are keyed by label."""
    return {(name, config_label(c)): c for name, configs in spaces.items() for c in configs}


def space_hash(variants: dict[str, type[Variant]], spaces: dict[str, list[dict]]) -> str:
    """Changes when the searched variants, their sources or their spaces change: old results then don't apply."""
    digest = hashlib.sha256(SUGGEST_SCHEME.encode())
    for name in sorted(spaces):
        digest.update(name.encode())
        digest.update(variants[name].source_hash().encode())
        digest.update(json.dumps(spaces[name], sort_keys=True, default=str).encode())
    return digest.hexdigest()[:12]


def open_study(name: str, seed: int, storage=None) -> optuna.Study:
    """``storage``: None, a URL (``autofuse.tuning.storage``) or an Optuna storage.

    TPE's constant liar counts other processes' running trials as bad, so cooperating
    processes (and one process's batch) spread over the space instead of asking alike.
    """
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    # multivariate + group: the parameters of one variant are modelled jointly, and only with
    # the trials that chose that variant.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        sampler = optuna.samplers.TPESampler(seed=seed, n_startup_trials=STARTUP_TRIALS, multivariate=True,
                                             group=True, constant_liar=True)
    return optuna.create_study(study_name=name, storage=open_storage(storage), sampler=sampler,
                               direction="minimize", load_if_exists=True)


def enqueue_starting_points(study: optuna.Study, spaces: dict[str, list[dict]],
                            first: list[tuple[str, dict]] = ()) -> None:
    """Enqueue ``first`` (variant, configuration) pairs, then each variant's default
    configuration, once per study (not again on resume).

    ``first`` is what the table already holds for this key: a retune with a different set of
    variants (a new study) measures the recorded winner again before anything else, so a
    short retune cannot replace it with a worse configuration of the same variant that it
    never drew. Pairs outside ``spaces`` are skipped. Two processes opening a new study at once
    may both enqueue: the search skips a configuration that is measured or being measured
    elsewhere, so nothing is measured twice.
    """
    if study.trials:
        return
    wanted = [(name, config) for name, config in first if config in spaces.get(name, ())]
    wanted += [(name, configs[0]) for name, configs in spaces.items()]
    seen = []
    for name, config in wanted:
        if (name, config) in seen:
            continue
        seen.append((name, config))
        enqueue(study, name, config)


def enqueue(study: optuna.Study, name: str, config: dict, *, once: bool = True) -> None:
    """Make (variant ``name``, ``config``) the next trial asked. With ``once``, not if any trial
    of the study already has it, in whatever state: waiting, measured, or dropped unmeasured."""
    study.enqueue_trial({"variant": name, **{f"{name}.{p}": v for p, v in config.items()}}, skip_if_exists=once)


def suggest(trial: optuna.Trial, spaces: dict[str, list[dict]]) -> tuple[str, dict]:
    """The variant and configuration this trial evaluates (always one of ``spaces[variant]``)."""
    name = trial.suggest_categorical("variant", sorted(spaces))
    configs = spaces[name]
    axes = parameter_axes(configs)
    wanted = {p: trial.suggest_categorical(f"{name}.{p}", values) for p, values in axes.items()}
    return name, nearest_config(configs, axes, wanted)


def parameter_axes(configs: list[dict]) -> dict[str, list]:
    """Each parameter's distinct values across the valid configurations, in sorted order."""
    axes: dict[str, set] = {}
    for config in configs:
        for param, value in config.items():
            axes.setdefault(param, set()).add(value)
    return {p: sorted(values, key=_order) for p, values in axes.items()}


def nearest_config(configs: list[dict], axes: dict[str, list], wanted: dict) -> dict:
    """The valid configuration fewest steps from ``wanted`` along the axes (the first on a tie,
    so the default wins ties); ``wanted`` itself when it is valid."""
    position = {p: {v: i for i, v in enumerate(values)} for p, values in axes.items()}

    def steps(config: dict) -> int:
        return sum(abs(position[p][config[p]] - position[p][v]) if p in config else len(axes[p])
                   for p, v in wanted.items())
    return min(configs, key=steps)


def _order(value):
    """Numbers by value, anything else after them by its text."""
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool)
    return (0, value, "") if is_number else (1, 0, str(value))


def finished(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE]
