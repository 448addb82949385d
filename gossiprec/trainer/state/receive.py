"""Receive (the receiving side): land a donor's state in the local objects' own tensors and load it.

The receiving side never allocates per transfer: :class:`ReceiveTarget` takes the local objects' own
state dicts (a hot spare builds model and optimizer in advance, and
:func:`materialize_optimizer_state` allocates optimizer state by a zero-gradient, lr=0 step) and uses
those very tensors as destinations when they are contiguous CPU tensors (otherwise a CPU staging
tensor, pinned if asked). :meth:`ReceiveTarget.bind` matches the donor's header against the local
layout *by name* (optimizer state may be created in another order on the donor) and refuses with
:class:`LayoutMismatch` naming the differences. Bytes then land straight in the destinations
(:meth:`BoundTarget.views` gives zero-copy ``memoryview`` s over them), :meth:`BoundTarget.verify`
checks every crc32 (:class:`ChecksumMismatch`), and :meth:`BoundTarget.apply` rebuilds each tree
around the destination tensors and calls ``load_state_dict``. On any failure before ``apply`` the
destination tensors hold a mix of old and new bytes: the target is only good for another attempt.
:func:`restore_state` does all of it from a snapshot held in memory.
"""

from __future__ import annotations

import logging
import warnings
import weakref
import zlib
from typing import TYPE_CHECKING, Any, Callable, Container, Iterable, Mapping, Sequence

from gossiprec.errors import ConfigError, TransferError
from gossiprec.trainer.state.capture import StateSnapshot
from gossiprec.trainer.state.header import (
    StateHeader, decode_tree, dtype_name, dtype_of, in_place_version, tensor_bytes, unpack_header, walk_objects,
)

if TYPE_CHECKING:  # torch is imported lazily: the non-torch parts of gossiprec must not pull it in
    import torch

    from gossiprec.trainer.objects import Stateful

log = logging.getLogger(__name__)


class LayoutMismatch(TransferError):
    """The donor's tensors (names, dtypes, shapes) differ from what the local objects hold."""


class ChecksumMismatch(TransferError):
    """Received bytes do not match the crc32 the donor computed when it captured the state."""


