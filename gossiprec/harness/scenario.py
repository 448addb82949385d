"""Run a local job under faults and check it: the state it ends with, and each fault's timeline.

:func:`run_scenario` starts a :class:`~gossiprec.harness.job.LocalJob` of ``ranks`` trainers and
``spares`` hot spares, each running the demo's trainer (:mod:`gossiprec.harness.trainer`); the
trainers begin together by themselves (``start()`` is the barrier, and waits for the spares to be up:
:data:`SPARES_UP_S`). It sends the faults that have no phase itself (in list
order, each once its node has committed the fault's step; a fault for node :data:`STORE_HOST` goes to
whichever node hosts the current epoch's store then); the others the trainers fire themselves.
:class:`Action` s are the caller's own interventions (a partition of the network, its healing), each
done once its condition holds, in list order. With ``lockstep``, every trainer waits after committing
the step of each fault sent from here until it has been sent (``--gate``), so that the fault lands at
that step whatever the load. Given ``hosts``, node i runs on host i of its own
(:class:`~gossiprec.harness.job.Hosts`, e.g. a network namespace).
When every rank of the final world has committed the last step, it waits for the rest of the
processes to end by themselves (the launchers of fenced nodes kill their stopped trainers; unused
spares leave with the job) and then builds the result:

- ``bit_identical``: every finished trainer's final state (model, optimizer, data position, RNG) equals,
  byte for byte, the failure-free run's (:func:`~gossiprec.harness.workload.reference_state`),
  computed here with the world sizes the recoveries chose;
- ``faults``: per fault, whether it fired, its step, and the :func:`~gossiprec.harness.timeline.timeline`
  of the first recovery after it (the records whose plan came after it and before the next fault),
  the epochs of its recoveries and which node holds which rank after them; the first fault's keys
  are repeated at the top level;
- ``median_step_s`` (step periods longer than 5 median steps, i.e. the recoveries, left out),
  ``final_step``, ``worlds``, ``resizes``, ``checkpoint_loads``, ``released``, ``exits``,
  ``hung_killed_by_launcher`` and ``actions`` (each action's name: the ``time.monotonic()`` it was done at).
"""

from __future__ import annotations

import json
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Sequence

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.faults import STALLS, Fault
from gossiprec.harness.job import Hosts, LocalJob, read_int, read_json
from gossiprec.harness.timeline import timeline
from gossiprec.harness.workload import reference_state

END_WAIT_S = 10.0
"""After the last step, how long the processes left have to end by themselves."""
STORE_HOST = "@store"
"""The node of a fault sent from here that means "the host of the current epoch's store" (rank 0's node
in epoch 0, then the ``store_node`` of the newest recovery record), resolved when the fault is due."""
SPARES_UP_S = 120.0
"""How long the ranks wait in ``start()`` for the spares to be up (``TrainerConfig.wait_for_spares``): a
fault must not find a spare still importing torch, or its recovery measures the import."""


@dataclass(frozen=True, slots=True)
class Action:
    """Something the caller does to a running job, once: ``do(job)`` as soon as ``when(job)`` holds
    (checked every few milliseconds, after the previous action was done)."""

    name: str
    when: Callable[[LocalJob], bool]
    do: Callable[[LocalJob], None]


