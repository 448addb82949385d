"""Per-epoch gloo groups: collectives, peer death, agent abort of a hung collective, re-formation."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import threading
import time
from datetime import timedelta
from typing import Any, Iterator

import pytest
import torch

from gossiprec.errors import ConfigError, RecoveryError
from gossiprec.trainer.collectives.groups import (
    Alarm,
    CollectiveAborted,
    EpochGroups,
    connect_store,
    start_store_server,
    wait_interruptible,
)

HOST = "127.0.0.1"
BIG = 16 * 1024 * 1024  # floats: an allreduce long enough to be killed in the middle


# ------------------------------------------------------------------------------------------------
# the wait loop, against fake work objects


class FakeWork:
    """A Work whose outcome the test scripts: completes after ``polls`` checks of ``is_completed`` (NCCL's
    way: polled, never waited while pending), with ``error`` or not."""

    def __init__(self, polls: int | None, error: str | None = None) -> None:
        self.polls, self.error, self.calls = polls, error, 0

    def is_completed(self) -> bool:
        self.calls += 1
        return self.polls is not None and self.calls > self.polls

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and not self.is_completed():
            raise RuntimeError("Operation timed out!")
        if self.error:
            raise RuntimeError(self.error)
        return True


class UntimedWork:
    """As gloo's reduce-scatters in torch 2.13: no future, never ``is_completed``, and the collective runs
    inside ``wait()`` whatever its timeout (here: until ``release`` is set; then ``error`` or not)."""

    def __init__(self, error: str | None = None, released: bool = True) -> None:
        self.error, self.release = error, threading.Event()
        if released:
            self.release.set()
        self.waits: list[tuple[str, timedelta | None]] = []  # (thread, timeout) of every wait

    def is_completed(self) -> bool:
        return False

    def get_future(self) -> Any:
        raise RuntimeError("Work::getFuture not implemented.")

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.waits.append((threading.current_thread().name, timeout))
        self.release.wait(30)
        if self.error:
            raise RuntimeError(self.error)
        return True


def test_a_work_without_a_future_runs_on_a_waiter_thread() -> None:
    """Its wait would hold the rank until the collective ends: a waiter thread runs it, once, untimed."""
    work = UntimedWork()
    wait_interruptible(work, threading.Event(), epoch=0, op="_reduce_scatter_base")
    assert work.waits == [("gossiprec-waiter", None)]
    work = UntimedWork()  # the waiter that ran the first is idle again: it runs the next
    wait_interruptible(work, Alarm(), epoch=0, op="_reduce_scatter_base")
    assert work.waits == [("gossiprec-waiter", None)]


def test_peer_error_becomes_collective_aborted_with_cause() -> None:
    work = UntimedWork(error="Connection reset by peer")
    with pytest.raises(CollectiveAborted, match="peer died") as info:
        wait_interruptible(work, threading.Event(), epoch=4, op="_reduce_scatter_base")
    assert info.value.reason == "peer_failed" and info.value.epoch == 4
    assert isinstance(info.value.__cause__, RuntimeError) and isinstance(info.value, RecoveryError)
    work = FakeWork(polls=2, error="Connection reset by peer")  # the same from a polled work
    with pytest.raises(CollectiveAborted, match="peer died") as info:
        wait_interruptible(work, threading.Event(), epoch=4, op="allreduce", blocking_wait=False)
    assert info.value.reason == "peer_failed" and isinstance(info.value.__cause__, RuntimeError)


@pytest.mark.parametrize("alarm", [False, True])
def test_abort_event_interrupts_the_wait(alarm: bool) -> None:
    """A work whose peer never comes: the agent's abort ends the wait (an Alarm at once, a plain event
    within a poll slice); the waiter stays in the work until it ends, and is not reused meanwhile."""
    abort = Alarm() if alarm else threading.Event()
    stuck = UntimedWork(released=False)
    threading.Timer(0.05, abort.set).start()  # the "agent", from another thread
    with pytest.raises(CollectiveAborted, match="aborted by the agent: hung") as info:
        wait_interruptible(stuck, abort, epoch=1, op="_reduce_scatter_base", reason_of_abort=lambda: "hung")
    assert info.value.reason == "aborted" and len(stuck.waits) == 1
    other = UntimedWork()  # the next epoch's: another waiter runs it
    wait_interruptible(other, threading.Event(), epoch=2, op="_reduce_scatter_base")
    assert len(other.waits) == 1
    stuck.release.set()  # the backend's own timeout, in a real group
    work = FakeWork(polls=None)
    threading.Timer(0.05, abort.set).start()
    abort.clear()
    with pytest.raises(CollectiveAborted, match="aborted by the agent") as info:
        wait_interruptible(work, abort, epoch=1, op="allreduce", blocking_wait=False)
    assert info.value.reason == "aborted" and work.calls > 1


def test_deadline_and_polling_mode() -> None:
    with pytest.raises(CollectiveAborted, match="timed out") as info:
        wait_interruptible(FutureWork(), threading.Event(), epoch=0, op="barrier",
                           deadline=time.monotonic() - 1)
    assert info.value.reason == "timeout"
    work = FakeWork(polls=3)  # non-blocking mode (NCCL): only is_completed() is consulted
    wait_interruptible(work, threading.Event(), epoch=0, op="allreduce", blocking_wait=False)
    assert work.calls == 4
    abort = threading.Event()
    abort.set()
    with pytest.raises(CollectiveAborted):
        wait_interruptible(FakeWork(polls=None), abort, epoch=0, op="allreduce", blocking_wait=False)


class FutureWork(FakeWork):
    """A Work with a future: never completes by waiting; :meth:`complete` (any thread) completes it."""

    def __init__(self) -> None:
        super().__init__(polls=None)
        self.callbacks: list[Any] = []
        self.done = False

    def is_completed(self) -> bool:
        return self.done

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None:
            self.calls += 1  # the timed native waits: one slice, then none
        return super().wait(timeout)

    def get_future(self) -> Any:
        return self

    def add_done_callback(self, fn: Any) -> None:
        self.callbacks.append(fn)

    def complete(self) -> None:
        self.done = True
        for fn in self.callbacks:
            fn(self)


def _in_thread(fn: Any) -> tuple[threading.Thread, list[BaseException | None]]:
    out: list[BaseException | None] = []

    def run() -> None:
        try:
            fn()
            out.append(None)
        except BaseException as exc:  # noqa: BLE001 (handed to the test)
            out.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def test_a_long_wait_sleeps_on_the_future_after_one_timed_slice() -> None:
    """One native slice (a timed wait that runs out raises, costly), then no more: the wait sleeps until
    the future completes, or until the abort, an Alarm, wakes it; slices of a minute show that nothing
    else wakes it."""
    work = FutureWork()
    t, out = _in_thread(lambda: wait_interruptible(work, Alarm(), epoch=0, op="allreduce", poll_interval=60.0,
                                                   deadline=time.monotonic() + 600))
    while not work.callbacks:
        time.sleep(0.001)
    work.complete()
    t.join(10)
    assert out == [None] and work.calls == 1
    abort, work = Alarm(), FutureWork()
    t, out = _in_thread(lambda: wait_interruptible(work, abort, epoch=2, op="allreduce", poll_interval=60.0,
                                                   deadline=time.monotonic() + 600, reason_of_abort=lambda: "view 3"))
    while not work.callbacks:
        time.sleep(0.001)
    abort.set()
    t.join(10)
    assert len(out) == 1 and isinstance(out[0], CollectiveAborted) and out[0].reason == "aborted", out
    assert work.calls == 1


def test_an_alarm_sets_what_it_watches_and_forgets_the_completed() -> None:
    alarm, a, b = Alarm(), threading.Event(), threading.Event()
    alarm.watch(a)
    a.set()  # completed: dropped at the next watch
    alarm.watch(b)
    assert alarm._watched == [b]
    alarm.set()
    assert b.is_set() and alarm._watched == []
    late = threading.Event()
    alarm.watch(late)  # watched after the abort: set at once
    assert late.is_set()


def test_epochs_must_grow_and_late_aborts_miss_new_groups() -> None:
    store, _ = start_store_server(HOST)
    groups = EpochGroups(store, timeout=5)
    g3 = groups.build(3, 0, 1)
    with pytest.raises(ConfigError, match="never be reused"):
        groups.build(3, 0, 1)
    g4 = groups.build(4, 0, 1)
    assert groups.graveyard == [g3] and g3.aborted
    assert groups.abort(3) is False and not g4.aborted
    with pytest.raises(ConfigError):
        EpochGroups(store, backend="mpi")


# ------------------------------------------------------------------------------------------------
# two real gloo ranks in one process (threads): fast checks of abort latency and poisoning


def two_ranks(port: int, epoch: int, groups: list[EpochGroups]) -> list[Any]:
    out: list[Any] = [None, None]

    def build(r: int) -> None:
        out[r] = groups[r].build(epoch, r, 2)

    t = threading.Thread(target=build, args=(1,))
    t.start()
    build(0)
    t.join(10)
    return out


def test_a_group_builds_on_a_sealed_store_and_a_timeout_names_the_missing_ranks() -> None:
    from gossiprec.trainer.keys import TransferKeys

    keys = TransferKeys.fixed(bytes(range(32)))
    store, port = start_store_server(HOST)
    groups = [EpochGroups(connect_store(HOST, port), timeout=10, host=HOST, keys=keys) for _ in range(2)]
    g0, g1 = two_ranks(port, 0, groups)
    a, b = torch.tensor([1.0]), torch.tensor([3.0])
    pending = g1.allreduce(b, async_op=True)
    g0.allreduce(a)
    pending.wait()
    assert a.item() == b.item() == 4.0
    raw = store.get("gossiprec/e0/arrived/1")
    assert raw != b"1" and len(raw) > 1  # every value in the store is sealed
    # a build whose other rank never comes: the error says which one is missing
    lonely = EpochGroups(connect_store(HOST, port), timeout=10, host=HOST, keys=keys)
    with pytest.raises(CollectiveAborted) as info:
        lonely.build(1, 0, 3, timeout=0.5)
    assert info.value.reason == "timeout" and info.value.missing == (1, 2)
    assert "ranks [1, 2] never arrived" in str(info.value)


def test_a_gloo_reduce_scatter_whose_peer_never_joins_ends_at_the_abort() -> None:
    """FSDP2's reduce-scatter on gloo: a rank in it whose peer left for a recovery without issuing its
    half was held until the group's timeout (here 10 s, 30 s in a job) and removed as hung. The
    agent's abort now ends the wait."""
    store, port = start_store_server(HOST)
    groups = [EpochGroups(connect_store(HOST, port), timeout=10) for _ in range(2)]
    g0, g1 = two_ranks(port, 0, groups)
    import torch.distributed as dist

    out, stranded = torch.empty(4), torch.ones(8)
    work = g0.pg._reduce_scatter_base(out, stranded, dist.ReduceScatterOptions())
    threading.Timer(0.1, lambda: groups[0].abort(0, "view 1 installed")).start()
    t0 = time.monotonic()
    with pytest.raises(CollectiveAborted, match="view 1 installed") as info:
        wait_interruptible(work, g0.abort_event, epoch=0, op="_reduce_scatter_base",
                           reason_of_abort=lambda: g0.abort_reason, deadline=t0 + 10)
    assert info.value.reason == "aborted" and time.monotonic() - t0 < 5.0
    # the peer joins late and completes it: nothing is left hung whose destructor would block
    g1.pg._reduce_scatter_base(torch.empty(4), torch.ones(8), dist.ReduceScatterOptions()).wait()
    work.wait()
    assert torch.equal(out, torch.full((4,), 2.0))


