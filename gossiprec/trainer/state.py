"""Complete training state as a msgpack header plus raw tensor bytes; never pickle.

Theory of operation
-------------------
A training state is a set of named objects that follow the :class:`Stateful` protocol
(``state_dict()`` / ``load_state_dict()``): model, optimizer, LR scheduler, a data-position object and
:class:`RNGState` (torch CPU and CUDA generators, Python ``random``, numpy when importable).

:func:`capture_state` walks each object's nested state dict depth-first in insertion order. Every tensor
leaf becomes an entry of the *payload*: a contiguous CPU tensor, described in the header by a
:class:`TensorSpec` (name, dtype, shape, byte offset, size, crc32). The offsets pack the tensors densely
in that order, so the payload is one flat byte range ``[0, total_nbytes)`` that can be split anywhere
(several donors each serve a slice). Everything else (ints, floats, str, bool, None, bytes, lists,
dicts with str/int keys) stays in the header's *tree*, where a tensor leaf is a msgpack ext reference
(code 1) to its index, a tuple is ext code 2 (so ``betas`` comes back a tuple) and a dict that carries
``_metadata`` (``nn.Module.state_dict``) is ext code 3. The header is a :class:`StateHeader`;
:func:`pack_header` / :func:`unpack_header` turn it into bytes and back, validating everything.

The receiving side never allocates per transfer: :class:`ReceiveTarget` takes the local objects'
own state dicts (a hot spare builds model and optimizer in advance, and
:func:`materialize_optimizer_state` allocates optimizer state by a zero-gradient, lr=0 step) and
uses those very tensors as destinations when they are contiguous CPU tensors (otherwise a CPU
staging tensor, pinned if asked). :meth:`ReceiveTarget.bind` matches the donor's header against the
local layout *by name* (optimizer state may be created in another order on the donor) and refuses
with :class:`LayoutMismatch` naming the differences. Bytes then land straight in the destinations
(:meth:`BoundTarget.views` gives zero-copy ``memoryview`` s over them), :meth:`BoundTarget.verify`
checks every crc32 (:class:`ChecksumMismatch`), and :meth:`BoundTarget.apply` rebuilds each tree
around the destination tensors and calls ``load_state_dict``. On any failure before ``apply`` the
destination tensors hold a mix of old and new bytes: the target is only good for another attempt.

crc32 (zlib, ~3.3 GB/s here) is the in-memory end-to-end check: computed at capture, it also catches
a snapshot that was mutated after it was taken (``copy=False`` while training runs on). Over the
network, :mod:`gossiprec.trainer.transfer` seals chunks with keyed GMAC tags instead (faster than
crc32 and unforgeable) and checks the crc32s only on request.
"""

from __future__ import annotations

import bisect
import copy
import ctypes
import random
import re
import struct
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Container, Iterable, Mapping, Protocol, Sequence, runtime_checkable

import msgpack

from gossiprec.errors import ConfigError, DecodeError, TransferError

if TYPE_CHECKING:  # torch is imported lazily: the non-torch parts of gossiprec must not pull it in
    import torch

HEADER_VERSION = 1
EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_META_DICT = 3
CHECKSUMS = ("crc32", "none")
MAX_TREE_DEPTH = 64
_DTYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


class LayoutMismatch(TransferError):
    """The donor's tensors (names, dtypes, shapes) differ from what the local objects hold."""


