"""A local job: one ``gossiprec run`` (agent + trainer child) per node, on loopback or on hosts of its own.

:class:`LocalJob` decides the members (``ranks`` trainers ``n0``.. with their ranks, then the spares),
their ports (three in a row per node: agent, epoch store, state donor), and writes the job spec
(``job.toml``) and a fresh keyring (agents and state transfers are authenticated) into the work
directory; :meth:`LocalJob.spawn` starts a node's launcher with the trainer command the caller gives.
By default every node is on 127.0.0.1 (free ports drawn for each); given :class:`Hosts` (e.g. network
namespaces), node i runs on host i, at that host's address, every node with the same ports
(:data:`HOST_PORT`: each host has its own network stack), its processes started through
:meth:`Hosts.command`; :meth:`LocalJob.crash` ends a whole host at once.
The processes and the caller talk through files in the work directory named after the node
(``<node>.log``: the launcher's and the trainer's stderr; ``<node>.pid``: the trainer's pid, which
every trainer writes first); :func:`read_int` and :func:`read_json` read such files while they may
still be half written.

Reaping: leaving the ``with`` block of a job (on any path: a result, an error, a timeout, Ctrl-C)
ends every process it started. A stopped trainer (SIGSTOP, a hang under test) ignores its launcher's
SIGTERM, so it is SIGKILLed first; then every launcher still running gets SIGTERM (it passes it on to
its trainer) and, ``grace`` seconds later, SIGKILL; a trainer that outlived its launcher is SIGKILLed
last. A trainer is known by its environment (it names the job's keyring), not by its pid alone,
which may have been reused. :func:`reap` is the launcher part, for any process a harness user starts.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable, Iterable, Mapping, Protocol, Self, Sequence

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.harness.ports import free_ports

NODE_PORTS = 3
"""Ports per node, from its agent's: agent (UDP and TCP), epoch store (+1), state donor (+2)."""
REAP_GRACE_S = 10.0
"""How long a launcher has to end its trainer and leave after SIGTERM before it is SIGKILLed."""
HOST_PORT = 7990
"""A node's agent port on a host of its own (store and donor: the next two); the k-th node of a host
shared by several takes HOST_PORT + 3k, as ``gossiprec spec`` numbers a host's slots."""


class Hosts(Protocol):
    """Hosts of their own for a job's nodes (node i on host i), e.g. network namespaces on one machine."""

    def addr(self, index: int) -> str:
        """Host ``index``'s address: its agent, store and donor listen there."""
        ...

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        """``argv`` made to run on host ``index`` (e.g. wrapped in ``ip netns exec``)."""
        ...

    def cut(self, index: int) -> None:
        """Host ``index``'s network goes silent: no packet leaves or reaches it (a power cut)."""
        ...

    def kill_all(self, index: int) -> None:
        """SIGKILL every process on host ``index``."""
        ...


def job_toml(names: Sequence[str], ports: Sequence[int], trainers: int, *, allow_shrink: bool = False,
             tp_pp: int = 1, placement: bool = False, addrs: Sequence[str] = (),
             job_table: str | None = None) -> str:
    """The job spec of view 0, member i at ``addrs[i]`` (default 127.0.0.1): the first ``trainers``
    members are trainers with ranks 0.., the rest spares. ``tp_pp`` > 1 declares a grid of ``trainers
    // tp_pp`` replicas of ``tp_pp`` shards; ``placement`` gives member i host ``h<i>`` and rack ``r<i % 4>``;
    ``job_table`` replaces the ``[job]`` table (e.g. :meth:`MeshSpec.job_toml()
    <gossiprec.trainer.collectives.sharded.MeshSpec.job_toml>`)."""
    if tp_pp < 1 or trainers % tp_pp:
        raise ConfigError(f"tp_pp must divide ranks ({trainers}), got {tp_pp}")
    topology = ['topology = "ddp"'] if tp_pp == 1 else ['topology = "grid"', f"dp = {trainers // tp_pp}",
                                                        f"tp_pp = {tp_pp}"]
    lines = ["[job]", *topology, f'allow_shrink = {"true" if allow_shrink else "false"}', ""]
    if job_table is not None:
        lines = [job_table.rstrip("\n"), ""]
    for i, (name, port) in enumerate(zip(names, ports)):
        role = "trainer" if i < trainers else "spare"
        rank = f"rank = {i}\n" if role == "trainer" else ""
        where = f'host = "h{i}"\nrack = "r{i % 4}"\n' if placement else ""
        addr = addrs[i] if addrs else "127.0.0.1"
        lines.append(f'[[members]]\nname = "{name}"\naddr = "{addr}:{port}"\nrole = "{role}"\n{rank}{where}')
    return "\n".join(lines)


