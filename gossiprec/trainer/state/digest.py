"""Cross-replica state digests: replicas of one shard must hold the same bytes; check that they do.

What it decides: whether the ranks of each replica group hold identical state at a given step, and if
not, which entries differ on which ranks. An entry is one tensor of the state (by its path, e.g.
``optimizer/state/0/exp_avg``) or one top-level key of an object's non-tensor values (``rng/numpy``,
``data/index``); its value is a crc32 of its bytes (a tensor's: :func:`gmac32`, faster, in the
comparison after a recovery, where nothing reuses checksums made at a commit).

The comparison takes one small all-reduce: every rank fills its row of a ``world x 3`` int64 matrix
with (entry count, crc of the entry names, crc of all values) and the others' rows are zero, so the
sum is everyone's rows. Only when rows of one replica group differ does a second all-reduce of
``world x entries`` name the entries. Equal entry lists are checked first: a gloo collective of
mismatched sizes terminates the process.

Everything recovery relies on (a donor's state is what its receiver would have computed) assumes
identical replicas; a rank that differs from the start (a generator seeded per rank, numpy's global
generator never seeded) or a survivor restored wrong would otherwise train on silently.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Container, Mapping, Sequence

import msgpack

from gossiprec.errors import RecoveryError
from gossiprec.trainer.state.capture import StateSnapshot, capture_state
from gossiprec.trainer.state.header import tensor_bytes
from gossiprec.trainer.objects import Stateful

if TYPE_CHECKING:
    import torch

SHOWN = 6
"""Entries and ranks named in a mismatch message (the rest are counted)."""


class ReplicaMismatch(RecoveryError):
    """Ranks of one replica group hold different state (see the message for which entries and ranks)."""

    def __init__(self, message: str, *, step: int, entries: tuple[str, ...], ranks: tuple[int, ...]) -> None:
        super().__init__(message)
        self.step = step
        self.entries = entries
        self.ranks = ranks


@dataclass(frozen=True, slots=True)
class StateDigest:
    """Per-entry crc32s of one rank's state at ``step`` (entries in state order)."""

    step: int
    names: tuple[str, ...]
    values: tuple[int, ...]

    def without(self, prefixes: tuple[str, ...]) -> StateDigest:
        """This digest less the entries whose names start with one of ``prefixes``."""
        if not prefixes:
            return self
        kept = [(n, v) for n, v in zip(self.names, self.values, strict=True) if not n.startswith(prefixes)]
        return StateDigest(self.step, tuple(n for n, _ in kept), tuple(v for _, v in kept))

    def summary(self) -> tuple[int, int, int]:
        """(entry count, crc of the names, crc of the values): equal summaries mean equal digests."""
        names = zlib.crc32("\0".join(self.names).encode())
        values = zlib.crc32(b"".join(v.to_bytes(4, "little") for v in self.values))
        return len(self.names), names, values


GMAC_PIECE = 1 << 30
"""Bytes hashed by one GMAC call (AES-GCM takes less than 2**31 bytes of associated data at once)."""
_GMAC: list[Any] = []


def gmac32(data: memoryview) -> int:
    """A 32-bit checksum of ``data``, 1.5 to 2 times as fast as crc32 here: GMAC (AES-GCM with the bytes as
    associated data) under a fixed, public key and nonce, the first 4 bytes of the tag (of the pieces'
    tags, beyond :data:`GMAC_PIECE`). GHASH is a polynomial hash that AES-NI and carry-less multiplication
    compute at several GB/s, with the GIL released. Public, it catches accidental differences, as crc32
    does, not forged ones: nothing here is secret, and the transfer authenticates the state on its own."""
    if not _GMAC:
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        _GMAC.append(AESGCM(bytes(16)))
    aead, nonce = _GMAC[0], bytes(12)
    if len(data) > GMAC_PIECE:
        data = memoryview(b"".join(aead.encrypt(nonce, b"", data[i:i + GMAC_PIECE])
                                   for i in range(0, len(data), GMAC_PIECE)))
    return int.from_bytes(aead.encrypt(nonce, b"", data)[:4], "little")