class ChecksumMismatch(TransferError):
    """Received bytes do not match the crc32 the donor computed when it captured the state."""


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One tensor of the payload: where its bytes are and what they mean."""

    name: str
    """Path in the state, ``object/key/key``, e.g. ``optimizer/state/0/exp_avg``."""
    dtype: str
    """torch dtype name without the ``torch.`` prefix, e.g. ``float32``."""
    shape: tuple[int, ...]
    offset: int
    """Byte offset in the flat payload."""
    nbytes: int
    crc32: int | None
    """zlib.crc32 of the bytes, or None when the header was captured with ``checksum=False``."""

    def key(self) -> tuple[str, str, tuple[int, ...]]:
        return (self.name, self.dtype, self.shape)


@dataclass(frozen=True, slots=True)
class StateHeader:
    """Everything but the tensor bytes. ``trees`` maps object name to its encoded state dict."""

    step: int
    tensors: tuple[TensorSpec, ...]
    trees: Mapping[str, Any]
    total_nbytes: int
    checksum: str = "crc32"
    version: int = HEADER_VERSION

    def to_wire(self) -> dict[str, Any]:
        """A msgpack-able dict (the trees hold msgpack ``ExtType`` references)."""
        return {
            "v": self.version,
            "step": self.step,
            "checksum": self.checksum,
            "total": self.total_nbytes,
            "tensors": [[s.name, s.dtype, list(s.shape), s.offset, s.nbytes, s.crc32]
                        for s in self.tensors],
            "trees": dict(self.trees),
        }

    @classmethod
    def from_wire(cls, obj: Any) -> StateHeader:
        """Validate a decoded header; raises :class:`DecodeError` on anything malformed."""
        if not isinstance(obj, dict):
            raise DecodeError("bad_state_header", "not a map")
        version = _field(obj, "v", int)
        if version != HEADER_VERSION:
            raise DecodeError("bad_state_header", f"version {version}, this build reads {HEADER_VERSION}")
        step = _field(obj, "step", int)
        checksum = _field(obj, "checksum", str)
        if checksum not in CHECKSUMS:
            raise DecodeError("bad_state_header", f"unknown checksum {checksum!r}")
        total = _field(obj, "total", int)
        raw_tensors = _field(obj, "tensors", list)
        trees = _field(obj, "trees", dict)
        specs: list[TensorSpec] = []
        offset = 0
        for i, row in enumerate(raw_tensors):
            specs.append(_spec_from_wire(i, row, offset, checksum))
            offset += specs[-1].nbytes
        if offset != total:
            raise DecodeError("bad_state_header", f"tensors add up to {offset} bytes, header says {total}")
        for name in trees:
            if not isinstance(name, str) or not name or "/" in name:
                raise DecodeError("bad_state_header", f"bad object name {name!r}")
        refs: list[int] = []
        for tree in trees.values():
            _collect_refs(tree, refs, 0)
        if sorted(refs) != list(range(len(specs))):
            raise DecodeError("bad_state_header", "tensor references do not match the tensor table")
        return cls(step=step, tensors=tuple(specs), trees=trees, total_nbytes=total,
                   checksum=checksum, version=version)

    def layout(self) -> tuple[tuple[str, str, tuple[int, ...]], ...]:
        return tuple(s.key() for s in self.tensors)


def pack_header(header: StateHeader) -> bytes:
    return msgpack.packb(header.to_wire(), use_bin_type=True)


def unpack_header(data: bytes | memoryview) -> StateHeader:
    """Inverse of :func:`pack_header`; raises :class:`DecodeError` on malformed bytes."""
    try:
        obj = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise DecodeError("bad_state_header", f"msgpack: {exc}") from exc
    return StateHeader.from_wire(obj)


def _field(obj: dict[Any, Any], key: str, typ: type) -> Any:
    value = obj.get(key)
    if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
        raise DecodeError("bad_state_header", f"field {key!r} missing or not {typ.__name__}")
    return value


def _spec_from_wire(i: int, row: Any, offset: int, checksum: str) -> TensorSpec:
    if not isinstance(row, list) or len(row) != 6:
        raise DecodeError("bad_state_header", f"tensor entry {i} is not a 6-item list")
    name, dtype_name, shape, off, nbytes, crc = row
    if not isinstance(name, str) or not isinstance(dtype_name, str) or not isinstance(shape, list):
        raise DecodeError("bad_state_header", f"tensor entry {i} has bad name/dtype/shape types")
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise DecodeError("bad_state_header", f"tensor {name!r} has a bad shape {shape!r}")
    if off != offset or not isinstance(nbytes, int):
        raise DecodeError("bad_state_header", f"tensor {name!r} is not packed densely (offset {off!r})")
    numel = 1
    for d in shape:
        numel *= d
    if nbytes != numel * dtype_itemsize(dtype_name):
        raise DecodeError("bad_state_header", f"tensor {name!r}: {nbytes} bytes for shape {shape}")
    if checksum == "crc32":
        if not isinstance(crc, int) or not 0 <= crc < 2**32:
            raise DecodeError("bad_state_header", f"tensor {name!r} lacks a crc32")
    elif crc is not None:
        raise DecodeError("bad_state_header", f"tensor {name!r} has a checksum but the header says none")
    return TensorSpec(name, dtype_name, tuple(shape), off, nbytes, crc)


def _collect_refs(node: Any, refs: list[int], depth: int) -> None:
    if depth > MAX_TREE_DEPTH:
        raise DecodeError("bad_state_header", f"state tree nested deeper than {MAX_TREE_DEPTH}")
    if isinstance(node, msgpack.ExtType):
        inner = _unpack_ext(node)
        if node.code == EXT_TENSOR:
            refs.append(inner)
        else:
            _collect_refs(inner, refs, depth + 1)
    elif isinstance(node, dict):
        for v in node.values():
            _collect_refs(v, refs, depth + 1)
    elif isinstance(node, list):
        for v in node:
            _collect_refs(v, refs, depth + 1)


def _unpack_ext(ext: msgpack.ExtType) -> Any:
    try:
        inner = msgpack.unpackb(ext.data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException, TypeError) as exc:
        raise DecodeError("bad_state_header", f"ext {ext.code}: {exc}") from exc
    if ext.code == EXT_TENSOR:
        if not isinstance(inner, int) or isinstance(inner, bool) or inner < 0:
            raise DecodeError("bad_state_header", "bad tensor reference")
    elif ext.code == EXT_TUPLE:
        if not isinstance(inner, list):
            raise DecodeError("bad_state_header", "bad tuple")
    elif ext.code == EXT_META_DICT:
        if not (isinstance(inner, list) and len(inner) == 2 and isinstance(inner[0], dict)
                and isinstance(inner[1], dict)):
            raise DecodeError("bad_state_header", "bad dict with metadata")
    else:
        raise DecodeError("bad_state_header", f"unknown ext code {ext.code}")
    return inner


# --------------------------------------------------------------------------------------------------
# dtypes and zero-copy byte views


def dtype_itemsize(name: str) -> int:
    """Bytes per element of the torch dtype ``name``; :class:`DecodeError` if it is not one."""
    return _dtype(name).itemsize


def _dtype(name: str) -> torch.dtype:
    import torch

    value = getattr(torch, name, None) if _DTYPE_NAME.match(name) else None
    if not isinstance(value, torch.dtype):
        raise DecodeError("bad_state_header", f"unknown dtype {name!r}")
    return value


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable, zero-copy ``memoryview`` (format ``B``) over a contiguous CPU tensor's bytes.

    The view keeps the tensor alive. Works for every dtype (bfloat16 too) and needs no numpy.
    """
    import torch

    if t.device.type != "cpu" or t.layout != torch.strided or not t.is_contiguous():
        raise ConfigError(f"need a contiguous, strided CPU tensor, got {t.device} {t.layout} "
                          f"contiguous={t.is_contiguous()}")
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(bytearray())
    arr = (ctypes.c_ubyte * n).from_address(t.data_ptr())
    arr._gossiprec_owner = t  # type: ignore[attr-defined]  # ties the tensor's life to the view
    return memoryview(arr).cast("B")


