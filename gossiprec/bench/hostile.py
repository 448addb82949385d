"""``python -m gossiprec.bench.hostile``: what an outsider without the key costs an agent, build by build.

Theory of operation
-------------------
Each build is a source tree (``--tree PATH``, repeatable; default: the tree this module is in), run as
agent processes on 127.0.0.1 with ``PYTHONPATH=PATH``, so that two builds are measured side by side in
the same run on the same machine. Three attacks, each by someone who never held the cluster key:

``memory``
    ``rounds`` rounds of ``conns`` TCP connections to one agent, each declaring a frame of
    ``garbage_mib`` MiB and sending it: random bytes, or (every other round) a real stream header
    copied from the wire (key id and all) in front of random bytes. Figures: the agent's resident set
    (``VmRSS``) before, after each round and after the last, and its peak (``VmHWM``), from
    ``/proc/<pid>/status``.
``join``
    ``idle`` TCP connections that never send a byte hold a seed agent's port (from 127.0.0.2 and
    127.0.0.3, each reopened when the agent closes it); a spare (in the measuring process, on the
    build under test) joins through that seed. Figure: seconds from the spare's start to its first
    peer, with and without the idle connections (``null``: not within ``JOIN_GIVE_UP_S``).
``flood``
    three agents from one job spec; one of them gets ``seconds`` of UDP datagrams at ``rate`` a
    second: garbage, then forgeries (the cluster's clear-text key id, a fresh sender id each, the
    right receiver). Figures: that agent's CPU share during each flood (``utime + stime`` from
    ``/proc/<pid>/stat``) and the suspicions and alerts any agent raised meanwhile (events from the
    control sockets).

``slow``
    ``slow_conns`` TCP connections from 127.0.0.2 and 127.0.0.3, each sending one byte a second and
    reopened as soon as the agent closes it (more than one source's share of pending connections, so
    the agent evicts them as fast as they come). Figures: the agent's CPU share over ``seconds``, the
    attacker's connections opened a second, and a spare's join time through the seed, quiet and during
    the attack.
``cost``
    the same three kinds of datagram (garbage, forgeries, and genuine ones for comparison) handed
    to the build's datagram opener in one process, ``packets`` of each, configured as the agent
    configures it. Figure: CPU microseconds per datagram (``process_time``), and what a flood at
    ``rate`` would cost in cores; it does not depend on what else the machine runs, unlike ``flood``.

The output is one JSON document (``--json FILE`` also writes it to a file). The helpers below
(:func:`tcp_garbage_round`, :class:`IdleConnections`, :func:`forged_datagrams`, ...) are what the
tests of the same attacks use; :class:`KeyHolder` is the insider's: it holds the cluster key and
forges messages in other members' names (``tests/test_forgery_live.py``). This module drives
processes; nothing in the agent imports it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

from gossiprec.harness.ports import free_ports
from gossiprec.local.client import AsyncControlClient, ControlClient
from gossiprec.security.crypto import HEADER_SIZE, Sealer
from gossiprec.security.keyring import Keyring, key_id

KEY = bytes(range(32))
"""The cluster key of every bench agent."""
CLUSTER = "gossiprec"
HERE = Path(__file__).resolve()
TREE = str(HERE.parents[2])
"""The source tree this module belongs to."""
JOIN_GIVE_UP_S = 60.0
"""A join not done by then is reported as ``null`` (did not complete)."""
SUSPICIOUS = ("MemberSuspected", "MemberFailed", "AlertRaised", "ViewInstalled", "Fenced")


# --- agent processes ----------------------------------------------------------------------------------
def proc_memory_kib(pid: int) -> dict[str, int]:
    """``{"rss": VmRSS, "hwm": VmHWM}`` of ``pid`` in KiB (Linux)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            out[key[2:].lower()] = int(value.split()[0])
    return out


