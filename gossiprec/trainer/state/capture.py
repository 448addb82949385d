"""Capture (the donor side): copy the registered objects' state into a snapshot, now or deferred.

:func:`capture_state` walks the objects (:func:`~gossiprec.trainer.state.header.walk_objects`) and copies
every tensor into a contiguous CPU tensor of the payload, optionally with its crc32 in the header.
crc32 is the in-memory end-to-end check: computed at capture, it also catches a snapshot that was
mutated after it was taken (``copy=False`` while training runs on). Over the network the transfer
seals chunks with keyed GMAC tags instead (:mod:`gossiprec.trainer.transfer.wire`).

:func:`capture_deferred` leaves the copies of chosen tensors (those only the optimizer step changes)
to the caller as :class:`DeferredCopies`, to run while the next step computes; a CUDA source then goes
to pinned host memory on a side stream, so the DMA runs beside the next step's kernels.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Container, Mapping, Sequence, cast

from gossiprec.errors import ConfigError
from gossiprec.trainer.state.header import (
    StateHeader, TensorSpec, dtype_name, in_place_version, tensor_bytes, walk_objects,
)

if TYPE_CHECKING:  # torch is imported lazily: the non-torch parts of gossiprec must not pull it in
    import torch

    from gossiprec.trainer.objects import Stateful


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """A captured state: the header and the payload tensors (contiguous, CPU) in header order."""

    header: StateHeader
    tensors: tuple[torch.Tensor, ...]
    sources: tuple[tuple[int, int], ...] = ()
    """``(data_ptr, in-place version)`` of each copied source tensor at capture (empty when not copied;
    the version as :func:`~gossiprec.trainer.state.header.in_place_version` reads it):
    :func:`restore_state` skips tensors that still hold exactly these bytes."""
    live: tuple[int, ...] = ()
    """Indices of the payload tensors that are the live tensors themselves (no copy, see ``view`` in
    :func:`capture_deferred`): the snapshot is valid only while none of them was modified in place."""
    owners: tuple[Any, ...] = ()
    """One per index of :attr:`live`: the DTensor whose local shard that tensor is (None for a plain
    tensor): an optimizer step through the DTensor moves only the DTensor's version counter."""

    @property
    def step(self) -> int:
        return self.header.step

    def valid(self) -> bool:
        """No live tensor of the payload was modified since capture (always True without live tensors)."""
        return all(v == self.sources[i][1] for i, v in zip(self.live, self.live_versions(), strict=True))

    def live_versions(self) -> list[int]:
        """The in-place versions of the live tensors now, in the order of :attr:`live`."""
        return [in_place_version(self.tensors[i], o) for i, o in zip(self.live, self.owners, strict=True)]

    def host_bytes(self) -> int:
        """Bytes of host memory this snapshot holds of its own (live tensors are not its own)."""
        live = set(self.live)
        return sum(t.nbytes for i, t in enumerate(self.tensors) if i not in live and t.device.type == "cpu")

    def served(self) -> StateSnapshot:
        """This snapshot with every tensor in host memory: live CUDA tensors are copied now (a donor of
        the snapshot-free mode stages its device state for the duration of a transfer)."""
        if not any(self.tensors[i].device.type != "cpu" for i in self.live):
            return self
        tensors = tuple(t.to("cpu") if t.device.type != "cpu" else t for t in self.tensors)
        return StateSnapshot(self.header, tensors, self.sources, self.live, self.owners)

    def views(self) -> list[memoryview]:
        """Zero-copy byte views of the payload tensors, in header order."""
        return [tensor_bytes(t) for t in self.tensors]

    def payload(self) -> bytes:
        """The whole payload as one bytes object (a copy; for tests and small states)."""
        return b"".join(bytes(v) for v in self.views())


