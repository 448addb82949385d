"""One torch.distributed process group per membership epoch, with collectives an agent can interrupt.

Theory of operation
-------------------
Recovery in place means the surviving processes keep running and switch to a new group when the
membership changes; nobody calls ``init_process_group`` again. :class:`EpochGroups` builds, for each
epoch the agent decides, a standalone backend (``ProcessGroupGloo`` on a device bound to this member's
address, or ``ProcessGroupNCCL`` with non-blocking communicators) on ``PrefixStore("gossiprec/e{epoch}",
store)``. The store is a TCPStore hosted by whichever process the recovery plan names
(:func:`start_store_server` in that process, :func:`connect_store` everywhere else, connected from the
build's own thread so that a store host that is late or gone delays only a build that can be
cancelled); the per-epoch prefix keeps keys of an old group from leaking into a new one, so one store
serves every epoch. Given the cluster's keys, every value goes through a
:func:`~gossiprec.trainer.keys.sealed_store` (authenticated: a TCPStore has none). Each rank marks its
arrival in the epoch's store first, so a build that times out names the ranks that never came.

Collectives are issued asynchronously and waited for against the group's abort event
(:meth:`EpochGroup.abort`, set by the agent from another thread). On gloo the first slice is
``work.wait(timeout)``; a longer wait then sleeps on an event that the work's future and the abort both
set (:class:`Alarm`). Gloo's reduce-scatters have no future and run inside ``wait()``, whatever its
timeout: a waiter thread runs that wait and sets the event (about 0.12 ms per reduce-scatter here, the
price of being interruptible; a waiter held by a peer that never comes stays until gloo's timeout).
Elsewhere it is ``work.is_completed()`` polled with ``Event.wait``. Either way an
abort is seen within one slice (5 ms by default) and raises :class:`CollectiveAborted`; so does the
backend's own error when a peer dies (gloo reports a reset connection; the original exception is the
``__cause__``) and a per-call ``timeout``. A group that raised is poisoned: every later collective on
it raises at once. Gloo's own report is best effort: it comes only when the dead rank was exchanging
data with this one; a rank that died before its first byte, or a rank waiting on another survivor,
hangs until the timeout. The agent's abort is what bounds recovery time.

Two facts of torch's gloo backend shape the design: abort/shutdown/destroy of a group from another
thread does not unblock a thread stuck in it, and dropping the last reference to a hung group blocks
for a long time in its destructor. So retired groups, and the work and tensors still pending on them,
go to :attr:`EpochGroups.graveyard` and are never destroyed; a new group comes up beside them.
A process whose graveyard holds a hung group should leave with ``os._exit`` (interpreter teardown
would run that destructor). A tensor given to a collective that was aborted may still be written by
the dead group later: do not reuse it for the next step.

NCCL (not run in CI; ``tests/test_groups_nccl.py`` covers it where CUDA is, two ranks only with two
GPUs, as NCCL refuses two ranks on one GPU): communicators are created with
``config.blocking = False`` so that :meth:`EpochGroup.abort` can call ``pg.abort()`` without hanging,
and ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` must be 0 or 2 (the default, 3, kills the process on a
timeout); building an NCCL group refuses otherwise, and refuses without CUDA.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable

from gossiprec.errors import ConfigError, RecoveryError

if TYPE_CHECKING:
    import torch
    import torch.distributed as dist

    from gossiprec.trainer.keys import TransferKeys

STORE_PREFIX = "gossiprec/e{epoch}"
BACKENDS = ("gloo", "nccl")
REDUCE_OPS = ("sum", "avg", "max", "min", "product")


class CollectiveAborted(RecoveryError):
    """A collective did not complete: aborted by the agent, a peer failed, or it timed out.

    ``reason`` is "aborted", "peer_failed" or "timeout"; the backend's exception, if any, is the cause.
    The group is unusable afterwards: build the next epoch's group.
    """

    def __init__(self, message: str, *, epoch: int, op: str, reason: str,
                 missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.epoch = epoch
        self.op = op
        self.reason = reason
        self.missing = missing
        """For a build that timed out: the ranks that never marked their arrival in the epoch's store."""