def tree_entries(trees: Mapping[str, Any]) -> list[tuple[str, int]]:
    """``(object/key, crc32)`` of each object's non-tensor values (tensors appear as references)."""
    out: list[tuple[str, int]] = []
    for obj, tree in trees.items():
        items = tree.items() if isinstance(tree, dict) else [("", tree)]
        for key, value in items:
            packed = msgpack.packb(value, use_bin_type=True)
            out.append((f"{obj}/{key}" if key != "" else obj, zlib.crc32(packed)))
    return out


class PendingDigest:
    """A digest being computed: the values of ``late`` tensors (changed only by the optimizer step) are
    hashed on a thread, the rest at once (a forward pass may change buffers and consumes the RNG).

    ``result()`` waits for the thread. Built from the live objects (``copy=False``: views, no copy).
    ``hasher``: each tensor's value (crc32, or :func:`gmac32` to compare with a :class:`SnapshotDigest`)."""

    def __init__(self, objects: Mapping[str, Stateful], step: int, late: Container[int] = (),
                 hasher: Callable[[memoryview], int] = zlib.crc32) -> None:
        import threading

        snap = capture_state(objects, step=step, copy=False, checksum=False)
        self.step = step
        self._hasher = hasher
        self._names = [s.name for s in snap.header.tensors]
        self._values: list[int | None] = [None] * len(self._names)
        later: list[int] = []
        for i, t in enumerate(snap.tensors):
            if t.data_ptr() in late:  # a view of the live tensor (copy=False); copies are hashed now
                later.append(i)
            else:
                self._values[i] = hasher(tensor_bytes(t))
        self._trees = tree_entries(snap.header.trees)
        self._snap: StateSnapshot | None = snap
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if later:
            self._thread = threading.Thread(target=self._hash, args=(later,), name="gossiprec-digest",
                                            daemon=True)
            self._thread.start()
        else:
            self._snap = None

    def _hash(self, indices: list[int]) -> None:
        snap = self._snap
        assert snap is not None
        try:
            for i in indices:  # zlib releases the GIL for large buffers: this overlaps the step's compute
                self._values[i] = self._hasher(tensor_bytes(snap.tensors[i]))
        except BaseException as exc:  # reported by result()
            self._error = exc

    def result(self) -> StateDigest:
        if self._thread is not None:
            self._thread.join()
            self._thread, self._snap = None, None
        if self._error is not None:
            raise RecoveryError(f"computing the state digest failed: {self._error}") from self._error
        values = [v for v in self._values if v is not None]
        assert len(values) == len(self._names)
        return StateDigest(self.step, tuple(self._names) + tuple(n for n, _ in self._trees),
                           tuple(values) + tuple(c for _, c in self._trees))


class SnapshotDigest:
    """The digest of a committed snapshot (a copy), computed on a thread: it waits for the snapshot's
    background copies (``wait``) and hashes every tensor of the copy (:func:`gmac32`). Nothing writes a
    snapshot's buffers before the commit after next, so the hash may run through the whole next step.

    ``result()`` waits for the thread."""

    def __init__(self, snap: StateSnapshot, wait: Callable[[], object]) -> None:
        import threading

        self.step = snap.step
        self._names = tuple(s.name for s in snap.header.tensors)
        self._trees = tree_entries(snap.header.trees)  # (copied at commit: small)
        self._values: tuple[int, ...] = ()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = threading.Thread(
            target=self._hash, args=(snap, wait), name="gossiprec-digest", daemon=True)
        self._thread.start()

    def _hash(self, snap: StateSnapshot, wait: Callable[[], object]) -> None:
        try:
            wait()
            # zlib releases the GIL for large buffers: this overlaps the step's compute
            self._values = tuple(gmac32(tensor_bytes(t)) for t in snap.tensors)
        except BaseException as exc:  # reported by result()
            self._error = exc

    def result(self) -> StateDigest:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            raise RecoveryError(f"computing the state digest failed: {self._error}") from self._error
        assert len(self._values) == len(self._names)
        return StateDigest(self.step, self._names + tuple(n for n, _ in self._trees),
                           self._values + tuple(c for _, c in self._trees))


