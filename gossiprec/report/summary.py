"""The summary of a timeline: one row per recovery per rank, totals per run, step time per rank.

Theory of operation
-------------------
A *recovery* is the set of ``recovery`` lines with one ``epoch`` (every rank of the new view writes one;
files of several agents merged hold them all). Its RTO is the largest of its ranks' ``rto_s`` (the job
trains again when its last rank has done its first step), its lost steps the largest of its ranks'
``lost_steps`` (every rank rolls back to one ``target_step``: summing them would count one loss once per
rank). Bytes are summed over the lines (each receiver counts what it received).

Totals: recoveries (distinct epochs) and lines, recoveries per action, RTO p50 (the median, the mean of
the two middle values for an even count) and max over recoveries, lost steps and bytes in all.
Step time per rank: the median of its ``steps`` samples' ``step_s`` (the mean step time over each sample's
interval), with the number of samples, its last step and its largest ``behind_ms``.
MB/s is ``bytes / transfer_s / 1e6`` (decimal megabytes), absent when nothing was transferred.
``phase_sum_off`` counts the lines whose phases do not add up to their ``rto_s`` within
:data:`PHASE_SUM_TOLERANCE_S` (the format promises they do: a count above 0 is a writer's bug).
"""

from __future__ import annotations

import statistics
import time as _time
from typing import Any

from gossiprec.report.timeline import ACTIONS, PHASES, Recovery, Timeline

PHASE_SUM_TOLERANCE_S = 0.001


def phase_sum_off(r: Recovery) -> bool:
    """Whether ``r``'s phases miss its RTO by more than the tolerance."""
    return abs(sum(secs for _, secs in r.phases) - r.rto_s) > PHASE_SUM_TOLERANCE_S


def row(r: Recovery) -> dict[str, Any]:
    """One recovery line as a flat dict (the ``rows`` of ``--json``)."""
    mb_s = r.bytes / r.transfer_s / 1e6 if r.bytes and r.transfer_s > 0 else None
    return {
        "time": r.time, "node": r.node, "epoch": r.epoch, "rank": r.rank, "role": r.role, "action": r.action,
        "cause": r.cause, "world_size": r.world_size, "previous_world_size": r.previous_world_size,
        "target_step": r.target_step, "rto_s": r.rto_s, "phases": dict(r.phases), "lost_steps": r.lost_steps,
        "bytes": r.bytes, "transfer_s": r.transfer_s, "mb_s": mb_s, "donors": list(r.donors),
        "digest": r.digest,
    }


def by_epoch(recoveries: list[Recovery]) -> dict[int, list[Recovery]]:
    """The lines of each recovery, in the order of their first line's time."""
    out: dict[int, list[Recovery]] = {}
    for r in sorted(recoveries, key=lambda r: r.time):
        out.setdefault(r.epoch, []).append(r)
    return out


def step_times(tl: Timeline) -> dict[int, dict[str, Any]]:
    """Rank -> {median_step_s, samples, last_step, max_behind_ms}, ranks in order."""
    per: dict[int, list[Any]] = {}
    for s in tl.steps:
        per.setdefault(s.rank, []).append(s)
    out = {}
    for rank in sorted(per):
        ss = per[rank]
        out[rank] = {"median_step_s": statistics.median(s.step_s for s in ss), "samples": len(ss),
                     "last_step": max(s.step for s in ss), "max_behind_ms": max(s.behind_ms for s in ss)}
    return out