def store_prefix(epoch: int) -> str:
    return STORE_PREFIX.format(epoch=epoch)


def start_store_server(host: str = "0.0.0.0", port: int = 0, *, timeout: float = 30.0
                       ) -> tuple[dist.TCPStore, int]:
    """Host a TCPStore in this process (any rank may); returns the store and the port it listens on.

    It listens on ``host`` alone: torch's TCPStore server binds every interface whatever host it is
    given, so the socket is bound here and handed over. ``port=0`` picks a free port. The server does
    not wait for workers; clients connect with :func:`connect_store`. It lives as long as the returned
    object does.
    """
    import socket

    import torch.distributed as dist

    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=1024)
    bound = int(sock.getsockname()[1])
    store = dist.TCPStore(host, bound, None, True, timedelta(seconds=timeout), wait_for_workers=False,
                          master_listen_fd=sock.detach())
    return store, bound


def connect_store(host: str, port: int, *, timeout: float = 30.0) -> dist.TCPStore:
    """A client of the TCPStore at ``host:port``; ``timeout`` bounds every store operation."""
    import torch.distributed as dist

    return dist.TCPStore(host, port, None, False, timedelta(seconds=timeout))


def _reduce_op(op: str) -> Any:
    import torch.distributed as dist

    table = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.AVG, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN, "product": dist.ReduceOp.PRODUCT}
    if op not in table:
        raise ConfigError(f"unknown reduce op {op!r}; use one of {REDUCE_OPS}")
    return table[op]


def wait_interruptible(work: Any, abort: threading.Event, *, epoch: int, op: str,
                       poll_interval: float = 0.005, deadline: float | None = None,
                       blocking_wait: bool = True, reason_of_abort: Callable[[], str] = lambda: "",
                       slow_after: float | None = None, on_slow: Callable[[], None] | None = None) -> None:
    """Wait for ``work`` (a ``torch.distributed.Work``) unless ``abort`` is set or ``deadline`` passes.

    ``blocking_wait``: a first slice of ``work.wait(poll_interval)``, then waits on an event the work's
    future sets (gloo: completion wakes either at once); a work without a future (gloo's reduce-scatters,
    which run inside ``wait`` whatever its timeout) is waited by a waiter thread that sets such an event;
    otherwise poll ``work.is_completed()`` (NCCL: ``wait`` does not block the host). ``on_slow()`` is
    called once, from this thread, when the work is still pending ``slow_after`` seconds in (the
    trainer tells its agent it is alive and waiting on peers). Raises :class:`CollectiveAborted` with
    reason "aborted", "timeout" or "peer_failed" (backend error as cause).
    """
    slice_ = timedelta(seconds=poll_interval)
    backoff = min(poll_interval, 0.0001)
    done: threading.Event | None = None
    if blocking_wait and not _has_future(work):
        # gloo's reduce-scatters: the collective runs inside wait(), whatever its timeout (a peer that
        # left for the recovery without issuing its half held this rank for the group's timeout, and
        # the agents removed it as hung); a waiter thread runs it, this one waits for it or the abort
        done = _waiter_event(work, abort)
    slow_at = time.monotonic() + slow_after if on_slow is not None and slow_after is not None else None
    while True:
        if slow_at is not None and time.monotonic() >= slow_at:
            slow_at = None
            assert on_slow is not None
            on_slow()
        if abort.is_set():
            if isinstance(done, _Waited) and done.ran:  # done before the abort: a complete result is still good
                _raise_failed(done.error, epoch, op)
                return
            if work.is_completed():
                _finish(work, epoch, op, None)
                return
            why = reason_of_abort()
            raise CollectiveAborted(f"{op} of epoch {epoch} aborted by the agent"
                                    + (f": {why}" if why else ""), epoch=epoch, op=op, reason="aborted")
        if deadline is not None and time.monotonic() >= deadline:
            raise CollectiveAborted(f"{op} of epoch {epoch} timed out; a peer is hung or gone",
                                    epoch=epoch, op=op, reason="timeout")
        if blocking_wait:
            if done is None:  # a timed native wait: returns as the work completes
                try:
                    work.wait(slice_)
                    return
                except RuntimeError as exc:
                    if work.is_completed():
                        _finish(work, epoch, op, exc)
                        return
                    done = _completion_event(work, abort)  # the slice ran out: the rest waits on the future
                    continue
            # until the work completes or the abort wakes us (an Alarm does), or the next timer is due
            due = [t for t in (slow_at, deadline) if t is not None]
            ahead = min(due) - time.monotonic() if due else None
            if done.wait(poll_interval if not isinstance(abort, Alarm) else ahead):
                if isinstance(done, _Waited) and done.ran:
                    _raise_failed(done.error, epoch, op)
                    return
                if work.is_completed() or not abort.is_set():
                    _finish(work, epoch, op, None)
                    return
            continue
        if work.is_completed():
            _finish(work, epoch, op, None)
            return
        abort.wait(backoff)
        backoff = min(poll_interval, backoff * 2)