# --------------------------------------------------------------------------------------------------
# encoding state dicts


_TENSOR_REFS: list[msgpack.ExtType] = []
"""``_TENSOR_REFS[i]``: the tree's reference to payload tensor ``i`` (immutable, so shared by every capture)."""


def _tensor_ref(i: int) -> msgpack.ExtType:
    refs = _TENSOR_REFS
    while len(refs) <= i:
        refs.append(msgpack.ExtType(EXT_TENSOR, msgpack.packb(len(refs))))
    return refs[i]


def _encode(value: Any, path: tuple[str, ...], found: list[tuple[str, torch.Tensor]]) -> Any:
    """``value`` as a msgpack-ready tree; its tensors are appended to ``found`` and replaced by references.

    On every commit's path, so written for it: the tensors and leaves (numbers, strings, None) of a
    dict or list are taken in the loop over their container, without a call or a path of their own,
    and a dict's path is joined once, for its first tensor (an optimizer's state is hundreds of small
    dicts of tensors).
    """
    tensor_type = _tensor_type()
    if isinstance(value, tensor_type):
        found.append(("/".join(path), value))
        return _tensor_ref(len(found) - 1)
    if value is None or isinstance(value, (bool, int, float, str, bytes)):
        if isinstance(value, int) and not isinstance(value, bool) and not -2**63 <= value < 2**64:
            raise ConfigError(f"state value at {'/'.join(path)} = {value} does not fit 64 bits")
        return value
    if len(path) > MAX_TREE_DEPTH:
        raise ConfigError(f"state nested deeper than {MAX_TREE_DEPTH} at {'/'.join(path)}")
    if isinstance(value, dict):
        enc: dict[Any, Any] = {}
        refs = _TENSOR_REFS
        prefix = ""
        for k, v in value.items():
            tk = type(k)
            if tk is not str and (tk is bool or not isinstance(k, (str, int))):
                raise ConfigError(f"state dict key {k!r} at {'/'.join(path)} is a {tk.__name__}; "
                                  "only str and int keys can be transferred")
            if isinstance(v, tensor_type):
                if not prefix:
                    prefix = "/".join(path) + "/"
                n = len(found)
                found.append((prefix + (k if tk is str else str(k)), v))
                enc[k] = refs[n] if n < len(refs) else _tensor_ref(n)
            elif _plain(v):
                enc[k] = v
            else:
                enc[k] = _encode(v, (*path, str(k)), found)
        meta = getattr(value, "_metadata", None)
        if isinstance(meta, dict):
            return msgpack.ExtType(EXT_META_DICT, msgpack.packb([enc, _encode_meta(meta, path)], use_bin_type=True))
        return enc
    if isinstance(value, (list, tuple)):
        items = [v if _plain(v) else _encode(v, (*path, str(i)), found) for i, v in enumerate(value)]
        if isinstance(value, list):
            return items
        return msgpack.ExtType(EXT_TUPLE, msgpack.packb(items, use_bin_type=True))
    raise ConfigError(f"state value at {'/'.join(path)} is a {type(value).__name__}; only tensors, "
                      "None, bool, int, float, str, bytes, lists, tuples and dicts can be transferred: "
                      "convert it in that object's state_dict()")