class ReceiveTarget:
    """Destination tensors for a transfer, taken from the local objects' own state dicts.

    Contiguous CPU tensors in the local state dicts are used in place (bytes land directly in the
    model parameters and optimizer state); anything else gets a CPU staging tensor of the same
    dtype and shape (pinned when ``pin_memory`` and CUDA is available) that ``load_state_dict``
    copies from in :meth:`BoundTarget.apply`.

    Optimizer state is created lazily by torch (at the first ``step()``), so a receiver's optimizer
    may hold none while the donor's holds some, or the other way round (a donor at step 0). Tensors of
    an optimizer object that only the donor has get a fresh tensor to land in, and local ones the donor
    lacks are dropped by ``load_state_dict``; any other difference (the model, a shape, a dtype) is a
    :class:`LayoutMismatch`.
    """

    def __init__(self, objects: Mapping[str, Stateful], *, pin_memory: bool = False) -> None:
        import torch

        self.objects: dict[str, Stateful] = dict(objects)
        self.wrappers: dict[str, Any] = {}
        """The DTensors among the local state, by name: their shards are the destinations."""
        _, found = walk_objects(self.objects, wrappers=self.wrappers)
        self._pin = pin_memory and torch.cuda.is_available()
        self._dest: dict[str, torch.Tensor] = {}
        for name, t in found:
            if name in self._dest:
                raise ConfigError(f"two tensors are both named {name!r}; state dict keys must be unique")
            t = t.detach()
            if t.device.type == "cpu" and t.is_contiguous() and t.layout == torch.strided:
                self._dest[name] = t
            else:
                self._dest[name] = torch.empty(tuple(t.shape), dtype=t.dtype, pin_memory=self._pin)
        self._lazy = frozenset(n for n, o in self.objects.items() if isinstance(o, torch.optim.Optimizer))
        """Objects whose state torch creates lazily (optimizers): see the class docstring."""
        self.total_nbytes = sum(t.numel() * t.element_size() for t in self._dest.values())

    def layout(self) -> dict[str, tuple[str, tuple[int, ...]]]:
        """Local tensors: name -> (dtype name, shape)."""
        return {n: (dtype_name(t.dtype), tuple(t.shape)) for n, t in self._dest.items()}

    def _lazy_tensor(self, name: str) -> bool:
        return name.split("/", 1)[0] in self._lazy

    def bind(self, header: StateHeader) -> BoundTarget:
        """Match ``header`` against the local layout; :class:`LayoutMismatch` lists what differs."""
        import torch

        problems: list[str] = []
        missing_objects = set(self.objects) ^ set(header.trees)
        if missing_objects:
            problems.append(f"state objects differ: local {sorted(self.objects)}, "
                            f"donor {sorted(header.trees)}")
        local = self.layout()
        remote_names = {s.name for s in header.tensors}
        dests: list[torch.Tensor] = []
        for spec in header.tensors:
            have = local.get(spec.name)
            if have is None and self._lazy_tensor(spec.name) and not problems:
                dests.append(torch.empty(spec.shape, dtype=dtype_of(spec.dtype), pin_memory=self._pin))
            elif have is None:
                problems.append(f"donor tensor {spec.name} {spec.dtype}{list(spec.shape)} has no local "
                                "counterpart")
            elif have != (spec.dtype, spec.shape):
                problems.append(f"{spec.name}: donor {spec.dtype}{list(spec.shape)}, local "
                                f"{have[0]}{list(have[1])}")
            else:
                dests.append(self._dest[spec.name])
        for name in local:
            if name not in remote_names and not self._lazy_tensor(name):
                problems.append(f"local tensor {name} is not in the donor's state")
        if problems:
            shown = "; ".join(problems[:6]) + (f"; and {len(problems) - 6} more" if len(problems) > 6 else "")
            raise LayoutMismatch(f"refusing the donor's state at step {header.step}: its layout differs "
                                 f"from this process's: {shown} (a hot spare must build the same model, "
                                 "optimizer and other objects as the trainers)")
        return BoundTarget(self, header, tuple(dests))


class BoundTarget:
    """A :class:`ReceiveTarget` matched to one donor header: destinations in header order."""

    def __init__(self, target: ReceiveTarget, header: StateHeader,
                 tensors: tuple[torch.Tensor, ...]) -> None:
        self.target = target
        self.header = header
        self.tensors = tensors
        self._views: list[memoryview] | None = None

    def views(self) -> list[memoryview]:
        """Writable zero-copy byte views of the destinations, in header order, for a writer outside
        torch (a fetch). Every destination counts as modified from here on (see :func:`mark_written`)."""
        mark_written(self.tensors)
        return self._raw_views()

    def _raw_views(self) -> list[memoryview]:
        if self._views is None:
            self._views = [tensor_bytes(t) for t in self.tensors]
        return self._views

    def write_payload(self, payload: bytes | bytearray | memoryview | Iterable[memoryview],
                      skip: Container[int] = ()) -> None:
        """Copy a whole payload (one buffer, or one view per tensor in header order, e.g. a snapshot's
        :meth:`StateSnapshot.views`) into the destinations, leaving out the tensor indices in ``skip``."""
        if isinstance(payload, (bytes, bytearray, memoryview)):
            flat = memoryview(payload).cast("B")
            if len(flat) != self.header.total_nbytes:
                raise TransferError(f"payload is {len(flat)} bytes, header says {self.header.total_nbytes}")
            pieces = [flat[s.offset:s.offset + s.nbytes] for s in self.header.tensors]
        else:
            pieces = [memoryview(p).cast("B") for p in payload]
            if [len(p) for p in pieces] != [s.nbytes for s in self.header.tensors]:
                raise TransferError("payload views do not match the header's tensors (count or sizes)")
        views = self._raw_views()
        written = [t for i, t in enumerate(self.tensors) if i not in skip]
        mark_written(written)
        for i, (piece, view) in enumerate(zip(pieces, views, strict=True)):
            if i not in skip:
                view[:] = piece

    def verify(self) -> None:
        """Check every tensor's crc32 against the header (no-op for ``checksum='none'``)."""
        if self.header.checksum == "none":
            return
        bad = [spec.name for spec, view in zip(self.header.tensors, self._raw_views(), strict=True)
               if zlib.crc32(view) != spec.crc32]
        if bad:
            raise ChecksumMismatch(f"{len(bad)} tensor(s) of the step-{self.header.step} state fail their "
                                   f"crc32 ({', '.join(bad[:5])}): the donor's snapshot changed after "
                                   "capture or memory is corrupt; fetch again from another donor")

    def apply(self) -> None:
        """Rebuild each state dict around the destination tensors and load it into its object."""
        tensors: Sequence[Any] = self.tensors
        wrappers = self.target.wrappers
        if wrappers:
            tensors = [_as_shard_of(t, wrappers.get(spec.name)) for spec, t in zip(self.header.tensors, tensors,
                                                                                   strict=True)]
        for name, tree in self.header.trees.items():
            self.target.objects[name].load_state_dict(decode_tree(tree, tensors))