def test_in_process_collectives_abort_and_reform() -> None:
    store, port = start_store_server(HOST)
    groups = [EpochGroups(connect_store(HOST, port), timeout=10) for _ in range(2)]
    g0, g1 = two_ranks(port, 0, groups)
    a, b = torch.tensor([1.0, 2.0]), torch.tensor([3.0, 4.0])
    pending = g1.allreduce(b, op="avg", async_op=True)
    g0.allreduce(a, op="avg")
    pending.wait()
    assert torch.equal(a, torch.tensor([2.0, 3.0])) and torch.equal(b, a)
    x, y = torch.zeros(3), torch.arange(3.0)
    pending = g1.broadcast(y, src=1, async_op=True)
    g0.broadcast(x, src=1)
    pending.wait()
    assert torch.equal(x, torch.arange(3.0))

    # rank 1 never joins this allreduce: only the agent's abort gets rank 0 out, and fast
    fired: list[float] = []

    def agent() -> None:
        fired.append(time.monotonic())
        groups[0].abort(0, "rank 1 is hung")

    stranded = torch.ones(2)
    pending = g0.allreduce(stranded, async_op=True)
    timer = threading.Timer(0.05, agent)  # the agent's decision, from another thread
    timer.start()
    with pytest.raises(CollectiveAborted, match="rank 1 is hung") as info:
        pending.wait()
    # the agent's abort ended the wait, not the 10 s collective timeout (the latency is benchmark figure)
    assert info.value.reason == "aborted" and time.monotonic() >= fired[0]
    with pytest.raises(CollectiveAborted, match="was aborted"):  # poisoned from now on
        g0.barrier()
    # the "hung" rank wakes up and completes the old collective: the aborted group still writes
    # into the tensor it was given (why such tensors must not be reused), and is no longer hung, so
    # this test leaves nothing whose destructor would block
    late = g1.allreduce(torch.ones(2), async_op=True)
    late.wait()
    pending.work.wait()
    assert torch.equal(stranded, torch.full((2,), 2.0))

    g0, g1 = two_ranks(port, 1, groups)
    a, b = torch.ones(2), torch.ones(2)
    pending = g1.allreduce(b, async_op=True)
    g0.allreduce(a)
    pending.wait()
    assert torch.equal(a, torch.full((2,), 2.0))
    assert [g.epoch for g in groups[0].graveyard] == [0]