_TENSOR_TYPE: Any = None


def _tensor_type() -> Any:
    """``torch.Tensor``, imported on first use (this module is imported by processes without torch)."""
    global _TENSOR_TYPE
    if _TENSOR_TYPE is None:
        import torch

        _TENSOR_TYPE = torch.Tensor
    return _TENSOR_TYPE


_META_CACHE: dict[tuple[str, ...], tuple[dict[Any, Any], Any]] = {}
"""path -> (a copy of the last ``_metadata`` seen there, its encoding); see :func:`_encode_meta`."""
_META_CACHE_MAX = 256


def _encode_meta(meta: dict[Any, Any], path: tuple[str, ...]) -> Any:
    """The encoding of a state dict's ``_metadata`` (nn.Module's: one ``{"version": n}`` per module).

    Encoding it cost a model most of its walk (13 of 16 us for 5 modules; it grows with the module
    count) although it does not change between commits, so the last encoding per path is kept and
    reused while the metadata compares equal (a C-level comparison, ~0.1 us per module).
    """
    hit = _META_CACHE.get(path)
    if hit is not None and hit[0] == meta:
        return hit[1]
    encoded = _encode(dict(meta), (*path, "_metadata"), [])
    if len(_META_CACHE) >= _META_CACHE_MAX:
        _META_CACHE.clear()
    _META_CACHE[path] = (copy.deepcopy(dict(meta)), encoded)
    return encoded


_LEAF_TYPES = frozenset({float, str, bytes, bool, type(None)})


def _plain(v: Any) -> bool:
    """A leaf :func:`_encode` keeps as it is: one of the exact types above, or an int that fits 64 bits."""
    t = type(v)
    return t in _LEAF_TYPES or (t is int and -2**63 <= v < 2**64)


