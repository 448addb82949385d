"""Network-namespace clusters: several "hosts" with real addresses on one machine, and packet faults.

Theory of operation
-------------------
:class:`NetnsCluster` builds, for one test run::

    hub namespace  <prefix>-hub:  bridge "br0" (no address), one veth end "v<i>" per host
    host i         <prefix>-n<i>: "lo" and "eth0" (the other veth end) with 10.77.0.<first+i>/24

so the hosts reach each other through a real L2 segment and their own IP stacks, and nothing on the
machine's own network can see them (the bridge lives in the hub namespace, not in the root one). Every
run gets its own namespace names (``grns-<pid>-<random>``); interface names are private to each
namespace, so concurrent runs, even with the same subnet, never clash. :func:`reap_stale` deletes the
namespaces of runs whose process no longer exists (a test run that was SIGKILLed).

Faults are iptables rules on the *receiving* side, in a chain of their own (``GRFAULT``) that each
host's ``INPUT`` jumps to for packets arriving on ``eth0``: senders never see an error (as on a real
lossy network; an ``OUTPUT`` drop would fail ``sendto`` with EPERM), loopback traffic is never touched,
and :meth:`NetnsCluster.heal` is one flush per host. Rules for one host are applied in one
``iptables-restore --noflush`` call (atomic per host; all hosts in parallel):

- :meth:`~NetnsCluster.block` ``(src, dst)``: drop every packet from src at dst (one direction);
- :meth:`~NetnsCluster.drop_from` ``(x)``: nobody hears x; x still hears everyone (one-way partition);
- :meth:`~NetnsCluster.drop_to` ``(x)``: x hears nobody; everyone still hears x;
- :meth:`~NetnsCluster.partition` ``(a, b)``: both directions between two groups;
- :meth:`~NetnsCluster.loss` ``(p)``: ``-m statistic --mode random --probability p`` at every host, so
  each directed link loses a fraction p of its packets, independently per packet (both directions of
  a link: p each);
- :meth:`~NetnsCluster.heal`: flush the fault chain(s).

Processes run in a host with :meth:`~NetnsCluster.popen` (``ip netns exec``, which execs the command
in place, so the Popen pid is the command's pid). The file system is shared: Unix sockets and files in
a temporary directory are reachable from the test process without entering any namespace.

Clean-up: the context manager always tears everything down, also when set-up fails half way or the
body raises: every process in the cluster's namespaces is SIGKILLed (``ip netns pids``), then the host
namespaces and the hub are deleted (deleting a namespace deletes its veth end, and with it the pair).
Processes started with ``die_with_parent`` (default) also get SIGKILL from the kernel if the thread
that started them dies, so even a SIGKILLed test leaves no agent behind, only namespaces for
:func:`reap_stale`.

Needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN), ``ip`` (iproute2) and ``iptables``/``iptables-restore``
(either backend); :func:`netns_unavailable` says why a machine cannot run it.
"""

from __future__ import annotations

import ipaddress
import os
import re
import secrets
import shutil
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, Iterable, Sequence

import pytest

from gossiprec.errors import GossiprecError

NAME_ROOT = "grns"
"""Every namespace this module creates is named ``grns-<pid>-<hex>-...``."""
CHAIN = "GRFAULT"
"""The iptables chain holding the fault rules of one host (jumped to from INPUT for eth0)."""
IFNAME = "eth0"
BRIDGE = "br0"
_STALE = re.compile(rf"^{NAME_ROOT}-(\d+)-[0-9a-f]+-")
_CMD_TIMEOUT = 20.0

HostRef = int | str
"""A host by index (0..n-1) or by address (``"10.77.0.11"``)."""


class NetnsError(GossiprecError):
    """Building, changing or removing a namespace cluster failed (the message holds the command and
    its stderr). Usually: not root, or ``ip``/``iptables`` missing; see :func:`netns_unavailable`."""


@dataclass(frozen=True, slots=True)
class NetnsHost:
    """One host of the cluster: its namespace and its address on the bridge."""

    index: int
    netns: str
    addr: str
    ifname: str = IFNAME