class Alarm(threading.Event):
    """An abort event that also sets the events of the waits it watches (:meth:`watch`), so that a long
    wait sleeps until its work completes or this is set, without a wake-up every poll slice."""

    def __init__(self) -> None:
        super().__init__()
        self._watched: list[threading.Event] = []
        self._watch_lock = threading.Lock()

    def watch(self, event: threading.Event) -> None:
        with self._watch_lock:
            self._watched = [e for e in self._watched if not e.is_set()]  # the completed ones go
            self._watched.append(event)
        if self.is_set():
            event.set()

    def set(self) -> None:
        super().set()
        with self._watch_lock:
            watched, self._watched = self._watched, []
        for event in watched:
            event.set()


def _has_future(work: Any) -> bool:
    """Whether ``work`` has a future (1-2 us; 20 us when it raises, for the works that have none)."""
    try:
        work.get_future()
    except (RuntimeError, AttributeError, NotImplementedError):
        return False
    return True


def _completion_event(work: Any, abort: threading.Event) -> threading.Event:
    """An event set when ``work`` (one that has a future) completes or fails, from its future's
    callback; an :class:`Alarm` ``abort`` sets it too. The rest of a long wait sleeps on
    it: timed ``work.wait`` slices that run out raise a C++ error each, 80-150 us of CPU here (four ranks
    waiting on each other every step paid that on two cores). A short wait stays one native wait: the
    callback's trip through the GIL costs ~190 us per collective."""
    event = threading.Event()
    work.get_future().add_done_callback(lambda _f: event.set())
    if isinstance(abort, Alarm):
        abort.watch(event)
    return event


class _Waited(threading.Event):
    """Set when a waiter thread's ``work.wait()`` returned (``ran``; ``error``: what it raised), or by an
    :class:`Alarm`."""

    def __init__(self) -> None:
        super().__init__()
        self.ran = False
        self.error: RuntimeError | None = None


class _Waiter:
    """A daemon thread that runs untimed ``work.wait()`` calls one at a time. A waiter stuck in a work
    whose peer never comes stays with it until the backend's own timeout ends the wait (it keeps the
    work and its tensors alive meanwhile); other waits take another waiter."""

    _idle: list[_Waiter] = []
    _lock = threading.Lock()

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[tuple[Any, _Waited]] = queue.SimpleQueue()
        threading.Thread(target=self._run, name="gossiprec-waiter", daemon=True).start()

    @classmethod
    def submit(cls, work: Any, event: _Waited) -> None:
        with cls._lock:
            waiter = cls._idle.pop() if cls._idle else None
        (waiter or cls())._jobs.put((work, event))

    def _run(self) -> None:
        while True:
            work, event = self._jobs.get()
            try:
                work.wait()
            except RuntimeError as exc:
                event.error = exc
            event.ran = True
            event.set()
            del work, event
            with self._lock:
                self._idle.append(self)


def _waiter_event(work: Any, abort: threading.Event) -> _Waited:
    """Run ``work.wait()`` on a :class:`_Waiter`; the event it sets when that returns (an
    :class:`Alarm` ``abort`` sets it too)."""
    event = _Waited()
    _Waiter.submit(work, event)
    if isinstance(abort, Alarm):
        abort.watch(event)
    return event