def _decode(node: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(node, msgpack.ExtType):
        inner = _unpack_ext(node)
        if node.code == EXT_TENSOR:
            return tensors[inner]
        if node.code == EXT_TUPLE:
            return tuple(_decode(v, tensors) for v in inner)
        out = OrderedDict((k, _decode(v, tensors)) for k, v in inner[0].items())
        out._metadata = _decode(inner[1], tensors)  # type: ignore[attr-defined]
        return out
    if isinstance(node, dict):
        return {k: _decode(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [_decode(v, tensors) for v in node]
    return node


def _walk_objects(objects: Mapping[str, Stateful]
                  ) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    trees: dict[str, Any] = {}
    found: list[tuple[str, torch.Tensor]] = []
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"state object name {name!r} must be a non-empty str without '/'")
        trees[name] = _encode(obj.state_dict(), (name,), found)
    return trees, found


# --------------------------------------------------------------------------------------------------
# payload geometry: chunks (never across a tensor) and stripes (byte ranges served by one donor each)


def plan_chunks(specs: Sequence[TensorSpec], start: int, end: int,
                chunk_size: int) -> list[tuple[int, int, int]]:
    """Chunks ``(tensor index, first byte, end byte)`` covering payload bytes ``[start, end)``.

    Chunks are at most ``chunk_size`` bytes and never cross a tensor boundary; empty tensors get none.
    Donor and receiver compute the same list from the same header.
    """
    if chunk_size < 1:
        raise ConfigError("chunk_size must be >= 1")
    out: list[tuple[int, int, int]] = []
    first = max(0, bisect.bisect_right([s.offset for s in specs], start) - 1)
    for i in range(first, len(specs)):
        s = specs[i]
        if s.offset >= end:
            break
        pos, stop = max(start, s.offset), min(end, s.offset + s.nbytes)
        while pos < stop:
            nxt = min(pos + chunk_size, stop)
            out.append((i, pos - s.offset, nxt - s.offset))
            pos = nxt
    return out


def select_chunks(chunks: Sequence[tuple[int, int, int]], specs: Sequence[TensorSpec], start: int,
                  end: int) -> range:
    """Indices of the chunks whose first payload byte lies in ``[start, end)``."""
    starts = [specs[ti].offset + lo for ti, lo, _ in chunks]
    return range(bisect.bisect_left(starts, start), bisect.bisect_left(starts, end))


def even_stripes(total: int, n: int, align: int = 4096) -> list[tuple[int, int]]:
    """Split ``[0, total)`` into ``n`` contiguous ranges of nearly equal size, cut at ``align``."""
    if n < 1:
        raise ConfigError("need at least one stripe")
    cuts = [0] + [min(total, (total * k // n) // align * align) for k in range(1, n)] + [total]
    return [(cuts[k], cuts[k + 1]) for k in range(n)]


# --------------------------------------------------------------------------------------------------
# capture (donor side)


@dataclass(frozen=True, slots=True)
class StateSnapshot:
    """A captured state: the header and the payload tensors (contiguous, CPU) in header order."""

    header: StateHeader
    tensors: tuple[torch.Tensor, ...]
    sources: tuple[tuple[int, int], ...] = ()
    """``(data_ptr, in-place version)`` of each copied source tensor at capture (empty when not copied):
    :func:`restore_state` skips tensors that still hold exactly these bytes."""

    @property
    def step(self) -> int:
        return self.header.step

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
    tensor's crc32 goes into the header (about 30 ms per 100 MB here).

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

    ``versions`` are the sources' in-place version counters at capture: :meth:`modified` tells whether any
    source was modified before its copy finished (the snapshot would then mix two steps).

    A CUDA source is copied into a pinned host tensor on a side stream of its device, which first
    waits for ``ready`` (an event recorded at capture on the capturing thread's current stream: the
    copy sees the optimizer step, however far the host ran ahead of the device). The DMA then runs
    beside the next step's kernels; :meth:`run` returns once it is done. The caller must not let the
    next optimizer step modify the sources before :meth:`run` has returned (what ``modified`` checks).
    """

    pairs: list[tuple[torch.Tensor, torch.Tensor]]
    names: list[str]
    versions: list[int]
    ready: dict[Any, Any] = field(default_factory=dict)
    """CUDA device -> event recorded at capture (see the class docstring); empty for CPU sources."""
    nbytes: int = 0
    """Bytes the copies move (summed at capture)."""

    def run(self) -> None:
        """Make the copies (host-to-host ones in one ``_foreach_copy_``: an optimizer's state is
        hundreds of small tensors, and one ``copy_`` each cost ~1.4 us of dispatch apiece)."""
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
        return [n for n, (_, src), v in zip(self.names, self.pairs, self.versions, strict=True)
                if src._version != v]


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
                     defer: Container[int] = ()) -> tuple[StateSnapshot, DeferredCopies]:
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
    trees, found = _walk_objects(objects)
    spare: list[torch.Tensor | None] = [None] * len(found)
    old_specs: Sequence[TensorSpec | None] = spare
    if reuse is not None and copy and [s.name for s in reuse.header.tensors] == [n for n, _ in found]:
        spare = list(reuse.tensors)
        old_specs = reuse.header.tensors
    tensors: list[torch.Tensor] = []
    specs: list[TensorSpec] = []
    sources: list[tuple[int, int]] = []
    deferred = DeferredCopies([], [], [])
    devices: set[Any] = set()  # CUDA devices of deferred sources
    offset = 0
    strided = torch.strided
    with torch.no_grad():  # copies from parameters must not join their autograd graph: no detach needed
        for (name, t), old, old_spec in zip(found, spare, old_specs, strict=True):
            if t.layout != strided:
                raise ConfigError(f"tensor {name} has layout {t.layout}; only dense tensors can be "
                                  "transferred (convert sparse tensors in state_dict())")
            ptr, version = t.data_ptr(), t._version
            kept = old is not None and old.dtype == t.dtype and old.shape == t.shape
            if copy and defer and ptr in defer and (t.is_cpu or t.is_cuda) and t.is_contiguous():
                if checksum:
                    raise ConfigError("checksum=True needs every tensor's bytes at capture; defer nothing")
                if t.is_cuda:
                    if old is None or not kept or not old.is_pinned():
                        old = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                        kept = False
                    devices.add(t.device)
                elif not kept:
                    old = torch.empty_like(t, memory_format=torch.contiguous_format)
                deferred.pairs.append((old, t))
                deferred.names.append(name)
                deferred.versions.append(version)
                deferred.nbytes += old.nbytes
                payload_t = old
            elif kept:
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
                crc = zlib.crc32(tensor_bytes(payload_t)) if checksum else None
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
    return StateSnapshot(header=header, tensors=tuple(tensors), sources=tuple(sources) if copy else ()), deferred


# --------------------------------------------------------------------------------------------------
# receive side


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
        _, found = _walk_objects(self.objects)
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
                dests.append(torch.empty(spec.shape, dtype=_dtype(spec.dtype), pin_memory=self._pin))
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
        for name, tree in self.header.trees.items():
            self.target.objects[name].load_state_dict(_decode(tree, self.tensors))


def mark_written(tensors: Sequence[torch.Tensor]) -> None:
    """Bump the in-place version counters of ``tensors``, whose bytes are (about to be) written outside
    torch, through memoryviews. A restore may skip a tensor whose version still equals a snapshot's
    record of it (:func:`restore_state`); without the bump, bytes written behind torch's back (a fetch,
    an earlier restore) would pass for the snapshot's."""
    if tensors:
        from torch.autograd.graph import increment_version

        increment_version(list(tensors))


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
            skip = {i for i, (dst, (ptr, version)) in enumerate(zip(bound.tensors, snapshot.sources, strict=True))
                    if ptr in unchanged and dst.data_ptr() == ptr and dst._version == version}
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


def materialize_optimizer_state(optimizer: Any) -> None:
    """Allocate the per-parameter state of ``optimizer`` (Adam, AdamW, SGD with momentum, ...).

    A hot spare builds model and optimizer in advance, but optimizers create their state lazily in
    the first ``step()``; without it the spare's layout would not match a donor's. This runs one step
    with every learning rate set to 0 and a zero gradient for each trainable parameter that has no
    state yet, then restores the learning rates and gradients. Parameters with state already are left
    out (their gradient is hidden during the step), so calling it twice changes nothing.

    The step counters and buffers it creates hold meaningless values (step=1, zero moments); they
    exist only to be overwritten by the transfer. With lr=0, Adam/AdamW/SGD leave parameter values
    unchanged; other optimizers may not, which does not matter as the transfer overwrites the model.
    """
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


class RNGState:
    """The process's random generators as a :class:`Stateful`.

    ``state_dict()`` holds ``torch`` (CPU generator state, a uint8 tensor), ``cuda`` (one tensor per
    device, when CUDA is available), ``python`` (``random.getstate()``, its 625 words as
    little-endian bytes) and ``numpy`` (the legacy global ``np.random`` state, keys as little-endian
    bytes, when numpy is importable). Pass ``cuda``/``numpy`` explicitly to
    force the layout, e.g. when donors and receivers differ in what is installed.
    """

    def __init__(self, *, cuda: bool | None = None, numpy: bool | None = None) -> None:
        import torch

        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        if numpy is None:
            try:
                import numpy as _np  # noqa: F401
                numpy = True
            except ImportError:
                numpy = False
        self.numpy = numpy

    def state_dict(self) -> dict[str, Any]:
        import torch

        # the Mersenne Twisters' 625 words travel as one little-endian bytes value, not 625 ints:
        # walking them on every commit cost ~2.5 ms
        raw_python, raw_numpy = _raw_readers()
        python = raw_python.read() if raw_python is not None else None
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": python or _python_rng_state(random)}
        if self.cuda:
            sd["cuda"] = list(torch.cuda.get_rng_state_all())
        if self.numpy:
            st = raw_numpy.read() if raw_numpy is not None else None
            if st is None:
                import numpy as np

                st = _numpy_rng_state(np.random)
            sd["numpy"] = st
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        import torch

        try:
            torch.set_rng_state(state_dict["torch"])
            version, internal, gauss = state_dict["python"]
            random.setstate((version, _unpack_words(internal), gauss))
            if self.cuda:
                torch.cuda.set_rng_state_all(state_dict["cuda"])
            if self.numpy:
                import numpy as np

                st = state_dict["numpy"]
                keys = st["keys"]
                keys = (np.frombuffer(keys, dtype="<u4").astype(np.uint32) if isinstance(keys, bytes)
                        else np.asarray(keys, dtype=np.uint32))
                np.random.set_state((st["algo"], keys, st["pos"], st["has_gauss"], st["cached_gaussian"]))
        except (KeyError, TypeError, ValueError, RuntimeError, struct.error) as exc:
            raise TransferError(f"RNG state does not fit this process ({exc}); donor and receiver must "
                                "agree on CUDA and numpy being present") from exc


def _python_rng_state(gen: Any) -> list[Any]:
    """What :meth:`RNGState.state_dict` stores under ``python`` for ``gen`` (the ``random`` module or a
    ``random.Random``), through ``getstate()``."""
    version, internal, gauss = gen.getstate()
    return [version, _pack_words(internal), gauss]


def _numpy_rng_state(gen: Any) -> dict[str, Any]:
    """What :meth:`RNGState.state_dict` stores under ``numpy`` for ``gen`` (``numpy.random`` or a
    ``RandomState``), through ``get_state``."""
    import numpy as np

    algo, keys, pos, has_gauss, cached = gen.get_state(legacy=True)
    return {"algo": str(algo), "keys": np.asarray(keys, dtype="<u4").tobytes(), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


class _RawPythonRNG:
    """Python ``random``'s global state read from its C struct: what :meth:`RNGState.state_dict` stores
    under ``python``, in ~1 us instead of ~15 us (``random.getstate()`` builds 625 ints, then they are
    packed again).

    CPython's ``RandomObject`` is ``{PyObject_HEAD; int index; uint32_t state[624]}``. The offsets are
    not assumed: :meth:`probe` finds them on a scratch generator and checks the reading against
    ``getstate()`` (after draws and a ``gauss()``, and on the global generator too); anything
    unexpected (another interpreter, a replaced ``random._inst``, a big-endian machine) leaves the
    reader unset and ``getstate()`` in use. Every :meth:`read` first checks that ``random._inst`` is
    still the generator it was probed on, else returns None (the caller falls back).
    """

    INDEX_AT = struct.calcsize("P") * 2
    """Offset of ``index`` (after PyObject_HEAD: refcount and type); the 624 words follow it."""

    def __init__(self, inst: Any) -> None:
        self.inst = inst

    @staticmethod
    def _read(gen: Any) -> list[Any]:
        raw = ctypes.string_at(id(gen) + _RawPythonRNG.INDEX_AT, 2500)  # one read: index and words of one state
        return [gen.VERSION, raw[4:] + raw[:4], gen.gauss_next]

    def read(self) -> list[Any] | None:
        inst = random._inst  # type: ignore[attr-defined]
        return self._read(inst) if inst is self.inst else None

    @classmethod
    def probe(cls) -> _RawPythonRNG | None:
        import sys

        inst = getattr(random, "_inst", None)
        if (sys.byteorder != "little" or sys.implementation.name != "cpython" or type(inst) is not random.Random
                or getattr(random.getstate, "__self__", None) is not inst):
            return None
        scratch = random.Random(20260301)
        scratch.random()
        scratch.gauss()
        try:
            if any(cls._read(gen) != _python_rng_state(gen) for gen in (scratch, inst)):
                return None
        except (struct.error, TypeError, ValueError):
            return None
        return cls(inst)


class _RawNumpyRNG:
    """numpy's legacy global ``RandomState`` read from its C structs: what :meth:`RNGState.state_dict`
    stores under ``numpy``, in ~2 us instead of ~42 us (``get_state`` copies the 624 key words one
    by one into a new array).

    The MT19937 state (``uint32_t key[624]; int pos``) is at the bit generator's
    ``ctypes.state_address``; the cached Gaussian (``has_gauss``, ``gauss``) lives in the
    ``RandomState`` object, in an ``aug_bitgen_t`` (``{bitgen_t *bit_generator; int has_gauss; double
    gauss}``) whose first field points at the object's own ``bitgen_t`` copy, which starts with the
    state address. :meth:`probe` finds both offsets by those two pointers, within the object's
    ``__basicsize__``, on a scratch ``RandomState``, and checks the reading against ``get_state``
    with and without a cached Gaussian, then on the global one; if anything differs it returns None
    and ``get_state`` stays in use. Every :meth:`read` checks that the global generator, its bit
    generator and both pointers are still the probed ones, else returns None (the caller falls back).
    """

    def __init__(self, mtrand: Any, bitgen_at: int, aug_at: int) -> None:
        self.mtrand = mtrand
        self.rs = mtrand._rand
        self.bg = self.rs._bit_generator
        self.state_address = int(self.bg.ctypes.state_address)
        self.bitgen_at, self.aug_at = bitgen_at, aug_at

    def _fields(self, rs: Any) -> tuple[int, int, float] | None:
        """(state address, has_gauss, gauss) as read in ``rs``; None if its aug_bitgen_t does not point
        at its own bitgen_t."""
        base = id(rs)
        state_ptr, = struct.unpack("=Q", ctypes.string_at(base + self.bitgen_at, 8))
        aug_ptr, has_gauss, gauss = struct.unpack("=Qi4xd", ctypes.string_at(base + self.aug_at, 24))
        if aug_ptr != base + self.bitgen_at:
            return None
        return state_ptr, has_gauss, gauss

    def _read(self, rs: Any, state_address: int) -> dict[str, Any] | None:
        f = self._fields(rs)
        if f is None or f[0] != state_address:
            return None
        raw = ctypes.string_at(state_address, 2500)  # one read: keys and pos of one state
        if self._fields(rs) != f:  # another thread seeded or set the state in between: use get_state
            return None
        pos, = struct.unpack("=i", raw[2496:])
        return {"algo": "MT19937", "keys": raw[:2496], "pos": pos, "has_gauss": f[1], "cached_gaussian": f[2]}

    def read(self) -> dict[str, Any] | None:
        rs = self.mtrand._rand
        if rs is not self.rs or rs._bit_generator is not self.bg:
            return None
        return self._read(rs, self.state_address)

    @classmethod
    def probe(cls) -> _RawNumpyRNG | None:
        import sys

        try:
            import numpy as np
            from numpy.random import MT19937, RandomState
        except ImportError:
            return None
        rs = getattr(np.random.mtrand, "_rand", None)
        if (sys.byteorder != "little" or sys.implementation.name != "cpython" or struct.calcsize("P") != 8
                or type(rs) is not RandomState
                or type(rs._bit_generator) is not MT19937):
            return None
        scratch = RandomState(20260301)
        size = type(scratch).__basicsize__
        base, address = id(scratch), int(scratch._bit_generator.ctypes.state_address)
        words = struct.unpack(f"={size // 8}Q", ctypes.string_at(base, size // 8 * 8))
        bitgen = [i * 8 for i, w in enumerate(words) if w == address]
        if len(bitgen) != 1:
            return None
        aug = [i * 8 for i, w in enumerate(words) if w == base + bitgen[0]]
        if len(aug) != 1 or aug[0] + 24 > size:
            return None
        reader = cls(np.random.mtrand, bitgen[0], aug[0])
        try:
            scratch.standard_normal()  # leaves one Gaussian cached
            ok = reader._read(scratch, address) == _numpy_rng_state(scratch)
            scratch.standard_normal()  # takes it
            scratch.random_sample(3)
            ok = (ok and reader._read(scratch, address) == _numpy_rng_state(scratch)
                  and reader.read() == _numpy_rng_state(rs))
        except (struct.error, TypeError, ValueError):
            return None
        return reader if ok else None


def _pack_words(words: Sequence[int]) -> bytes:
    """Python ``random``'s internal state (32-bit words) as little-endian bytes."""
    return struct.pack(f"<{len(words)}I", *words)


def _unpack_words(data: bytes | Sequence[int]) -> tuple[int, ...]:
    """Inverse of :func:`_pack_words`; also takes the list form older snapshots used."""
    if isinstance(data, (bytes, bytearray)):
        if len(data) % 4:
            raise ValueError(f"python RNG state of {len(data)} bytes is not whole 32-bit words")
        return struct.unpack(f"<{len(data) // 4}I", data)
    return tuple(data)


_RAW_READERS: list[Any] = []
"""``[python reader or None, numpy reader or None]`` once probed (on the first :meth:`RNGState.state_dict`:
numpy is not imported before, as agents import this module)."""


def _raw_readers() -> list[Any]:
    if not _RAW_READERS:
        _RAW_READERS[:] = [_RawPythonRNG.probe(), _RawNumpyRNG.probe()]
    return _RAW_READERS


def training_state(model: Any, optimizer: Any, scheduler: Any = None, data: Any = None, *,
                   rng: bool = True) -> dict[str, Stateful]:
    """The usual objects under their conventional names (``model``, ``optimizer``, ...)."""
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        objects["scheduler"] = scheduler
    if data is not None:
        objects["data"] = data
    if rng:
        objects["rng"] = RNGState()
    return objects