def _as_shard_of(local: torch.Tensor, like: Any) -> Any:
    """``local`` as the shard of a DTensor placed as ``like`` (the live DTensor of that name), or
    ``local`` itself when ``like`` is None: ``load_state_dict`` of a sharded model or optimizer takes
    DTensors, and one made around the destination copies nothing."""
    if like is None:
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False, shape=like.shape,
                              stride=like.stride())


def mark_written(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the in-place version counters of ``tensors``, whose bytes are (about to be) written outside
    torch, through memoryviews. A restore may skip a tensor whose version still equals a snapshot's
    record of it (:func:`restore_state`); without the bump, bytes written behind torch's back (a fetch,
    an earlier restore) would pass for the snapshot's."""
    if tensors:
        from torch.autograd.graph import increment_version

        try:
            increment_version(list(tensors))  # one call for all (torch >= 2.5 takes a list)
        except (TypeError, RuntimeError):
            for t in tensors:
                increment_version(t)


def prepare_receive(objects: Mapping[str, Stateful], *, pin_memory: bool = False) -> ReceiveTarget:
    """Shorthand for :class:`ReceiveTarget`."""
    return ReceiveTarget(objects, pin_memory=pin_memory)


def restore_state(objects: Mapping[str, Stateful], snapshot: StateSnapshot | tuple[bytes, bytes], *,
                  unchanged: Container[int] = ()) -> int:
    """Load a snapshot (or ``(packed header, payload)``) into ``objects`` in memory, verifying it.

    ``unchanged``: ``data_ptr()`` s of live tensors that only tracked in-place operations may have changed
    since the snapshot was captured (the caller's promise; a ``.data`` write breaks it). Such a tensor
    whose pointer and in-place version counter still equal the snapshot's record of its source holds
    the snapshot's bytes already, and is not copied. Restores and fetches write through memoryviews
    and bump the counters of what they write (:func:`mark_written`), so several restores in a row are
    safe. Returns the number of bytes copied.
    """
    if isinstance(snapshot, StateSnapshot):
        header, payload = snapshot.header, snapshot.views()
        bound = ReceiveTarget(objects).bind(header)
        skip: set[int] = set()
        if unchanged and snapshot.sources:
            wrappers = bound.target.wrappers
            skip = {i for i, (spec, dst, (ptr, version))
                    in enumerate(zip(header.tensors, bound.tensors, snapshot.sources, strict=True))
                    if ptr in unchanged and dst.data_ptr() == ptr
                    and in_place_version(dst, wrappers.get(spec.name)) == version}
        bound.write_payload(payload, skip)
        copied = sum(s.nbytes for i, s in enumerate(header.tensors) if i not in skip)
    else:
        header = unpack_header(snapshot[0])
        bound = ReceiveTarget(objects).bind(header)
        bound.write_payload(snapshot[1])
        copied = header.total_nbytes
    bound.verify()
    bound.apply()
    return copied


