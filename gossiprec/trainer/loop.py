"""The training-loop wrapper: report, all-reduce interruptibly, commit, and recover in place.

Theory of operation
-------------------
:class:`ResilientTrainer` sits in an ordinary data-parallel loop with a handful of calls::

    rt = ResilientTrainer(training_state(model, opt, data=pos))
    rt.start()                                # trainer: build the epoch group; spare: wait for a rank
    while rt.step < steps:
        s = rt.begin_step()                   # the step being computed (committed step + 1)
        opt.zero_grad(); loss_of(model, batch(rt.rank, s)).backward()
        if not rt.allreduce_gradients(model.parameters()):
            continue                          # a recovery happened: redo from rt.step
        opt.step()
        rt.commit()                           # step s is committed on this rank
    rt.finish()

**Commit point.** Step ``s`` is committed on a rank when its optimizer step has finished and
:meth:`commit` has captured the registered objects into a snapshot (a copy, into a reused buffer).
Before that, a failure rolls this rank back to ``s - 1`` (its live objects are reloaded from the
snapshot, so RNG and data position consumed by the interrupted step are undone). The last *two*
snapshots are kept, because the agent's state report of a new view can lag one commit behind the
trainer; a donor serves whichever step the plan names. Every commit sends the agent a non-blocking
``state`` message (committed step, payload size) and every phase a ``report`` (step, phase, step
time): three small Unix-socket writes per step, no reply awaited.

**Interruption.** A thread reads the agent's event stream. A ``ViewInstalled`` for a newer epoch, or
``Fenced``, aborts the current group (:class:`~gossiprec.trainer.groups.EpochGroups`): a waiting
all-reduce raises within a poll slice; a collective that fails by itself (gloo sees the dead peer)
raises too. Either way the trainer enters :meth:`_recover`.

**Recovery**, driven by the agreed plan (the newest ``PlanReady``; ``status`` is polled as a
fallback): this rank's new rank is the plan's assignment. A rank named as a receiver fetches the
target step from the plan's donors, striped exactly as the plan says (:func:`fetch_state`, bytes
land in the local tensors); a rank at the target reloads its own snapshot; then the new epoch's group
is built on the TCPStore of the plan's ``store_node`` and training continues from ``target_step``.
A hot spare (role ``spare`` in view 0) builds model and optimizer (allocated by
:func:`materialize_optimizer_state`) before :meth:`start`, which blocks until a plan gives it a rank.

**Addresses.** Every trainer process hosts a TCPStore server and a :class:`DonorServer` from the
start, on fixed offsets from its agent's port (``agent port + store_offset`` and ``+ donor_offset``,
default 1 and 2), so the host and port of any member's store and donor follow from the view's member
address; no address needs to be gossiped and the store of a new epoch is already listening. The view
0 store is rank 0's.

**Keys.** State is authenticated with the primary key of ``GOSSIPREC_KEYRING`` (the cluster's
keyring); without one (``--insecure`` clusters) a key derived from the cluster name is used, which
protects against accidents, not attackers.

Limits: one replica group per plan transfer set (data parallelism; shards follow the same code);
``checkpoint``/``stop`` plans raise :class:`RecoveryError` (``on_checkpoint`` callback is the user's
hook); released ranks of a shrink leave after ``linger`` seconds of serving.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

from gossiprec.errors import ConfigError, FencedError, GossiprecError, RecoveryError, TransferError
from gossiprec.io.control import ControlClient, ControlError
from gossiprec.trainer.groups import CollectiveAborted, EpochGroups, connect_store, start_store_server
from gossiprec.trainer.state import (
    LayoutMismatch, ReceiveTarget, StateSnapshot, Stateful, capture_state, restore_state,
)
from gossiprec.trainer.transfer import DonorServer, fetch_state

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

STORE_OFFSET = 1
DONOR_OFFSET = 2
FAILURE_EVENTS = frozenset({"MemberFailed", "MemberLeft", "AlertRaised", "MemberSuspected"})


@dataclass(frozen=True, slots=True)
class RecoveryRecord:
    """Timeline of one recovery on this rank (``time.monotonic()`` seconds, comparable across the
    processes of one machine) and what it moved."""

    epoch: int
    cause: str
    role: str
    """``receiver`` (fetched state), ``survivor`` (reloaded its own snapshot) or ``donor`` (both
    reloaded and served)."""
    rank: int
    world_size: int
    target_step: int
    lost_steps: int
    """Committed steps of this rank that the plan rolled back (0 means nothing committed was lost)."""
    noticed_at: float
    detected_at: float | None
    """The agent's first failure event (alert, suspect, failed) seen, if any."""
    agreed_at: float | None
    planned_at: float
    group_at: float
    state_at: float
    first_step_at: float
    bytes_received: int
    transfer_s: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(slots=True)