# ------------------------------------------------------------------------------------------------
# three processes and a hot spare


def _worker(port: int, rank: int, role: str, mode: str) -> None:
    """Runs in a spawned process; reports to the test through the store, then exits hard."""
    store = connect_store(HOST, port, timeout=30)

    def report(key: str, **obj: Any) -> None:
        store.set(f"res/{key}", json.dumps(obj))

    def await_key(key: str) -> None:
        store.wait([key], timedelta(seconds=30))

    try:
        groups = EpochGroups(store, timeout=10)
        if role != "spare":
            g = groups.build(0, rank, 3)
            t = torch.full((2,), float(rank + 1))
            g.allreduce(t)
            b = torch.full((1,), float(rank))
            g.broadcast(b, src=1)
            g.barrier()
            report(f"e0/{rank}", sum=t.tolist(), bcast=b.item())
            if role == "victim":
                if mode == "kill":  # join a long collective, then get killed in the middle of it
                    g.allreduce(torch.ones(BIG), async_op=True)
                store.set("victim/ready", "1")
                await_key("never")  # SIGKILLed or SIGSTOPped in here
            event_at: list[float] = []

            def agent() -> None:  # the agent side: another thread, another store client
                connect_store(HOST, port, timeout=30).wait(["abort/0"], timedelta(seconds=30))
                event_at.append(time.monotonic())
                groups.abort(0, "rank 2 is gone or hung")

            threading.Thread(target=agent, daemon=True).start()
            pending = g.allreduce(torch.ones(BIG if mode == "kill" else 1), async_op=True)
            store.set(f"inflight/{rank}", "1")
            try:
                pending.wait()  # type: ignore[union-attr]
                report(f"abort/{rank}", reason="completed?!")
            except CollectiveAborted as exc:
                report(f"abort/{rank}", reason=exc.reason, at=time.monotonic(),
                       event_at=event_at[0] if event_at else None, cause=repr(exc.__cause__)[:200])
        else:
            await_key("go/1")
        g1 = groups.build(1, rank, 3)
        t = torch.full((2,), float(rank + 1))
        g1.allreduce(t)
        b = torch.full((1,), float(rank))
        g1.broadcast(b, src=2)  # from the process that just joined
        g1.barrier()
        report(f"e1/{rank}", sum=t.tolist(), bcast=b.item(), graveyard=len(groups.graveyard))
    except BaseException as exc:  # surfaced by the test on timeout
        report(f"error/{rank}/{role}", error=repr(exc)[:500])
    finally:
        os._exit(0)  # never run a hung group's destructor at interpreter exit