def run_scenario(ranks: int, spares: int, steps: int, faults: Sequence[Fault], *, hidden: int = 256,
                 step_ms: float = 20.0, workdir: str | None = None, timeout: float = 100.0,
                 allow_shrink: bool = False, checkpoint_every: int = 0, slow_fetch: float = 0.0,
                 lr_scale: bool = False, tp_pp: int = 1, trainer_timeout: float = 30.0, log: Any = None,
                 verbose: bool = False, agent_log_level: str = "warning", protocol: Mapping[str, Any] = {},
                 mistakes: Mapping[str, str] = {}, may_fail: Collection[str] = (),
                 late: Mapping[str, float] = {}, trainer_args: Sequence[str] = (), hosts: Hosts | None = None,
                 actions: Sequence[Action] = (), lockstep: bool = False, metrics: bool = False,
                 join_at: Sequence[int] = ()) -> dict[str, Any]:
    """Run a job of ``ranks`` trainers (nodes ``n0``..) and ``spares`` spares, inject ``faults`` (the
    ones without a phase sent from here, in list order) and compare the final states with the
    failure-free run.

    ``timeout`` bounds the whole run (GossiprecError on expiry, logs kept in the work directory).
    ``allow_shrink`` goes into the job spec; ``lr_scale`` makes ``on_resize`` apply
    :func:`~gossiprec.harness.workload.scale_lr`; ``checkpoint_every`` makes rank 0 checkpoint
    (``on_no_replica`` loads it); ``slow_fetch`` slows every receiver by that many seconds per chunk.
    ``tp_pp`` > 1 declares the job a grid of ``ranks // tp_pp`` replicas of ``tp_pp`` shards (the
    trainers still train data-parallel: only the agents' notion of which ranks hold the same state
    changes), e.g. ``tp_pp=ranks`` leaves every shard without a replica. ``protocol``: agreement
    settings for every agent (``--protocol``); ``mistakes``: node -> a loop mistake of
    :data:`~gossiprec.harness.trainer.MISTAKES` its trainer makes; ``may_fail``: nodes whose trainer
    may exit with an error without failing the run; ``late``: node -> seconds its trainer sleeps before
    it starts (a slow import); ``trainer_args``: more options for every trainer; ``hosts``: a host of its
    own for each node (default: all on loopback); ``actions``: see :class:`Action`; ``lockstep``: see the
    module docstring (the gate of step S is ``<workdir>/gate-S``); ``metrics``: every agent serves its
    metrics (``job.metrics_ports``); ``join_at``: for each step, a node the job spec does not list (the
    nodes after the listed ones, in order) is started once ``n0`` reached it and joins as a spare
    (``joined_at`` in the result: when each was started). The agents write the job's timeline file (``timeline``).
    Once the job is done,
    every process left must end by itself: ``exits`` holds each launcher's exit code (None: still
    running :data:`END_WAIT_S` later).
    """
    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    tmp = Path(workdir or tempfile.mkdtemp(prefix="gossiprec-demo-"))
    with LocalJob(tmp, ranks, spares, allow_shrink=allow_shrink, tp_pp=tp_pp, hosts=hosts, metrics=metrics,
                  outsiders=len(join_at)) as job:
        names = job.names
        joiners = dict(zip(names[job.listed:], join_at))  # outsider -> the step it is started at
        # slow, lag and hold are stalls the trainers make themselves, not faults to report on
        everything, faults = list(faults), [f for f in faults if f.kind not in STALLS]
        unknown = {f.node for f in everything} - set(names) - {STORE_HOST}
        if any(f.node == STORE_HOST and f.phase is not None for f in everything):
            raise ConfigError(f"a {STORE_HOST} fault is sent from outside: give it no phase")
        if unknown:
            raise ConfigError(f"faults name unknown nodes {sorted(unknown)}; nodes are {names}")
        commands: dict[str, list[str]] = {}
        for name in names:
            cmd = [sys.executable, "-m", "gossiprec.harness.trainer", "--steps", str(steps),
                   "--hidden", str(hidden), "--step-ms", str(step_ms), "--timeout", str(trainer_timeout),
                   "--out", str(tmp / f"{name}.json"), "--slow-fetch", str(slow_fetch),
                   "--wait-for-spares", str(SPARES_UP_S), "--late", str(late.get(name, 0.0)), *trainer_args]
            cmd += [a for f in everything if f.node == name and f.phase is not None for a in ("--fault", f.spec())]
            if lockstep:
                cmd += [a for s in sorted({f.step for f in faults if f.phase is None})
                        for a in ("--gate", f"{s}:{tmp / f'gate-{s}'}")]
            cmd += ["--mistake", mistakes[name]] if name in mistakes else []
            if checkpoint_every:
                cmd += ["--checkpoint", str(tmp / "ckpt.state"), "--checkpoint-every", str(checkpoint_every)]
            cmd += ["--lr-scale"] * lr_scale + ["--verbose"] * verbose
            commands[name] = cmd
            if name not in joiners:
                job.spawn(name, cmd, agent_log_level=agent_log_level, protocol=protocol)
        say(f"started {ranks} ranks + {spares} spare(s) in {tmp}")
        procs = job.procs
        result: dict[str, Any] = {"ranks": ranks, "spares": spares, "steps": steps,
                                  "victim": faults[0].node if faults else None, "timeline": str(job.timeline)}
        sent = [f for f in faults if f.phase is None]
        fault_at: dict[int, float] = {}
        deadline = time.monotonic() + timeout
        victims = {f.node for f in faults}
        paused: dict[str, int] = {}
        done_at: dict[str, float] = {}
        joined_at: dict[str, float] = {}
        while True:
            if time.monotonic() > deadline:
                raise GossiprecError(f"the job did not finish within {timeout:.0f}s; see the logs in {tmp}")
            failed = {n: p.returncode for n, p in procs.items()
                      if n not in victims and n not in may_fail and p.poll() not in (None, 0)}
            if failed:
                raise GossiprecError(f"trainers failed: {failed}; see the logs in {tmp}")
            i = len(fault_at)
            if i < len(sent) and sent[i].node == STORE_HOST:
                host = _store_host(tmp, names)
                if host is not None and read_int(tmp / f"{host}.step") >= sent[i].step:
                    f = Fault(host, sent[i].kind, sent[i].step)
                    faults[faults.index(sent[i])] = sent[i] = f
                    victims.add(host)
                    say(f"the store of the current epoch is hosted by {host}")
            if i < len(sent) and sent[i].node != STORE_HOST and read_int(tmp / f"{sent[i].node}.step") >= sent[i].step:
                f = sent[i]
                # each fault is dated before it is made: what it causes can follow within microseconds
                if f.kind == "crash":
                    fault_at[i] = time.monotonic()
                    job.crash(f.node)
                    say(f"crash of {f.node}'s host at step {read_int(tmp / f'{f.node}.step')}")
                elif f.kind == "reprovision":  # the whole node dies; started again once the others recovered
                    paused[f.node] = _records_count(tmp, names, but=f.node)
                    fault_at[i] = time.monotonic()
                    job.signal(f.node, signal.SIGKILL)  # in its own session: the launcher's death spares it
                    procs[f.node].kill()
                    procs[f.node].wait()
                    say(f"SIGKILL agent and trainer of {f.node} at step {read_int(tmp / f'{f.node}.step')}")
                elif f.kind == "pause":  # the whole node (agent and trainer), until the others recovered
                    paused[f.node] = _records_count(tmp, names, but=f.node)
                    fault_at[i] = time.monotonic()
                    procs[f.node].send_signal(signal.SIGSTOP)
                    job.signal(f.node, signal.SIGSTOP)
                    say(f"SIGSTOP agent and trainer of {f.node} at step {read_int(tmp / f'{f.node}.step')}")
                else:
                    fault_at[i] = time.monotonic()
                    pid = job.signal(f.node, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
                    say(f"{'SIGKILL' if f.kind == 'kill' else 'SIGSTOP'} trainer of {f.node} at step "
                        f"{read_int(tmp / f'{f.node}.step')} (pid {pid})")
            if lockstep and i < len(fault_at):
                (tmp / f"gate-{sent[i].step}").touch()  # the fault is out: the ranks go on
            for node, count in list(paused.items()):
                if _records_count(tmp, names, but=node) > count:  # the others recovered without it
                    del paused[node]
                    if procs[node].poll() is not None:  # reprovisioned: the same command, the same job spec
                        job.spawn(node, commands[node], agent_log_level=agent_log_level, protocol=protocol)
                        say(f"started {node} again (a re-provisioned host)")
                        continue
                    # the trainer first: a launcher that wakes to a stopped child kills it as hung
                    job.signal(node, signal.SIGCONT)
                    procs[node].send_signal(signal.SIGCONT)
                    say(f"SIGCONT trainer and agent of {node}: the partition heals")
            for node, step in joiners.items():
                if node not in joined_at and read_int(tmp / f"{names[0]}.step") >= step:
                    joined_at[node] = time.monotonic()
                    job.spawn(node, commands[node], agent_log_level=agent_log_level, protocol=protocol)
                    say(f"started {node}, a node the job spec does not list, at step {step}")
            if len(done_at) < len(actions) and actions[len(done_at)].when(job):
                action = actions[len(done_at)]
                action.do(job)
                done_at[action.name] = time.monotonic()
                say(f"{action.name}: done")
            outs = [o for o in (read_json(tmp / f"{n}.json") for n in names) if o is not None]
            done = [o for o in outs if o.get("step") == steps and not o.get("released")]
            if len(fault_at) == len(sent) and not paused and len(done_at) == len(actions) and done \
                    and len(joined_at) == len(joiners) \
                    and len(done) >= max(o["world_size"] for o in done):
                break
            time.sleep(0.01)
        stopped = [f.node for f in faults if f.kind == "stop"]
        end_by = time.monotonic() + END_WAIT_S  # the trainers that finished leave, and so do the unused spares
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < end_by:
            time.sleep(0.02)
        result["hung_killed_by_launcher"] = {n: procs[n].poll() is not None for n in stopped}
        result["exits"] = {n: p.poll() for n, p in procs.items()}
        result["actions"] = done_at
        result["joined_at"] = joined_at
        return _results(result, tmp, names, faults, sent, fault_at, steps, ranks, hidden, lr_scale)


def _records_count(tmp: Path, names: Sequence[str], but: str = "") -> int:
    """How many recovery records the nodes (but ``but``) have written so far."""
    paths = [tmp / f"{n}.records" for n in names if n != but]
    return sum(len(p.read_text().splitlines()) for p in paths if p.exists())


def _store_host(tmp: Path, names: Sequence[str]) -> str | None:
    """The node hosting the newest epoch's store, from the recovery records (rank 0's node, ``n0``,
    before any); None while the newest recovery's records are still to come from every rank."""
    newest: tuple[int, str] | None = None
    for n in names:
        path = tmp / f"{n}.records"
        lines = path.read_text().splitlines() if path.exists() else []
        for line in lines:
            try:
                rec = json.loads(line)
            except ValueError:  # half written
                continue
            if newest is None or rec["epoch"] > newest[0]:
                newest = (int(rec["epoch"]), str(rec.get("store_node") or ""))
    if newest is None:
        return names[0]
    return newest[1] or None


def _results(result: dict[str, Any], tmp: Path, names: list[str], faults: Sequence[Fault], sent: list[Fault],
             fault_at: dict[int, float], steps: int, ranks: int, hidden: int, lr_scale: bool) -> dict[str, Any]:
    """Compare the finished trainers' states with the reference and build the per-fault timelines."""
    outs = {n: o for n in names if (o := read_json(tmp / f"{n}.json")) is not None}
    finished = {n: o for n, o in outs.items() if not o.get("released")}
    records = [json.loads(line) for n in names if (tmp / f"{n}.records").exists()
               for line in (tmp / f"{n}.records").read_text().splitlines() if line.strip()]
    by_epoch = {r["epoch"]: (r["target_step"], r["world_size"]) for r in sorted(records, key=lambda r: r["epoch"])}
    worlds, world = [], ranks
    for target, w in by_epoch.values():
        if w != world:
            worlds.append((target, w))
            world = w
    t_ref = time.monotonic()
    expected = reference_state(steps, ranks, hidden, worlds=worlds, lr_scale=lr_scale)
    result["reference_s"] = round(time.monotonic() - t_ref, 3)
    result["bit_identical"] = bool(finished) and all((tmp / f"{n}.state").read_bytes() == expected
                                                    for n in finished)
    result["worlds"] = worlds
    times: list[float | None] = []
    for f in faults:
        if f.phase is None:
            times.append(fault_at.get(sent.index(f)))
        else:
            rec = read_json(tmp / f"{f.node}.fault")
            times.append(float(rec["t"]) if rec else None)
    entries = []
    for i, (f, t) in enumerate(zip(faults, times)):
        entry: dict[str, Any] = {"node": f.node, "kind": f.kind, "phase": f.phase or "any", "fired": t is not None}
        if t is not None:
            rec = read_json(tmp / f"{f.node}.fault") if f.phase else None
            entry["step"] = rec["step"] if rec else f.step
            later = [u for u in times[i + 1:] if u is not None and u >= t]
            end = min(later, default=float("inf"))
            mine = [r for r in records if t <= r["planned_at"] < end]
            entry.update(timeline(t, mine))
            entry["epochs"] = sorted({r["epoch"] for r in mine})
            # who holds which rank once the fault's recoveries are over (the latest record per rank)
            entry["assignment_after"] = {r["rank"]: r["node"] for r in sorted(mine, key=lambda r: r["epoch"])}
        entries.append(entry)
    result["faults"] = entries
    first = next((e for e in entries if e["fired"]), {})
    result.update({k: first.get(k) for k in ("rto_s", "phases_s", "lost_steps", "transfer_mb_s",
                                              "transfer_bytes", "epoch", "roles")})
    periods = [b - a for o in finished.values() for a, b in zip(o["commit_times"], o["commit_times"][1:])]
    if periods:
        typical = statistics.median(periods)
        result["median_step_s"] = round(statistics.median(p for p in periods if p < 5 * typical), 4)
    result["state_bytes"] = next(iter(finished.values()))["state_bytes"] if finished else 0
    result["final_step"] = sorted({o["step"] for o in finished.values()})
    result["resizes"] = {n: o["resizes"] for n, o in finished.items() if o.get("resizes")}
    result["trainers"] = {n: {k: o.get(k) for k in ("interruptions", "epoch", "view_epoch", "view_members")}
                          for n, o in finished.items()}
    result["checkpoint_loads"] = {n: o["checkpoint_loads"] for n, o in finished.items()
                                  if o.get("checkpoint_loads")}
    result["released"] = sorted(n for n, o in outs.items() if o.get("released"))
    result["workdir"] = str(tmp)
    return result