def _run(argv: Sequence[str], stdin: str | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    try:
        cp = subprocess.run(list(argv), input=stdin, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    except FileNotFoundError as exc:
        raise NetnsError(f"{argv[0]} is not installed (needed for network namespace tests)") from exc
    except subprocess.TimeoutExpired as exc:
        raise NetnsError(f"`{' '.join(argv)}` did not finish within {_CMD_TIMEOUT:.0f} s") from exc
    if check and cp.returncode != 0:
        raise NetnsError(f"`{' '.join(argv)}` failed (exit {cp.returncode}): {cp.stderr.strip() or cp.stdout.strip()}")
    return cp


def netns_unavailable() -> str | None:
    """Why namespace clusters cannot run here (a sentence for ``pytest.skip``), or None if they can.

    Checks root, the tools, and that a namespace can really be created (containers often lack
    CAP_SYS_ADMIN even as uid 0) and that iptables with the statistic match works inside it.
    """
    if os.geteuid() != 0:
        return "network namespace tests need root (ip netns, iptables)"
    for tool in ("ip", "iptables", "iptables-restore"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = f"{NAME_ROOT}-{os.getpid()}-{secrets.token_hex(3)}-probe"
    try:
        _run(["ip", "netns", "add", probe])
    except NetnsError as exc:
        return f"cannot create a network namespace: {exc}"
    try:
        _run(["ip", "netns", "exec", probe, "iptables", "-w", "-A", "INPUT", "-m", "statistic",
              "--mode", "random", "--probability", "0.5", "-j", "DROP"])
    except NetnsError as exc:
        return f"iptables (statistic match) does not work in a namespace: {exc}"
    finally:
        _run(["ip", "netns", "del", probe], check=False)
    return None


def list_netns() -> list[str]:
    """Names of every named network namespace on the machine."""
    out = _run(["ip", "netns", "list"]).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def kill_netns_pids(ns: str) -> None:
    """SIGKILL every process in network namespace ``ns`` (a host that dies whole)."""
    cp = _run(["ip", "netns", "pids", ns], check=False)
    for tok in cp.stdout.split():
        try:
            os.kill(int(tok), signal.SIGKILL)
        except (ValueError, ProcessLookupError, PermissionError):
            pass


@pytest.fixture(scope="module")
def netns_ok() -> None:
    """Skips the module's tests unless this machine can build namespaces; reaps those of killed runs."""
    reason = netns_unavailable()
    if reason is not None:
        pytest.skip(reason)
    reap_stale()


def reap_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose process is gone (killed test runs); returns them.

    Only namespaces named by this module (``grns-<pid>-...``) whose pid does not exist are touched, so
    concurrent live runs are safe (within one pid namespace)."""
    gone: list[str] = []
    for ns in list_netns():
        m = _STALE.match(ns)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        kill_netns_pids(ns)
        if _run(["ip", "netns", "del", ns], check=False).returncode == 0:
            gone.append(ns)
    return gone


def _set_pdeathsig() -> None:
    """In the child before exec: SIGKILL when the parent thread dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG = 1


class NetnsCluster:
    """``n`` hosts on one bridge; see the module docstring. Use as a context manager::

        with NetnsCluster(5) as net:
            p = net.popen(0, ["python", "-m", "gossiprec", "agent", "--bind", net.hosts[0].addr, ...])
            net.partition([0, 1, 2], [3, 4])
            ...
            net.heal()
    """

    def __init__(self, n: int, *, subnet: str = "10.77.0.0/24", first_host: int = 11,
                 prefix: str | None = None) -> None:
        try:
            net = ipaddress.IPv4Network(subnet)
        except ValueError as exc:
            raise NetnsError(f"subnet {subnet!r} is not an IPv4 network like 10.77.0.0/24: {exc}") from None
        if n < 1 or first_host < 1 or first_host + n - 1 > net.num_addresses - 2:
            raise NetnsError(f"{n} hosts from .{first_host} do not fit in {subnet}; use fewer hosts or a "
                             "larger subnet")
        self.prefix = prefix or f"{NAME_ROOT}-{os.getpid()}-{secrets.token_hex(3)}"
        self.subnet = net
        self.hub = f"{self.prefix}-hub"
        self.hosts: tuple[NetnsHost, ...] = tuple(
            NetnsHost(i, f"{self.prefix}-n{i}", str(net.network_address + first_host + i)) for i in range(n))
        self._by_addr = {h.addr: h for h in self.hosts}
        self._created: list[str] = []
        self._procs: list[subprocess.Popen[Any]] = []
        self._faults: dict[int, list[str]] = {h.index: [] for h in self.hosts}

    # ------------------------------------------------------------------ life cycle
    def __enter__(self) -> NetnsCluster:
        try:
            self.create()
        except BaseException:
            self.destroy()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        try:
            self.destroy()
        except NetnsError:
            if et is None:
                raise  # do not hide the body's own error behind a clean-up one

    def create(self) -> None:
        """Build the hub, the bridge and every host (address, links up, fault chain hooked)."""
        plen = self.subnet.prefixlen
        self._add_ns(self.hub)
        _run(["ip", "-n", self.hub, "link", "add", BRIDGE, "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", BRIDGE, "up"])
        for h in self.hosts:
            self._add_ns(h.netns)
            veth = f"v{h.index}"
            _run(["ip", "-n", self.hub, "link", "add", veth, "type", "veth", "peer", "name", h.ifname,
                  "netns", h.netns])
            _run(["ip", "-n", self.hub, "link", "set", veth, "master", BRIDGE, "up"])
            _run(["ip", "-n", h.netns, "addr", "add", f"{h.addr}/{plen}", "dev", h.ifname])
            _run(["ip", "-n", h.netns, "link", "set", h.ifname, "up"])
            _run(["ip", "-n", h.netns, "link", "set", "lo", "up"])
            self._restore(h, [f":{CHAIN} - [0:0]", f"-A INPUT -i {h.ifname} -j {CHAIN}"])

    def _add_ns(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._created.append(name)

    def destroy(self) -> None:
        """Kill every process in the cluster's namespaces and delete them. Idempotent; tries every step
        and raises one :class:`NetnsError` listing what could not be removed."""
        for p in self._procs:
            if p.poll() is None:
                p.kill()
        for ns in self._created:
            kill_netns_pids(ns)
        for p in self._procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        failed = []
        for ns in reversed(self._created):  # hosts first, the hub last
            cp = _run(["ip", "netns", "del", ns], check=False)
            if cp.returncode != 0 and ns in list_netns():
                failed.append(f"{ns}: {cp.stderr.strip()}")
        self._created = [ns for ns in self._created if any(f.startswith(ns + ":") for f in failed)]
        if failed:
            raise NetnsError("could not delete namespace(s) " + "; ".join(failed) +
                             "; remove them with `ip netns del NAME`")

    def exists(self) -> list[str]:
        """The cluster's namespaces that exist right now (empty after :meth:`destroy`)."""
        mine = {self.hub, *(h.netns for h in self.hosts)}
        return [ns for ns in list_netns() if ns in mine]

    # ------------------------------------------------------------------ processes
    def host(self, ref: HostRef) -> NetnsHost:
        """A host by index or address."""
        if isinstance(ref, int):
            if not 0 <= ref < len(self.hosts):
                raise NetnsError(f"no host {ref}: the cluster has hosts 0..{len(self.hosts) - 1}")
            return self.hosts[ref]
        h = self._by_addr.get(ref)
        if h is None:
            raise NetnsError(f"no host at {ref!r}; addresses: {', '.join(self._by_addr)}")
        return h

    def argv(self, ref: HostRef, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside the host's namespace."""
        return ["ip", "netns", "exec", self.host(ref).netns, *argv]

    def popen(self, ref: HostRef, argv: Sequence[str], *, die_with_parent: bool = True,
              **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` in the host's namespace (killed by :meth:`destroy` if still running).

        ``die_with_parent``: the kernel SIGKILLs the process when the *thread* that called this exits
        (PR_SET_PDEATHSIG), so call it from a thread that lives as long as the cluster (not from
        ``asyncio.to_thread``)."""
        if die_with_parent:
            kwargs.setdefault("preexec_fn", _set_pdeathsig)
        p: subprocess.Popen[Any] = subprocess.Popen(self.argv(ref, argv), **kwargs)
        self._procs.append(p)
        return p

    def run(self, ref: HostRef, argv: Sequence[str]) -> str:
        """Run a short command in the host's namespace; its stdout (NetnsError on failure)."""
        return _run(self.argv(ref, argv)).stdout

    # ------------------------------------------------------------------ faults
    def _restore(self, h: NetnsHost, lines: Iterable[str]) -> None:
        self._restore_many({h.index: list(lines)})

    def _restore_many(self, batches: dict[int, list[str]]) -> None:
        """Apply each host's lines with one ``iptables-restore --noflush``, all hosts at once (so a
        partition starts at nearly the same moment everywhere); NetnsError if any host failed."""
        procs = []
        for idx, lines in batches.items():
            argv = self.argv(idx, ["iptables-restore", "-w", "--noflush"])
            text = "*filter\n" + "".join(f"{line}\n" for line in lines) + "COMMIT\n"
            try:
                p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
            except FileNotFoundError as exc:
                raise NetnsError("ip is not installed (needed for network namespace tests)") from exc
            procs.append((argv, p, text))
        errors = []
        for argv, p, text in procs:
            try:
                _, err = p.communicate(text, timeout=_CMD_TIMEOUT)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
                errors.append(f"`{' '.join(argv)}` did not finish within {_CMD_TIMEOUT:.0f} s")
                continue
            if p.returncode != 0:
                errors.append(f"`{' '.join(argv)}` failed (exit {p.returncode}): {err.strip()}")
        if errors:
            raise NetnsError("; ".join(errors))

    def _add_rules(self, rules: dict[int, list[str]]) -> None:
        batches = {idx: [f"-A {CHAIN} {s}" for s in specs] for idx, specs in rules.items() if specs}
        self._restore_many(batches)
        for idx in batches:
            self._faults[idx].extend(rules[idx])

    def _group(self, refs: Iterable[HostRef] | None) -> list[NetnsHost]:
        return list(self.hosts) if refs is None else [self.host(r) for r in refs]

    def block(self, src: HostRef, dst: HostRef) -> None:
        """Drop every packet from ``src`` arriving at ``dst`` (one direction of one link)."""
        s, d = self.host(src), self.host(dst)
        if s == d:
            raise NetnsError(f"block({s.addr}, {d.addr}): a host cannot be cut off from itself")
        self._add_rules({d.index: [f"-s {s.addr}/32 -j DROP"]})

    def drop_from(self, ref: HostRef, to: Iterable[HostRef] | None = None) -> None:
        """Nobody (or only ``to``) hears ``ref``; ``ref`` still hears everyone: a one-way partition."""
        x = self.host(ref)
        self._add_rules({d.index: [f"-s {x.addr}/32 -j DROP"] for d in self._group(to) if d != x})

    def drop_to(self, ref: HostRef, frm: Iterable[HostRef] | None = None) -> None:
        """``ref`` hears nobody (or not ``frm``); everyone still hears ``ref``."""
        x = self.host(ref)
        self._add_rules({x.index: [f"-s {s.addr}/32 -j DROP" for s in self._group(frm) if s != x]})

    def partition(self, side_a: Iterable[HostRef], side_b: Iterable[HostRef]) -> None:
        """No packet crosses between the two groups, in either direction."""
        a, b = self._group(side_a), self._group(side_b)
        if set(a) & set(b):
            raise NetnsError("partition: a host cannot be on both sides")
        rules: dict[int, list[str]] = {}
        for x, others in ((a, b), (b, a)):
            for d in x:
                rules[d.index] = [f"-s {s.addr}/32 -j DROP" for s in others]
        self._add_rules(rules)

    def loss(self, probability: float, at: Iterable[HostRef] | None = None) -> None:
        """Drop each packet arriving at every host (or at ``at``) with ``probability``, independently:
        every directed link into those hosts loses that fraction."""
        if not 0.0 < probability <= 1.0:
            raise NetnsError(f"loss probability must be in (0, 1], got {probability!r}")
        self._add_rules({h.index: [f"-m statistic --mode random --probability {probability:.6f} -j DROP"]
                         for h in self._group(at)})

    def heal(self, at: Iterable[HostRef] | None = None) -> None:
        """Remove every fault rule (at every host, or at ``at``)."""
        hosts = self._group(at)
        self._restore_many({h.index: [f"-F {CHAIN}"] for h in hosts})
        for h in hosts:
            self._faults[h.index] = []

    def faults(self) -> dict[str, list[str]]:
        """The fault rules in force, per host address (as given to iptables)."""
        return {self.hosts[i].addr: list(specs) for i, specs in self._faults.items() if specs}

    def counters(self, ref: HostRef) -> str:
        """``iptables -L GRFAULT -nvx`` of a host: packets dropped by each rule (for debugging)."""
        return self.run(ref, ["iptables", "-w", "-L", CHAIN, "-n", "-v", "-x"])
