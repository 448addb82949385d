"""The state transfer's wire format and its authentication: frames, chunks, stripes, seals, keys.

A receiver opens one TCP connection per donor and asks each for a byte range (a *stripe*) of the same
flat payload (:mod:`gossiprec.trainer.state.header`). Wire format (big-endian)::

    request   "GRXQ" | ver u8 | transfer id (16) | len u32 | msgpack {epoch, step, start, end} | tag
    response  "GRXS" | ver u8 | kind u8 | donor salt (16) | len u32 | msgpack body | tag
    data      for every chunk of the stripe, in order: its raw bytes, then its tag (16 bytes)

The response body is ``{epoch, step, start, end, chunk, salt, state: <state header>}`` (kind 0)
or ``{error, epoch, step}`` (kind 1, authenticated refusal). Kind 2 is an *unauthenticated* refusal
with a short reason and no tag: a donor sends it when the request does not authenticate (wrong cluster
key), so the receiver can say why; the receiver never treats it as anything but a failure.

Authentication is AES-GCM used as a MAC (GMAC: empty plaintext, the bytes as associated data): keyed,
and faster than HMAC-SHA256 or even unkeyed crc32. Keys are never used directly, always
``HKDF(cluster key, salt, "gossiprec-xfer-v1" + label + context)``:

* :func:`seal_state` cuts the payload into chunks (:func:`plan_chunks`: at most ``chunk_size`` bytes,
  never across a tensor boundary, so each chunk is one contiguous piece of one destination tensor)
  and tags chunk ``g`` under the snapshot key (salt = 16 random bytes per seal, label "state",
  nonce = g). The tags are the per-chunk checksums: computed where the state was captured, verified
  where it lands. A :class:`LazySeal` tags only the chunks receivers ask for, each once, so donors
  that stripe one transfer each tag their own stripe, and a donor tags ahead of its sends on a second
  thread: tagging overlaps the stream instead of preceding it (each tag follows its chunk on the wire).
* The response header carries the seal salt and is tagged under ``salt = transfer id + donor salt``
  (label "response", nonce 0). A chunk's tag is checked under the key of the seal salt that header
  names, which only a holder of the cluster key can make tags under, and its nonce is the chunk's
  index: no chunk can be altered, moved or taken from another seal; the receiver expects every chunk
  of its stripe, so none can be dropped. The receiver draws a fresh random transfer id per
  fetch, so a recorded old header cannot be replayed into a new transfer.
* The request is tagged under ``salt = transfer id`` (label "request"); a donor refuses a transfer id
  it has already served (bounded memory). Payload bytes are authenticated, not encrypted.

A stripe ``[start, end)`` is the set of chunks whose first byte lies in it, so any byte ranges that
partition the payload partition the chunks, and donors with identical headers agree on who sends what.
"""

from __future__ import annotations

import bisect
import os
import socket
import struct
import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import msgpack
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossiprec.errors import ConfigError, DecodeError, SecurityError, TransferError
from gossiprec.trainer.state.capture import StateSnapshot
from gossiprec.trainer.state.header import TensorSpec

REQ_MAGIC = b"GRXQ"
RESP_MAGIC = b"GRXS"
VERSION = 2
"""2: each chunk's tag follows the chunk (1 sent a stripe's tags in the header, before any byte)."""
KIND_OK = 0
KIND_REFUSED = 1
KIND_UNAUTHENTICATED_REFUSAL = 2
TAG_SIZE = 16
ID_SIZE = 16
KEY_SIZE = 32
REQ_PREFIX = struct.Struct(">4sB16sI")
RESP_PREFIX = struct.Struct(">4sBB16sI")
MAX_REQUEST_BODY = 4096
MAX_RESPONSE_BODY = 64 * 1024 * 1024
"""Largest response header accepted (the state header grows ~100 bytes per tensor)."""
DEFAULT_CHUNK = 1024 * 1024
"""Chunk size for sealing: small enough that a receiver checks one chunk's tag while the next arrives,
large enough that per-chunk costs stay small."""
MIN_CHUNK = 4096
MAX_CHUNK = 64 * 1024 * 1024
HKDF_INFO = b"gossiprec-xfer-v1\x00"