def _raise_failed(error: RuntimeError | None, epoch: int, op: str) -> None:
    if error is not None:
        raise CollectiveAborted(f"{op} of epoch {epoch} failed: a peer died or closed its connection "
                                f"({str(error).splitlines()[0][:200]})", epoch=epoch, op=op,
                                reason="peer_failed") from error


def _finish(work: Any, epoch: int, op: str, first: BaseException | None) -> None:
    """The work completed: return if it succeeded, else raise CollectiveAborted from its error."""
    try:
        work.wait()
    except RuntimeError as exc:
        _raise_failed(exc, epoch, op)


class PendingCollective:
    """An issued collective; :meth:`wait` blocks interruptibly (see :func:`wait_interruptible`)."""

    def __init__(self, group: EpochGroup, op: str, work: Any, tensor: torch.Tensor | None,
                 after: Callable[[], None] | None, deadline: float | None) -> None:
        self.group = group
        self.op = op
        self.work = work
        self.tensor = tensor
        self._after = after
        self._deadline = deadline
        self._done = False

    def done(self) -> bool:
        return self._done or bool(self.work.is_completed())

    def wait(self, *, slow_after: float | None = None, on_slow: Callable[[], None] | None = None) -> None:
        """Block until done (see :func:`wait_interruptible`, also for ``slow_after`` / ``on_slow``)."""
        if self._done:
            return
        g = self.group
        t0 = time.monotonic()
        try:
            wait_interruptible(self.work, g.abort_event, epoch=g.epoch, op=self.op,
                               poll_interval=g.poll_interval, deadline=self._deadline,
                               blocking_wait=g.backend == "gloo", reason_of_abort=lambda: g.abort_reason,
                               slow_after=slow_after, on_slow=on_slow)
        except CollectiveAborted as exc:
            g.abort(f"{self.op} raised: {exc}")  # poison the group; keep the work referenced there
            raise
        # how long this rank waited for its peers here (a clock pair, no collective): the rank the others
        # wait for waits least; its agents compare the figures to find stragglers
        g.waited_s += time.monotonic() - t0
        g._forget(self)
        self._done = True
        if self._after is not None:
            self._after()