def proc_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) ``pid`` has used (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def write_keyring(path: str | Path, key: bytes = KEY) -> str:
    Keyring([key]).save(path)
    return str(path)


@dataclass
class AgentProc:
    """One ``gossiprec agent`` process of the build at ``tree``."""

    tree: str
    workdir: str
    name: str
    port: int
    keyring: str
    job: str | None = None
    seeds: tuple[str, ...] = ()
    proc: subprocess.Popen[bytes] | None = None
    sock: str = field(init=False, default="")

    def start(self) -> AgentProc:
        self.sock = f"{self.workdir}/{self.name}.sock"
        argv = [sys.executable, "-m", "gossiprec", "agent", "--name", self.name, "--bind", "127.0.0.1",
                "--port", str(self.port), "--keyring", self.keyring, "--control-socket", self.sock,
                "--log-level", "error"]
        if self.job is not None:
            argv += ["--job", self.job]
        for s in self.seeds:
            argv += ["--seed", s]
        env = {**os.environ, "PYTHONPATH": self.tree, "PYTHONUNBUFFERED": "1"}
        env.pop("GOSSIPREC_INSECURE", None)
        self.proc = subprocess.Popen(argv, env=env, cwd=self.workdir, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.PIPE)
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    @property
    def addr(self) -> str:
        return f"127.0.0.1:{self.port}"

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        with ControlClient(self.sock, timeout=timeout) as c:
            return c.status()

    def wait_ready(self, timeout: float = 30.0, cond: Any = None) -> dict[str, Any]:
        """The first status reply (that satisfies ``cond``), polling the control socket."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"agent {self.name} exited: {self.proc.communicate()[1].decode()[-2000:]}")
            try:
                st = self.status(timeout=2.0)
                if cond is None or cond(st):
                    return st
            except Exception:  # not listening yet
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"agent {self.name} not ready within {timeout} s")
            time.sleep(0.05)

    def memory_kib(self) -> dict[str, int]:
        return proc_memory_kib(self.pid)

    def stop(self) -> None:
        p = self.proc
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


@contextlib.contextmanager
def agents(tree: str, n: int, *, job: bool = False) -> Iterator[list[AgentProc]]:
    """``n`` keyed agents of the build at ``tree`` (from one job spec when ``job``), ready."""
    workdir = tempfile.mkdtemp(prefix="grh", dir="/tmp")
    procs: list[AgentProc] = []
    try:
        ports = free_ports(n)
        ring = write_keyring(f"{workdir}/keys.json")
        spec = None
        if job:
            lines = ['[job]', 'topology = "ddp"', '']
            for i, p in enumerate(ports):
                lines.append(f'[[members]]\nname = "a{i}"\naddr = "127.0.0.1:{p}"\nrole = "trainer"\nrank = {i}\n')
            spec = f"{workdir}/job.toml"
            Path(spec).write_text("\n".join(lines))
        for i, p in enumerate(ports):
            procs.append(AgentProc(tree, workdir, f"a{i}", p, ring, job=spec).start())
        for a in procs:
            a.wait_ready(cond=(lambda st: st.get("view") is not None and st.get("live") == n) if job else None)
        yield procs
    finally:
        for a in procs:
            a.stop()
        shutil.rmtree(workdir, ignore_errors=True)


# --- attacks ------------------------------------------------------------------------------------------
def copied_stream_header(key: bytes = KEY, cluster: str = CLUSTER) -> bytes:
    """A real stream-frame header as it crosses the wire (what anyone on the path can copy)."""
    return Sealer(Keyring([key]), cluster).new_stream().seal_frame(b"")[4:4 + HEADER_SIZE]


async def tcp_garbage_round(port: int, conns: int, nbytes: int, header: bytes = b"",
                            host: str = "127.0.0.1", timeout: float = 120.0) -> dict[str, int]:
    """``conns`` connections at once, each declaring an ``nbytes`` frame (``header`` then random bytes)
    and sending all of it, then reading until the agent closes. Counts how each one ended."""
    body = header + random.Random(conns).randbytes(max(0, nbytes - len(header)))
    frame = struct.pack(">I", len(body)) + body
    ended = {"closed": 0, "reset": 0, "refused": 0}

    async def one() -> None:
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            ended["refused"] += 1
            return
        try:
            writer.write(frame)
            await writer.drain()
            await reader.read()
            ended["closed"] += 1
        except OSError:
            ended["reset"] += 1
        finally:
            writer.close()

    async with asyncio.timeout(timeout):
        await asyncio.gather(*(one() for _ in range(conns)))
    return ended


class IdleConnections:
    """Holds ``count`` TCP connections to ``port`` that never send a byte, from the local addresses
    ``sources`` in turn, opening a new one whenever the agent closes one (``max_opens`` in all)."""

    def __init__(self, port: int, count: int, sources: Sequence[str] = ("127.0.0.2", "127.0.0.3"),
                 max_opens: int = 1000, host: str = "127.0.0.1", trickle: float = 0.0) -> None:
        self.port, self.count, self.sources, self.max_opens, self.host = port, count, sources, max_opens, host
        self.trickle = trickle
        """Seconds between the bytes each connection sends (0: it never sends one)."""
        self.opens = 0
        self.closed_by_agent = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> IdleConnections:
        for i in range(self.count):
            self._tasks.append(asyncio.create_task(self._hold(self.sources[i % len(self.sources)])))
        return self

    async def __aexit__(self, *exc: object) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for w in self._writers:
            w.close()

    async def _hold(self, source: str) -> None:
        while self.opens < self.max_opens:
            self.opens += 1
            try:
                reader, writer = await asyncio.open_connection(self.host, self.port, local_addr=(source, 0))
            except OSError:
                await asyncio.sleep(0.01)
                continue
            self._writers.add(writer)
            try:
                if self.trickle > 0:
                    while not reader.at_eof():
                        writer.write(b"\x00")
                        await writer.drain()
                        with contextlib.suppress(TimeoutError):
                            async with asyncio.timeout(self.trickle):
                                await reader.read()  # returns at once when the agent closes it
                else:
                    await reader.read()  # never sends; returns when the agent closes the connection
            except OSError:
                pass
            finally:
                self._writers.discard(writer)
                writer.close()
            self.closed_by_agent += 1


def forged_template(to: str, cluster: str = CLUSTER) -> bytes:
    """A datagram sealed for ``to`` by someone without the cluster's key, in this build's format."""
    outsider = Sealer(Keyring([bytes(32)]), cluster)
    try:
        return outsider.seal(b"\x92\x01\x90" + bytes(60), to)  # type: ignore[call-arg,unused-ignore]
    except TypeError:  # a build whose datagrams name no receiver
        return outsider.seal(b"\x92\x01\x90" + bytes(60))


def forged_datagrams(to: str, count: int, key: bytes = KEY, cluster: str = CLUSTER,
                     seed: int = 1, template: bytes | bytearray | None = None) -> list[bytes]:
    """``count`` datagrams that look like the cluster's: its key id in clear, a fresh random sender id
    each, sealed for ``to`` (its receiver), but by someone without the key (the tag is wrong).
    ``template``: such a datagram in the format of the build attacked (default: this build's)."""
    template = bytearray(template if template is not None else forged_template(to, cluster))
    template[4:12] = key_id(key)  # the same place in every sealing format so far
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        template[12:28] = rng.randbytes(16)
        out.append(bytes(template))
    return out


class KeyHolder:
    """A process that holds the cluster key but no member's signing key (a key copied from one host):
    it seals whatever messages it likes, in any member's name, for any receiver. What the tests of
    per-member signatures forge with; the messages are this build's wire types."""

    def __init__(self, key: bytes = KEY, cluster: str = CLUSTER) -> None:
        self.sealer = Sealer(Keyring([key]), cluster)

    def datagram(self, msgs: Sequence[Any], to: str) -> bytes:
        from gossiprec.core.wire import encode_packet
        return self.sealer.seal(encode_packet(list(msgs)), to)

    def frame(self, msgs: Sequence[Any]) -> bytes:
        """One sealed stream frame (the reliable transport: views, large agreement payloads)."""
        from gossiprec.core.wire import encode_packet
        return self.sealer.new_stream().seal_frame(encode_packet(list(msgs)))

    def send(self, msgs: Sequence[Any], addrs: Sequence[str]) -> None:
        """``msgs`` in one datagram to each of ``addrs`` (host:port)."""
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for addr in addrs:
                host, _, port = addr.rpartition(":")
                s.sendto(self.datagram(msgs, addr), (host, int(port)))

    async def stream(self, msgs: Sequence[Any], addr: str) -> None:
        """``msgs`` as one frame on a fresh TCP connection to ``addr``."""
        host, _, port = addr.rpartition(":")
        _, writer = await asyncio.open_connection(host, int(port))
        try:
            writer.write(self.frame(msgs))
            await writer.drain()
            await asyncio.sleep(0)
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


def garbage_datagrams(count: int, size: int = 100, seed: int = 2) -> list[bytes]:
    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(count)]


def udp_flood(port: int, packets: Sequence[bytes], rate: float, seconds: float,
              host: str = "127.0.0.1") -> int:
    """Send ``packets`` round robin at ``rate`` a second for ``seconds`` (blocking); returns how many."""
    sent = 0
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.setblocking(False)
        t0 = time.monotonic()
        n = len(packets)
        while True:
            now = time.monotonic() - t0
            if now >= seconds:
                return sent
            due = int(now * rate)
            while sent < due:
                try:
                    s.sendto(packets[sent % n], (host, port))
                except BlockingIOError:
                    pass
                sent += 1
            time.sleep(0.001)


# --- measurements -------------------------------------------------------------------------------------
def measure_memory(tree: str, conns: int, garbage_mib: float, rounds: int) -> dict[str, Any]:
    with agents(tree, 1) as (a,):
        before = a.memory_kib()
        after_rounds = []
        ended = []
        header = copied_stream_header()
        for r in range(rounds):
            ended.append(asyncio.run(tcp_garbage_round(a.port, conns, int(garbage_mib * 2**20),
                                                       header if r % 2 else b"")))
            after_rounds.append(a.memory_kib()["rss"])
        st = a.status()
        return {"rss_before_mib": before["rss"] / 1024, "rss_after_round_mib": [x / 1024 for x in after_rounds],
                "peak_rss_mib": a.memory_kib()["hwm"] / 1024, "connections_ended": ended,
                "rejects": {k: v for k, v in st["transport"]["rejects"].items() if v}}


def _run_child(tree: str, *args: str, timeout: float = 300) -> dict[str, Any]:
    """Run this file's ``--child`` mode on the build at ``tree`` (its own modules, this file's code)."""
    argv = [str(HERE), "--child", *args]
    code = f"import runpy, sys; sys.argv = {argv!r}; runpy.run_path({str(HERE)!r}, run_name='__main__')"
    env = {**os.environ, "PYTHONPATH": tree}
    workdir = tempfile.mkdtemp(prefix="grc", dir="/tmp")
    try:
        out = subprocess.run([sys.executable, "-c", code], env=env, cwd=workdir, capture_output=True,
                             timeout=timeout, check=False)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"child {args} on {tree} failed: {out.stderr.decode()[-3000:]}")
    return dict(json.loads(out.stdout.decode().strip().splitlines()[-1]))


