"""Run a sharded local job (four ranks on a 2 x 2 mesh, plus spares) under faults, and read what it left.

:func:`run_sharded` starts a :class:`~gossiprec.harness.job.LocalJob` whose job spec's ``[job]`` table is
written from the layout's :class:`~gossiprec.trainer.collectives.sharded.MeshSpec` (never typed twice), each node
running :mod:`gossiprec.harness.sharded_trainer`; the faults (each with a phase) are fired by the
trainers themselves. When every rank of the mesh has written its final report, the processes left
(unused spares, launchers of removed nodes) have :data:`END_WAIT_S` to end by themselves, then the job
is reaped; a node whose own fault stalled it (hang, stop) is not waited for. The result:

- ``states``: rank -> SHA-256 of its final local state (its shards of model and optimizer, RNG): a run
  with failures must give the same digests as the failure-free run of the same layout and steps;
- ``assignment``: rank -> the node that finished it; ``final_step``: the steps the ranks ended at;
  ``commits``: rank -> its ``(step, time.monotonic())`` after each step it committed, ``cpu_s``: rank ->
  its process's CPU time (``time.process_time()``) at each of those commits; ``losses``: rank -> step ->
  the loss its finishing node committed that step with (``--model lm``); ``resizes``: rank -> each
  ``on_resize(old, new)`` of its finishing node, with the mesh's shape it saw; ``mesh``: rank -> the
  final mesh's shape;
- ``faults``: per fault, whether it fired (and when), and the records of the first recovery after it
  (:func:`~gossiprec.harness.timeline.timeline` of them, plus each receiver's donors);
- ``exits``: each launcher's exit code (None: still running when reaped); ``records``: every recovery
  record of the run; ``actions``: each action's name -> the ``time.monotonic()`` it was done at;
- ``resumed`` and ``saved`` (``--dcp``): rank -> the checkpoint step its run resumed from (None: none),
  and the steps it saved checkpoints of.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Collection, Mapping, Sequence

from gossiprec.errors import GossiprecError
from gossiprec.harness.faults import Fault
from gossiprec.harness.job import Hosts, LocalJob, read_json
from gossiprec.harness.scenario import Action
from gossiprec.harness.timeline import timeline
from gossiprec.local.launch import EXIT_STOPPED

END_WAIT_S = 10.0
"""After the last rank's report, how long the processes left have to end by themselves."""
SPARES_UP_S = 120.0
"""How long the ranks wait in ``start()`` for the spares to be up (a fault must not find one importing torch)."""
RANKS = 4
STALLED_UNTIL_KILLED = ("hang", "stop")
"""Fault kinds that leave their node's trainer alive until its launcher kills it (not waited for at the end)."""


def _tails(job: LocalJob, nodes: Sequence[str], lines: int = 25) -> str:
    """The last ``lines`` of each node's log, for the error: a CI machine keeps no work directory."""
    out = []
    for node in nodes:
        try:
            text = job.path(node, ".log").read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            continue
        out.append(f"\n--- {node}.log (last {len(text)} lines)\n" + "\n".join(line[:400] for line in text))
    return "".join(out)