def capture_state(objects: Mapping[str, Stateful], *, step: int, copy: bool = True,
                  checksum: bool = True, reuse: StateSnapshot | None = None) -> StateSnapshot:
    """Capture ``objects`` (name -> Stateful) at training step ``step``.

    ``copy=True`` copies every tensor, so the snapshot stays valid while training moves on.
    ``copy=False`` keeps views of contiguous CPU tensors (others are still copied): only safe while
    the state does not change, e.g. when training is paused for a recovery. With ``checksum`` each
    tensor's crc32 goes into the header.

    ``reuse``: an older snapshot (copied, same layout) whose tensors are overwritten instead of
    allocating new ones; copying into memory already mapped is several times faster than cloning.
    The old snapshot is invalid afterwards (a server still serving it would send bytes that no
    longer match their seal, which receivers refuse).
    """
    snap, deferred = capture_deferred(objects, step=step, copy=copy, checksum=checksum, reuse=reuse)
    assert not deferred.pairs
    return snap


@dataclass(slots=True)
class DeferredCopies:
    """Tensor copies :func:`capture_deferred` left to the caller: ``dst.copy_(src)`` for each pair.

    ``versions`` are the sources' in-place versions at capture (``owners``: the DTensor of each source
    that is a local shard, else None; see :func:`~gossiprec.trainer.state.header.in_place_version`):
    :meth:`modified` tells whether any source was modified before its copy finished (the snapshot would
    then mix two steps).

    A CUDA source is copied into a pinned host tensor on a side stream of its device, which first
    waits for ``ready`` (an event recorded at capture on the capturing thread's current stream: the
    copy sees the optimizer step, however far the host ran ahead of the device). The DMA then runs
    beside the next step's kernels; :meth:`run` returns once it is done. The caller must not let the
    next optimizer step modify the sources before :meth:`run` has returned (what ``modified`` checks).
    """

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    names: list[str]
    versions: list[int]
    owners: list[Any] = field(default_factory=list)
    ready: dict[Any, Any] = field(default_factory=dict)
    """CUDA device -> event recorded at capture (see the class docstring); empty for CPU sources."""
    nbytes: int = 0
    """Bytes the copies move (summed at capture)."""

    def run(self) -> None:
        """Make the copies (host-to-host ones in one ``_foreach_copy_``: an optimizer's state is
        hundreds of small tensors, and one ``copy_`` each would pay torch's dispatch for every one)."""
        import torch

        streams = {dev: _side_stream(dev) for dev in self.ready}
        for dev, stream in streams.items():
            stream.wait_event(self.ready[dev])
        host_dst: list[torch.Tensor] = []
        host_src: list[torch.Tensor] = []
        with torch.no_grad():  # sources may be parameters: the copies must not join their autograd graph
            for dst, src in self.pairs:
                if src.is_cuda:
                    with torch.cuda.stream(streams[src.device]):
                        dst.copy_(src, non_blocking=True)
                else:
                    host_dst.append(dst)
                    host_src.append(src)
            if host_dst:
                torch._foreach_copy_(host_dst, host_src)
        for stream in streams.values():
            stream.synchronize()

    def modified(self) -> list[str]:
        """Names of the sources whose version counter moved since capture."""
        return [n for n, (_, src), v, o in zip(self.names, self.pairs, self.versions, self.owners, strict=True)
                if in_place_version(src, o) != v]


_SIDE_STREAMS: dict[Any, Any] = {}


def _side_stream(device: Any) -> Any:
    """The stream deferred device-to-host copies of ``device`` run on (one per device, made once)."""
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        import torch

        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


