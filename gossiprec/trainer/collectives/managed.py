"""Process groups that survive recovery: torch holds the same group objects while their backend changes.

Theory of operation
-------------------
FSDP2 modules, DTensors and a ``DeviceMesh`` keep references to their process groups, so recovery in
place cannot hand torch new group objects. :class:`ManagedGroup` is a ``torch.distributed.ProcessGroup``
subclass that torch creates once (through the ``gossiprec`` backend that :func:`init_managed_world`
registers and makes the default one) and that forwards every collective to the backend of the current
epoch: a gloo group (CPU tensors), or an NCCL one with non-blocking communicators (CUDA tensors; a
world made with ``backend="nccl"``), built by :meth:`ManagedWorld.configure` on ``PrefixStore`` of the
epoch and the group's key, kept in an :class:`~gossiprec.trainer.collectives.groups.EpochGroups` per managed group.
NCCL's collectives are waited by polling their completion (its ``wait`` does not block the host), and
an abort also aborts its communicators.

The mesh has a fixed shape; a replacement process takes the lost rank's place (same global rank, same
coordinate), so every group keeps its rank and size across epochs, and torch's own bookkeeping
(``get_rank``, the group-name registry that functional collectives use, mesh coordinates) stays true.
A group that changes rank or world size per epoch is for the caller's own collectives only
(:meth:`ManagedGroup.configure` with a new rank and size, on a group made with :meth:`ManagedGroup.standalone`):
torch's C++ side reads the size given at construction. A mesh that changes shape (a shrink drops replica
groups) is a new managed world: :func:`retire_managed_world` aborts and takes down the old one (kept
referenced), and :func:`init_managed_world` makes the new one, whose groups torch creates afresh.

Every collective returns a :class:`ManagedWork` whose ``wait`` runs :func:`groups.wait_interruptible`
against the epoch's abort event, whether torch waits from Python (FSDP2, ``dist.*``) or from C++
(functional collectives: DTensor redistribution, through the ProcessGroup trampoline). So
:meth:`ManagedWorld.abort`, called from another thread (the agent follower's), makes every blocked wait
raise :class:`~gossiprec.trainer.collectives.groups.CollectiveAborted` within a poll slice; afterwards every
collective on that epoch raises at once until the next :meth:`ManagedWorld.configure`. Retired
backends, and the work and tensors still pending on an aborted one, stay referenced in a graveyard and
are never destroyed (gloo's destructor blocks on a hung peer): a process with a hung backend should
leave with ``os._exit``. A tensor given to an aborted collective may still be written later: the
step that used it must be redone from saved state, not from that tensor.

Store keys: ``gossiprec/managed/{key}/gossiprec/e{epoch}`` on the shared store, where ``key`` is torch's
group name and the group's global ranks, which agree across processes that create their groups in
the same order (the same program); a replacement process must therefore create the same mesh in the
same order before its first :meth:`ManagedWorld.configure`.

Importing this module imports torch.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Callable, Sequence, cast

import torch
import torch.distributed as dist

from gossiprec.core.topology import JobTopology
from gossiprec.errors import ConfigError
from gossiprec.trainer.collectives.groups import (
    BACKENDS, CollectiveAborted, EpochGroup, EpochGroups, check_nccl_environment, wait_interruptible,
)
from gossiprec.trainer.keys import TransferKeys

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

BACKEND_NAME = "gossiprec"
KEY_PREFIX = "gossiprec/managed/"

# Every collective entry point of torch 2.13's ProcessGroup that torch.distributed, FSDP2 or the
# functional collectives call; each is forwarded to the epoch's backend and its Work wrapped.
FORWARDED = (
    "_allgather_base", "_reduce_scatter_base", "all_gather_single", "all_gather_single_coalesced",
    "all_to_all_single", "allgather", "allgather_coalesced", "allgather_into_tensor_coalesced", "allreduce",
    "allreduce_coalesced", "alltoall", "alltoall_base", "barrier", "broadcast", "gather", "recv",
    "recv_anysource", "reduce", "reduce_scatter", "reduce_scatter_single", "reduce_scatter_single_coalesced",
    "reduce_scatter_tensor_coalesced", "scatter", "send",
)


class ManagedWork(dist.Work):
    """A collective in flight on one epoch's backend; ``wait`` can be interrupted by an abort."""

    def __init__(self, group: ManagedGroup, epoch_group: EpochGroup, op: str, inner: Any,
                 keep: tuple[Any, ...]) -> None:
        super().__init__()
        self._group = group
        self._epoch_group = epoch_group
        self._op = op
        self._inner = inner
        self._keep = keep  # the tensors the backend may still write
        self._error: BaseException | None = None
        self._done = False

    def wait(self, timeout: timedelta | None = None) -> bool:
        if self._done:
            return True
        if self._error is not None:
            raise self._error
        eg = self._epoch_group
        limit = eg.timeout if timeout is None or timeout.total_seconds() <= 0 else timeout.total_seconds()
        world = self._group.world
        slowed = False

        def slow() -> None:
            nonlocal slowed
            slowed = True
            assert world is not None
            world._slow()

        try:
            wait_interruptible(self._inner, eg.abort_event, epoch=eg.epoch, op=self._op,
                               poll_interval=eg.poll_interval, deadline=time.monotonic() + limit,
                               blocking_wait=eg.backend == "gloo",
                               reason_of_abort=lambda: eg.abort_reason,
                               slow_after=world.slow_after if world is not None else None,
                               on_slow=slow if world is not None else None)
        except CollectiveAborted as exc:
            self._error = exc
            eg.abort(f"{self._op} on {self._group.describe()} raised: {exc}")
            self._group._bury(self)
            raise
        self._done = True
        self._keep = ()
        if slowed and world is not None and world.on_resume is not None:
            world.on_resume()  # out of the collective: no longer "waiting"
        return True

    def is_completed(self) -> bool:
        return self._done or self._error is not None or bool(self._inner.is_completed())

    def is_success(self) -> bool:
        return self._done

    def exception(self) -> Any:
        return self._error

    def get_future(self) -> Any:
        # A future completes only when the backend's work does: not interruptible; wait() is.
        return self._inner.get_future()

    def result(self) -> Any:
        return self._inner.result()

    def synchronize(self) -> None:
        self.wait()