def summarize(tl: Timeline) -> dict[str, Any]:
    """``{"summary": {...}, "rows": [...], "step_time": {...}}`` (what ``--json`` prints)."""
    groups = by_epoch(tl.recoveries)
    rtos = [max(r.rto_s for r in g) for g in groups.values()]
    actions: dict[str, int] = {}
    for g in groups.values():
        for action in dict.fromkeys(r.action for r in g):  # one count per recovery, whatever its ranks say
            actions[action] = actions.get(action, 0) + 1
    order = {a: i for i, a in enumerate(ACTIONS)}
    summary = {
        "files": list(tl.files),
        "recoveries": len(groups),
        "lines": len(tl.recoveries),
        "by_action": dict(sorted(actions.items(), key=lambda kv: order.get(kv[0], len(order)))),
        "rto_p50_s": statistics.median(rtos) if rtos else None,
        "rto_max_s": max(rtos) if rtos else None,
        "lost_steps": sum(max(r.lost_steps for r in g) for g in groups.values()),
        "bytes": sum(r.bytes for r in tl.recoveries),
        "digest_mismatches": sum(1 for r in tl.recoveries if r.digest == "mismatch"),
        "phase_sum_off": sum(1 for r in tl.recoveries if phase_sum_off(r)),
        "step_samples": len(tl.steps),
        "truncated_lines": tl.truncated,
        "skipped_lines": tl.skipped,
    }
    return {"summary": summary, "rows": [row(r) for r in tl.recoveries],
            "step_time": {str(k): v for k, v in step_times(tl).items()}}


# --- text ---------------------------------------------------------------------------------------------
def _when(t: float) -> str:
    return _time.strftime("%Y-%m-%d %H:%M:%S", _time.gmtime(t)) + f".{int(t * 10 % 10)}Z"


CAUSE_WIDTH = 48
"""Characters of a recovery's cause in the table (an aborted collective's error can run to 300; --json
has it whole)."""


def _short(cause: str) -> str:
    return cause if len(cause) <= CAUSE_WIDTH else cause[:CAUSE_WIDTH - 3] + "..."


def _bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{int(n)} B"


def _table(header: list[str], body: list[list[str]]) -> list[str]:
    widths = [max(len(c) for c in col) for col in zip(header, *body)]
    return ["  ".join(c.ljust(w) for c, w in zip(line, widths)).rstrip() for line in [header, *body]]


def render_text(report: dict[str, Any]) -> str:
    """The summary as the table ``gossiprec report`` prints."""
    s, rows = report["summary"], report["rows"]
    out = []
    if not rows:
        out.append("no recoveries")
    else:
        header = ["time (UTC)", "node", "epoch", "rank", "role", "action", "cause", "RTO s",
                  *(f"{p} s" for p in PHASES), "lost", "bytes", "MB/s", "donors", "digest"]
        body = [[_when(r["time"]), r["node"], str(r["epoch"]), str(r["rank"]), r["role"],
                 r["action"], _short(r["cause"]), f"{r['rto_s']:.3f}", *(f"{r['phases'][p]:.3f}" for p in PHASES),
                 str(r["lost_steps"]),
                 _bytes(r["bytes"]), "-" if r["mb_s"] is None else f"{r['mb_s']:.1f}",
                 ",".join(r["donors"]) or "-", r["digest"]] for r in rows]
        out += _table(header, body)
        out.append("")
        acts = ", ".join(f"{a} {n}" for a, n in s["by_action"].items())
        out.append(f"{s['recoveries']} recoveries ({s['lines']} rank lines): {acts}")
        out.append(f"RTO p50 {s['rto_p50_s']:.3f} s, max {s['rto_max_s']:.3f} s; lost steps {s['lost_steps']}; "
                   f"bytes {_bytes(s['bytes'])}; digest mismatches {s['digest_mismatches']}")
    steps = report["step_time"]
    if steps:
        out.append("")
        out += _table(["rank", "median step s", "samples", "last step", "max behind ms"],
                      [[k, f"{v['median_step_s']:.4f}", str(v["samples"]), str(v["last_step"]),
                        f"{v['max_behind_ms']:.1f}"] for k, v in steps.items()])
    notes = []
    if s["phase_sum_off"]:
        notes.append(f"{s['phase_sum_off']} line(s) whose phases do not add up to their RTO within "
                     f"{PHASE_SUM_TOLERANCE_S * 1000:g} ms")
    if s["truncated_lines"]:
        notes.append(f"{s['truncated_lines']} truncated last line(s) dropped")
    if s["skipped_lines"]:
        notes.append(f"{s['skipped_lines']} line(s) of other kinds skipped")
    if notes:
        out.append("(" + "; ".join(notes) + ")")
    return "\n".join(out)