class EpochGroup:
    """The process group of one epoch, with interruptible collectives; built by :class:`EpochGroups`."""

    def __init__(self, epoch: int, rank: int, world_size: int, backend: str, *,
                 poll_interval: float, timeout: float) -> None:
        self.epoch = epoch
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.poll_interval = poll_interval
        self.timeout = timeout
        self.pg: Any = None
        self.abort_event = Alarm()
        self.abort_reason = ""
        self.waited_s = 0.0
        """Seconds spent inside :meth:`PendingCollective.wait` on this group so far (the straggler check's
        measure: a rank that arrives last at a collective waits least)."""
        self._lock = threading.Lock()
        self._pending: list[PendingCollective] = []

    def __repr__(self) -> str:
        state = f"aborted: {self.abort_reason}" if self.abort_event.is_set() else "live"
        return (f"EpochGroup(epoch={self.epoch}, rank={self.rank}/{self.world_size}, {self.backend}, "
                f"{state})")

    @property
    def aborted(self) -> bool:
        return self.abort_event.is_set()

    def abort(self, reason: str = "") -> None:
        """Make every current and future collective on this group raise. Thread-safe, idempotent.

        For NCCL this also aborts the communicators (non-blocking, so it returns promptly).
        """
        with self._lock:
            if self.abort_event.is_set():
                return
            self.abort_reason = reason
            self.abort_event.set()
        if self.backend == "nccl" and self.pg is not None:
            try:
                self.pg.abort()
            except RuntimeError:
                pass

    def _forget(self, pending: PendingCollective) -> None:
        with self._lock:
            if pending in self._pending:
                self._pending.remove(pending)

    def _issue(self, op: str, start: Callable[[], Any], tensor: torch.Tensor | None,
               after: Callable[[], None] | None, timeout: float | None, async_op: bool
               ) -> PendingCollective | None:
        if self.abort_event.is_set():
            raise CollectiveAborted(f"{op} on epoch {self.epoch}'s group, which was aborted "
                                    f"({self.abort_reason}); build the next epoch's group", epoch=self.epoch,
                                    op=op, reason="aborted")
        if self.pg is None:
            raise ConfigError(f"epoch {self.epoch}'s group is not built yet")
        t = self.timeout if timeout is None else timeout
        try:
            work = start()
        except RuntimeError as exc:
            self.abort(f"{op} could not be issued: {exc}")
            raise CollectiveAborted(f"{op} on epoch {self.epoch} could not be issued: {exc}",
                                    epoch=self.epoch, op=op, reason="peer_failed") from exc
        pending = PendingCollective(self, op, work, tensor, after, time.monotonic() + t)
        with self._lock:
            self._pending.append(pending)
        if async_op:
            return pending
        pending.wait()
        return None

    def allreduce(self, tensor: torch.Tensor, op: str = "sum", *, timeout: float | None = None,
                  async_op: bool = False) -> PendingCollective | None:
        """All-reduce ``tensor`` in place. ``op``: sum, avg, max, min, product."""
        import torch.distributed as dist

        opts = dist.AllreduceOptions()
        after: Callable[[], None] | None = None
        if op == "avg" and self.backend == "gloo":  # gloo has no AVG
            opts.reduceOp = _reduce_op("sum")
            ws = self.world_size

            def after() -> None:
                tensor.div_(ws)
        else:
            opts.reduceOp = _reduce_op(op)
        return self._issue("allreduce", lambda: self.pg.allreduce([tensor], opts), tensor, after, timeout,
                           async_op)

    def broadcast(self, tensor: torch.Tensor, src: int, *, timeout: float | None = None,
                  async_op: bool = False) -> PendingCollective | None:
        """Broadcast ``tensor`` from rank ``src`` of this epoch's group, in place."""
        import torch.distributed as dist

        if not 0 <= src < self.world_size:
            raise ConfigError(f"broadcast source {src} is not a rank of a {self.world_size}-rank group")
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        opts.rootTensor = 0
        return self._issue("broadcast", lambda: self.pg.broadcast([tensor], opts), tensor, None, timeout,
                           async_op)

    def barrier(self, *, timeout: float | None = None) -> None:
        import torch.distributed as dist

        self._issue("barrier", lambda: self.pg.barrier(dist.BarrierOptions()), None, None, timeout, False)


