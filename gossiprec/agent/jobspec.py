"""The job spec: who is in view 0, with which rank, and which ranks hold identical state.

A TOML file, read once at the edge (the core never reads files)::

    [job]
    topology = "ddp"        # or "grid" (then dp = ... and tp_pp = ...)
    allow_shrink = true     # with no spare left, drop data-parallel replicas instead of stopping
    min_replicas = 1

    [[members]]
    name = "node-a"
    addr = "10.0.0.1:7980"
    role = "trainer"        # or "spare"
    rank = 0
    host = "host-a"         # optional; placement for choosing a nearby spare
    rack = "rack-1"         # optional

Every agent of the job reads the same file, so all derive the same view 0 without any coordinator.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.errors import ConfigError


def view0_from_dict(doc: dict[str, Any], where: str = "job spec") -> View:
    job = doc.get("job", {})
    rows = doc.get("members")
    if not isinstance(job, dict) or not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: needs a [job] table and at least one [[members]] entry")
    members = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: members[{i}] must be a table")
        unknown = set(row) - {"name", "addr", "role", "rank", "host", "rack"}
        if unknown:
            raise ConfigError(f"{where}: members[{i}] has unknown key(s) {', '.join(sorted(unknown))}")
        try:
            members.append(ViewMember(str(row["name"]), str(row["addr"]), str(row.get("role", "trainer")),
                                      row.get("rank"), str(row.get("host", "")), str(row.get("rack", ""))))
        except KeyError as exc:
            raise ConfigError(f"{where}: members[{i}] lacks {exc.args[0]!r}") from None
        members[-1].as_member()  # validates role and rank
    trainers = sum(1 for m in members if m.role == "trainer")
    kind = job.get("topology", "ddp")
    shrink = bool(job.get("allow_shrink", False))
    min_rep = int(job.get("min_replicas", 1))
    if kind == "ddp":
        topology = JobTopology.ddp(trainers, allow_shrink=shrink, min_replicas=min_rep)
    elif kind == "grid":
        topology = JobTopology.grid(int(job["dp"]), int(job["tp_pp"]), allow_shrink=shrink, min_replicas=min_rep)
    else:
        raise ConfigError(f"{where}: topology must be 'ddp' or 'grid', got {kind!r}")
    return View.initial(members, topology)


def load_view0(path: str) -> View:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read job spec {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job spec {path} is not valid TOML: {exc}") from None
    return view0_from_dict(doc, path)
