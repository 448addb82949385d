"""``gossiprec bench agents --bootstrap seeds``: real agents that agree on view 0 without a member list.

Theory of operation
-------------------
One ``gossiprec agent`` process per member on 127.0.0.1 (the agent's own code, sockets and event loop),
started as a user would start a job with no spec: ``--nnodes N --spares S --host localhost --local-index
i`` and the same ``--seed`` list everywhere (the first three agents' addresses; they are never killed).
With ``per_process`` K > 1, the seeds and the agents to be killed still run alone and the others K to a
process (:mod:`gossiprec.bench.agent_host`). As soon as an agent's control socket answers, the bench
subscribes to its events, so the ``ViewZeroAgreed`` (view 0 decided, as this agent learnt it) arrives
with the agent's own ``time.monotonic()`` stamp (``at``). The bootstrap figure is the latest agent's
view-0 stamp minus the moment the last agent's control socket first answered, i.e. the last agent is up
(``bootstrap_s``), and minus the moment the last process was spawned (``bootstrap_after_spawn_s``:
Python start-up of every agent included, on a loaded machine most of it). An agent whose subscription
came after its view 0 (it is then already in ``status``) is counted in ``late_subscriptions`` and
stamped when its ``status`` said so (an upper bound).

Then, with the cluster converged, ``--idle S`` measures it at rest (:func:`gossiprec.bench.agents.
measure_idle`: CPU, RSS, datagrams and loopback bytes per agent), and ``--trials K`` SIGKILLs K
trainers one after another (:func:`gossiprec.bench.agents.run_trial`): time from the SIGKILL until
every survivor installed the view without the victim, and whether all survivors installed the same
configuration for that epoch (a disagreement otherwise). A victim is not replaced: the cluster is N - k
agents before trial k (spares are promoted first, then ``--allow-shrink`` drops replicas), so it keeps a
majority for K < N / 2. Packets refused are the agents' transport refusal counters (``rejects``), summed
over the survivors at the end. ``cpu_per_agent_per_recovery_s``: the survivors' processes' CPU from
the SIGKILL until the last survivor installed the view, per survivor, less the idle rate (mean over the
trials; it includes serving the bench's event subscriptions). ``seed_bytes_at_bootstrap``: each seed's
transport byte counters (received, sent) from its start until just after the bootstrap.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
import shutil
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from gossiprec.bench.agents import (AgentProc, BenchError, BenchSpec, LocalCluster, TrialResult,
                                    measure_idle, run_trial, summary)
from gossiprec.harness.ports import free_ports
from gossiprec.local.client import AsyncControlClient
from gossiprec.local.protocol import ControlError


BOOT_SEEDS = 3
"""The first agents are the seed list (a majority of them must answer for view 0 to be decided)."""


class SeededCluster(LocalCluster):
    """Agents started with ``--nnodes`` and a seed list instead of a job spec."""

    def __init__(self, spec: BenchSpec, workdir: Path, per_process: int = 1) -> None:
        super().__init__(spec, workdir, 0)
        self.per_process = per_process
        self.control_timeout = 30.0
        self.spawned_at: dict[str, float] = {}
        self.processes = 0

    def _argv(self, name: str, port: int, sock: str, spare: bool = False) -> list[str]:
        index = int(name[1:])
        argv = [sys.executable, "-m", "gossiprec", "agent", "--name", name, "--bind", "127.0.0.1",
                "--port", str(port), "--control-socket", sock, "--profile", self.spec.profile,
                "--log-level", "warning", "--nnodes", str(self.spec.nodes), "--spares", str(self.spec.n_spares),
                "--allow-shrink", "--host", "localhost", "--local-index", str(index),
                "--bootstrap-timeout", str(int(self.boot_timeout))]
        for s in self.seed_addrs:
            argv += ["--seed", s]
        argv += ["--keyring", str(self.keyring)] if self.keyring is not None else ["--insecure"]
        return argv

    @property
    def boot_timeout(self) -> float:
        # every agent's timeout runs from its own start: the first must outwait the others' start-up
        return self.spec.start_timeout or 120.0 + 2.0 * self.spec.nodes

    def start(self) -> None:
        spec = self.spec
        self.make_keyring()
        names = [f"a{i:04d}" for i in range(spec.nodes)]
        ports = free_ports(spec.nodes)
        self.seed_addrs = [f"127.0.0.1:{p}" for p in ports[:min(BOOT_SEEDS, spec.nodes)]]
        trainers = names[BOOT_SEEDS:spec.nodes - spec.n_spares]
        self.killable = set(trainers)  # never a seed
        if self.per_process > 1:
            # the victims-to-be run alone (a SIGKILL kills exactly one agent), the others share processes
            self.killable = set(random.Random(spec.seed).sample(trainers, min(spec.trials, len(trainers))))
        seeds = set(names[:BOOT_SEEDS])  # a seed answers every candidate: it gets a process of its own
        group: list[tuple[str, int]] = []
        for name, port in zip(names, ports):
            if self.per_process == 1 or name in self.killable or name in seeds:
                self.spawn(name, port, original=True)
                self.processes += 1
                self.spawned_at[name] = time.monotonic()
            else:
                group.append((name, port))
                if len(group) == self.per_process:
                    self._spawn_group(group)
                    group = []
        if group:
            self._spawn_group(group)
        self.agents = {n: self.agents[n] for n in names}  # rank order: the seeds first

    def _spawn_group(self, group: list[tuple[str, int]]) -> None:
        """One ``agent_host`` process running the agents of ``group`` on one event loop."""
        argvs, socks = [], []
        for name, port in group:
            self._spawned += 1
            sock = str(self.dir / f"{self.gen}-{self._spawned}.sock")
            argvs.append(self._argv(name, port, sock)[4:])  # less "python -m gossiprec agent"
            socks.append(sock)
        argf = self.dir / f"{group[0][0]}-host.json"
        argf.write_text(json.dumps(argvs))
        logf = self.dir / f"{group[0][0]}-host.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
        with open(logf, "ab") as err:
            proc = subprocess.Popen([sys.executable, "-m", "gossiprec.bench.agent_host", str(argf)], env=env,
                                    stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)
        self.processes += 1
        now = time.monotonic()
        for (name, port), sock in zip(group, socks):
            self.agents[name] = AgentProc(name, port, sock, proc, logf, True)
            self.spawned_at[name] = now


async def _view0_stamp(a: AgentProc, deadline: float) -> tuple[float, float, bool]:
    """(control socket first answered, view 0 installed, late) for one agent, by its own clock."""
    while True:
        if a.proc.poll() is not None:
            raise BenchError(f"{a.name} exited with {a.proc.returncode} while bootstrapping; see {a.log}")
        try:
            c = await AsyncControlClient.connect(a.sock, timeout=30)
            break
        except (OSError, ControlError):
            if time.monotonic() > deadline:
                raise BenchError(f"{a.name}'s control socket never answered; see {a.log}") from None
            await asyncio.sleep(0.05)
    ready = time.monotonic()
    try:
        await c.subscribe()
        st = await c.status()
        if st.get("view") is not None:
            return ready, time.monotonic(), True
        async with asyncio.timeout(max(0.1, deadline - time.monotonic())):
            while True:
                ev = await c.next_event()
                if ev.get("event") in ("ViewZeroAgreed", "ViewInstalled"):
                    return ready, float(ev["at"]), False
    except TimeoutError:
        pass
    finally:
        await c.aclose()
    try:
        async with await AsyncControlClient.connect(a.sock, timeout=30) as c2:
            why = (await c2.status()).get("bootstrap")
    except (OSError, ControlError) as exc:
        why = f"no status: {exc}"
    raise BenchError(f"{a.name} learnt no view 0 in time (bootstrap: {why}); see {a.log}")


def _refused(statuses: list[dict[str, Any]]) -> dict[str, Any]:
    per = [sum(int(v) for v in st.get("transport", {}).get("rejects", {}).values()) for st in statuses]
    reasons: dict[str, int] = {}
    for st in statuses:
        for k, v in st.get("transport", {}).get("rejects", {}).items():
            reasons[k] = reasons.get(k, 0) + int(v)
    return {"total": sum(per), "max_per_agent": max(per) if per else 0, "by_reason": reasons,
            "agents": len(per)}


def _cpu_per_recovery(results: list[TrialResult], idle: dict[str, Any] | None) -> float | None:
    """Mean over trials of the survivors' CPU from the kill to the last install, per survivor, less
    the idle rate over the same window (None without an idle measurement to subtract)."""
    if idle is None or not idle.get("cpu_pct_of_core"):
        return None
    rate = idle["cpu_pct_of_core"]["mean"] / 100.0
    xs = [r.survivor_cpu_s / r.survivors - rate * r.window_s for r in results
          if r.survivor_cpu_s is not None and r.window_s is not None and r.survivors]
    return round(sum(xs) / len(xs), 5) if xs else None


async def run_seeded(spec: BenchSpec, progress: Any = None, per_process: int = 1) -> dict[str, Any]:
    """Bootstrap ``spec.nodes`` agents from seeds, measure idle, SIGKILL ``spec.trials`` trainers."""
    workdir = Path(spec.workdir) if spec.workdir else Path(tempfile.mkdtemp(prefix="grs", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    spec = replace(spec, restore="restart")  # run_trial: no replacement (the victim stays dead)
    rng = random.Random(spec.seed)

    def say(msg: str) -> None:
        if progress is not None:
            print(msg, file=progress, flush=True)

    load_before = os.getloadavg()
    cluster = SeededCluster(spec, workdir, per_process)
    results: list[TrialResult] = []
    idle: dict[str, Any] | None = None
    try:
        t_first = time.monotonic()
        deadline = t_first + cluster.boot_timeout + 30.0
        cluster.start()
        t_last = max(cluster.spawned_at.values())
        say(f"{spec.nodes} agents spawned in {t_last - t_first:.2f} s")
        stamps = await asyncio.gather(*(_view0_stamp(a, deadline) for a in cluster.agents.values()))
        ready_last = max(r for r, _, _ in stamps)
        view0 = [v for _, v, _ in stamps]
        await cluster.wait_converged(max(10.0, deadline - time.monotonic()))
        boot = {
            "spawn_s": round(t_last - t_first, 3),
            "last_ready_after_spawn_s": round(ready_last - t_last, 3),
            "bootstrap_s": round(max(view0) - ready_last, 3),
            "bootstrap_after_spawn_s": round(max(view0) - t_last, 3),
            "view0_spread_s": round(max(view0) - min(view0), 3),
            "late_subscriptions": sum(1 for _, _, late in stamps if late),
        }
        say(f"bootstrap: {boot}")
        statuses = await asyncio.gather(*(cluster.status(a) for a in cluster.live()))
        boot_refused = _refused(statuses)
        seed_bytes = [{k: int(st.get("transport", {}).get("counters", {}).get(k, 0)) for k in ("rx_bytes", "tx_bytes")}
                      for st in statuses[:BOOT_SEEDS]]
        await asyncio.sleep(spec.settle_s)
        if spec.idle_s > 0:
            await asyncio.sleep(max(0.0, spec.idle_warmup_s - spec.settle_s))
            idle = await measure_idle(cluster, spec.idle_s)
            say(f"idle: {idle}")
        for i in range(spec.trials):
            try:
                r = await run_trial(cluster, i, rng)
                await cluster.wait_converged(spec.trial_timeout)
                await asyncio.sleep(spec.settle_s)
            except (BenchError, ControlError, OSError, KeyError, TypeError) as exc:
                r = TrialResult(i, "?", None, None, None, None, False, 0, 0, True, None,
                                error=f"{type(exc).__name__}: {exc}")
                results.append(r)
                say(f"trial {i}: {r.error}; stopping the trials")
                break
            results.append(r)
            say(f"trial {i}: victim {r.victim} new view after {r.new_view_s} s, agreed {r.agreed}")
        statuses = await asyncio.gather(*(cluster.status(a) for a in cluster.live()))
        end_refused = _refused(statuses)
    finally:
        cluster.stop()
        if not spec.keep and not spec.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    done = [r.new_view_s for r in results if r.new_view_s is not None]
    report: dict[str, Any] = {
        "bench": "agents", "bootstrap": "seeds", "nodes": spec.nodes, "trials": spec.trials, "mode": "kill",
        "profile": spec.profile, "spares": spec.n_spares, "secure": spec.secure, "cores": os.cpu_count(),
        "agents_per_process": per_process, "processes": cluster.processes,
        "load_avg_before": [round(x, 2) for x in load_before],
        "load_avg_after": [round(x, 2) for x in os.getloadavg()],
        **boot,
        "new_view_s": summary(done),
        "cpu_per_agent_per_recovery_s": _cpu_per_recovery(results, idle),
        "detect_s": summary([r.alerts_s[0] for r in results if r.alerts_s]),
        "timed_out": sum(1 for r in results if r.timed_out),
        "disagreements": sum(1 for r in results if not r.agreed and not r.timed_out),
        "fenced": sum(r.fenced for r in results),
        "seed_bytes_at_bootstrap": seed_bytes,
        "refused_during_bootstrap": boot_refused,
        "refused": end_refused,
        "per_trial": [asdict(r) for r in results],
        "note": ("one `gossiprec agent` process per member" if per_process == 1 else
                 f"the seeds and the agents to be killed run alone (`gossiprec agent`), the others "
                 f"{per_process} per process "
                 "(gossiprec.bench.agent_host: the agent's own code and sockets, one event loop each process)")
                + " on 127.0.0.1; victims are SIGKILLed and not replaced; new_view_s is until the last survivor "
                  "installed the view without the victim; idle CPU and RSS of a shared process are split evenly",
    }
    if idle is not None:
        report["idle"] = idle
    return report
