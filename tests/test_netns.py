"""Five real agent processes on five "hosts" (network namespaces on one bridge, 10.77.0.11-15), with
packet faults from iptables: a 3/2 partition and its healing, 10% random loss, one-way loss.

Each test builds its own namespace cluster (tests.support.netns.NetnsCluster) and starts the agents
from one job spec (4 trainers + 1 hot spare, lan profile) and a generated keyring (sealed traffic, as
in production). The test process talks to the agents over their Unix control sockets (the file system
is shared across namespaces): one subscription per agent records every protocol event with the agent's
own ``time.monotonic()`` stamp (the same system-wide clock as the test's), and waits re-check their
condition after every event instead of sleeping. Figures are printed (``pytest -s`` shows them).

Skipped without root, ``ip netns`` or ``iptables``. ``GOSSIPREC_KEEP_NETNS_LOGS=1`` keeps the agents' logs
(the directory is printed).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
import time
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator

import pytest

from gossiprec.local.client import AsyncControlClient
from gossiprec.local.protocol import ControlError
from gossiprec.security.keyring import Keyring
from tests.support.netns import NetnsCluster, NetnsHost

pytestmark = pytest.mark.netns

N = 5
PORT = 7980
NAMES = [f"n{i}" for i in range(N)]
SPARE = 4
"""n4 is the hot spare of view 0; n0-n3 are trainers with ranks 0-3."""
START_TIMEOUT = 30.0


def _job_spec(hosts: tuple[NetnsHost, ...]) -> str:
    lines = ["[job]", 'topology = "ddp"', "allow_shrink = true", ""]
    for i, (name, h) in enumerate(zip(NAMES, hosts)):
        role = "spare" if i == SPARE else "trainer"
        rank = "" if i == SPARE else f"rank = {i}\n"
        lines.append(f'[[members]]\nname = "{name}"\naddr = "{h.addr}:{PORT}"\nrole = "{role}"\n{rank}'
                     f'host = "h{i}"\nrack = "r{i}"\n')
    return "\n".join(lines)


@dataclass
class AgentProc:
    name: str
    host: NetnsHost
    sock: str
    log: Path
    proc: subprocess.Popen[bytes]


class Harness:
    """The agents of one namespace cluster and a record of every event they publish."""

    def __init__(self, net: NetnsCluster, workdir: Path) -> None:
        self.net = net
        self.dir = workdir
        self.agents: dict[str, AgentProc] = {}
        self.events: dict[str, list[dict[str, Any]]] = {n: [] for n in NAMES}
        self._changed = asyncio.Event()
        """Set on every recorded event; made anew by :meth:`watching` (each test has its own loop)."""

    def start(self) -> None:
        keyring = self.dir / "keyring.json"
        Keyring([os.urandom(32)]).save(keyring)
        job = self.dir / "job.toml"
        job.write_text(_job_spec(self.net.hosts))
        seeds = [f"{self.net.hosts[i].addr}:{PORT}" for i in (0, 1)]
        env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
        env["PYTHONUNBUFFERED"] = "1"
        for name, h in zip(NAMES, self.net.hosts):
            sock = str(self.dir / f"{name}.sock")
            log = self.dir / f"{name}.log"
            argv = [sys.executable, "-m", "gossiprec", "agent", "--name", name, "--bind", h.addr,
                    "--port", str(PORT), "--job", str(job), "--keyring", str(keyring), "--profile", "lan",
                    "--control-socket", sock, "--log-level", "info"]
            for s in seeds:
                argv += ["--seed", s]
            with open(log, "ab") as err:
                proc = self.net.popen(h.index, argv, env=env, stdin=subprocess.DEVNULL,
                                      stdout=subprocess.DEVNULL, stderr=err)
            self.agents[name] = AgentProc(name, h, sock, log, proc)

    def stop(self) -> None:
        """SIGKILL every agent and reap it (a graceful leave would only slow the test down)."""
        for a in self.agents.values():
            if a.proc.poll() is None:
                a.proc.kill()
        for a in self.agents.values():
            a.proc.wait(timeout=10)

    # ------------------------------------------------------------------ queries
    async def status(self, name: str) -> dict[str, Any]:
        async with await AsyncControlClient.connect(self.agents[name].sock, timeout=5) as c:
            return await c.status()

    async def statuses(self, names: list[str] | None = None) -> dict[str, dict[str, Any]]:
        names = names or NAMES
        sts = await asyncio.gather(*(self.status(n) for n in names))
        return dict(zip(names, sts))

    async def ready(self) -> tuple[int, str]:
        """Wait until every agent answers and all hold the same view with all five in it and all five
        alive (polls: before the sockets exist there is nothing to subscribe to)."""
        t0 = time.monotonic()
        deadline = t0 + START_TIMEOUT
        last: Any = None
        while time.monotonic() < deadline:
            dead = [a.name for a in self.agents.values() if a.proc.poll() is not None]
            if dead:
                raise AssertionError(f"agent(s) {dead} exited at start-up:\n{self.logs(dead)}")
            try:
                sts = await self.statuses()
            except (ControlError, OSError) as exc:
                last = str(exc)
            else:
                views = {(st["view"]["epoch"], st["view"]["config_id"]) for st in sts.values()}
                members = {tuple(sorted(m["node"] for m in st["view"]["members"])) for st in sts.values()}
                live = {st["live"] for st in sts.values()}
                # every agent has heard from every member: during the startup grace, a member nobody
                # heard from is not judged, so cutting it off earlier is seen only when the grace ends
                unheard = {st["unheard"] for st in sts.values()}
                if len(views) == 1 and members == {tuple(NAMES)} and live == {N} and unheard == {0}:
                    print(f"\ncluster formed in {time.monotonic() - t0:.2f} s", end="")
                    return views.pop()
                last = {"views": views, "live": live, "unheard": unheard}
            await asyncio.sleep(0.1)
        raise AssertionError(f"the cluster did not form within {START_TIMEOUT} s (last: {last}):\n{self.logs()}")

    # ------------------------------------------------------------------ events
    @asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Subscribe to every agent; events land in ``self.events`` until the block ends. The pump
        tasks are owned here: cancelled and awaited on the way out."""
        clients: list[AsyncControlClient] = []
        tasks: list[asyncio.Task[None]] = []
        self._changed = asyncio.Event()
        try:
            for name in NAMES:
                c = await AsyncControlClient.connect(self.agents[name].sock, timeout=5)
                clients.append(c)
                await c.subscribe()
                tasks.append(asyncio.create_task(self._pump(name, c), name=f"events-{name}"))
            yield
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for c in clients:
                await c.aclose()

    async def _pump(self, name: str, c: AsyncControlClient) -> None:
        while True:
            try:
                ev = await c.next_event()
            except ControlError:
                return  # the agent went away
            self.events[name].append(ev)
            self._changed.set()

    async def wait_for(self, cond: Callable[[], bool], timeout: float, what: str) -> float:
        """Return the time once ``cond()`` holds (re-checked after every event); AssertionError after
        ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}\n{self.summary()}\n"
                                     f"{self.logs()}")
            self._changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                pass
        return time.monotonic()

    async def quiet(self, cond: Callable[[], bool], seconds: float) -> None:
        """Watch for ``seconds``; fail as soon as ``cond()`` (something that must not happen) holds."""
        deadline = time.monotonic() + seconds
        while True:
            if cond():
                raise AssertionError(f"unexpected: {cond.__doc__ or cond}\n{self.summary()}\n{self.logs()}")
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._changed.clear()
            try:
                async with asyncio.timeout(left):
                    await self._changed.wait()
            except TimeoutError:
                pass

    def of(self, name: str, kind: str, after: float = float("-inf")) -> list[dict[str, Any]]:
        return [e for e in self.events[name] if e.get("event") == kind and float(e.get("at", 0)) >= after]

    def summary(self) -> str:
        out = []
        for name in NAMES:
            keep = [f"{e['event']}@{e.get('at', 0):.2f}" + (f"(e{e['epoch']} {e.get('members')} removed "
                                                             f"{e.get('removed')}"
                                                             f"{' STOPPED' if e.get('stopped') else ''})"
                                                             if e["event"] == "ViewInstalled" else
                                                             f"({e.get('reason', e.get('subject', ''))})")
                    for e in self.events[name]
                    if e["event"] in ("ViewInstalled", "Fenced", "Unfenced", "AlertRaised", "MemberFailed")]
            out.append(f"  {name}: {' '.join(keep[-12:])}")
        return "events (last 12 per agent):\n" + "\n".join(out)

    def logs(self, names: list[str] | None = None, n: int = 1500) -> str:
        parts = []
        for name in names or NAMES:
            a = self.agents.get(name)
            if a is not None:
                try:
                    parts.append(f"--- {name} log tail:\n{a.log.read_text(errors='replace')[-n:]}")
                except OSError:
                    pass
        return "\n".join(parts)


@contextmanager
def _cluster() -> Iterator[Harness]:
    """A namespace cluster with the five agents started; everything killed and removed afterwards."""
    workdir = Path(tempfile.mkdtemp(prefix="grns", dir="/tmp"))
    os.chmod(workdir, 0o700)
    try:
        with NetnsCluster(N) as net:
            h = Harness(net, workdir)
            try:
                h.start()
                yield h
            finally:
                h.stop()
            leftover = [a.name for a in h.agents.values() if a.proc.poll() is None]
            assert not leftover, f"agents still running after stop: {leftover}"
        assert not net.exists(), f"namespaces left behind: {net.exists()}"
    finally:
        if os.environ.get("GOSSIPREC_KEEP_NETNS_LOGS"):
            print(f"logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def harness(netns_ok: None) -> Iterator[Harness]:
    """A fresh cluster for a test that leaves it broken."""
    with _cluster() as h:
        yield h


@pytest.fixture(scope="module")
def shared(netns_ok: None) -> Iterator[Harness]:
    """One cluster for the loss test and then the one-way test (start-up is the slowest part of
    these tests on a busy machine). Each test starts from whatever view all five agree on."""
    with _cluster() as h:
        yield h


def _view_of(ev: dict[str, Any]) -> tuple[int, str]:
    return int(ev["epoch"]), str(ev["config_id"])


class NotConvergedAfterHeal(AssertionError):
    """After healing a partition, the five agents did not come back to one view with everyone in it."""


def _removal(h: Harness, healthy: list[str], gone: list[str], since: float) -> bool:
    """Every healthy agent installed a view without any of ``gone``."""
    return all(any(not set(gone) & set(e["members"]) for e in h.of(n, "ViewInstalled", since))
               for n in healthy)


def _assert_one_removal(h: Harness, healthy: list[str], gone: list[str], since: float, e0: int) -> None:
    """Each healthy agent installed exactly one view since ``since``: epoch e0 + 1, the same one
    everywhere, removing exactly ``gone``; and none of them fenced."""
    installs = {n: h.of(n, "ViewInstalled", since) for n in healthy}
    assert all(len(v) == 1 for v in installs.values()), f"view changes: {installs}"
    assert len({_view_of(v[0]) for v in installs.values()}) == 1, f"different views: {installs}"
    new = installs[healthy[0]][0]
    assert new["epoch"] == e0 + 1, new
    # the members, not the event's ``removed``: an agent that missed the decision and caught up by
    # ViewRequest/ViewState reports removed=() (seen under load)
    assert sorted(new["members"]) == sorted(healthy), new
    assert set(new["removed"]) <= set(gone), new
    fenced = {n: h.of(n, "Fenced", since) for n in healthy if h.of(n, "Fenced", since)}
    assert not fenced, f"healthy agents fenced: {fenced}"


# --- 1: a 3/2 partition, then healing ------------------------------------------------------------
HEAL_S = 12.0
"""Bound on convergence after healing (catch-up, join request, one agreement: a few seconds)."""


async def test_partition_3_2_minority_fences_majority_moves_on_and_all_converge_after_heal(
        harness: Harness) -> None:
    h = harness
    e0, cid0 = await h.ready()
    majority, minority = ["n0", "n2", "n4"], ["n1", "n3"]
    async with h.watching():
        t0 = time.monotonic()
        h.net.partition([NAMES.index(n) for n in majority], [NAMES.index(n) for n in minority])
        t_cut = time.monotonic()
        await h.wait_for(lambda: _removal(h, majority, minority, t0) and
                         all(h.of(n, "Fenced", t0) for n in minority), 30,
                         "the majority to install a view without the minority and the minority to fence")
        t_view = max(float(h.of(n, "ViewInstalled", t0)[0]["at"]) for n in majority) - t0
        t_fence = max(float(h.of(n, "Fenced", t0)[0]["at"]) for n in minority) - t0
        _assert_one_removal(h, majority, minority, t0, e0)
        # the minority: fenced, still in the old view, never a view of its own
        sts = await h.statuses(minority)
        for n in minority:
            assert not h.of(n, "ViewInstalled", t0), h.of(n, "ViewInstalled", t0)
            assert sts[n]["fenced"], sts[n]
            assert _view_of(sts[n]["view"]) == (e0, cid0), sts[n]["view"]
        print(f"\n3/2 partition (rules in place in {t_cut - t0:.3f} s): majority view "
              f"{t_view:.2f} s, minority fenced {t_fence:.2f} s ({h.of('n1', 'Fenced', t0)[0]['reason']})")

        t_heal = time.monotonic()
        h.net.heal()

        def converged() -> bool:
            last = [h.of(n, "ViewInstalled", t0) for n in NAMES]
            if not all(last):
                return False
            return len({_view_of(v[-1]) for v in last}) == 1 and \
                all(sorted(v[-1]["members"]) == NAMES for v in last)

        try:
            await h.wait_for(converged, HEAL_S, "all five to install one view with everyone in it after healing")
        except AssertionError as exc:
            sts = await h.statuses()
            seen = {n: [e["name"] for e in h.of(n, "MemberJoined", t_heal)] for n in majority}
            state = {n: {"view": _view_of(st["view"]), "fenced": st["fenced"], "live": st["live"],
                         "rx_other_epoch": st["machine"].get("rx_other_epoch", 0)} for n, st in sts.items()}
            raise NotConvergedAfterHeal(
                f"{HEAL_S:.0f} s after healing: agents {state}; SWIM rejoins seen by the majority since the heal: "
                f"{seen}\n{exc}") from None
        t_conv = max(float(h.of(n, "ViewInstalled", t0)[-1]["at"]) for n in NAMES) - t_heal
        sts = await h.statuses()
        assert len({_view_of(st["view"]) for st in sts.values()}) == 1, sts
        assert all(not st["fenced"] for st in sts.values()), {n: st["fenced"] for n, st in sts.items()}
        for n in minority:
            assert h.of(n, "Unfenced", t_heal), h.events[n]
        final = sts["n0"]["view"]
        roles = {m["node"]: m["role"] for m in final["members"]}
        print(f"healed: one view everywhere {t_conv:.2f} s after healing: epoch {final['epoch']}, "
              f"roles {roles}")


# --- 2: 10% loss on every link --------------------------------------------------------------------
LOSS = 0.10
LOSS_S = 20.0


async def test_ten_percent_random_loss_on_every_link_causes_no_false_failure(shared: Harness) -> None:
    h = shared
    e0, cid0 = await h.ready()
    async with h.watching():
        t0 = time.monotonic()
        h.net.loss(LOSS)  # at every host's input: each direction of each link loses 10%

        def changed() -> bool:
            """a view change or a fence under 10% loss"""
            return any(h.of(n, "ViewInstalled", t0) or h.of(n, "Fenced", t0) for n in NAMES)

        await h.quiet(changed, LOSS_S)
        sts = await h.statuses()
        dropped = sum(int(line.split()[0]) for i in range(N)
                      for line in h.net.counters(i).splitlines()[2:] if line.split())
        h.net.heal()
    assert {_view_of(st["view"]) for st in sts.values()} == {(e0, cid0)}, sts
    assert not any(st["fenced"] for st in sts.values())
    count = {k: sum(len(h.of(n, k, t0)) for n in NAMES) for k in ("MemberSuspected", "MemberFailed", "AlertRaised")}
    rx = sum(int(st["transport"].get("counters", {}).get("rx_datagrams", 0)) for st in sts.values())
    print(f"\n{LOSS:.0%} loss for {LOSS_S:.0f} s: 0 view changes, 0 fences; packets dropped {dropped} "
          f"(datagrams received, whole run: {rx}); {count}")
    assert dropped > 0, "the loss rules dropped nothing: the test did not test anything"


# --- 3: one-way loss -------------------------------------------------------------------------------
QUIET_S = 3.0
"""After the view change, the healthy agents are watched this long for a second change or a fence."""


async def _one_way(h: Harness, victim: str, mode: str, healthy: list[str]) -> None:
    """Cut ``victim`` one way (``from``: nobody hears it; ``to``: it hears nobody) and check that the
    ``healthy`` agents remove it, and only it, in one view change, and that it fences."""
    st0 = await h.status(healthy[0])
    e0, cid0 = _view_of(st0["view"])
    t0 = time.monotonic()
    if mode == "from":
        h.net.drop_from(NAMES.index(victim))
    else:
        h.net.drop_to(NAMES.index(victim))
    await h.wait_for(lambda: _removal(h, healthy, [victim], t0) and bool(h.of(victim, "Fenced", t0)),
                     30, f"the healthy agents to remove {victim} and {victim} to fence")
    t_view = max(float(h.of(n, "ViewInstalled", t0)[0]["at"]) for n in healthy) - t0
    fence = h.of(victim, "Fenced", t0)[0]
    t_fence = float(fence["at"]) - t0

    def more() -> bool:
        """a second view change or a fence among the healthy agents"""
        return any(len(h.of(n, "ViewInstalled", t0)) > 1 or h.of(n, "Fenced", t0) for n in healthy)

    await h.quiet(more, QUIET_S - (time.monotonic() - t0 - t_view))  # QUIET_S after the change in all
    _assert_one_removal(h, healthy, [victim], t0, e0)
    st = await h.status(victim)
    assert st["fenced"], st
    # Never a view of its own: whatever it installed is the healthy agents' view. Whether it learns
    # that view at all is a race (``from``: it hears the others, but its own probes get no ack, so to
    # it everyone has failed; the decision reaches it only if a broadcast does before the others
    # stop talking to it), so both outcomes are accepted and printed.
    healthy_view = _view_of(h.of(healthy[0], "ViewInstalled", t0)[0])
    assert {_view_of(e) for e in h.of(victim, "ViewInstalled", t0)} <= {healthy_view}
    assert _view_of(st["view"]) in ((e0, cid0), healthy_view), st["view"]
    if mode == "to":
        # it hears nothing, so it cannot learn the new view: it fences for want of a quorum
        assert _view_of(st["view"]) == (e0, cid0), st["view"]
    print(f"\none-way loss {mode} {victim}: view without it at the {len(healthy)} healthy {t_view:.2f} s, "
          f"{victim} fenced {t_fence:.2f} s ({fence['reason']}; it holds epoch {st['view']['epoch']}); "
          f"no other change for {QUIET_S:.0f} s")


async def test_one_way_loss_removes_the_cut_off_node_and_no_healthy_one(shared: Harness) -> None:
    """First n1 hears nobody (everyone hears it), in the view of five; then, with n1 still cut off, nobody
    hears n3 (it hears everyone), in the view of four. Each time exactly that node is removed, in one
    view change, and it fences. Runs on the loss test's cluster (healed) when both run; it breaks the
    cluster, so it comes last."""
    h = shared
    await h.ready()
    async with h.watching():
        await _one_way(h, "n1", "to", ["n0", "n2", "n3", "n4"])
        await _one_way(h, "n3", "from", ["n0", "n2", "n4"])