class TransferAuthError(TransferError, SecurityError):
    """A request, header or chunk failed authentication (corruption, tampering or another key)."""


@dataclass(frozen=True, slots=True)
class TransferRequest:
    """What a receiver asks one donor for: the chunks starting in bytes ``[start, end)`` of the
    state at (epoch, step)."""

    epoch: int
    step: int
    start: int
    end: int

    def to_wire(self) -> dict[str, int]:
        return {"epoch": self.epoch, "step": self.step, "start": self.start, "end": self.end}

    @classmethod
    def from_wire(cls, obj: Any) -> TransferRequest:
        if not isinstance(obj, dict):
            raise DecodeError("bad_request", "not a map")
        vals = [obj.get(k) for k in ("epoch", "step", "start", "end")]
        if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in vals):
            raise DecodeError("bad_request", "epoch/step/start/end must be ints >= 0")
        req = cls(*(v for v in vals if isinstance(v, int)))
        if req.start > req.end:
            raise DecodeError("bad_request", f"bad range in {req}")
        return req




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
# keys, request frames, seals


def check_key(key: bytes) -> None:
    """Refuse a cluster key that is not :data:`KEY_SIZE` bytes (:class:`~gossiprec.errors.ConfigError`)."""
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE:
        raise ConfigError(f"the cluster key must be {KEY_SIZE} bytes, got "
                          f"{len(key) if isinstance(key, (bytes, bytearray)) else type(key).__name__}")


def derive_aead(key: bytes, salt: bytes, label: bytes, context: bytes = b"") -> AESGCM:
    """AES-GCM under ``HKDF-SHA256(key, salt, "gossiprec-xfer-v1\\0" + label + "\\0" + context)``."""
    check_key(key)
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=salt,
                info=HKDF_INFO + label + b"\x00" + context)
    return AESGCM(hkdf.derive(bytes(key)))


def nonce(counter: int) -> bytes:
    """The 12-byte GCM nonce of chunk (or frame) ``counter`` under one derived key."""
    return b"\x00\x00\x00\x00" + counter.to_bytes(8, "big")


def encode_request(key: bytes, tid: bytes, request: TransferRequest, context: bytes = b"") -> bytes:
    """The request frame for transfer id ``tid`` (16 random bytes, new for every fetch)."""
    if len(tid) != ID_SIZE:
        raise ConfigError(f"transfer id must be {ID_SIZE} bytes")
    body: bytes = msgpack.packb(request.to_wire())
    head = REQ_PREFIX.pack(REQ_MAGIC, VERSION, tid, len(body)) + body
    return head + derive_aead(key, tid, b"request", context).encrypt(nonce(0), b"", head)