class _Built:
    """What one epoch built for one group: the backend and torch's ProcessGroup around it."""

    __slots__ = ("epoch_group", "wrapper", "hung")

    def __init__(self, epoch_group: EpochGroup, wrapper: Any) -> None:
        self.epoch_group = epoch_group
        self.wrapper = wrapper
        self.hung: list[ManagedWork] = []


class ManagedGroup(dist.ProcessGroup):
    """A process group whose backend is replaced each epoch; torch sees one object for the whole job.

    Made by torch through the ``gossiprec`` backend (``init_process_group``, ``new_group``,
    ``init_device_mesh``) or by :meth:`standalone`. Collectives before the first :meth:`configure`, or
    after an abort, raise :class:`CollectiveAborted` (reason "aborted") or :class:`ConfigError`.
    """

    def __init__(self, rank: int, size: int, *, global_ranks: Sequence[int] | None = None,
                 timeout: float = 30.0, poll_interval: float = 0.005, world: ManagedWorld | None = None,
                 host: str | None = None, keys: TransferKeys | None = None, backend: str = "gloo") -> None:
        super().__init__(rank, size)  # type: ignore[call-arg]  # torch has (rank, size) too; its stub lacks it
        self.backend = backend
        self._host = host
        self._keys = keys
        self._rank = rank
        self._size = size
        self.global_ranks = tuple(global_ranks) if global_ranks is not None else None
        self.world = world
        self._name: str = ""
        self._desc: str = ""
        self._timeout = timeout
        self._poll_interval = poll_interval
        self._epochs: EpochGroups | None = None
        self._current: _Built | None = None
        self.graveyard: list[_Built] = []
        self._lock = threading.Lock()

    @classmethod
    def standalone(cls, name: str, *, timeout: float = 30.0, poll_interval: float = 0.005,
                   host: str | None = None, keys: TransferKeys | None = None) -> ManagedGroup:
        """A group for the caller's own collectives, not registered with torch; rank and size per epoch."""
        group = cls(0, 1, timeout=timeout, poll_interval=poll_interval, host=host, keys=keys)
        group._name = name
        return group

    # torch's view of the group ------------------------------------------------------------------
    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:  # noqa: N802 (torch's name)
        return BACKEND_NAME

    def _get_backend_name(self) -> str:
        return BACKEND_NAME

    @property
    def group_name(self) -> GroupName:
        return cast("GroupName", self._name)  # torch's NewType of str

    def _set_group_name(self, name: str) -> None:
        self._name = name

    @property
    def group_desc(self) -> str:
        return self._desc

    def _set_group_desc(self, desc: str) -> None:
        self._desc = desc

    def _get_backend(self, device: Any) -> Any:
        return self._live("_get_backend")[1]._get_backend(device)

    def abort(self) -> None:
        self.abort_epoch("aborted through torch")

    def shutdown(self) -> None:
        self.abort_epoch("shut down through torch")

    @property
    def key(self) -> str:
        ranks = "-".join(str(r) for r in self.global_ranks) if self.global_ranks is not None else "standalone"
        return f"{self._name}/{ranks}"

    @property
    def epoch(self) -> int | None:
        built = self._current
        return built.epoch_group.epoch if built is not None else None

    def describe(self) -> str:
        return f"group {self._desc or self._name!r} (rank {self._rank}/{self._size}, epoch {self.epoch})"

    def __repr__(self) -> str:
        return f"ManagedGroup({self.describe()})"

    # the epoch's backend --------------------------------------------------------------------------
    def configure(self, epoch: int, store: dist.Store, *, rank: int | None = None, size: int | None = None,
                  cancelled: Callable[[], str] | None = None) -> None:
        """Retire the current backend and build epoch ``epoch``'s on ``store`` (blocks until all joined).

        ``rank``/``size`` change this group's place (standalone groups only; torch-made groups keep
        the place torch gave them). Raises :class:`CollectiveAborted` when the build is aborted,
        cancelled or times out; the group is then unusable until a later epoch's configure succeeds.
        """
        if (rank is not None or size is not None) and self.global_ranks is not None:
            if (rank, size) != (self._rank, self._size):
                raise ConfigError(f"{self.describe()} was made by torch with a fixed rank and size; a "
                                  "replacement process takes the lost rank's place instead")
        new_rank = self._rank if rank is None else rank
        new_size = self._size if size is None else size
        if not 0 <= new_rank < new_size:
            raise ConfigError(f"rank {new_rank} is not in [0, {new_size})")
        with self._lock:
            last = max([b.epoch_group.epoch for b in [*self.graveyard, self._current] if b is not None],
                       default=-1)
            if epoch <= last:
                raise ConfigError(f"epoch {epoch} is not newer than epoch {last} of {self.describe()}: store "
                                  "prefixes must never be reused")
            if self._epochs is None:
                self._epochs = EpochGroups(store, backend=self.backend, timeout=self._timeout,
                                           poll_interval=self._poll_interval, host=self._host, keys=self._keys,
                                           seal_context=f"{KEY_PREFIX}{self.key}/",
                                           device=torch.cuda.current_device() if self.backend == "nccl" else None)
            epochs = self._epochs
            if self._current is not None:
                self._current.epoch_group.abort(f"superseded by epoch {epoch}")
                self.graveyard.append(self._current)
                self._current = None
            self._rank, self._size = new_rank, new_size
        prefixed = dist.PrefixStore(KEY_PREFIX + self.key, store)
        eg = epochs.build(epoch, new_rank, new_size, store=prefixed, cancelled=cancelled)
        wrapper = dist.ProcessGroup(prefixed, new_rank, new_size)
        if self.backend == "nccl":
            wrapper._set_default_backend(dist.ProcessGroup.BackendType.NCCL)
            wrapper._register_backend(torch.device("cuda"), dist.ProcessGroup.BackendType.NCCL, eg.pg)
        else:
            wrapper._register_backend(torch.device("cpu"), dist.ProcessGroup.BackendType.GLOO, eg.pg)
        wrapper._set_group_name(cast("GroupName", f"{BACKEND_NAME}-{self.key}-e{epoch}"))
        with self._lock:
            self._current = _Built(eg, wrapper)

    def abort_epoch(self, reason: str) -> bool:
        """Abort the current (or being built) backend: blocked waits raise. Thread-safe; False if none."""
        with self._lock:
            epochs = self._epochs
        return epochs.abort(None, reason) if epochs is not None else False

    def _live(self, op: str) -> tuple[EpochGroup, Any]:
        built = self._current
        if built is None:
            raise ConfigError(f"{op} on {self.describe()}, which has no backend: call configure() for the "
                              "current epoch first")
        eg = built.epoch_group
        if eg.abort_event.is_set():
            raise CollectiveAborted(f"{op} on {self.describe()}, which was aborted ({eg.abort_reason}); "
                                    "configure the next epoch", epoch=eg.epoch, op=op, reason="aborted")
        return eg, built.wrapper

    def _issue(self, op: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ManagedWork:
        eg, wrapper = self._live(op)
        world = self.world
        if world is not None and world.on_issue is not None:
            world.on_issue()  # entered: the rank's position (the hang check's) is one collective further
        try:
            inner = getattr(wrapper, op)(*args, **kwargs)
        except RuntimeError as exc:
            eg.abort(f"{op} could not be issued: {exc}")
            raise CollectiveAborted(f"{op} on {self.describe()} could not be issued: {exc}", epoch=eg.epoch,
                                    op=op, reason="peer_failed") from exc
        return ManagedWork(self, eg, op, inner, args)

    def _bury(self, work: ManagedWork) -> None:
        with self._lock:
            for built in [self._current, *self.graveyard]:
                if built is not None and built.epoch_group is work._epoch_group:
                    built.hung.append(work)
                    return


def _forwarder(op: str) -> Callable[..., ManagedWork]:
    def forward(self: ManagedGroup, *args: Any, **kwargs: Any) -> ManagedWork:
        return self._issue(op, args, kwargs)

    forward.__name__ = op
    forward.__doc__ = f"torch's ProcessGroup.{op}, on the current epoch's backend, interruptible."
    return forward


for _op in FORWARDED:
    setattr(ManagedGroup, _op, _forwarder(_op))


class ManagedWorld:
    """Every managed group of this process (the default group, mesh dimensions, ``new_group``s).

    :meth:`configure` gives all of them the epoch's backends; :meth:`abort` (any thread) interrupts
    every collective in flight. ``slow_after`` / ``on_slow``: a wait still pending that many seconds
    in calls ``on_slow()`` once, from the waiting thread (the trainer can report "waiting"), and
    :attr:`on_resume` when that wait completes. :attr:`on_issue` is called as each collective is
    entered, on any group (the trainer counts them: its position in the step).
    ``host`` and ``keys``: as for :class:`~gossiprec.trainer.collectives.groups.EpochGroups` (the address gloo binds
    to, the agent's; the cluster's keys every store value is sealed with), for every group.
    ``backend``: ``gloo`` (CPU tensors) or ``nccl`` (CUDA tensors, on the current CUDA device).
    """

    def __init__(self, rank: int, world_size: int, *, timeout: float = 30.0, poll_interval: float = 0.005,
                 slow_after: float | None = None, on_slow: Callable[[], None] | None = None,
                 host: str | None = None, keys: TransferKeys | None = None, backend: str = "gloo") -> None:
        if backend not in BACKENDS:
            raise ConfigError(f"backend must be one of {BACKENDS}, got {backend!r}")
        self.backend = backend
        self.host = host
        self.keys = keys
        self.rank = rank
        self.world_size = world_size
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.slow_after = slow_after
        self.on_slow = on_slow
        self.on_resume: Callable[[], None] | None = None
        self.on_issue: Callable[[], None] | None = None
        self.groups: list[ManagedGroup] = []
        self.epoch: int | None = None
        self.waiting = threading.Event()  # set when a wait went slow; cleared by configure
        self._abort_reason = ""
        self._dead_upto = -1  # epochs up to this one were aborted (possibly before their configure)
        self._dead_reason = ""
        self._lock = threading.Lock()

    def _slow(self) -> None:
        self.waiting.set()
        if self.on_slow is not None:
            self.on_slow()

    def _create(self, opts: Any, _backend_options: Any) -> ManagedGroup:
        ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))
        group = ManagedGroup(opts.group_rank, opts.group_size, global_ranks=ranks, timeout=self.timeout,
                             poll_interval=self.poll_interval, world=self, host=self.host, keys=self.keys,
                             backend=self.backend)
        with self._lock:
            if self.epoch is not None:
                raise ConfigError("a managed group was created after the first configure(); create the "
                                  "whole mesh first so that every process builds the same groups")
            self.groups.append(group)
        return group

    def configure(self, epoch: int, store: dist.Store, *, cancelled: Callable[[], str] | None = None) -> float:
        """Build epoch ``epoch``'s backend for every managed group; returns the seconds it took.

        Groups are built one at a time in creation order, the same in every process, so no two
        processes wait for each other in opposite orders. ``store`` is the shared store (a new one
        may be given per epoch). Raises :class:`CollectiveAborted` if aborted (also between two
        groups' builds), cancelled or late; then configure a newer epoch.
        """
        t0 = time.monotonic()
        with self._lock:
            if self.epoch is not None and epoch <= self.epoch:
                raise ConfigError(f"epoch {epoch} is not newer than epoch {self.epoch}")
            self.epoch = epoch
            self._abort_reason = self._dead_reason if epoch <= self._dead_upto else ""
            groups = list(self.groups)
            self.waiting.clear()
        if not groups:
            raise ConfigError("no managed groups: call init_managed_world() before configure()")

        def stop() -> str:
            return self._abort_reason or (cancelled() if cancelled is not None else "")

        for group in groups:
            why = stop()
            if why:
                self.abort(why, epoch=epoch)  # the groups built so far must not serve this epoch
                raise CollectiveAborted(f"configuring epoch {epoch} was aborted: {why}", epoch=epoch,
                                        op="build", reason="aborted")
            group.configure(epoch, store, cancelled=stop)
        return time.monotonic() - t0

    def abort(self, reason: str = "aborted by the agent", *, epoch: int | None = None) -> int:
        """Make every blocked and later collective of the current epoch raise; returns groups aborted.

        Thread-safe. ``epoch``: abort that epoch and every older one: the current epoch only if it is
        not newer (a late abort for an old view cannot hit the next epoch's groups), and a
        :meth:`configure` of ``epoch`` that has not begun yet raises at once when it does.
        """
        reason = reason or "aborted"
        with self._lock:
            if epoch is not None:
                if epoch > self._dead_upto:
                    self._dead_upto, self._dead_reason = epoch, reason
                if self.epoch is None or self.epoch > epoch:
                    return 0
            self._abort_reason = reason
            groups = list(self.groups)
        return sum(1 for g in groups if g.abort_epoch(reason))

    @property
    def abort_reason(self) -> str:
        """Why the current epoch was aborted ("" while it was not)."""
        return self._abort_reason

    @property
    def hung(self) -> int:
        """Collectives aborted while pending on some epoch's backend (they keep it from being freed)."""
        return sum(len(b.hung) for g in self.groups for b in [*g.graveyard, g._current] if b is not None)


_world: ManagedWorld | None = None


def init_managed_world(rank: int, world_size: int, *, timeout: float = 30.0, poll_interval: float = 0.005,
                       slow_after: float | None = None, on_slow: Callable[[], None] | None = None,
                       host: str | None = None, keys: TransferKeys | None = None,
                       backend: str = "gloo") -> ManagedWorld:
    """Make the ``gossiprec`` backend torch's default group; later groups and meshes are managed too.

    Call once per process, instead of ``init_process_group``; then build the mesh
    (``init_device_mesh("cpu", shape, mesh_dim_names=...)``; ``"cuda"`` with ``backend="nccl"``, after
    ``torch.cuda.set_device``) and the model, and call :meth:`ManagedWorld.configure` for the epoch.
    ``rank`` is the mesh position this process plays (a replacement takes the lost rank's). ``host``,
    ``keys``, ``backend``: see :class:`ManagedWorld` (give the trainer's: the agent's address and
    ``ResilientTrainer.keys``). No collective runs here.
    """
    global _world
    if _world is not None or dist.is_initialized():
        raise ConfigError("torch.distributed is already initialised in this process; init_managed_world "
                          "must replace init_process_group, once per process")
    world = ManagedWorld(rank, world_size, timeout=timeout, poll_interval=poll_interval, slow_after=slow_after,
                         on_slow=on_slow, host=host, keys=keys, backend=backend)
    if backend == "nccl":
        if not torch.cuda.is_available() or not dist.is_nccl_available():
            raise ConfigError("a managed world on nccl needs CUDA and an NCCL build of torch; use backend='gloo'")
        check_nccl_environment()  # now, not as a process killed by NCCL's watchdog later
    # torch asks the plugin for one group per device it names: the one our backend's tensors live on
    device = "cuda" if backend == "nccl" else "cpu"
    if BACKEND_NAME.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND_NAME, _create_managed, devices=[device], extended_api=True)
    elif dist.Backend.backend_capability.get(BACKEND_NAME) != [device]:
        raise ConfigError(f"this process registered the {BACKEND_NAME} backend for "
                          f"{dist.Backend.backend_capability.get(BACKEND_NAME)}; a world on {backend} needs "
                          f"[{device!r}]: one kind of managed world per process")
    _world = world
    # The store torch keeps for the default group is only used by its own bookkeeping barriers (off by
    # default); every backend is built on the shared store given to configure().
    dist.init_process_group(BACKEND_NAME, store=dist.HashStore(), rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout))
    return world


