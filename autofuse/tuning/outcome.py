"""A trial: the job and the candidate measured, and what it came to (a typed outcome with its
reason, never an abort). Below the worker and what it runs (``evaluate``), which both use them."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from autofuse.tuning.timing import Timing


@dataclasses.dataclass(frozen=True)
class Job:
    """What every candidate of one tune is measured on."""

    problem: str
    shape: dict
    device: str
    dtype: str
    precision: str
    mode: str
    seed: int
    budget_ms: float = 400.0
    # Where the worker sends what the candidates print (Inductor's autotuning, Triton, nvcc): a
    # log per key, so the terminal keeps the progress bar and the result table (None: inherited).
    log: str | None = None


@dataclasses.dataclass(frozen=True)
class Candidate:
    variant: str
    params: dict
    autograd: bool = False
    # Run at this precision instead of the job's: a stricter one, whose gate the candidate must
    # then pass (a batch class's fallback where the key's operands pass only at some shapes).
    precision: str | None = None

    def label(self) -> str:
        params = ",".join(f"{k}={v}" for k, v in self.params.items())
        at = f" @{self.precision}" if self.precision else ""
        return f"{self.variant}[{params}]{at}" + (" +grad" if self.autograd else "")


class Outcome(str, enum.Enum):
    OK = "ok"
    INCORRECT = "incorrect"
    COMPILE_FAILED = "compile_failed"
    RUNTIME_FAILED = "runtime_failed"
    TIMED_OUT = "timed_out"
    # Timed, not gated: slower than the budget's reach of the best gated candidate (``budget``).
    OUT_OF_REACH = "out_of_reach"


@dataclasses.dataclass
class TrialResult:
    outcome: Outcome
    reason: str | None = None
    error: float | None = None  # worst relative L2 error against the float64 reference
    timing: Timing | None = None
    # The worker's CUDA context may be broken (illegal address, launch failure): restart it.
    poisoned: bool = False
    # Seconds the variant's first call spent compiling (torch.compile); None where nothing compiles then.
    compile_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "outcome": self.outcome.value,
            "reason": self.reason,
            "error": self.error,
            "timing": None if self.timing is None else self.timing.to_dict(),
            "poisoned": self.poisoned,
            "compile_s": self.compile_s,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrialResult":
        timing = data.get("timing")
        return cls(
            outcome=Outcome(data["outcome"]),
            reason=data.get("reason"),
            error=data.get("error"),
            timing=None if timing is None else Timing(**timing),
            poisoned=bool(data.get("poisoned", False)),
            compile_s=data.get("compile_s"),  # absent from trials recorded before it existed
        )