def open_request(key: bytes, frame: bytes, context: bytes = b"") -> tuple[bytes, TransferRequest]:
    """Inverse of :func:`encode_request`: ``(tid, request)``; raises DecodeError or InvalidTag."""
    if len(frame) < REQ_PREFIX.size + TAG_SIZE:
        raise DecodeError("bad_request", "truncated")
    magic, version, tid, n = REQ_PREFIX.unpack_from(frame)
    if magic != REQ_MAGIC or version != VERSION or len(frame) != REQ_PREFIX.size + n + TAG_SIZE:
        raise DecodeError("bad_request", "bad magic, version or length")
    head, tag = frame[:-TAG_SIZE], frame[-TAG_SIZE:]
    derive_aead(key, tid, b"request", context).decrypt(nonce(0), tag, head)
    try:
        obj = msgpack.unpackb(head[REQ_PREFIX.size:], raw=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise DecodeError("bad_request", str(exc)) from exc
    return tid, TransferRequest.from_wire(obj)


@dataclass(frozen=True, slots=True)
class SealedState:
    """A snapshot with a GMAC tag per chunk (see :func:`seal_state`); what a donor serves."""

    snapshot: StateSnapshot
    salt: bytes
    chunk_size: int
    chunks: tuple[tuple[int, int, int], ...]
    tags: bytes
    """``TAG_SIZE`` bytes per chunk, in chunk order."""

    @property
    def step(self) -> int:
        return self.snapshot.step

    def tags_for(self, sel: range) -> bytes:
        """The tags of chunks ``sel`` (contiguous chunk indices), concatenated."""
        return self.tags[sel.start * TAG_SIZE:sel.stop * TAG_SIZE]

    def tag(self, g: int) -> bytes:
        """The tag of chunk ``g``."""
        return self.tags[g * TAG_SIZE:(g + 1) * TAG_SIZE]

    def tag_ahead(self, sel: range, stop: Callable[[], bool]) -> None:
        """Nothing to do: every chunk was tagged when sealed."""


class LazySeal:
    """A snapshot whose chunks are tagged on first demand, each once (what a donor makes of a raw
    snapshot): a donor serving one stripe of several tags only that stripe, so the GMAC work of a
    striped transfer is split among its donors instead of repeated by each. Thread-safe: threads that
    tag the same chunks (a prepare, a sender, its tagger) each claim the next untagged chunk, so they
    tag in parallel and never twice."""

    def __init__(self, snapshot: StateSnapshot, key: bytes, chunk_size: int, context: bytes = b"") -> None:
        if not MIN_CHUNK <= chunk_size <= MAX_CHUNK:
            raise ConfigError(f"chunk_size must be in [{MIN_CHUNK}, {MAX_CHUNK}], got {chunk_size}")
        self.snapshot = snapshot
        self.salt = os.urandom(ID_SIZE)
        self.chunk_size = chunk_size
        self.chunks = tuple(plan_chunks(snapshot.header.tensors, 0, snapshot.header.total_nbytes, chunk_size))
        self._aead = derive_aead(key, self.salt, b"state", context)
        self._tags: list[bytes | None] = [None] * len(self.chunks)
        self._busy: set[int] = set()
        """Chunks a thread is tagging now (claimed under the lock, tagged outside it)."""
        self._views: list[memoryview] | None = None
        self._cond = threading.Condition()

    @property
    def step(self) -> int:
        return self.snapshot.step

    def _claim(self, g: int) -> bool:
        """Under the lock: whether the caller is to tag chunk ``g`` now (False: done or being done)."""
        if self._tags[g] is not None or g in self._busy:
            return False
        self._busy.add(g)
        if self._views is None:
            self._views = self.snapshot.views()
        return True

    def _compute(self, g: int) -> None:
        """Tag claimed chunk ``g`` (outside the lock: the GMAC releases the GIL, other threads tag on)."""
        assert self._views is not None
        ti, lo, hi = self.chunks[g]
        tag: bytes | None = None
        try:
            tag = self._aead.encrypt(nonce(g), b"", self._views[ti][lo:hi])
        finally:
            with self._cond:
                self._busy.discard(g)
                self._tags[g] = tag
                self._cond.notify_all()

    def tag(self, g: int) -> bytes:
        """The tag of chunk ``g``: tagged now if no thread has, waited for if one is tagging it."""
        while True:
            with self._cond:
                while (done := self._tags[g]) is None and g in self._busy:
                    self._cond.wait()
                if done is not None:
                    return done
                self._claim(g)
            self._compute(g)

    def tag_ahead(self, sel: range, stop: Callable[[], bool]) -> None:
        """Tag the chunks of ``sel`` that no thread has tagged or is tagging, in order, until ``stop()``:
        what a donor's tagger thread runs while the sender streams (and sends chunks the tagger has not
        reached, tagging them itself)."""
        for g in sel:
            if stop():
                return
            with self._cond:
                mine = self._claim(g)
            if mine:
                self._compute(g)

    def tags_for(self, sel: range) -> bytes:
        """Tag the chunks of ``sel`` not tagged yet, then return their tags concatenated. A second
        caller for the same chunks waits for the first instead of tagging them again."""
        self.tag_ahead(sel, lambda: False)
        return b"".join(self.tag(g) for g in sel)

    def stripe(self, start: int, end: int) -> range:
        """Indices of the chunks a request for bytes ``[start, end)`` is served."""
        return select_chunks(self.chunks, self.snapshot.header.tensors, start, end)


def seal_state(snapshot: StateSnapshot, key: bytes, *, chunk_size: int = DEFAULT_CHUNK,
               context: bytes = b"") -> SealedState:
    """Tag every chunk of ``snapshot`` under a fresh snapshot key.

    Do it when the state is committed, not when a receiver asks: the transfer then costs the donor no
    crypto. The snapshot must not change afterwards (receivers would refuse the changed chunks).
    """
    seal = LazySeal(snapshot, key, chunk_size, context)
    tags = seal.tags_for(range(len(seal.chunks)))
    return SealedState(snapshot, seal.salt, chunk_size, seal.chunks, tags)


WHOLE = 2**62
"""End of the one stripe of a single donor asked for everything it holds."""


# --------------------------------------------------------------------------------------------------
# sockets


WAITALL = getattr(socket, "MSG_WAITALL", 0)


def set_stall_timeout(sock: socket.socket, seconds: float) -> None:
    """Make ``sock`` blocking, with the kernel's own send and receive timeouts of ``seconds``.

    Why not ``settimeout``: Python's timeout mode polls before every send and receive, and a receive
    then returns whatever has arrived; a blocking socket with ``MSG_WAITALL`` takes a whole chunk in
    one call. A timeout then surfaces as :class:`TimeoutError` from the helpers below (only a receive
    that got no byte for ``seconds``, or a send that could put none, times out). Where the options
    are not accepted, falls back to ``settimeout``.
    """
    secs = max(0.001, float(seconds))  # (0 would mean no timeout at all)
    tv = struct.pack("ll", int(secs), int(round(secs % 1 * 1e6)))
    try:
        sock.settimeout(None)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
    except (OSError, AttributeError):
        sock.settimeout(seconds)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` from ``sock`` (one call per ``view`` on a blocking socket, see :func:`set_stall_timeout`)."""
    got, n = 0, len(view)
    while got < n:
        try:
            r = sock.recv_into(view[got:], n - got, WAITALL)
        except BlockingIOError as exc:  # the kernel's receive timeout: no byte for that long
            raise TimeoutError("timed out") from exc
        if r == 0:
            raise ConnectionError("connection closed by peer")
        got += r


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """``bufs`` without their first ``n`` bytes (and without empty buffers)."""
    out: list[memoryview] = []
    for b in bufs:
        if n >= len(b):
            n -= len(b)
        else:
            out.append(b[n:])
            n = 0
    return out


def recv_into_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Fill every buffer of ``bufs`` in order, scattering with ``recvmsg_into``: a chunk and its tag land
    in their places with one system call."""
    while bufs:
        try:
            r = sock.recvmsg_into(bufs, 0, WAITALL)[0]
        except BlockingIOError as exc:
            raise TimeoutError("timed out") from exc
        if r == 0:
            raise ConnectionError("connection closed by peer")
        bufs = _advance(bufs, r)


def send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Send every buffer of ``bufs`` in order, gathering with ``sendmsg`` (no copy in Python)."""
    while bufs:
        try:
            r = sock.sendmsg(bufs)
        except BlockingIOError as exc:  # the kernel's send timeout: the receiver took nothing for that long
            raise TimeoutError("timed out") from exc
        bufs = _advance(bufs, r)


def send_frame(conn: socket.socket, aead: AESGCM, kind: int, salt: bytes, body: bytes) -> None:
    """Send a response frame of ``kind`` with ``body``, tagged under ``aead``."""
    head = RESP_PREFIX.pack(RESP_MAGIC, VERSION, kind, salt, len(body)) + body
    conn.sendall(head + aead.encrypt(nonce(0), b"", head))


def send_plain_refusal(conn: socket.socket, reason: str) -> None:
    """Send an unauthenticated refusal (kind 2) with a short ``reason``; a failed send is ignored."""
    body = reason.encode()[:512]
    try:
        conn.sendall(RESP_PREFIX.pack(RESP_MAGIC, VERSION, KIND_UNAUTHENTICATED_REFUSAL,
                                       bytes(ID_SIZE), len(body)) + body)
    except OSError:
        pass


def shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass

