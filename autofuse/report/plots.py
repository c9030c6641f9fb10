"""The PNGs of ``autofuse report``: a bar chart per shape, a tuning history per study.

Drawn with matplotlib's Agg backend (the caller passes pyplot in, imported lazily). Failed
candidates are told to Optuna as a huge value (``study.FAILED_VALUE_MS``) so TPE avoids them;
plotted as such they would flatten every real point, so they are marked at the top instead.
"""

from __future__ import annotations

import pathlib

WINNER = "#d9822b"
OTHER = "#3b75af"
FAILED = "#c23030"
PALETTE = ["#3b75af", "#4c9a5b", "#8e5ea2", "#d9822b", "#5aa9c7", "#b5872c", "#d45d8c", "#6f6f6f"]


def shape_chart(plt, title: str, groups: list[tuple[str, list]], path: pathlib.Path) -> pathlib.Path:
    """Horizontal bars of each candidate's median ms, one panel per dispatch key; failures named."""
    heights = [max(1, len(cands)) * 0.32 + 0.7 for _, cands in groups]
    fig, axes = plt.subplots(len(groups), 1, figsize=(7.5, sum(heights) + 0.5), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, (label, cands) in zip(axes[:, 0], groups):
        _bars(ax, label, cands)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _bars(ax, label: str, cands: list) -> None:
    names = [c.variant + (f" ({_params(c.params)})" if c.params else "") for c in cands]
    times = [c.median_ms or 0.0 for c in cands]
    ax.barh(range(len(cands)), times, color=[WINNER if c.winner else OTHER for c in cands], height=0.6)
    ax.set_yticks(range(len(cands)), [n if len(n) <= 40 else n[:39] + "…" for n in names], fontsize=8)
    ax.invert_yaxis()
    positive = [t for t in times if t > 0]
    if positive and max(positive) / min(positive) > 20:
        ax.set_xscale("log")
        _plain_numbers(ax.xaxis)
    right = max(positive, default=1.0)
    ax.set_xlim(right=right * (3 if ax.get_xscale() == "log" else 1.25))
    for i, c in enumerate(cands):
        text = f"{c.median_ms:.4g} ms" if c.median_ms else c.outcome
        ax.text(c.median_ms or (min(positive, default=1.0) if ax.get_xscale() == "log" else 0), i, " " + text,
                va="center", fontsize=7, color=FAILED if not c.median_ms else "#222222")
    ax.set_title(label, fontsize=8, loc="left")
    ax.set_xlabel("median ms (orange: the winner)", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)


def history_chart(plt, title: str, trials: list, path: pathlib.Path) -> pathlib.Path:
    """Each trial's time by trial number, coloured by variant, the best so far as a step line,
    failures as red crosses along the top."""
    from matplotlib.transforms import blended_transform_factory

    fig, ax = plt.subplots(figsize=(7.5, 3.2))
    variants = sorted({t.variant for t in trials})
    for i, variant in enumerate(variants):
        ok = [t for t in trials if t.variant == variant and t.value_ms is not None]
        if ok:
            ax.scatter([t.number for t in ok], [t.value_ms for t in ok], s=22, label=variant,
                       color=PALETTE[i % len(PALETTE)], zorder=3)
    steps, best = [], None
    for t in trials:
        if t.value_ms is not None:
            best = t.value_ms if best is None else min(best, t.value_ms)
        if best is not None:
            steps.append((t.number, best))
    if steps:
        ax.step(*zip(*steps), where="post", color="#222222", linewidth=1.2, label="best so far", zorder=2)
        ax.set_yscale("log")
        _plain_numbers(ax.yaxis)
        low, high = ax.get_ylim()
        ax.set_ylim(low, high * (high / low) ** 0.25)  # headroom for the failure marks
    failed = [t for t in trials if t.value_ms is None]
    if failed:
        top = blended_transform_factory(ax.transData, ax.transAxes)
        ax.scatter([t.number for t in failed], [0.95] * len(failed), marker="x", color=FAILED, s=30,
                   transform=top, label=f"failed ({len(failed)})", zorder=3)
    ax.set_xlabel("trial", fontsize=8)
    ax.set_ylabel("median ms", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9, loc="left")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _plain_numbers(axis) -> None:
    """0.03, not 3x10^-2: the page's tables print milliseconds that way too."""
    from matplotlib.ticker import FuncFormatter

    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}" if f"{v:.0e}"[0] in "25" else ""))


def _params(params: dict) -> str:
    return ",".join(f"{k}={v}" for k, v in params.items())