def measure_join(tree: str, idle: int, trials: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with agents(tree, 1) as (seed,):
        for label, n in (("quiet", 0), ("idle_connections", idle)):
            times = [_run_child(tree, "join", seed.addr, seed.keyring, str(n))["join_s"] for _ in range(trials)]
            out[f"join_s_{label}"] = times
        st = seed.status()["transport"]
        out["seed_counters"] = {k: v for k, v in st["counters"].items() if k.startswith("rx_streams")}
    return out


def measure_slow(tree: str, conns: int, seconds: float) -> dict[str, Any]:
    """``conns`` connections from two sources, each sending one byte every second and reopened as
    soon as the agent closes it: the agent's CPU share over ``seconds`` and a spare's join through it."""
    with agents(tree, 1) as (seed,):
        port = int(seed.addr.rpartition(":")[2])
        quiet = _run_child(tree, "join", seed.addr, seed.keyring, "0")["join_s"]

        async def attack() -> dict[str, Any]:
            async with IdleConnections(port, conns, max_opens=10**9, trickle=1.0) as holder:
                await asyncio.sleep(1.0)
                cpu0, t0, opens0 = proc_cpu_s(seed.pid), time.monotonic(), holder.opens
                await asyncio.sleep(seconds)
                cpu1, t1, opens1 = proc_cpu_s(seed.pid), time.monotonic(), holder.opens
                join = await asyncio.to_thread(_run_child, tree, "join", seed.addr, seed.keyring, "0")
                return {"agent_cpu_share": round((cpu1 - cpu0) / (t1 - t0), 4),
                        "connections_opened_per_s": round((opens1 - opens0) / (t1 - t0), 1),
                        "join_s_under_attack": join["join_s"]}

        out: dict[str, Any] = {"conns": conns, "seconds": seconds, "join_s_quiet": quiet, **asyncio.run(attack())}
        counters = seed.status()["transport"]["counters"]
        out["seed_counters"] = {k: v for k, v in counters.items() if k.startswith(("rx_streams", "rx_accept"))}
    return out


async def _child_join(seed: str, keyring: str, idle: int) -> dict[str, Any]:
    from gossiprec.agent.pump import Agent
    from gossiprec.agent.settings import AgentSettings
    workdir = os.getcwd()
    host, _, port = seed.rpartition(":")
    async with contextlib.AsyncExitStack() as stack:
        if idle:
            holder = await stack.enter_async_context(IdleConnections(int(port), idle, host=host))
            deadline = time.monotonic() + 10
            while holder.opens < idle and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.2)  # the seed has accepted them
        s = AgentSettings(name=f"spare{os.getpid()}", bind_host="127.0.0.1", port=0, seeds=(seed,),
                          keyring=keyring, role="spare", control_socket=f"{workdir}/j.sock")
        t0 = time.monotonic()
        joiner = Agent(s)
        await joiner.start()
        try:
            await joiner.wait_until(lambda: joiner.live_count() > 1, JOIN_GIVE_UP_S)
            return {"join_s": time.monotonic() - t0}
        except TimeoutError:
            return {"join_s": None, "gave_up_after_s": JOIN_GIVE_UP_S}
        finally:
            joiner.abort()
            await joiner.aclose()