def capture_deferred(objects: Mapping[str, Stateful], *, step: int, copy: bool = True,
                     checksum: bool = False, reuse: StateSnapshot | None = None,
                     defer: Container[int] = (), view: Container[int] = ()) -> tuple[StateSnapshot, DeferredCopies]:
    """:func:`capture_state`, except that the copies of contiguous CPU and CUDA tensors whose
    ``data_ptr()`` is in ``defer`` are not made: the snapshot holds their (uninitialised or stale)
    destination tensors (pinned host memory for CUDA sources) and :class:`DeferredCopies` says what to
    copy. The snapshot is valid once ``run()`` has returned, and only if no source changed before that
    (``modified()`` is empty). ``checksum`` needs the bytes, so it cannot be combined with deferred
    tensors.
    """
    import torch

    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ConfigError(f"step must be an int >= 0, got {step!r}")
    wrappers: dict[str, Any] = {}
    trees, found = walk_objects(objects, wrappers=wrappers)
    spare: list[torch.Tensor | None] = [None] * len(found)
    old_specs: Sequence[TensorSpec | None] = cast("list[TensorSpec | None]", spare)  # all None here
    if reuse is not None and copy and [s.name for s in reuse.header.tensors] == [n for n, _ in found]:
        spare = list(reuse.tensors)
        old_specs = reuse.header.tensors
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    sources: list[tuple[int, int]] = []
    live: list[int] = []
    owners: list[Any] = []
    deferred = DeferredCopies([], [], [])
    devices: set[Any] = set()  # CUDA devices of deferred sources
    offset = 0
    strided = torch.strided
    with torch.no_grad():  # copies from parameters must not join their autograd graph: no detach needed
        for (name, t), old, old_spec in zip(found, spare, old_specs, strict=True):
            if t.layout != strided:
                raise ConfigError(f"tensor {name} has layout {t.layout}; only dense tensors can be "
                                  "transferred (convert sparse tensors in state_dict())")
            owner = wrappers.get(name)
            ptr, version = t.data_ptr(), in_place_version(t, owner)
            kept = old is not None and old.dtype == t.dtype and old.shape == t.shape
            if view and ptr in view and (t.is_cpu or t.is_cuda) and t.is_contiguous():
                payload_t = t.detach()  # shares the version counter: valid() sees the optimizer step
                live.append(len(tensors))
                owners.append(owner)
            elif copy and defer and ptr in defer and (t.is_cpu or t.is_cuda) and t.is_contiguous():
                if checksum:
                    raise ConfigError("checksum=True needs every tensor's bytes at capture; defer nothing")
                if t.is_cuda:
                    if old is None or not kept or not old.is_pinned():
                        old = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        kept = False
                    devices.add(t.device)
                elif not kept:
                    old = torch.empty_like(t, memory_format=torch.contiguous_format)
                assert old is not None  # made above unless kept (kept: old is not None)
                deferred.pairs.append((old, t))
                deferred.names.append(name)
                deferred.versions.append(version)
                deferred.owners.append(owner)
                deferred.nbytes += old.nbytes
                payload_t = old
            elif kept:
                assert old is not None  # kept: old is not None
                payload_t = old.copy_(t)
            elif t.device.type != "cpu":
                payload_t = t.to("cpu").contiguous()
            elif copy or not t.is_contiguous():
                payload_t = t.clone(memory_format=torch.contiguous_format)
            else:
                payload_t = t.detach() if t.requires_grad else t  # a view of the live tensor
            nbytes = payload_t.nbytes
            if kept and old_spec is not None and old_spec.offset == offset and old_spec.crc32 is None and not checksum:
                specs.append(old_spec)  # the buffer the last capture into it described: same name, dtype, shape
            else:
                host_t = payload_t.cpu() if payload_t.is_cuda else payload_t  # a live device tensor: crc of a copy
                crc = zlib.crc32(tensor_bytes(host_t)) if checksum else None
                specs.append(TensorSpec(name, dtype_name(payload_t.dtype), tuple(payload_t.shape), offset,
                                        nbytes, crc))
            tensors.append(payload_t)
            sources.append((ptr, version))
            offset += nbytes
    for dev in devices:  # after every source's capture: the copies see all the work queued before
        event = deferred.ready[dev] = torch.cuda.Event()
        event.record(torch.cuda.current_stream(dev))
    header = StateHeader(step=step, tensors=tuple(specs), trees=trees, total_nbytes=offset,
                         checksum="crc32" if checksum else "none")
    return StateSnapshot(header=header, tensors=tuple(tensors), sources=tuple(sources) if copy else (),
                         live=tuple(live), owners=tuple(owners)), deferred
