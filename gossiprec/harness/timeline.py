"""The timeline of a recovery, from the records its trainers wrote, measured from the fault.

Every trainer that took part in a recovery writes one record (``RecoveryRecord.to_dict()``) with
``time.monotonic()`` stamps (CLOCK_MONOTONIC: the same clock on every process of the machine, so a
fault stamped by the orchestrator or by the victim itself is comparable with them). :func:`timeline`
takes the first recovery (the lowest epoch) among the records it is given and reports each phase of
:data:`PHASES` in seconds after the fault: ``detected`` is the first failure event any agent
reported, ``noticed_by_trainers`` the last rank that was a trainer before to notice, every other
phase the last rank's stamp. ``rto_s`` is ``first_step_done``: the fault until every rank has
committed its first step after the recovery; ``transfer_mb_s`` the receivers' bytes over their fetch
time.
"""

from __future__ import annotations

from typing import Any, Sequence

PHASES = ("detected", "noticed_by_trainers", "agreed", "planned", "state_moved", "group_rebuilt",
          "first_step_done")
"""The phases :func:`timeline` reports, in order; from ``agreed`` on they are ordered on every rank."""


def timeline(t_fault: float, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Phases measured from the fault, over the records of the first recovery after it."""
    if not records:
        return {"rto_s": None, "phases_s": {}, "lost_steps": None, "transfer_mb_s": None}
    epoch = min(r["epoch"] for r in records)
    recs = [r for r in records if r["epoch"] == epoch]

    def rel(key: str, agg: Any = max) -> float | None:
        vals = [r[key] for r in recs if r.get(key) is not None]
        return round(agg(vals) - t_fault, 4) if vals else None

    recv = [r for r in recs if r["role"] == "receiver"]
    nbytes = sum(r["bytes_received"] for r in recv)
    secs = sum(r["transfer_s"] for r in recv)
    trainers = [r for r in recs if r.get("previous_role", "trainer") == "trainer"]
    noticed = [r["noticed_at"] for r in trainers]
    phases = {"detected": rel("detected_at", min),
              "noticed_by_trainers": round(max(noticed) - t_fault, 4) if noticed else None,
              "agreed": rel("agreed_at", max), "planned": rel("planned_at", max),
              "state_moved": rel("state_at", max), "group_rebuilt": rel("group_at", max),
              "first_step_done": rel("first_step_at", max)}
    return {"rto_s": phases["first_step_done"], "phases_s": phases,
            "lost_steps": max(r["lost_steps"] for r in recs),
            "transfer_mb_s": round(nbytes / secs / 1e6, 1) if secs > 0 else None,
            "transfer_bytes": nbytes, "epoch": epoch, "action": recs[0].get("action", "resume"),
            "roles": {r["rank"]: r["role"] for r in recs},
            "assignment": {r["rank"]: r["node"] for r in recs if "node" in r}}
