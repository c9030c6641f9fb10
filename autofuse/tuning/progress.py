"""The tuning progress bar: trials done, the best candidate so far and its speedup over eager."""

from __future__ import annotations

import sys

from tqdm import tqdm

from autofuse.tuning.outcome import Outcome


class TrialProgress:
    def __init__(self, total: int, done: int, label: str, enabled: bool = True):
        self._bar = tqdm(total=total, initial=done, desc=label, unit="trial", file=sys.stderr,
                         disable=not enabled, dynamic_ncols=True, leave=True)

    def update_best(self, results: dict) -> None:
        ok = {key: r for key, r in results.items() if r.outcome is Outcome.OK}
        if not ok:
            return
        (variant, config), best = min(ok.items(), key=lambda item: item[1].timing.median_ms)
        eager = next((r.timing.median_ms for (v, _), r in ok.items() if v == "eager"), None)
        postfix = f"best {variant}[{config}] {best.timing.median_ms:.4g} ms"
        if eager:
            postfix += f" ({eager / best.timing.median_ms:.2f}x eager)"
        self._bar.set_postfix_str(postfix)

    def show(self, results: dict) -> None:
        """Show ``results`` as they are now (other processes add to them too)."""
        self.update_best(results)
        done = min(len(results), self._bar.total)
        if done != self._bar.n:
            self._bar.n = done
            self._bar.refresh()

    def advance(self, note: str) -> None:
        """One more candidate measured outside the study (a batch class's), ``note`` beside the bar."""
        self._bar.update(1)
        self._bar.set_postfix_str(note)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._bar.close()