class Cluster:
    def __init__(self, mode: str) -> None:
        self.store, self.port = start_store_server(HOST, timeout=30)
        ctx = mp.get_context("forkserver")  # imports torch once, then forks each rank in ms
        ctx.set_forkserver_preload(["torch", "torch.distributed", "gossiprec.trainer.collectives.groups"])
        roles = [(0, "survivor"), (1, "survivor"), (2, "victim"), (2, "spare")]
        self.procs = {role if role != "survivor" else f"r{rank}":
                      ctx.Process(target=_worker, args=(self.port, rank, role, mode), daemon=True)
                      for rank, role in roles}
        for p in self.procs.values():
            p.start()

    def get(self, key: str, timeout: float = 20.0) -> Any:
        try:
            self.store.wait([f"res/{key}"], timedelta(seconds=timeout))
        except Exception as exc:
            errors = [f"{k}: {self.store.get(k).decode()}" for k in
                      (f"res/error/{r}/{role}" for r, role in
                       [(0, "survivor"), (1, "survivor"), (2, "victim"), (2, "spare")])
                      if self.store.check([k])]
            raise AssertionError(f"no {key} from the workers; errors: {errors}") from exc
        return json.loads(self.store.get(f"res/{key}"))

    def wait_keys(self, *keys: str, timeout: float = 20.0) -> None:
        self.store.wait(list(keys), timedelta(seconds=timeout))

    def close(self) -> None:
        for p in self.procs.values():
            p.kill()  # SIGKILL; a worker that exited meanwhile is fine (no ProcessLookupError race)
        for p in self.procs.values():
            p.join(10)