async def _follow(sock: str, stop: asyncio.Event, seen: list[str]) -> None:
    async with await AsyncControlClient.connect(sock, timeout=5) as c:
        await c.subscribe()
        while not stop.is_set():
            try:
                async with asyncio.timeout(0.2):
                    ev = await c.next_event()
            except TimeoutError:
                continue
            if ev.get("event") in SUSPICIOUS:
                seen.append(str(ev.get("event")))


def measure_flood(tree: str, rate: float, seconds: float) -> dict[str, Any]:
    out: dict[str, Any] = {"rate": rate, "seconds": seconds}
    with agents(tree, 3, job=True) as procs:
        target = procs[1]
        template = bytes.fromhex(_run_child(tree, "template", target.addr)["template"])
        kinds = {"garbage": garbage_datagrams(4096),
                 "forged": forged_datagrams(target.addr, 4096, template=template)}
        for kind, packets in kinds.items():
            async def run(packets: list[bytes] = packets) -> dict[str, Any]:
                stop = asyncio.Event()
                seen: list[str] = []
                followers = [asyncio.create_task(_follow(a.sock, stop, seen)) for a in procs]
                await asyncio.sleep(0.5)
                cpu0, t0 = proc_cpu_s(target.pid), time.monotonic()
                sent = await asyncio.to_thread(udp_flood, target.port, packets, rate, seconds)
                cpu = (proc_cpu_s(target.pid) - cpu0) / (time.monotonic() - t0)
                await asyncio.sleep(1.0)
                stop.set()
                await asyncio.gather(*followers, return_exceptions=True)
                return {"sent": sent, "target_cpu_share": round(cpu, 3), "suspicious_events": seen}
            res = asyncio.run(run())
            st = target.status()["transport"]
            res["rejects"] = {k: v for k, v in st["rejects"].items() if v}
            res["subkey_derivations"] = st["counters"].get("rx_subkey_derivations")
            out[kind] = res
    return out


