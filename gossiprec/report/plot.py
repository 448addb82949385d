"""The picture of a timeline (matplotlib, the ``plot`` extra, imported only when a plot is asked for).

Two panels, one above the other:

(a) the recovery timelines: one horizontal bar per recovery per rank, its phases stacked left to right
    in :data:`~gossiprec.report.timeline.PHASES` order, one colour per phase; the x axis is seconds
    since the first evidence of the failure, so the bar's length is its RTO. Past :data:`MAX_BARS` rank
    lines (a large job), one bar per recovery: its slowest rank's; past :data:`MAX_BARS` recoveries,
    the last ones (the title says so);
(b) the step time over the run: each rank's ``step_s`` samples against time since the first line of
    the run, with a dashed vertical line where each recovery began (its earliest ``time - rto_s``).
"""

from __future__ import annotations

from typing import Any

from gossiprec.report.summary import by_epoch
from gossiprec.report.timeline import PHASES, Recovery, Timeline, TimelineError

MAX_BARS = 48
"""Most bars panel (a) draws (a bar is ~0.28 in high: the picture stays readable and finite)."""
MAX_LEGEND_RANKS = 16
"""Panel (b) names its ranks in a legend up to this many."""
MAX_LABELLED = 20
"""Panel (b) labels its recovery lines up to this many (more would overlap)."""
PHASE_COLOURS = ("#d62728", "#ff7f0e", "#bcbd22", "#2ca02c", "#1f77b4", "#9467bd")


def _pyplot() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise TimelineError("--plot needs matplotlib: pip install 'gossiprec[plot]' (or matplotlib)") from None
    return plt


def _bars(groups: dict[int, list[Recovery]]) -> tuple[list[Recovery], str]:
    """The lines panel (a) draws, in time order, and a few words on which they are."""
    lines = [r for g in groups.values() for r in sorted(g, key=lambda r: r.rank)]
    if len(lines) <= MAX_BARS:
        return lines, f"{len(lines)} rank lines"
    slowest = [max(g, key=lambda r: r.rto_s) for g in groups.values()]
    if len(slowest) <= MAX_BARS:
        return slowest, f"the slowest rank of each ({len(lines)} rank lines)"
    return slowest[-MAX_BARS:], f"the slowest rank of the last {MAX_BARS}"


def plot(tl: Timeline, path: str) -> None:
    """Draw ``tl`` into the PNG (or any format matplotlib knows by extension) at ``path``."""
    plt = _pyplot()
    groups = by_epoch(tl.recoveries)
    bars, what = _bars(groups)
    height = 2.5 + 0.28 * max(len(bars), 4)
    fig, (a, b) = plt.subplots(2, 1, figsize=(11, height + 3.5), height_ratios=[height, 3.5])
    try:
        # (a) one bar per recovery per rank, top to bottom in time order
        labels = []
        for y, r in enumerate(bars):
            left = 0.0
            for (name, secs), colour in zip(r.phases, PHASE_COLOURS):
                a.barh(y, secs, left=left, color=colour, edgecolor="white", linewidth=0.5,
                       label=name if y == 0 else None)
                left += secs
            a.text(left, y, f" {r.rto_s:.2f} s", va="center", fontsize=8)
            labels.append(f"e{r.epoch} {r.action} r{r.rank} ({r.node})")
        if bars:
            a.set_yticks(range(len(bars)), labels, fontsize=8)
            a.invert_yaxis()
            # below the axis label, so that it never hides a bar
            a.legend(title="phase", loc="upper center", bbox_to_anchor=(0.5, -0.2), fontsize=8, ncols=len(PHASES))
            a.set_xlim(0, max(r.rto_s for r in bars) * 1.15 or 1.0)
        else:
            a.set_yticks([])
            a.text(0.5, 0.5, "no recoveries", transform=a.transAxes, ha="center", va="center")
        a.set_xlabel("seconds since the first evidence of the failure (the rank's or its agent's)")
        a.set_title(f"(a) recovery timelines: {len(groups)} recoveries, {what}")
        a.grid(axis="x", alpha=0.3)

        # (b) step time per rank over the run
        stamps = [s.time for s in tl.steps] + [r.time - r.rto_s for r in tl.recoveries]
        t0 = min(stamps) if stamps else 0.0
        ranks = sorted({s.rank for s in tl.steps})
        for rank in ranks:
            ss = [s for s in tl.steps if s.rank == rank]
            b.plot([s.time - t0 for s in ss], [s.step_s * 1000 for s in ss], ".-", ms=3, lw=1, label=f"rank {rank}")
        for epoch, g in groups.items():
            start = min(r.time - r.rto_s for r in g) - t0
            b.axvline(start, color="black", ls="--", lw=1)
            if len(groups) <= MAX_LABELLED:
                b.annotate(f"e{epoch} {g[0].action}", (start, 1.0), xycoords=("data", "axes fraction"),
                           xytext=(3, -12), textcoords="offset points", fontsize=8)
        if 0 < len(ranks) <= MAX_LEGEND_RANKS:
            b.legend(fontsize=8, loc="upper left", ncols=min(len(ranks), 8))
        elif not ranks:
            b.text(0.5, 0.5, "no step samples", transform=b.transAxes, ha="center", va="center")
        b.set_xlabel("seconds since the start of the timeline")
        b.set_ylabel("step time (ms)")
        b.set_ylim(bottom=0)
        b.set_title(f"(b) step time of {len(ranks)} rank(s); dashed: a recovery began")
        b.grid(alpha=0.3)
        fig.tight_layout()
        try:
            fig.savefig(path, dpi=100)
        except OSError as exc:
            raise TimelineError(f"{path}: cannot write the plot: {exc.strerror or exc}") from None
        except ValueError as exc:  # an extension matplotlib has no writer for
            raise TimelineError(f"{path}: cannot write the plot: {exc}") from None
    finally:
        plt.close(fig)
