"""``gossiprec bench agents``: real agent processes on loopback, timed from the outside.

Theory of operation
-------------------
The bench writes a job spec (view 0: ``nodes - spares`` trainers with ranks, ``spares`` hot spares) and
a keyring, and starts one process per member on 127.0.0.1: ``gossiprec agent`` in ``kill`` mode,
``gossiprec run -- sleep ...`` (an agent with a trainer child) in ``exit`` mode. It waits until every
agent reports view 0 with all members alive, then runs the trials one after another:

1. connect to every survivor-to-be's control socket and ``subscribe`` (events from now on are kept);
2. ``t0 = time.monotonic()``; then ``exit``: SIGKILL the victim's trainer child, so its launcher sees
   the child die and announces its own departure at once (the path ``gossiprec run`` users rely on);
   ``kill``: SIGKILL the victim's agent (a silent death that probes must discover);
3. every survivor's ``ViewInstalled`` event for the first view without the victim; its ``at`` stamp is
   the survivor's ``time.monotonic()``, the same system-wide clock as ``t0``, so neither the event's
   trip to the bench nor the bench's own scheduling enters the figure. A trial's ``new_view_s`` is the
   latest survivor's; all survivors must have installed the same ``config_id``;
4. ``--restore rejoin`` (default): a replacement process under a new name joins as a spare (so the
   job keeps its spares), and the bench waits until every agent holds a view with it, plus a short
   quiet period. ``--restore restart``: the cluster is stopped and a fresh one started from view 0, so
   that no trial inherits anything from the one before (slower: a start-up per trial).

A victim is a trainer drawn from the current view with a seeded PRNG; the first two members (the
seeds everyone joins through) are never victims. A trial that does not finish within
``trial_timeout`` is recorded as timed out, and the cluster is restarted from scratch.

``--idle S`` measures the cluster at rest for S seconds (no subscriber, no control traffic): CPU from
``/proc/<pid>/stat`` (utime + stime), RSS from ``/proc/<pid>/status``, datagrams from the transport
counters in ``status``, and bytes per agent from the loopback interface's counters
(``/proc/<pid>/net/dev``: IP and UDP headers included; traffic of other processes in the same network
namespace counts too, so run the bench in a namespace of its own for an exact figure:
``unshare -n sh -c 'ip link set lo up && gossiprec bench agents ...'``). If the transport counts bytes
(``tx_bytes``), that figure is reported as well.

``--bootstrap seeds`` (:mod:`gossiprec.bench.seeded`) starts the agents without a job spec, times their
agreement on view 0, and SIGKILLs victims without replacing them; ``--per-process K`` packs the agents
that are not killed K to a process (:mod:`gossiprec.bench.agent_host`).

Nothing here is imported by the agent; it only drives processes and reads their control sockets.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.job import job_toml, reap
from gossiprec.harness.ports import free_ports
from gossiprec.local.client import AsyncControlClient
from gossiprec.local.protocol import ControlError

MODES = ("exit", "kill")
RESTORES = ("rejoin", "restart")
SEEDS = 2
"""The first members are the seeds everyone joins through; they are never victims."""


class BenchError(GossiprecError):
    """The benchmark cluster could not be brought up or restored."""


@dataclass(frozen=True, slots=True)
class BenchSpec:
    """What to run. Seconds for times."""

    nodes: int = 8
    trials: int = 10
    mode: str = "kill"
    spares: int | None = None
    """Hot spares in view 0 (None: 1 below 8 nodes, else 2)."""
    idle_s: float = 0.0
    """Measure the idle cluster this long (0: skip)."""
    profile: str = "lan"
    secure: bool = True
    """Encrypt with a generated keyring (as in production); False: ``--insecure``."""
    trial_timeout: float = 30.0
    start_timeout: float | None = None
    """Cluster start-up bound (None: 30 s + 1 s per node)."""
    settle_s: float = 1.0
    """Quiet period before each trial."""
    idle_warmup_s: float = 5.0
    """Wait after start-up before the idle window (joins and first push-pulls die down)."""
    restore: str = "rejoin"
    """Between trials: ``rejoin`` (the victim comes back under a new name as a spare) or ``restart``
    (a fresh cluster for every trial: slower, but no trial inherits the previous one's state)."""
    seed: int = 1
    workdir: str | None = None
    keep: bool = False

    def __post_init__(self) -> None:
        if self.restore not in RESTORES:
            raise ConfigError(f"--restore must be one of {', '.join(RESTORES)}, got {self.restore!r}")
        if self.mode not in MODES:
            raise ConfigError(f"--mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if self.nodes < 3:
            raise ConfigError(f"--nodes must be at least 3 (a majority must survive), got {self.nodes}")
        if self.trials < 0 or self.idle_s < 0:
            raise ConfigError("--trials and --idle must not be negative")
        if self.trials == 0 and self.idle_s == 0:
            raise ConfigError("nothing to do: give --trials N and/or --idle SECONDS")
        sp = self.n_spares
        if not 0 <= sp <= self.nodes - 2:
            raise ConfigError(f"--spares must be 0..{self.nodes - 2}, got {sp}")
        if self.trials and self.nodes - sp <= SEEDS:
            raise ConfigError(f"with {self.nodes} nodes and {sp} spares no trainer outside the {SEEDS} "
                              "seeds can be a victim; add nodes or drop spares")

    @property
    def n_spares(self) -> int:
        return self.spares if self.spares is not None else (1 if self.nodes < 8 else 2)


@dataclass(frozen=True, slots=True)
class TrialResult:
    index: int
    victim: str
    new_view_s: float | None
    """Kill/exit until the last survivor installed the view without the victim (None: timed out)."""
    survivor_p50_s: float | None
    first_alert_s: float | None
    """Until the first survivor raised an alert about the victim (exit mode: usually none, the
    departure is announced)."""
    epoch: int | None
    agreed: bool
    """Every survivor installed the same config_id."""
    survivors: int
    fenced: int
    """Survivors that fenced during the trial (should be 0)."""
    timed_out: bool
    restore_s: float | None
    """Until the replacement spare was in everyone's view (None: not rejoined; the cluster restarts)."""
    error: str | None = None
    alerts_s: tuple[float, ...] = ()
    """Every survivor's own alert about the victim, in order (the view change waits for H of its K
    observers: ``watermarks``)."""
    fast_ratio: float | None = None
    """Share of survivors whose ``ViewInstalled`` says the fast path decided it (else classic Paxos)."""
    survivor_cpu_s: float | None = None
    """CPU of the survivors' processes from the kill until the last survivor installed the view."""
    window_s: float | None = None
    """That window's length."""


@dataclass
class AgentProc:
    name: str
    port: int
    sock: str
    proc: subprocess.Popen[bytes]
    log: Path
    original: bool

    def child_pid(self) -> int | None:
        """The launcher's training child (exit mode), found by parent pid."""
        return _child_of(self.proc.pid)


# --- helpers --------------------------------------------------------------------------------------
def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (q in 0..100) of a non-empty sequence."""
    xs = sorted(values)
    if not xs:
        raise ValueError("percentile of nothing")
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def summary(values: Sequence[float]) -> dict[str, float] | None:
    if not values:
        return None
    return {"p50": round(percentile(values, 50), 4), "p99": round(percentile(values, 99), 4),
            "max": round(max(values), 4)}


def _child_of(ppid: int) -> int | None:
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == ppid:
            return int(entry)
    return None


def proc_cpu_split(pid: int) -> tuple[float, float]:
    """(user, system) CPU seconds of ``pid``."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return int(fields[11]) / tick, int(fields[12]) / tick  # utime, stime (fields 14, 15 of stat)


def proc_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return 0.0


def loopback_bytes(pid: int) -> int:
    """Bytes sent on ``lo`` in ``pid``'s network namespace (sent == received on loopback)."""
    for line in Path(f"/proc/{pid}/net/dev").read_text().splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == "lo":
            return int(rest.split()[8])  # transmit bytes
    return 0


def job_spec(members: Sequence[tuple[str, int]], spares: int) -> str:
    """TOML of view 0: the first ``len(members) - spares`` are trainers with ranks 0.., then spares;
    shrinking allowed, member i on host ``h<i>`` in rack ``r<i % 4>``."""
    return job_toml([n for n, _ in members], [p for _, p in members], len(members) - spares,
                    allow_shrink=True, placement=True)


# --- the cluster ----------------------------------------------------------------------------------
class LocalCluster:
    """Agent processes on loopback from one job spec. Synchronous process control, async queries."""

    def __init__(self, spec: BenchSpec, workdir: Path, generation: int = 0) -> None:
        self.spec = spec
        self.dir = workdir
        self.gen = generation
        self.agents: dict[str, AgentProc] = {}
        self.seed_addrs: list[str] = []
        self.keyring: Path | None = None
        self.control_timeout = 5.0
        """Seconds a control request may take (a process hosting several agents answers slower)."""
        self.killable: set[str] | None = None
        """The agents a trial may kill (None: any trainer but the seeds)."""
        self._spawned = 0

    def _argv(self, name: str, port: int, sock: str, spare: bool = False) -> list[str]:
        cmd = "run" if self.spec.mode == "exit" else "agent"
        argv = [sys.executable, "-m", "gossiprec", cmd, "--name", name, "--bind", "127.0.0.1",
                "--port", str(port), "--job", str(self.dir / "job.toml"), "--control-socket", sock,
                "--profile", self.spec.profile, "--log-level", "warning"]
        for s in self.seed_addrs:
            argv += ["--seed", s]
        argv += ["--keyring", str(self.keyring)] if self.keyring is not None else ["--insecure"]
        if spare:  # a replacement under a name the job spec does not list joins as a spare
            argv += ["--spare"] if cmd == "run" else ["--role", "spare"]
        if cmd == "run":
            argv += ["--", "sleep", "1000000"]
        return argv

    def spawn(self, name: str, port: int, original: bool) -> AgentProc:
        self._spawned += 1
        sock = str(self.dir / f"{self.gen}-{self._spawned}.sock")
        logf = self.dir / f"{name}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
        with open(logf, "ab") as err:
            proc = subprocess.Popen(self._argv(name, port, sock, spare=not original), env=env, stdin=subprocess.DEVNULL,
                                    stdout=subprocess.DEVNULL, stderr=err)
        a = AgentProc(name, port, sock, proc, logf, original)
        self.agents[name] = a
        return a

    def make_keyring(self) -> None:
        """A secure cluster's keyring file, made once (every agent of the cluster reads it)."""
        if self.spec.secure:
            from gossiprec.security.keyring import Keyring
            self.keyring = self.dir / "keyring.json"
            if not self.keyring.exists():
                Keyring([os.urandom(32)]).save(self.keyring)

    def start(self) -> None:
        spec = self.spec
        self.make_keyring()
        names = [f"g{self.gen}n{i:02d}" for i in range(spec.nodes)]
        ports = free_ports(spec.nodes)
        (self.dir / "job.toml").write_text(job_spec(list(zip(names, ports)), spec.n_spares))
        self.seed_addrs = [f"127.0.0.1:{p}" for p in ports[:SEEDS]]
        for name, port in zip(names, ports):
            self.spawn(name, port, original=True)

    def stop(self) -> None:
        """SIGTERM everyone (graceful leave), SIGKILL what is left after 10 s, and their children."""
        children = [c for a in self.agents.values() if (c := a.child_pid()) is not None]
        reap([a.proc for a in self.agents.values()])
        for pid in children:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def live(self) -> list[AgentProc]:
        return [a for a in self.agents.values() if a.proc.poll() is None]

    def log_tail(self, a: AgentProc, n: int = 1500) -> str:
        try:
            return a.log.read_text(errors="replace")[-n:]
        except OSError:
            return ""

    async def status(self, a: AgentProc) -> dict[str, Any]:
        async with await AsyncControlClient.connect(a.sock, timeout=self.control_timeout) as c:
            return await c.status()

    async def wait_converged(self, timeout: float, must_hold: str | None = None) -> tuple[int, str]:
        """Until every live agent holds the same view with all of them in it and every member alive."""
        deadline = time.monotonic() + timeout
        last: Any = None
        while time.monotonic() < deadline:
            agents = self.live()
            if len(agents) < len(self.agents):
                break  # an agent died on its own
            try:
                sts = await asyncio.gather(*(self.status(a) for a in agents))
            except (ControlError, OSError) as exc:
                last = str(exc)
                await asyncio.sleep(0.2)
                continue
            views = {(st["view"]["epoch"], st["view"]["config_id"]) if st.get("view") else None for st in sts}
            names = {a.name for a in agents}
            if len(views) == 1 and None not in views:
                members = {m["node"] for m in sts[0]["view"]["members"]}
                if members == names and all(st.get("live") == len(agents) for st in sts) \
                        and (must_hold is None or must_hold in members):
                    epoch, cid = views.pop()  # type: ignore[misc]
                    return int(epoch), str(cid)
            last = {"views": sorted(map(str, views)), "missing": {
                a.name: sorted(names - {m["node"] for m in (st.get("view") or {}).get("members", ())})
                for a, st in zip(agents, sts)
                if names - {m["node"] for m in (st.get("view") or {}).get("members", ())}},
                "expected_live": len(agents),
                "live": {a.name: [st.get("live"), st.get("known")] for a, st in zip(agents, sts)
                         if st.get("live") != len(agents)}}
            await asyncio.sleep(0.2)
        exited = [f"{a.name} (exit {a.proc.returncode}): {self.log_tail(a)}" for a in self.agents.values()
                  if a.proc.poll() is not None][:2]
        raise BenchError(f"the cluster did not converge within {timeout:.0f} s (last: {last}); "
                         f"exited: {exited or 'none'}; logs in {self.dir}")


# --- trials ---------------------------------------------------------------------------------------
async def _watch(a: AgentProc, victim: str, timeout: float = 5.0) -> tuple[AsyncControlClient, int]:
    c = await AsyncControlClient.connect(a.sock, timeout=timeout)
    try:
        await c.subscribe()
        st = await c.status()
    except BaseException:
        await c.aclose()
        raise
    return c, int(st["view"]["epoch"]) if st.get("view") else -1


async def _until_view_without(c: AsyncControlClient, victim: str, epoch0: int,
                              alerts: list[float], fences: list[float]) -> dict[str, Any]:
    while True:
        ev = await c.next_event()
        kind = ev.get("event")
        if kind == "AlertRaised" and ev.get("subject") == victim:
            alerts.append(float(ev["at"]))
        elif kind == "Fenced":
            fences.append(float(ev["at"]))
        elif kind == "ViewInstalled" and ev.get("epoch", -1) > epoch0 and victim not in ev.get("members", ()):
            return ev


async def run_trial(cluster: LocalCluster, index: int, rng: random.Random) -> TrialResult:
    spec = cluster.spec
    seeds = set(list(cluster.agents)[:SEEDS])
    st0 = await cluster.status(next(iter(cluster.agents.values())))
    trainers = sorted(m["node"] for m in st0["view"]["members"]
                      if m["role"] == "trainer" and m["node"] not in seeds and m["node"] in cluster.agents
                      and (cluster.killable is None or m["node"] in cluster.killable))
    victim = rng.choice(trainers)
    va = cluster.agents[victim]
    survivors = [a for a in cluster.live() if a.name != victim]
    watches = await asyncio.gather(*(_watch(a, victim, cluster.control_timeout) for a in survivors))
    clients = [c for c, _ in watches]
    alerts: list[float] = []
    fences: list[float] = []
    target = va.child_pid() if spec.mode == "exit" else va.proc.pid
    if target is None:
        raise BenchError(f"{victim} has no training child to stop; see {va.log}")
    pids = sorted({a.proc.pid for a in survivors} - {va.proc.pid})
    cpu0 = sum(sum(proc_cpu_split(p)) for p in pids)
    t0 = time.monotonic()
    os.kill(target, signal.SIGKILL)
    timed_out = False
    events: list[dict[str, Any]] = []
    cpu_s = window_s = None
    try:
        async with asyncio.timeout(spec.trial_timeout):
            events = list(await asyncio.gather(*(_until_view_without(c, victim, e0, alerts, fences)
                                                 for c, e0 in watches)))
        window_s = round(time.monotonic() - t0, 4)
        cpu_s = round(sum(sum(proc_cpu_split(p)) for p in pids) - cpu0, 4)
    except TimeoutError:
        timed_out = True
    finally:
        for c in clients:
            await c.aclose()
    try:
        va.proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        va.proc.kill()
        va.proc.wait()
    del cluster.agents[victim]
    lat = [float(ev["at"]) - t0 for ev in events]
    configs = {ev.get("config_id") for ev in events}
    restore_s = None
    error = None
    if not timed_out and spec.restore == "rejoin":
        t1 = time.monotonic()
        name = f"{victim}r{index}"
        cluster.spawn(name, free_ports(1)[0], original=False)
        try:
            await cluster.wait_converged(spec.trial_timeout, must_hold=name)
            restore_s = round(time.monotonic() - t1, 3)
            await asyncio.sleep(spec.settle_s)
        except BenchError as exc:
            error = f"restore failed: {exc}"
    return TrialResult(
        index=index, victim=victim,
        new_view_s=round(max(lat), 4) if lat and not timed_out else None,
        survivor_p50_s=round(percentile(lat, 50), 4) if lat else None,
        first_alert_s=round(min(alerts) - t0, 4) if alerts else None,
        epoch=int(events[0]["epoch"]) if events else None,
        agreed=len(configs) == 1 and not timed_out,
        survivors=len(survivors), fenced=len(fences), timed_out=timed_out, restore_s=restore_s,
        error=error,
        alerts_s=tuple(round(a - t0, 4) for a in sorted(alerts)),
        fast_ratio=round(sum(1 for ev in events if ev.get("fast")) / len(events), 3) if events else None,
        survivor_cpu_s=cpu_s, window_s=window_s)


# --- idle -----------------------------------------------------------------------------------------
async def measure_idle(cluster: LocalCluster, seconds: float) -> dict[str, Any]:
    agents = cluster.live()
    pids = [a.proc.pid for a in agents]
    share = {p: pids.count(p) for p in set(pids)}  # agents hosted by one process split its CPU and RSS
    st_a = await asyncio.gather(*(cluster.status(a) for a in agents))
    cpu_a = [proc_cpu_split(p) for p in pids]
    lo_a = loopback_bytes(pids[0])
    t_a = time.monotonic()
    await asyncio.sleep(seconds)
    t_b = time.monotonic()
    cpu_b = [proc_cpu_split(p) for p in pids]
    lo_b = loopback_bytes(pids[0])
    rss = [proc_rss_mb(p) / share[p] for p in pids]
    st_b = await asyncio.gather(*(cluster.status(a) for a in agents))
    dt = t_b - t_a

    def rate(key: str) -> list[float]:
        out = []
        for a, b in zip(st_a, st_b):
            ca = a.get("transport", {}).get("counters", {})
            cb = b.get("transport", {}).get("counters", {})
            if key in cb:
                out.append((cb[key] - ca.get(key, 0)) / dt)
        return out

    def stats(xs: list[float], nd: int = 3) -> dict[str, float] | None:
        if not xs:
            return None
        return {"mean": round(sum(xs) / len(xs), nd), "max": round(max(xs), nd)}

    tx_bytes = rate("tx_bytes")
    return {
        "seconds": round(dt, 3), "agents": len(agents),
        "cpu_pct_of_core": stats([100 * (sum(b) - sum(a)) / dt / share[p] for p, a, b in zip(pids, cpu_a, cpu_b)]),
        "cpu_user_pct": stats([100 * (b[0] - a[0]) / dt / share[p] for p, a, b in zip(pids, cpu_a, cpu_b)]),
        "cpu_system_pct": stats([100 * (b[1] - a[1]) / dt / share[p] for p, a, b in zip(pids, cpu_a, cpu_b)]),
        "processes": len(share),
        "rss_mb": stats(rss, 1),
        "tx_datagrams_per_s": stats(rate("tx_datagrams"), 1),
        "tx_bytes_per_s": stats(tx_bytes, 1),
        "loopback_bytes_per_s_per_agent": round((lo_b - lo_a) / dt / len(agents), 1),
        "bytes_note": "loopback_bytes_per_s_per_agent is lo's transmit counter of the network namespace "
                      "divided by the agents (IP+UDP headers included; exact only in a namespace of its "
                      "own); tx_bytes_per_s is null unless the transport counts bytes",
    }


# --- driver ---------------------------------------------------------------------------------------
async def run_bench(spec: BenchSpec, progress: Any = None) -> dict[str, Any]:
    """Run the benchmark; returns the JSON-ready report."""
    workdir = Path(spec.workdir) if spec.workdir else Path(tempfile.mkdtemp(prefix="grb", dir="/tmp"))
    workdir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(spec.seed)
    results: list[TrialResult] = []
    idle: dict[str, Any] | None = None
    restarts = 0
    gen = 0

    def say(msg: str) -> None:
        if progress is not None:
            print(msg, file=progress, flush=True)

    start_timeout = spec.start_timeout or 30.0 + spec.nodes
    cluster = LocalCluster(spec, workdir, gen)
    try:
        t = time.monotonic()
        cluster.start()
        await cluster.wait_converged(start_timeout)
        started_s = round(time.monotonic() - t, 2)
        say(f"{spec.nodes} agents up in {started_s} s")
        await asyncio.sleep(spec.settle_s)
        if spec.idle_s > 0:
            await asyncio.sleep(max(0.0, spec.idle_warmup_s - spec.settle_s))
            idle = await measure_idle(cluster, spec.idle_s)
            say(f"idle: {json.dumps(idle)}")
        for i in range(spec.trials):
            try:
                r = await run_trial(cluster, i, rng)
            except (BenchError, ControlError, OSError, KeyError, TypeError) as exc:
                r = TrialResult(i, "?", None, None, None, None, False, 0, 0, True, None,
                                error=f"{type(exc).__name__}: {exc}")
            results.append(r)
            say(f"trial {i}: {json.dumps(asdict(r))}")
            if i < spec.trials - 1 and (r.timed_out or r.restore_s is None):
                if r.timed_out or r.error is not None:
                    say(f"trial {i}: restarting the cluster")
                    restarts += 1
                cluster.stop()
                gen += 1
                cluster = LocalCluster(spec, workdir, gen)
                cluster.start()
                await cluster.wait_converged(start_timeout)
                await asyncio.sleep(spec.settle_s)
    finally:
        cluster.stop()
        if not spec.keep and not spec.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    done = [r.new_view_s for r in results if r.new_view_s is not None]
    report: dict[str, Any] = {
        "nodes": spec.nodes, "trials": spec.trials, "mode": spec.mode, "profile": spec.profile,
        "spares": spec.n_spares, "secure": spec.secure, "cores": os.cpu_count(),
        "startup_s": started_s,
        "new_view_s": summary(done),
        "timed_out": sum(1 for r in results if r.timed_out),
        "disagreements": sum(1 for r in results if not r.agreed and not r.timed_out),
        "restore": spec.restore,
        "cluster_restarts": restarts,
        "per_trial": [asdict(r) for r in results],
    }
    if idle is not None:
        report["idle"] = idle
    return report


def _cmd_agents(args: argparse.Namespace) -> int:
    try:
        spec = BenchSpec(nodes=args.nodes, trials=args.trials, mode=args.mode, spares=args.spares,
                         idle_s=args.idle, idle_warmup_s=args.idle_warmup, profile=args.profile,
                         secure=not args.insecure, restore=args.restore,
                         trial_timeout=args.trial_timeout, seed=args.seed, workdir=args.workdir,
                         keep=args.keep)
        if args.bootstrap == "seeds" and args.mode != "kill":
            raise ConfigError("--bootstrap seeds times SIGKILLs only (--mode kill)")
        if args.per_process != 1 and (args.bootstrap != "seeds" or args.per_process < 1):
            raise ConfigError("--per-process K (>= 1) needs --bootstrap seeds")
    except ConfigError as exc:
        print(f"gossiprec bench agents: error: {exc}", file=sys.stderr)
        return 2
    from gossiprec.agent.cli import run_async
    out = None if args.quiet else sys.stderr
    if args.bootstrap == "seeds":
        if args.seeded is None:
            print("gossiprec bench agents: error: --bootstrap seeds runs from `gossiprec bench agents`",
                  file=sys.stderr)
            return 2
        report = run_async(args.seeded(spec, out, args.per_process))
    else:
        report = run_async(run_bench(spec, out))
    print(json.dumps(report, indent=None if args.json else 2))
    return 0


def add_cli(subparsers: Any, seeded: Any = None) -> argparse.ArgumentParser:
    """Add ``agents`` to the ``bench`` sub-commands (sets ``func``). ``seeded``: the runner of
    ``--bootstrap seeds`` (:func:`gossiprec.bench.seeded.run_seeded`, which builds on this module)."""
    p = subparsers.add_parser(
        "agents", help="time view changes and idle cost of real agent processes on loopback",
        description="Start N agents on 127.0.0.1 from a generated job spec; per trial make one leave "
                    "(mode exit: its trainer child dies under `gossiprec run`) or SIGKILL one (mode kill) "
                    "and time until every survivor installs the view without it. --idle S measures "
                    "CPU, RSS and traffic of the idle cluster. Prints one JSON report on stdout.")
    p.add_argument("--nodes", type=int, default=8, help="agents (default 8)")
    p.add_argument("--trials", type=int, default=10, help="failures to time (default 10; 0: idle only)")
    p.add_argument("--mode", choices=MODES, default="kill",
                   help="exit (trainer child dies) or kill (agent SIGKILL)")
    p.add_argument("--spares", type=int, default=None,
                   help="hot spares in view 0 (default 1 below 8 nodes, else 2)")
    p.add_argument("--idle", type=float, default=0.0, metavar="S", help="measure the idle cluster for S seconds")
    p.add_argument("--idle-warmup", dest="idle_warmup", type=float, default=5.0, metavar="S",
                   help="seconds between start-up and the idle window (default 5)")
    p.add_argument("--profile", choices=("lan", "wan"), default="lan")
    p.add_argument("--insecure", action="store_true", help="no encryption (default: a generated keyring)")
    p.add_argument("--trial-timeout", dest="trial_timeout", type=float, default=30.0,
                   help="bound on each trial and restore, seconds (default 30)")
    p.add_argument("--restore", choices=RESTORES, default="rejoin",
                   help="between trials: rejoin (victim returns as a spare; default) or restart (fresh "
                        "cluster per trial)")
    p.add_argument("--seed", type=int, default=1, help="PRNG seed for the choice of victims")
    p.add_argument("--bootstrap", choices=("spec", "seeds"), default="spec",
                   help="spec: view 0 from a generated job spec (default); seeds: no member list, the "
                        "agents agree on view 0 (--nnodes, --seed), the bench times it; victims are "
                        "SIGKILLed and not replaced")
    p.add_argument("--per-process", dest="per_process", type=int, default=1, metavar="K",
                   help="with --bootstrap seeds: run the agents that are not killed K per process (each "
                        "with its own sockets, on one event loop); the victims run alone (default 1)")
    p.add_argument("--workdir", default=None, help="keep job spec, sockets and agent logs here")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--json", action="store_true", help="compact JSON (one line)")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd_agents, seeded=seeded)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec bench")
    sub = parser.add_subparsers(dest="bench", required=True)
    add_cli(sub)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