def _child_cost(packets: int) -> dict[str, Any]:
    """CPU per datagram of this process's build's opener (see ``cost`` in the module notes)."""
    from gossiprec.security.crypto import Opener, OpenError
    to = "10.0.0.1:7980"
    ring = Keyring([KEY])
    try:  # configured as the agent's transport configures it, in builds that have these settings
        opener = Opener(ring, CLUSTER, clock=time.monotonic, receiver=to)  # type: ignore[call-arg,unused-ignore]
    except TypeError:
        opener = Opener(ring, CLUSTER)
    member = Sealer(ring, CLUSTER)

    def genuine(payload: bytes) -> bytes:
        try:
            return member.seal(payload, to)  # type: ignore[call-arg,unused-ignore]
        except TypeError:
            return member.seal(payload)

    kinds = {"garbage": garbage_datagrams(4096),
             "forged": forged_datagrams(to, 4096, template=forged_template(to)),
             "genuine": [genuine(b"\x92\x01\x90" + bytes(60)) for _ in range(packets)]}
    out: dict[str, Any] = {}
    for kind, pool in kinds.items():
        refused = 0
        t0 = time.process_time()
        for i in range(packets):
            try:
                opener.open(pool[i % len(pool)])
            except OpenError:
                refused += 1
        out[f"{kind}_us_per_packet"] = round((time.process_time() - t0) / packets * 1e6, 2)
        out[f"{kind}_refused"] = refused
    return out