def read_int(path: Path) -> int:
    """The integer in ``path``; -1 while it is missing, empty or half written."""
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def read_float(path: Path) -> float | None:
    """The float in ``path``; None while it is missing or half written."""
    try:
        return float(path.read_text())
    except (OSError, ValueError):
        return None


def read_json(path: Path) -> dict[str, Any] | None:
    """The JSON object in ``path``; None while it is missing or half written."""
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def reap(procs: Iterable[subprocess.Popen[bytes]], grace: float = REAP_GRACE_S,
         while_waiting: Callable[[], None] | None = None) -> None:
    """SIGTERM every process of ``procs`` still running, SIGKILL those left after ``grace`` seconds,
    and wait for all of them (also when interrupted while waiting). ``while_waiting()`` is called every
    few milliseconds meanwhile."""
    procs = list(procs)
    try:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace
        for p in procs:
            while time.monotonic() < deadline:
                if while_waiting is not None:
                    while_waiting()
                try:
                    p.wait(timeout=0.05)
                    break
                except subprocess.TimeoutExpired:
                    pass
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


def _state(pid: int) -> str | None:
    """The state letter of process ``pid`` (``/proc/<pid>/stat``); None if there is none."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


class LocalJob:
    """The members, job spec, keyring and processes of one local job in ``workdir``.

    ``env``: the environment the launchers start from (default: this process's), plus an unbuffered
    Python, one OpenMP thread and the keyring. ``hosts``: node i runs on host i (default: every node on
    loopback). Use it as a context manager: leaving the block reaps every process (see the module
    docstring).
    """

    def __init__(self, workdir: Path, ranks: int, spares: int, *, allow_shrink: bool = False,
                 tp_pp: int = 1, env: Mapping[str, str] | None = None, outsiders: int = 0,
                 hosts: Hosts | None = None, job_table: str | None = None, mesh: str | None = None,
                 metrics: bool = False) -> None:
        from gossiprec.security.keyring import Keyring, decode_key, generate_key

        self.dir = Path(os.path.abspath(workdir))  # the keyring's path marks the job's trainers (see _trainers)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.ranks = ranks
        self.names = [f"n{i}" for i in range(ranks + spares + outsiders)]
        """The members of the job spec, then ``outsiders`` nodes it does not list (they join as spares)."""
        self.hosts = hosts
        if hosts is None:
            self.addrs = ["127.0.0.1"] * len(self.names)
            self.ports = free_ports(len(self.names), width=NODE_PORTS)
        else:
            self.addrs = [hosts.addr(i) for i in range(len(self.names))]
            self.ports = [HOST_PORT + NODE_PORTS * self.addrs[:i].count(a) for i, a in enumerate(self.addrs)]
        listed = self.listed = ranks + spares
        self.mesh = mesh
        """With a mesh (``--mesh``), the listed nodes agree on view 0 through their seeds (``--nnodes``),
        each on a host of its own name, and the job spec is not read."""
        (self.dir / "job.toml").write_text(job_toml(self.names[:listed], self.ports[:listed], ranks,
                                                    allow_shrink=allow_shrink, tp_pp=tp_pp,
                                                    addrs=self.addrs[:listed], job_table=job_table))
        Keyring([decode_key(generate_key())]).save(self.dir / "keyring.json")
        self.timeline = self.dir / "timeline.jsonl"
        """The job's timeline file, every agent's recoveries and step samples (gossiprec.agent.recoveries)."""
        self.env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
                    "GOSSIPREC_KEYRING": str(self.dir / "keyring.json"), "GOSSIPREC_TIMELINE": str(self.timeline),
                    "GOSSIPREC_TIMELINE_INTERVAL": "1"}
        self.metrics_ports: dict[str, int] = dict(zip(self.names, free_ports(len(self.names)))) if metrics else {}
        """With ``metrics``: each node's Prometheus endpoint port (on its agent's address)."""
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        """Each node's launcher (``gossiprec run``), in the order they were spawned."""
        self.replaced: list[subprocess.Popen[bytes]] = []
        """Launchers of nodes spawned again since (reaped with the others)."""

    @property
    def trainers(self) -> list[str]:
        """The nodes that hold a rank in view 0."""
        return self.names[:self.ranks]

    def path(self, node: str, suffix: str) -> Path:
        """``<workdir>/<node><suffix>``: where ``node``'s processes leave what they report."""
        return self.dir / f"{node}{suffix}"

    def spawn(self, node: str, trainer: Sequence[str], *, agent_log_level: str = "warning",
              protocol: Mapping[str, Any] = {}, seed: str | None = None) -> subprocess.Popen[bytes]:
        """Start ``gossiprec run`` for ``node`` with ``trainer`` as its child; ``protocol``: agreement
        settings (``--protocol KEY=VALUE``); ``seed``: the node to join through (default the first).
        A node spawned again (a re-provisioned host) replaces its entry in :attr:`procs`."""
        i, s = self.names.index(node), self.names.index(seed or self.names[0])
        argv = [sys.executable, "-m", "gossiprec", "run", "--name", node, "--bind", self.addrs[i],
                "--port", str(self.ports[i]), "--control-socket", str(self.path(node, ".sock")),
                "--log-level", agent_log_level]
        if self.mesh is None:
            argv += ["--job", str(self.dir / "job.toml"), "--seed", f"{self.addrs[s]}:{self.ports[s]}"]
        else:  # the first three listed nodes are the bootstrap's seeds, the same list on every agent
            argv += ["--nnodes", str(self.listed), "--spares", str(self.listed - self.ranks), "--mesh", self.mesh,
                     "--host", node, "--local-index", "0"]
            argv += [a for k in range(min(3, self.listed)) for a in ("--seed", f"{self.addrs[k]}:{self.ports[k]}")]
        argv += [a for k, v in protocol.items() for a in ("--protocol", f"{k}={v}")]
        if node in self.metrics_ports:
            argv += ["--metrics-port", str(self.metrics_ports[node])]
        if i >= self.listed:
            argv.append("--spare")  # a node the spec does not list joins as a spare (a trainer would be refused)
        with open(self.path(node, ".log"), "ab") as log:  # the child keeps its own copy of the file
            argv = [*argv, "--", *trainer]
            proc = subprocess.Popen(argv if self.hosts is None else self.hosts.command(i, argv), env=self.env,
                                    stdout=subprocess.DEVNULL, stderr=log)
        if node in self.procs:
            self.replaced.append(self.procs.pop(node))
        self.procs[node] = proc
        return proc

    def pid(self, node: str) -> int:
        """``node``'s trainer's pid (-1 before it has written it)."""
        return read_int(self.path(node, ".pid"))

    def signal(self, node: str, sig: int) -> int:
        """Send ``sig`` to ``node``'s trainer; returns its pid. Refuses before the trainer wrote its pid:
        ``os.kill(-1, sig)`` would signal every process this user may signal."""
        pid = self.pid(node)
        if pid <= 0:
            raise GossiprecError(f"{node}'s trainer has not written its pid ({self.path(node, '.pid')}) yet: "
                                 "nothing to signal")
        os.kill(pid, sig)
        return pid

    def crash(self, node: str) -> None:
        """``node``'s whole host dies at once, without a word: its network is cut, then every process on
        it is SIGKILLed (no FIN or RST reaches anyone). On loopback, where there is no network to cut,
        its trainer and its launcher are SIGKILLed."""
        i = self.names.index(node)
        if self.hosts is not None:
            self.hosts.cut(i)
            self.hosts.kill_all(i)
        else:
            pid = self.pid(node)
            if pid > 0:
                _kill(pid)  # in its own session: the launcher's death spares it
        self.procs[node].kill()
        self.procs[node].wait()

    def close(self, grace: float = REAP_GRACE_S) -> None:
        """End every process the job started (see the module docstring); idempotent."""
        def kill_stopped() -> None:
            for pid in self._trainers():
                if _state(pid) in ("T", "t"):  # stopped: it would ignore its launcher's SIGTERM
                    _kill(pid)

        # again while the launchers end: a SIGSTOP sent just before may not have taken effect yet
        kill_stopped()
        try:
            reap([*self.replaced, *self.procs.values()], grace, while_waiting=kill_stopped)
        finally:
            for pid in self._trainers():  # outlived its launcher
                if _state(pid) not in (None, "Z", "X"):
                    _kill(pid)

    def _trainers(self) -> list[int]:
        """The trainers' pids that are still this job's processes: their environment names this job's
        keyring (a pid from a ``.pid`` file may have been reused by then)."""
        mark = f"GOSSIPREC_KEYRING={self.env['GOSSIPREC_KEYRING']}".encode()
        out = []
        for node in self.procs:
            pid = self.pid(node)
            try:
                if pid > 0 and mark in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"):
                    out.append(pid)
            except OSError:  # gone, or not ours to read
                pass
        return out

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