# --------------------------------------------------------------------------------------------------
# hot-spare helpers


_TRAINER_HELD: "weakref.WeakKeyDictionary[Any, Callable[[], bool]]" = weakref.WeakKeyDictionary()
"""Optimizers a :class:`~gossiprec.trainer.ResilientTrainer` holds -> whether its rank trains now."""
_warned = False
"""Whether this process has warned once of a call on a trainer's optimizer (see below)."""


def held_by(objects: Mapping[str, Any], trains: Callable[[], bool]) -> None:
    """Note the optimizers among ``objects`` as held by a rank; ``trains()``: whether it trains now."""
    for obj in objects.values():
        if hasattr(obj, "param_groups") and hasattr(obj, "state"):
            try:
                _TRAINER_HELD[obj] = trains
            except TypeError:  # (not weakly referenceable: nothing to warn about then)
                pass


def materialize_optimizer_state(optimizer: Any) -> None:
    """Allocate the per-parameter state of ``optimizer`` (Adam, AdamW, SGD with momentum, ...).

    Only a spare needs this, and :meth:`ResilientTrainer.start` does it for a spare. Called on the
    optimizer of a rank that trains (its ``ResilientTrainer`` started with a rank), it warns once per
    process (a ``UserWarning``) and runs: its step counters then read 1 before the first real step
    (AdamW's bias correction counts that step as the second).

    A hot spare builds model and optimizer in advance, but optimizers create their state lazily in
    the first ``step()``; without it the spare's layout would not match a donor's. This runs one step
    with every learning rate set to 0 and a zero gradient for each trainable parameter that has no
    state yet, then restores the learning rates and gradients. Parameters with state already are left
    out (their gradient is hidden during the step), so calling it twice changes nothing.

    The step counters and buffers it creates hold meaningless values (step=1, zero moments); they
    exist only to be overwritten by the transfer. With lr=0, Adam/AdamW/SGD leave parameter values
    unchanged; other optimizers may not, which does not matter as the transfer overwrites the model.
    """
    global _warned
    trains = _TRAINER_HELD.get(optimizer)
    if not _warned and trains is not None and trains():
        _warned = True
        warnings.warn("materialize_optimizer_state() on the optimizer of a rank that trains: its step "
                      "counters now read 1 before the first real step (AdamW counts that step as the "
                      "second); only a spare needs it, and ResilientTrainer.start() does that (warned once)",
                      UserWarning, stacklevel=2)
    allocate_state(optimizer)


def allocate_state(optimizer: Any) -> None:
    """:func:`materialize_optimizer_state` without its warning: what the library's own paths call (a
    spare's start, a rebuilt mesh, a checkpoint's template)."""
    import torch

    trainable = [p for g in optimizer.param_groups for p in g["params"] if p.requires_grad]
    missing = [p for p in trainable if not optimizer.state.get(p)]
    if not missing:
        return
    missing_ids = {id(p) for p in missing}
    saved_grads = {id(p): p.grad for p in trainable}
    saved_lr = [g["lr"] for g in optimizer.param_groups]
    try:
        for g in optimizer.param_groups:
            lr = g["lr"]
            g["lr"] = torch.zeros_like(lr) if isinstance(lr, torch.Tensor) else 0.0
        for p in trainable:
            p.grad = torch.zeros_like(p) if id(p) in missing_ids else None
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, saved_lr, strict=True):
            g["lr"] = lr
        for p in trainable:
            p.grad = saved_grads[id(p)]


def materialize_optimizers(objects: Mapping[str, Stateful]) -> None:
    """:func:`materialize_optimizer_state` for every optimizer among ``objects``, so that a spare's state
    arrives in memory already mapped; one that fails is left alone (its state then arrives anyway: a
    receiver allocates what the donor has and it lacks)."""
    import torch

    for name, obj in objects.items():
        if isinstance(obj, torch.optim.Optimizer):
            try:
                allocate_state(obj)
            except Exception as exc:  # the optimizer's own step: any error; the state then arrives anyway
                log.debug("could not allocate the state of optimizer %r in advance: %s", name, exc)