@pytest.fixture
def cluster(request: pytest.FixtureRequest) -> Iterator[Cluster]:
    c = Cluster(request.param)
    try:
        yield c
    finally:
        c.close()


def check_epochs(c: Cluster) -> None:
    for r in (0, 1):
        assert c.get(f"e0/{r}") == {"sum": [6.0, 6.0], "bcast": 1.0}
    for r in (0, 1, 2):  # survivors plus the new process
        e1 = c.get(f"e1/{r}")
        assert e1["sum"] == [6.0, 6.0] and e1["bcast"] == 2.0
        assert e1["graveyard"] == (1 if r < 2 else 0)


@pytest.mark.parametrize("cluster", ["kill"], indirect=True)
def test_sigkill_mid_collective_then_new_epoch_with_a_spare(cluster: Cluster) -> None:
    cluster.wait_keys("res/e0/2", "victim/ready", "inflight/0", "inflight/1")
    victim = cluster.procs["victim"]
    killed_at = time.monotonic()
    os.kill(victim.pid, signal.SIGKILL)  # type: ignore[arg-type]
    # gloo usually reports the reset connection itself when the victim was already
    # exchanging data; when it died before its first byte, survivors wait on each other and only the
    # agent's abort frees them. The test plays the agent, which would have noticed the death anyway.
    try:
        cluster.wait_keys("res/abort/0", "res/abort/1", timeout=1.0)
    except Exception:
        cluster.store.set("abort/0", "1")
    for r in (0, 1):
        out = cluster.get(f"abort/{r}")
        assert out["reason"] in ("peer_failed", "aborted"), out
        if out["reason"] == "peer_failed":
            assert "RuntimeError" in out["cause"]
        assert out["at"] >= killed_at, out  # the group's 10 s timeout would say "timeout"
    cluster.store.set("go/1", "1")
    check_epochs(cluster)


@pytest.mark.parametrize("cluster", ["stop"], indirect=True)
def test_sigstop_then_agent_abort_then_new_epoch_with_a_spare(cluster: Cluster) -> None:
    cluster.wait_keys("res/e0/2", "victim/ready", "inflight/0", "inflight/1")
    victim = cluster.procs["victim"]
    os.kill(victim.pid, signal.SIGSTOP)  # type: ignore[arg-type]
    cluster.store.set("abort/0", "1")  # what the agents would decide
    for r in (0, 1):
        out = cluster.get(f"abort/{r}")
        assert out["reason"] == "aborted", out
        assert out["at"] >= out["event_at"], out  # ended by the abort event, not by a timeout
    cluster.store.set("go/1", "1")
    check_epochs(cluster)  # the stopped rank is still alive and hung in the old group