def run_sharded(layout: str, steps: int, faults: Sequence[Fault] = (), *, spares: int = 1,
                workdir: str | None = None, timeout: float = 120.0, step_ms: float = 0.0,
                trainer_timeout: float = 30.0, hidden: int = 16, agent_log_level: str = "warning",
                log: Any = None, actions: Sequence[Action] = (), may_fail: Collection[str] = (),
                trainer_args: Sequence[str] = (), extra_args: Mapping[str, Sequence[str]] | None = None,
                hosts: Hosts | None = None, mesh: str | None = None, allow_shrink: bool = False,
                min_replicas: int = 1, finish_ranks: int = RANKS, until_exit: bool = False,
                stops: bool = False, protocol: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Run ``layout`` (``tp`` or ``hsdp``, :data:`~gossiprec.harness.sharded_trainer.LAYOUTS`) for
    ``steps`` steps with ``spares`` hot spares and ``faults``; see the module docstring for the result.
    ``timeout`` bounds the whole run (GossiprecError on expiry; the logs stay in the work directory);
    ``hidden``: the MLP's width; ``agent_log_level``: the agents' (``info`` logs every agent event);
    ``actions``: the caller's interventions, one after the other, as in
    :func:`~gossiprec.harness.scenario.run_scenario` (each name -> when it was done: ``actions`` in the
    result); ``may_fail``: nodes whose trainer may exit with an error; ``trainer_args``: more options
    for every trainer (e.g. ``--start-gate PATH``); ``extra_args``: node -> more options for that node's
    trainer alone; ``hosts``: node i runs on host i (default: every
    node on loopback; see :class:`~gossiprec.harness.job.LocalJob`); ``mesh``: launch with ``--nnodes`` and
    this ``--mesh`` instead of a job spec (view 0 agreed through the seeds, carrying the mesh);
    ``allow_shrink``, ``min_replicas``: the job spec's; ``finish_ranks``: the ranks of the world the job
    ends with (fewer than the mesh's after a shrink); ``until_exit``: return once every process has
    ended, whether or not the ranks reported (a job that stops); ``stops``: the same, and the job is
    expected to stop in good order (exit 75, say with no spare left), so 75 is no error; ``protocol``: the
    agents' agreement settings (``--protocol KEY=VALUE``, e.g. ``{"hang_floor": 4}``)."""
    from gossiprec.harness.sharded_trainer import LAYOUTS

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    spec = LAYOUTS[layout]
    work = Path(workdir or tempfile.mkdtemp(prefix=f"gossiprec-sharded-{layout}-"))
    table = spec.job_toml(allow_shrink=allow_shrink, min_replicas=min_replicas)
    with LocalJob(work, RANKS, spares, job_table=table, hosts=hosts, mesh=mesh) as job:
        for node in job.names:
            argv = [sys.executable, "-m", "gossiprec.harness.sharded_trainer", "--layout", layout,
                    "--steps", str(steps), "--out", str(job.path(node, ".json")), "--step-ms", str(step_ms),
                    "--timeout", str(trainer_timeout), "--hidden", str(hidden),
                    "--wait-for-spares", str(SPARES_UP_S if spares else 0), *trainer_args,
                    *(extra_args or {}).get(node, ())]
            for f in faults:
                if f.node == node:
                    argv += ["--fault", f.spec()]
            job.spawn(node, argv, agent_log_level=agent_log_level, protocol=protocol or {})
        deadline = time.monotonic() + timeout
        reports: dict[int, dict[str, Any]] = {}
        done_at: dict[str, float] = {}
        while len(reports) < finish_ranks:
            if len(done_at) < len(actions) and actions[len(done_at)].when(job):
                action = actions[len(done_at)]
                say(f"action: {action.name}")
                action.do(job)
                done_at[action.name] = time.monotonic()
            for node in job.names:
                rep = read_json(job.path(node, ".json"))
                if rep is not None and "rank" in rep:
                    reports[int(rep["rank"])] = rep
            dead = [n for n, p in job.procs.items() if p.poll() not in (None, 0, *([EXIT_STOPPED] if stops else []))
                    and n not in may_fail and not any(f.node == n for f in faults)]
            if (until_exit or stops) and all(p.poll() is not None for p in job.procs.values()):
                break
            if dead:
                raise GossiprecError(f"node(s) {dead} exited with an error; logs in {work}"
                                     f"{_tails(job, dead)}")
            if time.monotonic() >= deadline:
                raise GossiprecError(f"the sharded job did not finish within {timeout:.0f} s (ranks done: "
                                     f"{sorted(reports)}); logs in {work}{_tails(job, job.names)}")
            time.sleep(0.05)
        say(f"ranks {sorted(reports)} finished")
        # A node stalled by its own fault (hang, stop) ends only when its launcher kills it, 10 s after
        # its removal: nobody waits for it (its exit code is None in the result).
        stalled = {f.node for f in faults if f.kind in STALLED_UNTIL_KILLED
                   and read_json(job.path(f.node, ".fault")) is not None}
        end = time.monotonic() + END_WAIT_S
        while time.monotonic() < end and any(p.poll() is None for n, p in job.procs.items() if n not in stalled):
            time.sleep(0.05)
        exits = {n: p.poll() for n, p in job.procs.items()}
    records = [json.loads(line) for node in job.names if job.path(node, ".records").exists()
               for line in job.path(node, ".records").read_text().splitlines() if line]
    fired = []
    for f in faults:
        rec = read_json(job.path(f.node, ".fault"))
        after = [r for r in records if rec is not None and r["planned_at"] >= rec["t"]]
        first = [r for r in after if r["epoch"] == min(x["epoch"] for x in after)] if after else []
        tl = timeline(rec["t"], first) if rec is not None else {}
        fired.append({"node": f.node, "kind": f.kind, "phase": f.phase, "step": f.step, "fired": rec is not None,
                      **tl, "donors": {r["rank"]: r.get("donors", []) for r in first if r["role"] == "receiver"},
                      "causes": {r["rank"]: r["cause"] for r in first}, "records": first})
    return {"layout": layout, "steps": steps, "workdir": str(work),
            "states": {r: hashlib.sha256(job.path(rep["node"], ".state").read_bytes()).hexdigest()
                       for r, rep in sorted(reports.items())},
            "state_bytes": {r: rep["state_bytes"] for r, rep in sorted(reports.items())},
            "kept_bytes": {r: rep["kept_bytes"] for r, rep in sorted(reports.items())},
            "assignment": {r: rep["node"] for r, rep in sorted(reports.items())},
            "commits": {r: [(int(st), float(t)) for st, t in rep.get("commits", [])]
                        for r, rep in sorted(reports.items())},
            "cpu_s": {r: rep.get("cpu_s", []) for r, rep in sorted(reports.items())},
            "losses": {r: {int(s): v for s, v in rep.get("losses", {}).items()} for r, rep in sorted(reports.items())},
            "resizes": {r: rep.get("resizes", []) for r, rep in sorted(reports.items())},
            "mesh": {r: rep.get("mesh") for r, rep in sorted(reports.items())},
            "resumed": {r: rep.get("resumed") for r, rep in sorted(reports.items())},
            "saved": {r: rep.get("saved", []) for r, rep in sorted(reports.items())},
            "final_step": sorted({rep["step"] for rep in reports.values()}), "faults": fired, "exits": exits,
            "actions": done_at, "records": records,
            "replica_groups": [list(g) for g in spec.topology().replica_groups]}
