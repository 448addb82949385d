"""The state's serialized form: a msgpack header (tensor table and trees) plus raw tensor bytes; never pickle.

A training state is a set of named :class:`~gossiprec.trainer.objects.Stateful` objects. Their state
dicts are walked depth-first in insertion order (:func:`walk_objects`). Every tensor leaf becomes an
entry of the *payload*, described in the header by a :class:`TensorSpec` (name, dtype, shape, byte
offset, size, crc32); the offsets pack the tensors densely in that order, so the payload is one flat
byte range ``[0, total_nbytes)`` that can be split anywhere. Everything else (ints, floats, str, bool,
None, bytes, lists, dicts with str/int keys) stays in the header's *tree*, where a tensor leaf is a
msgpack ext reference (code 1) to its index, a tuple is ext code 2 (so ``betas`` comes back a tuple)
and a dict that carries ``_metadata`` (``nn.Module.state_dict``) is ext code 3.

:func:`pack_header` / :func:`unpack_header` turn a :class:`StateHeader` into bytes and back; decoding
validates everything (the bytes may come from the network) and raises
:class:`~gossiprec.errors.DecodeError`.
"""

from __future__ import annotations

import copy
import ctypes
import re
import sys
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence, cast

import msgpack

from gossiprec.errors import ConfigError, DecodeError

if TYPE_CHECKING:  # torch is imported lazily: the non-torch parts of gossiprec must not pull it in
    import torch

    from gossiprec.trainer.objects import Stateful

HEADER_VERSION = 1
EXT_TENSOR = 1
EXT_TUPLE = 2
EXT_META_DICT = 3
CHECKSUMS = ("crc32", "none")
MAX_TREE_DEPTH = 64
_DTYPE_NAME = re.compile(r"^[a-z][a-z0-9_]{0,31}$")


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
    return cast(bytes, msgpack.packb(header.to_wire(), use_bin_type=True))


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
    return dtype_of(name).itemsize


def dtype_of(name: str) -> torch.dtype:
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

    Encoding it is most of a model's walk, growing with the module count, although it does not change
    between commits; so the last encoding per path is kept and reused while the metadata compares
    equal (a C-level comparison, much cheaper than the encoding).
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


def decode_tree(node: Any, tensors: Sequence[torch.Tensor]) -> Any:
    if isinstance(node, msgpack.ExtType):
        inner = _unpack_ext(node)
        if node.code == EXT_TENSOR:
            return tensors[inner]
        if node.code == EXT_TUPLE:
            return tuple(decode_tree(v, tensors) for v in inner)
        out = OrderedDict((k, decode_tree(v, tensors)) for k, v in inner[0].items())
        out._metadata = decode_tree(inner[1], tensors)  # type: ignore[attr-defined]
        return out
    if isinstance(node, dict):
        return {k: decode_tree(v, tensors) for k, v in node.items()}
    if isinstance(node, list):
        return [decode_tree(v, tensors) for v in node]
    return node


def walk_objects(objects: Mapping[str, Stateful], *, wrappers: dict[str, Any] | None = None
                 ) -> tuple[dict[str, Any], list[tuple[str, torch.Tensor]]]:
    """Each object's encoded tree, and every tensor of the state with its path, in payload order.

    A ``DTensor`` (tensor parallelism, FSDP2 parameters and their optimizer state) stands for its
    local shard: that is what this rank holds, saves and serves, and what the same coordinate of
    another replica holds too. ``wrappers`` (if given) gets each such path -> the DTensor, so that a
    receiver can wrap the bytes it landed in the shard again (:class:`~gossiprec.trainer.state.receive.ReceiveTarget`).
    """
    trees: dict[str, Any] = {}
    found: list[tuple[str, torch.Tensor]] = []
    for name, obj in objects.items():
        if not isinstance(name, str) or not name or "/" in name:
            raise ConfigError(f"state object name {name!r} must be a non-empty str without '/'")
        trees[name] = _encode(obj.state_dict(), (name,), found)
    dtensor = _dtensor_type()
    if dtensor is not None:
        for i, (path, t) in enumerate(found):
            if isinstance(t, dtensor):
                found[i] = (path, t._local_tensor)
                if wrappers is not None:
                    wrappers[path] = t
    return trees, found


def in_place_version(local: torch.Tensor, wrapper: Any = None) -> int:
    """The in-place version of a state tensor as :func:`walk_objects` found it (``wrapper``: the DTensor
    whose local shard ``local`` is, from its ``wrappers``). An in-place op through a DTensor (the
    optimizer step on FSDP2 or tensor-parallel parameters and moments) bumps the DTensor's counter
    only, not its shard's; a write to the shard (a restore, a fetch) bumps the shard's only. Both only
    grow, so their sum moves whenever either tensor is written."""
    return local._version + (wrapper._version if wrapper is not None else 0)


def _dtensor_type() -> Any:
    """torch's ``DTensor`` class if a program imported it (no DTensor can exist otherwise), else None."""
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None) if module is not None else None
