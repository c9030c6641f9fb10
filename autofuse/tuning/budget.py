"""How much a tune spends on a key: ``quick`` (the default) or ``full`` (``--budget``).

Where a trial's seconds go (H100, 99 at 1024×8192², fp32): a Triton configuration's first call
compiles it (2-5 s), the gate runs it on four cases (about 2 s, more where the odd-sized case
compiles another specialisation), timing takes 0.2-0.5 s. A 40-trial search with every
candidate gated took 3 min, and the autograd entry (each autograd-capable variant gated with
gradients and timed as a training step, 2-11 s each) most of the rest of 7 min.

``quick`` spends the gate only where it can matter: each candidate is timed first, and gated only
if it comes within ``reach`` of the best gated time so far (a slower one is recorded as
``out_of_reach`` with its time: it could not be chosen, since the choice re-times the best few
and keeps a more complex variant only where it wins). A variant whose best time is beyond
``prune`` times the best is drawn no more (cuda_naive at 151 ms beside triton at 0.75 ms); the
search stops once ``stall`` measured trials in a row have not bettered the best by 1%; and only
variants whose forward is within ``grad_reach`` of the best forward enter the autograd entry.
``full`` gates every candidate and searches the whole trial budget, as autofuse did before.

Each batch class of the key (``autofuse.tuning.batch_classes``) races the winner's configuration,
``rung_runners_up`` more of the study's fastest, each other fused variant whose best at B was within
``prune`` of the winner and, below ``SMALL_BATCH``, ``rung_seeds``
small-tile configurations; under ``quick`` they too are gated only within ``reach``.

``quick`` also searches only each variant's ``quick_configs``: ``compiled`` in mode ``default``
with static sizes, whose other modes cost a bfloat16-model key of kb2-22 104 s of search on an
H100 and never won, and whose symbolic sizes compiled that key's training step for 73 s.
"""

from __future__ import annotations

import dataclasses
import math

from autofuse.errors import InputError

# A new best must beat the old by this much to count as progress for ``stall``.
STALL_GAIN = 0.01


@dataclasses.dataclass(frozen=True)
class Budget:
    name: str
    max_trials: int  # trials per key where --trials is not given (fewer where the space is smaller)
    reach: float  # gate a candidate only if its time is within reach × the best gated time
    prune: float  # draw no more of a variant whose best time is beyond prune × the best
    stall: int | None  # stop after this many measured trials without a STALL_GAIN gain
    grad_reach: float  # the autograd entry takes variants whose forward is within this × the best
    rung_runners_up: int = 1  # a batch class also races this many more of the study's fastest configurations
    rung_seeds: int = 1  # and, at a small batch, this many small-tile configurations
    every_config: bool = False  # search every configuration, not each variant's ``quick_configs``

    def gates(self, median_ms: float, best_ms: float | None) -> bool:
        """Whether a candidate timed at ``median_ms`` is worth gating."""
        return best_ms is None or median_ms <= self.reach * best_ms


BUDGETS = {
    "quick": Budget("quick", max_trials=24, reach=1.25, prune=2.0, stall=8, grad_reach=2.5,
                    rung_runners_up=1, rung_seeds=1),
    "full": Budget("full", max_trials=40, reach=math.inf, prune=math.inf, stall=None, grad_reach=math.inf,
                   rung_runners_up=3, rung_seeds=2, every_config=True),
}


def budget(name: str | Budget) -> Budget:
    if isinstance(name, Budget):
        return name
    if name not in BUDGETS:
        raise InputError(f"budget must be one of {sorted(BUDGETS)}, got {name!r}")
    return BUDGETS[name]