class _Pending:
    cause: str
    noticed_at: float
    detected_at: float | None = None
    agreed_at: float | None = None
    fields: dict[str, Any] = field(default_factory=dict)


def transfer_key(cluster: str | None = None) -> bytes:
    """The 32-byte key state transfers are authenticated with (see the module docstring)."""
    path = os.environ.get("GOSSIPREC_KEYRING")
    if path:
        from gossiprec.io.keyring import Keyring

        key = Keyring.load(path).primary
        if key is None:
            raise ConfigError(f"keyring {path} has no primary key; run `gossiprec keys use KEY`")
        return key
    name = cluster or os.environ.get("GOSSIPREC_CLUSTER", "gossiprec")
    return hashlib.sha256(b"gossiprec-insecure-transfer\x00" + name.encode()).digest()


def rank_ordered_mean(rows: list[torch.Tensor]) -> torch.Tensor:
    """``(((rows[0] + rows[1]) + rows[2]) + ...) / len(rows)``: the reduction of ``exact`` gradients,
    reproducible in one process (e.g. a failure-free reference run)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total.add_(r)
    return total.div_(len(rows))


def _host_port(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class ResilientTrainer:
    """Wraps one rank's training loop; see the module docstring for the calls and their contract.

    ``objects``: name -> Stateful, the complete replica state (model, optimizer, data position, RNG);
    it must be identical on every replica at a given step (rank-specific choices, such as which
    shard of data a rank reads, are computed from :attr:`rank`, not stored). ``control``: a
    connected client (default ``ControlClient.from_env()``). ``timeout``: seconds for group
    construction and a collective. ``poll_interval``: abort reaction time of a waiting collective.
    ``on_recovered(record)``: called after each recovery's first step.
    """

    def __init__(self, objects: Mapping[str, Stateful], *, control: ControlClient | None = None,
                 control_path: str | None = None, key: bytes | None = None, backend: str = "gloo",
                 timeout: float = 30.0, poll_interval: float = 0.002, store_offset: int = STORE_OFFSET,
                 donor_offset: int = DONOR_OFFSET, bind_host: str = "0.0.0.0", linger: float = 5.0,
                 on_recovered: Callable[[RecoveryRecord], None] | None = None) -> None:
        if not objects:
            raise ConfigError("ResilientTrainer needs the objects that make up the training state")
        self.objects = dict(objects)
        if control is None:
            control = ControlClient(control_path) if control_path else ControlClient.from_env()
        self.control = control
        self._control_path = control.path
        self.node: str = str(control.node)
        self.key = key if key is not None else transfer_key()
        self.backend = backend
        self.timeout = timeout
        self.poll_interval = poll_interval
        self.store_offset = store_offset
        self.donor_offset = donor_offset
        self.bind_host = bind_host
        self.linger = linger
        self.on_recovered = on_recovered
        self.rank: int = -1
        self.world_size: int = 0
        self.epoch: int = -1
        self.step: int = 0
        """The last committed step (0: the initial state)."""
        self.role = "trainer"
        self.records: list[RecoveryRecord] = []
        self.groups: EpochGroups | None = None
        self._snapshots: list[StateSnapshot] = []
        self._lock = threading.Condition()
        self._plans: dict[int, dict[str, Any]] = {}
        self._newest_view = -1
        self._fenced = ""
        self._agent_lost = ""
        self._pending: _Pending | None = None
        self._failure_events: list[float] = []
        self._last_view_at: float | None = None
        self._building_epoch: int | None = None
        self._last_recovered_at = 0.0
        self._record_open: _Pending | None = None
        self._step_t0 = time.monotonic()
        self._step_ms = 0
        self._stores: dict[tuple[str, int], Any] = {}
        self._store_server: Any = None
        self._donor: DonorServer | None = None
        self._events: threading.Thread | None = None
        self._closed = threading.Event()
        self._addrs: dict[str, str] = {}

    # ------------------------------------------------------------------ set-up
    def start(self) -> ResilientTrainer:
        """Open the store and donor servers, follow the agent's events, and join the job.

        A trainer of view 0 builds the epoch-0 group (rank 0's store) and commits step 0, the
        initial state. A spare blocks until a plan gives it a rank and the state has arrived.
        """
        status = self.control.status()
        view = status.get("view")
        if not view:
            raise ConfigError("the agent has no view: start it with a job spec (`--job job.toml`)")
        me = next((m for m in view["members"] if m["node"] == self.node), None)
        if me is None:
            raise ConfigError(f"node {self.node} is not in view {view['epoch']}; check the job spec")
        self._refresh_addrs()
        my_host, my_port = _host_port(self._addrs[self.node])
        self._store_server, _ = start_store_server(self.bind_host, my_port + self.store_offset,
                                                   timeout=self.timeout)
        self._donor = DonorServer(self._serve, self.key, self.bind_host, my_port + self.donor_offset).start()
        self._newest_view = int(view["epoch"])
        self._events = threading.Thread(target=self._follow_events, name="gossiprec-events", daemon=True)
        self._events.start()
        self.role = str(me["role"])
        if self.role == "trainer" and int(view["epoch"]) == 0:
            self._commit_snapshot(0)
            self.rank, self.world_size, self.epoch = int(me["rank"]), self._world_of(view), 0
            rank0 = next(m["node"] for m in view["members"] if m["role"] == "trainer" and m["rank"] == 0)
            self.groups = EpochGroups(self._store_for(rank0), backend=self.backend, timeout=self.timeout,
                                      poll_interval=self.poll_interval)
            try:
                self.groups.build(0, self.rank, self.world_size)
            except CollectiveAborted as exc:
                self._recover(f"epoch 0 group failed: {exc}")
        else:
            self.epoch = int(view["epoch"])
            self.groups = EpochGroups(self._store_server, backend=self.backend, timeout=self.timeout,
                                      poll_interval=self.poll_interval)
            self._report(0, "idle")
            self._recover("spare waiting for a rank", spare=True)
        return self

    @staticmethod
    def _world_of(view: Mapping[str, Any]) -> int:
        return sum(1 for m in view["members"] if m["role"] == "trainer")

    def _refresh_addrs(self) -> None:
        self._addrs.update({m["name"]: m["addr"] for m in self.control.members()})

    def _store_for(self, node: str) -> Any:
        if node == self.node:
            return self._store_server
        if node not in self._addrs:
            self._refresh_addrs()
        host, port = _host_port(self._addrs[node])
        key = (host, port + self.store_offset)
        if key not in self._stores:
            self._stores[key] = connect_store(host, port + self.store_offset, timeout=self.timeout)
        return self._stores[key]

    # ------------------------------------------------------------------ the loop's calls
    def begin_step(self) -> int:
        """Start computing step ``self.step + 1`` (recovering first if the agent asked); returns it."""
        if self._trouble():
            self._recover("view change")
        self._step_t0 = time.monotonic()
        self._report(self.step + 1, "compute")
        return self.step + 1

    def allreduce_gradients(self, params: Iterable[torch.Tensor], *, exact: bool = False) -> bool:
        """Average the gradients of ``params`` over the group (one flat all-reduce).

        Returns False when the collective was interrupted: recovery has already run and the loop
        must start the step again (``continue``). A parameter without a gradient counts as zero.
        ``exact``: reduce in rank order (each rank's gradients travel in their own row of a
        ``world_size`` x n buffer, then rows are added 0, 1, 2, ...): the result no longer depends on
        the collective's algorithm, so it is reproducible bit for bit (see :func:`rank_ordered_mean`),
        at ``world_size`` times the bytes.
        """
        import torch

        plist = [p for p in params if p.requires_grad]
        self._report(self.step + 1, "communicate")
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plist]
        flat = torch.cat([g.reshape(-1) for g in grads])  # a fresh buffer: an aborted one may be written later
        if exact:
            rows = flat.new_zeros((self.world_size, flat.numel()))
            rows[self.rank] = flat
            if not self.allreduce(rows, "sum"):
                return False
            flat = rank_ordered_mean(list(rows.unbind(0)))
        elif not self.allreduce(flat, "avg"):
            return False
        offset = 0
        for p, g in zip(plist, grads, strict=True):
            n = g.numel()
            chunk = flat[offset:offset + n].view_as(g)
            if p.grad is None:
                p.grad = chunk.clone()
            else:
                p.grad.copy_(chunk)
            offset += n
        self._report(self.step + 1, "optimizer")
        return True

    def allreduce(self, tensor: torch.Tensor, op: str = "sum") -> bool:
        """All-reduce ``tensor`` in place on the current group; False (after recovering) if interrupted."""
        if self._trouble():
            self._recover("view change")
            return False
        assert self.groups is not None and self.groups.current is not None
        try:
            self.groups.current.allreduce(tensor, op)
            return True
        except CollectiveAborted as exc:
            self._recover(f"{exc.reason}: {exc}")
            return False

    def commit(self) -> int:
        """Step ``self.step + 1`` is done (optimizer stepped): capture it; returns the new step."""
        step = self.step + 1
        self._commit_snapshot(step)
        self._step_ms = int((time.monotonic() - self._step_t0) * 1000)
        if self._record_open is not None:
            self._close_record()
        return step

    def finish(self, barrier: bool = True, exit_code: int | None = None) -> None:
        """End of training: a last barrier (errors ignored), then stop following the agent.

        ``exit_code``: end the process with ``os._exit`` (no interpreter teardown): a retired group
        hung in the graveyard would block ~30 s in its destructor otherwise.
        """
        self._report(self.step, "idle")
        if barrier and self.groups is not None and self.groups.current is not None:
            try:
                self.groups.current.barrier(timeout=min(self.timeout, 10.0))
            except GossiprecError:
                pass
        self.close()
        if exit_code is not None:
            os._exit(exit_code)

    def close(self) -> None:
        self._closed.set()
        if self._donor is not None:
            self._donor.close(timeout=0.5)

    # ------------------------------------------------------------------ commit and serve
    def _commit_snapshot(self, step: int) -> None:
        reuse = self._snapshots[0] if len(self._snapshots) >= 2 else None
        snap = capture_state(self.objects, step=step, copy=True, checksum=False, reuse=reuse)
        with self._lock:
            self._snapshots = [*self._snapshots[-1:], snap]
        self.step = step
        try:
            self.control.set_state(step, None, snap.header.total_nbytes, self._donor.port if self._donor else None,
                                   wait=False)
        except ControlError as exc:
            self._agent_lost = str(exc)

    def _snapshot_at(self, step: int) -> StateSnapshot | None:
        with self._lock:
            return next((s for s in self._snapshots if s.step == step), None)

    def _serve(self, epoch: int, step: int) -> StateSnapshot | None:
        return self._snapshot_at(step)

    def _report(self, step: int, phase: str) -> None:
        try:
            self.control.report(step, phase, self._step_ms, wait=False)
        except ControlError as exc:
            self._agent_lost = str(exc)

    # ------------------------------------------------------------------ agent events
    def _follow_events(self) -> None:
        try:
            client = ControlClient(self._control_path)
            client.subscribe()
        except ControlError as exc:
            self._set_lost(f"cannot follow the agent's events: {exc}")
            return
        with client:
            while not self._closed.is_set():
                try:
                    ev = client.next_event(timeout=0.2)
                except ControlError as exc:
                    if not self._closed.is_set():
                        self._set_lost(f"agent connection lost: {exc}")
                    return
                if ev is not None:
                    self._on_event(ev)

    def _set_lost(self, why: str) -> None:
        with self._lock:
            self._agent_lost = why
            self._lock.notify_all()
        if self.groups is not None:
            self.groups.abort(reason=why)

    def _on_event(self, ev: dict[str, Any]) -> None:
        kind = ev.get("event")
        now = time.monotonic()
        if kind in FAILURE_EVENTS:
            at = float(ev["at"]) if isinstance(ev.get("at"), (int, float)) else now
            with self._lock:
                self._failure_events = [*self._failure_events[-63:], at]
            return
        if kind == "ViewInstalled":
            epoch = int(ev["epoch"])
            with self._lock:
                if epoch > self._newest_view:
                    self._newest_view = epoch
                    self._last_view_at = float(ev.get("at", now))
                self._lock.notify_all()
            self._abort_older_than(epoch, f"view {epoch} installed")
        elif kind == "PlanReady":
            plan = ev.get("plan")
            if isinstance(plan, dict):
                with self._lock:
                    plan = dict(plan, planned_at=float(ev.get("at", now)))
                    self._plans[int(plan["epoch"])] = plan
                    self._newest_view = max(self._newest_view, int(plan["epoch"]))
                    self._lock.notify_all()
        elif kind == "Fenced":
            with self._lock:
                self._fenced = str(ev.get("reason", "fenced"))
                self._lock.notify_all()
            if self.groups is not None:
                self.groups.abort(reason=f"fenced: {self._fenced}")

    def _abort_older_than(self, epoch: int, reason: str) -> None:
        """Abort the current group and a group being built, when they belong to an epoch < ``epoch``."""
        if self.groups is None:
            return
        for e in {self.epoch, self._building_epoch}:
            if e is not None and e < epoch:
                self.groups.abort(epoch=e, reason=reason)

    def _trouble(self) -> bool:
        return self._newest_view > self.epoch or bool(self._fenced) or bool(self._agent_lost)

    # ------------------------------------------------------------------ recovery
    def _wait_plan(self, spare: bool) -> dict[str, Any]:
        """The plan of the newest epoch this rank knows of (waits; polls status as a fallback)."""
        next_poll = time.monotonic()
        while True:
            with self._lock:
                if self._agent_lost:
                    raise RecoveryError(f"lost the local agent ({self._agent_lost}); this trainer stops")
                if self._fenced:
                    raise FencedError(f"this node was fenced ({self._fenced}): it is on the minority side "
                                      "or was removed; the trainer must stop")
                newest = max(self._plans, default=-1)
                if newest > self.epoch and newest >= self._newest_view:
                    return self._plans[newest]
                self._lock.wait(0.05 if not spare else 0.2)
            if time.monotonic() >= next_poll:
                next_poll = time.monotonic() + (0.1 if not spare else 0.5)
                try:
                    st = self.control.status()
                except ControlError as exc:
                    self._set_lost(str(exc))
                    continue
                plan = st.get("plan")
                view = st.get("view") or {}
                with self._lock:
                    self._newest_view = max(self._newest_view, int(view.get("epoch", -1)))
                    if plan and int(plan["epoch"]) not in self._plans:
                        assignment = plan.get("assignment", {})
                        plan = dict(plan, assignment=[[int(r), n] for r, n in assignment.items()],
                                    planned_at=time.monotonic())
                        self._plans[int(plan["epoch"])] = plan

    def _recover(self, cause: str, spare: bool = False) -> None:
        """Wait for the plan, move state, rebuild the group; loops until one plan succeeds."""
        pending = self._pending or _Pending(cause, time.monotonic())
        self._pending = pending
        self._report(self.step, "recovering")
        while True:
            plan = self._wait_plan(spare)
            with self._lock:
                seen = [t for t in self._failure_events if t > self._last_recovered_at]
                pending.detected_at = min(seen) if seen else None
                pending.agreed_at = self._last_view_at
            try:
                if self._apply_plan(plan, pending):
                    return
            except (CollectiveAborted, GossiprecError, OSError) as exc:
                if isinstance(exc, FencedError):
                    raise
                log.warning("recovery with the plan of epoch %s failed (%s); waiting for the next plan",
                            plan["epoch"], exc)
                self.epoch = max(self.epoch, int(plan["epoch"]))
                self._snapshots_invalid_if_received(pending)
                continue

    def _snapshots_invalid_if_received(self, pending: _Pending) -> None:
        if pending.fields.get("role") == "receiver" and not pending.fields.get("state_ok"):
            # the local tensors hold a mix of old and new bytes: nothing to donate any more
            with self._lock:
                self._snapshots = []
            try:
                self.control.set_state(0, None, 0, None, wait=False)
            except ControlError:
                pass

    def _apply_plan(self, plan: dict[str, Any], pending: _Pending) -> bool:
        epoch = int(plan["epoch"])
        action = plan["action"]
        if action in ("stop", "checkpoint"):
            raise RecoveryError(f"the plan of epoch {epoch} is {action!r} ({plan.get('reason')}): no replica "
                                "holds the state to resume from; restart the job from your checkpoint")
        assignment = {int(r): str(n) for r, n in plan["assignment"]}
        my_rank = next((r for r, n in assignment.items() if n == self.node), None)
        target = int(plan["target_step"])
        transfers = plan.get("transfers") or []
        if my_rank is None:
            if any(t["donor_node"] == self.node for t in transfers):
                self._closed.wait(self.linger)  # released: serve the receivers for a while
            self.epoch = epoch
            if self.role == "spare":
                return False  # still a spare: wait for a later plan
            raise RecoveryError(f"this rank was released by the plan of epoch {epoch} (shrink); leave the job")
        mine = sorted((t for t in transfers if t["receiver_node"] == self.node), key=lambda t: int(t["offset"]))
        self._report(target, "recovering")
        pending.fields.update(rank=my_rank, world_size=int(plan["world_size"]), target_step=target,
                              planned_at=float(plan.get("planned_at", time.monotonic())),
                              lost_steps=max(0, self.step - target) if self.role == "trainer" else 0)
        nbytes, xfer_s = 0, 0.0
        if mine:
            pending.fields["role"] = "receiver"
            self._refresh_addrs()
            donors = []
            for t in mine:
                host, port = _host_port(self._addrs[t["donor_node"]])
                donors.append((host, port + self.donor_offset))
            stripes = [(int(t["offset"]), int(t["offset"]) + int(t["length"])) for t in mine]
            target_objects = ReceiveTarget(self.objects)
            kwargs: dict[str, Any] = {"step": target, "epoch": epoch, "timeout": max(self.timeout, 60.0),
                                      "stall_timeout": min(self.timeout, 5.0)}
            try:
                stats = fetch_state(donors, self.key, target_objects, stripes=stripes, **kwargs)
            except TransferError as exc:
                if len(donors) == 1 or isinstance(exc, LayoutMismatch):
                    raise
                # donors disagree (replicas not identical) or one failed: try each alone; a dead donor
                # also makes the agents agree on a new view, whose plan supersedes this one
                log.warning("striped fetch failed (%s); fetching from one donor", exc)
                stats = self._fetch_from_any(donors, target_objects, kwargs, exc)
            nbytes, xfer_s = stats.nbytes, stats.seconds
            pending.fields["state_ok"] = True
        else:
            snap = self._snapshot_at(target)
            if snap is None:
                raise RecoveryError(f"the plan of epoch {epoch} resumes at step {target} from this rank, but "
                                    f"it holds steps {[s.step for s in self._snapshots]}")
            restore_state(self.objects, snap)
            donor = any(t["donor_node"] == self.node for t in transfers)
            pending.fields["role"] = "donor" if donor else "survivor"
        pending.fields.update(state_at=time.monotonic(), bytes_received=nbytes, transfer_s=xfer_s)
        assert self.groups is not None
        self._building_epoch = epoch
        try:
            self.groups.build(epoch, my_rank, int(plan["world_size"]),
                              store=self._store_for(str(plan["store_node"])))
        finally:
            self._building_epoch = None
        pending.fields["group_at"] = time.monotonic()
        self.epoch, self.rank, self.world_size, self.role = epoch, my_rank, int(plan["world_size"]), "trainer"
        if mine:
            self._commit_snapshot(target)  # a receiver can donate from now on
        else:
            self.step = target
            try:
                snap = self._snapshot_at(target)
                self.control.set_state(target, None, snap.header.total_nbytes if snap else 0, None, wait=False)
            except ControlError:
                pass
        self._record_open, self._pending = pending, None
        self._last_recovered_at = time.monotonic()
        log.info("recovered into epoch %d as rank %d/%d at step %d (%s)", epoch, my_rank, self.world_size,
                 target, pending.fields["role"])
        return True

    def _fetch_from_any(self, donors: list[tuple[str, int]], target: ReceiveTarget, kwargs: dict[str, Any],
                        first: TransferError) -> Any:
        last: TransferError = first
        for donor in dict.fromkeys(donors):
            if self._newest_view > int(kwargs["epoch"]):
                break  # a newer view: its plan decides
            try:
                return fetch_state([donor], self.key, target, **kwargs)
            except TransferError as exc:
                last = exc
        raise last

    def _close_record(self) -> None:
        p = self._record_open
        assert p is not None
        self._record_open = None
        f = p.fields
        rec = RecoveryRecord(epoch=self.epoch, cause=p.cause, role=f["role"], rank=f["rank"],
                             world_size=f["world_size"], target_step=f["target_step"], lost_steps=f["lost_steps"],
                             noticed_at=p.noticed_at, detected_at=p.detected_at, agreed_at=p.agreed_at,
                             planned_at=f["planned_at"], group_at=f["group_at"], state_at=f["state_at"],
                             first_step_at=time.monotonic(), bytes_received=f["bytes_received"],
                             transfer_s=f["transfer_s"])
        self.records.append(rec)
        if self.on_recovered is not None:
            self.on_recovered(rec)