class EpochGroups:
    """Builds each epoch's group on a shared store and keeps every retired one alive (the graveyard).

    ``store`` is a TCPStore client (or server) object (None: each build connects its own);
    ``timeout`` (seconds) bounds group construction and is the default per-collective timeout;
    ``poll_interval`` (seconds) is how often a waiting collective looks at its abort event. ``device``
    is the CUDA device for NCCL. ``host``: the address gloo's connections bind to (default: what the
    host name resolves to). ``keys``: seal every store value with the cluster's keys (see
    :mod:`gossiprec.trainer.keys`); ``seal_context``: the store prefix the caller added below the epoch's
    (the seal covers it too).
    """

    def __init__(self, store: dist.Store | None, *, backend: str = "gloo", timeout: float = 30.0,
                 poll_interval: float = 0.005, device: torch.device | int | None = None,
                 host: str | None = None, keys: TransferKeys | None = None, seal_context: str = "") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 0 < poll_interval <= 1.0 or timeout <= 0:
            raise ConfigError("poll_interval must be in (0, 1] s and timeout > 0 s")
        if backend == "nccl":
            check_nccl_environment()
        self.store = store
        self.host = host
        self.keys = keys
        self.seal_context = seal_context
        self._sealed: dict[int, Any] = {}
        """The sealed wrapper of each store (by id): the Python objects must outlive every group built on
        them (the C++ side calls back into them)."""
        self._stores_seen: list[Any] = []
        self.backend = backend
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.device = device
        self.current: EpochGroup | None = None
        self.graveyard: list[EpochGroup] = []
        self._building: EpochGroup | None = None
        self._lock = threading.Lock()

    def build(self, epoch: int, rank: int, world_size: int, *, store: dist.Store | None = None,
              connect: Callable[[], dist.Store] | None = None, cancelled: Callable[[], str] | None = None,
              timeout: float | None = None) -> EpochGroup:
        """Retire the current group and build epoch ``epoch``'s (blocks until all ranks joined).

        Construction runs in a helper thread; an :meth:`abort` of this epoch, the build's timeout
        (``timeout``, default the groups' ``timeout``), or ``cancelled()`` returning a reason (polled every
        ``poll_interval``: it closes the window in which an abort sent before the build began would be
        missed, e.g. a newer view) makes this raise :class:`CollectiveAborted` promptly and leaves the
        half-built group in the graveyard; a timeout names the ranks that never arrived. ``store``
        replaces the shared store (e.g. the plan moved it to another host); ``connect()`` makes it in
        the helper thread instead (a client that may have to wait for its server).
        """
        if not 0 <= rank < world_size:
            raise ConfigError(f"rank {rank} is not in [0, {world_size})")
        with self._lock:
            last = max([g.epoch for g in self.graveyard] + ([self.current.epoch] if self.current else []),
                       default=-1)
            if epoch <= last:
                raise ConfigError(f"epoch {epoch} is not newer than epoch {last}: group store prefixes must "
                                  "never be reused")
            if store is not None:
                self.store = store
            given = self.store
            self._retire_locked(f"superseded by epoch {epoch}")
            group = EpochGroup(epoch, rank, world_size, self.backend, poll_interval=self.poll_interval,
                               timeout=self.timeout)
            self._building = group
        import torch.distributed as dist

        limit = self.timeout if timeout is None else timeout
        outcome: list[BaseException | None] = []
        done = threading.Event()
        prefixed: list[Any] = []

        def construct() -> None:
            try:
                built_on = connect() if connect is not None else given
                if built_on is None:
                    raise ConfigError(f"no store to build epoch {epoch}'s group on")
                with self._lock:
                    # a build given up meanwhile (a newer view) must not swap the newer build's store for its
                    # own when its connect() returns late: the epoch's other groups are built on self.store
                    if connect is not None and self._building is group:
                        self.store = built_on
                prefixed.append(dist.PrefixStore(store_prefix(epoch), self._sealed_store(built_on)))
                prefixed[0].set(f"arrived/{rank}", b"1")
                group.pg = self._make_backend(prefixed[0], rank, world_size, limit)
                outcome.append(None)
            except BaseException as exc:  # reported to the caller below
                outcome.append(exc)
            done.set()

        builder = threading.Thread(target=construct, name=f"gossiprec-build-e{epoch}", daemon=True)
        builder.start()
        deadline = time.monotonic() + limit
        while not done.wait(self.poll_interval):
            why_cancelled = cancelled() if cancelled is not None else ""
            if why_cancelled:
                group.abort(why_cancelled)
            if group.abort_event.is_set() or time.monotonic() >= deadline:
                missing: tuple[int, ...] = ()
                why = group.abort_reason
                reason = "aborted"
                if not why:
                    reason = "timeout"
                    missing = _missing(prefixed, world_size)
                    who = (f"ranks {list(missing)} never arrived" if missing else
                           "the store could not be reached" if not prefixed else "every rank arrived")
                    why = f"not all {world_size} ranks joined within {limit:.1f}s ({who})"
                group.abort(why)
                with self._lock:
                    self._building = None
                    self.graveyard.append(group)
                raise CollectiveAborted(f"building epoch {epoch}'s group failed: {why}", epoch=epoch,
                                        op="build", reason=reason, missing=missing)
        err = outcome[0]
        with self._lock:
            self._building = None
            if err is not None or group.abort_event.is_set():
                self.graveyard.append(group)
            else:
                self.current = group
        if isinstance(err, ConfigError):
            raise err  # a misconfiguration (NCCL without CUDA, ...): no later plan can fix it
        if err is not None:
            raise CollectiveAborted(f"building epoch {epoch}'s group failed: {err}", epoch=epoch, op="build",
                                    reason="peer_failed") from err
        if group.abort_event.is_set():
            raise CollectiveAborted(f"building epoch {epoch}'s group was aborted: {group.abort_reason}",
                                    epoch=epoch, op="build", reason="aborted")
        return group

    def abort(self, epoch: int | None = None, reason: str = "") -> bool:
        """Abort the group of ``epoch`` (default: the current or the one being built). Thread-safe.

        Returns False when there is no such live group (a late abort for an old epoch is a no-op, so it
        cannot hit the next epoch's group).
        """
        with self._lock:
            candidates = [g for g in (self._building, self.current) if g is not None]
        for g in candidates:
            if epoch is None or g.epoch == epoch:
                g.abort(reason or "aborted by the agent")
                return True
        return False

    def shared_store(self) -> Any:
        """The store the last build used, sealed as the groups' own values are (for other groups of the epoch)."""
        if self.store is None:
            raise ConfigError("no store yet: build an epoch's group first")
        return self._sealed_store(self.store)

    def retire(self, reason: str = "retired") -> None:
        """Abort the current group and move it to the graveyard (e.g. before leaving the job)."""
        with self._lock:
            self._retire_locked(reason)

    def _retire_locked(self, reason: str) -> None:
        if self.current is not None:
            self.current.abort(reason)
            self.graveyard.append(self.current)
            self.current = None

    def _sealed_store(self, store: Any) -> Any:
        if self.keys is None:
            return store
        sealed = self._sealed.get(id(store))
        if sealed is None:
            from gossiprec.trainer.keys import sealed_store

            sealed = self._sealed[id(store)] = sealed_store(store, self.keys, self.seal_context)
            self._stores_seen.append(store)  # keeps the id from being reused by another store
        return sealed

    def _make_backend(self, store: dist.Store, rank: int, world_size: int, limit: float) -> Any:
        import torch.distributed as dist

        # the group's own timeout bounds its rendezvous too (gloo waits for its peers' addresses that long)
        timeout = timedelta(seconds=max(self.timeout, limit))
        if self.backend == "gloo":
            if self.host is None:
                return dist.ProcessGroupGloo(store, rank, world_size, timeout)
            opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # not in torch 2.13's stub
            opts._timeout = timeout
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=self.host)]
            return dist.ProcessGroupGloo(store, rank, world_size, opts)
        return make_nccl_backend(store, rank, world_size, timeout, self.device)