def digest_of_snapshot(snap: StateSnapshot) -> StateDigest:
    """The digest of a checksummed snapshot (its header holds every tensor's crc32 already)."""
    crcs = [s.crc32 for s in snap.header.tensors]
    if any(c is None for c in crcs):
        raise ValueError("digest_of_snapshot needs a snapshot captured with checksum=True")
    trees = tree_entries(snap.header.trees)
    return StateDigest(snap.step, tuple(s.name for s in snap.header.tensors) + tuple(n for n, _ in trees),
                       tuple(int(c) for c in crcs if c is not None) + tuple(c for _, c in trees))


def rows_tensor(values: Sequence[int], rank: int, world: int, device: str = "cpu") -> torch.Tensor:
    """``world x len(values)`` int64 zeros with this rank's row filled: summed over ranks, the rows of all."""
    import torch

    rows = torch.zeros((world, len(values)), dtype=torch.int64)
    rows[rank] = torch.tensor(list(values), dtype=torch.int64)
    return rows if device == "cpu" else rows.to(device)


def differing_groups(rows: torch.Tensor, groups: Sequence[Sequence[int]]) -> list[tuple[int, ...]]:
    """The replica groups whose ranks' rows are not all equal."""
    out = []
    for g in groups:
        ranks = [r for r in g if r < rows.shape[0]]
        if any(not bool((rows[r] == rows[ranks[0]]).all()) for r in ranks[1:]):
            out.append(tuple(ranks))
    return out


def describe(digest: StateDigest, rows: torch.Tensor, groups: Sequence[tuple[int, ...]], when: str,
             layouts: Sequence[int] | None = None) -> ReplicaMismatch:
    """The error for replica groups whose full rows (``world x entries``) differ. ``layouts``: each
    rank's names checksum (the summary's second column); entries are named for the groups whose
    layout is this rank's (the others' names are theirs to print), the rest counted."""
    entries: dict[str, set[int]] = {}
    elsewhere: list[tuple[int, ...]] = []
    mine = digest.summary()[1]
    for g in groups:
        if layouts is not None and layouts[g[0]] != mine:
            elsewhere.append(g)
            continue
        for j, name in enumerate(digest.names):
            values: dict[int, list[int]] = {}
            for r in g:
                values.setdefault(int(rows[r, j]), []).append(r)
            if len(values) > 1:
                # the ranks outside the largest set of equal values (ties: outside the lowest rank's)
                keep = max(values.values(), key=lambda rs: (len(rs), -min(rs)))
                entries.setdefault(name, set()).update(r for rs in values.values() if rs is not keep for r in rs)
    names = list(entries)
    ranks = sorted(set().union(*entries.values())) if entries else []
    shown = ", ".join(f"{n} (ranks {sorted(entries[n])})" for n in names[:SHOWN])
    more = f" and {len(names) - SHOWN} more" if len(names) > SHOWN else ""
    hints = []
    if any(n.startswith("rng") for n in names):
        hints.append("seed every random generator alike on every rank (numpy's global one too, or pass "
                     "training_state(..., rng=False) and keep randomness out of the state); per-rank "
                     "randomness must come from (seed, step, rank), not from a generator in the state")
    if any(not n.startswith("rng") for n in names):
        hints.append("parameters, buffers and optimizer state must start equal and change only through "
                     "the averaged gradients and the optimizer step (no in-place writes through .data "
                     "between commit() and allreduce_gradients(), no per-rank buffers such as unsynced "
                     "BatchNorm statistics)")
    groups_txt = "; ".join(str(list(g)) for g in groups if g not in elsewhere)
    other = (f"; replica group(s) {', '.join(str(list(g)) for g in elsewhere)} (another shard) differ too, "
             "their ranks name the entries" if elsewhere else "")
    if not names:
        shown, groups_txt = "entries of another shard", ", ".join(str(list(g)) for g in elsewhere)
        other = ""
        hints = hints or ["see the errors of the ranks named"]
    return ReplicaMismatch(
        f"replicas hold different state at step {digest.step} ({when}): {shown}{more}, in replica "
        f"group(s) {groups_txt}{other}; every replica of a shard must hold identical state, or recovery "
        f"would hand a receiver another rank's state. To fix: {'; '.join(hints)}.",
        step=digest.step, entries=tuple(names),
        ranks=tuple(ranks) if names else tuple(r for g in elsewhere for r in g))