def measure_cost(tree: str, packets: int, rate: float) -> dict[str, Any]:
    res = _run_child(tree, "cost", str(packets))
    for kind in ("garbage", "forged", "genuine"):
        res[f"{kind}_cores_at_rate"] = round(res[f"{kind}_us_per_packet"] * rate / 1e6, 3)
    res["rate"] = rate
    return res


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m gossiprec.bench.hostile", description=__doc__.split("\n")[0])
    p.add_argument("--tree", action="append", default=None, help="source tree of a build (repeatable)")
    p.add_argument("--only", choices=("memory", "join", "flood", "cost", "slow"), action="append", default=None)
    p.add_argument("--packets", type=int, default=100_000, help="datagrams of each kind for cost")
    p.add_argument("--conns", type=int, default=64)
    p.add_argument("--garbage-mib", type=float, default=4.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--idle", type=int, default=64)
    p.add_argument("--join-trials", type=int, default=3)
    p.add_argument("--rate", type=float, default=50_000)
    p.add_argument("--seconds", type=float, default=5.0)
    p.add_argument("--slow-conns", type=int, default=72, help="connections of the slow attack")
    p.add_argument("--json", metavar="FILE", default=None)
    p.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        if args.child[0] == "cost":
            print(json.dumps(_child_cost(int(args.child[1]))))
            return 0
        if args.child[0] == "template":
            print(json.dumps({"template": forged_template(args.child[1]).hex()}))
            return 0
        if args.child[0] == "join":
            print(json.dumps(asyncio.run(_child_join(args.child[1], args.child[2], int(args.child[3])))))
            return 0
        raise SystemExit(f"unknown child mode {args.child[0]}")
    trees = args.tree or [TREE]
    only = args.only or ["memory", "join", "flood", "cost", "slow"]
    report: dict[str, Any] = {"machine": {"cpus": os.cpu_count(), "load": os.getloadavg()}, "builds": {}}
    for tree in trees:
        rev = subprocess.run(["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=False).stdout.strip()
        build: dict[str, Any] = {"tree": tree, "commit": rev}
        if "memory" in only:
            build["memory"] = measure_memory(tree, args.conns, args.garbage_mib, args.rounds)
        if "join" in only:
            build["join"] = measure_join(tree, args.idle, args.join_trials)
        if "flood" in only:
            build["flood"] = measure_flood(tree, args.rate, args.seconds)
        if "cost" in only:
            build["cost"] = measure_cost(tree, args.packets, args.rate)
        if "slow" in only:
            build["slow"] = measure_slow(tree, args.slow_conns, args.seconds)
        report["builds"][tree] = build
    text = json.dumps(report, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