def _missing(prefixed: list[Any], world_size: int) -> tuple[int, ...]:
    """The ranks whose arrival mark is not in the epoch's store (empty if the store cannot be asked)."""
    if not prefixed:
        return ()
    try:
        return tuple(r for r in range(world_size) if not prefixed[0].check([f"arrived/{r}"]))
    except RuntimeError:
        return ()


def check_nccl_environment() -> None:
    """Refuse (ConfigError) a ``TORCH_NCCL_ASYNC_ERROR_HANDLING`` that makes NCCL kill the process on a
    timeout: the agent's abort must be able to end a collective instead (``gossiprec run`` sets 2)."""
    mode = os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    if mode not in ("0", "2"):
        raise ConfigError(f"TORCH_NCCL_ASYNC_ERROR_HANDLING={mode} makes NCCL kill the process on a timeout "
                          "instead of letting gossiprec recover; set it to 2 (or 0) before starting the trainer "
                          "(`gossiprec run` sets 2 unless the environment says otherwise)")


def make_nccl_backend(store: dist.Store, rank: int, world_size: int, timeout: timedelta,
                      device: torch.device | int | None = None) -> Any:
    """A ``ProcessGroupNCCL`` with non-blocking communicators, safe to :meth:`abort` from any thread.

    Refuses (ConfigError) without CUDA/NCCL and unless TORCH_NCCL_ASYNC_ERROR_HANDLING is 0 or 2.
    Not exercised in CI (no GPU there); ``tests/test_groups_nccl.py`` runs it where CUDA is.
    """
    import torch
    import torch.distributed as dist

    if not torch.cuda.is_available() or not dist.is_nccl_available():
        raise ConfigError("the NCCL backend needs CUDA and an NCCL build of torch; use backend='gloo'")
    check_nccl_environment()
    opts = dist.ProcessGroupNCCL.Options()
    opts.config.blocking = False
    opts._timeout = timeout
    pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
    if device is not None:
        pg.eager_connect_single_device(torch.device("cuda", device) if isinstance(device, int) else device)
    return pg