_retired: list[ManagedWorld] = []
"""The worlds :func:`retire_managed_world` retired: referenced for good (a backend holding a hung collective
must never be destroyed: gloo's destructor would block)."""


def retire_managed_world(reason: str) -> None:
    """Retire this process's managed world so that :func:`init_managed_world` can make a new one (a mesh
    job's shrink builds its mesh again, smaller): every group's backend is aborted (a collective still
    blocked on one raises :class:`CollectiveAborted`), torch's default group and every group made from it are
    taken down, and the old world stays referenced here."""
    global _world
    world = managed_world()
    world.abort(reason)
    _retired.append(world)
    if dist.is_initialized():
        dist.destroy_process_group()  # (each managed group's shutdown aborts its epoch: nothing blocks)
    _world = None


def managed_world() -> ManagedWorld:
    """This process's :class:`ManagedWorld` (after :func:`init_managed_world`)."""
    if _world is None:
        raise ConfigError("init_managed_world() has not been called in this process")
    return _world


def _create_managed(opts: Any, backend_options: Any) -> ManagedGroup:
    return managed_world()._create(opts, backend_options)


def mesh_topology(mesh: Any, replicate: str | Sequence[str], *, allow_shrink: bool = False,
                  min_replicas: int = 1) -> JobTopology:
    """The agents' job topology read from a ``DeviceMesh``: the ranks along the ``replicate``
    dimension(s) hold the same shard, so each such line of the mesh is one replica group (the donors
    of a lost rank are the other ranks of its group). Never typed twice: give the agents this.

    ``mesh`` is a ``DeviceMesh`` or anything with ``.mesh`` (a rank tensor) and ``.mesh_dim_names``.
    """
    names = tuple(mesh.mesh_dim_names or ())
    wanted = (replicate,) if isinstance(replicate, str) else tuple(replicate)
    missing = [n for n in wanted if n not in names]
    if missing or not wanted:
        raise ConfigError(f"replicate dimension(s) {missing or wanted} are not among the mesh's {names}; name "
                          "the data-parallel replica dimension (e.g. 'replicate' for HSDP, 'dp' for dp x tp)")
    ranks = mesh.mesh
    rep = [names.index(n) for n in wanted]
    rest = [i for i in range(len(names)) if i not in rep]
    per_group = 1
    for i in rep:
        per_group *= int(ranks.shape[i])
    lines = ranks.permute(*rest, *rep).reshape(-1, per_group)
    groups = tuple(tuple(int(r) for r in line) for line in lines.tolist())
    return JobTopology(int(ranks.numel()), groups, allow_shrink, min_replicas)
