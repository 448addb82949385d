"""Sealing and opening of gossiprec datagrams and stream frames (AES-256-GCM), sans-IO.

Theory of operation
-------------------
Wire layout (big-endian), the same for every packet::

    magic "GR" (2) | version (1) | kind (1) | key id (8) | sender id (16) | counter (8) | body
    \\_____________________________ header, 36 bytes, in clear ___________________/

``kind`` says datagram or stream frame, sealed or plain. For a sealed packet ``body`` is the AES-GCM
ciphertext plus its 16-byte tag; the associated data is the whole header followed by the
length-prefixed cluster name, so a packet from another cluster, version or kind never opens, and no
header byte can be changed without the tag failing.

Nonces never repeat. Every sender draws a random 16-byte *sender id* (for datagrams: one per process,
the boot id; for streams: one per connection direction) and seals with a subkey
``HKDF-SHA256(master, salt=sender id, info=b"gossiprec-v1" + kind + cluster)`` under the nonce
``000000 kind counter64``. The counter only grows and sealing stops at 2**63, so a (subkey, nonce)
pair is never used twice, even across restarts (a new process has a new boot id) and key rotations
(the counter runs on across keys).

Opening checks, cheapest first, and stops at the first failure: size limit (before looking at any
byte), header truncation, magic and kind, version, tag truncation, key id known to the keyring, replay
(:class:`ReplayWindow` for datagrams, consecutive counters for streams: :class:`StreamOpener`), then
the AEAD tag. Only a packet that authenticates updates the replay state and the caches, so forged
traffic costs one HKDF and one failed decryption each and can evict nothing. Refusals raise
:class:`OpenError` (a :class:`~gossiprec.errors.SecurityError`) whose ``reason`` is one of
:data:`REASONS`, counted in a :class:`RejectCounter`; :class:`RejectLog` rate-limits the log lines.

Keys rotate live: the opener looks the key id up in the keyring on every packet, and the sealer
re-derives its subkey whenever the keyring's primary changes (see :mod:`gossiprec.security.keyring`).
Insecure mode (``--insecure`` only) uses the same header with plain kinds, no tag and no replay check;
a keyed opener refuses plain kinds (``bad_magic``), so a key set means insecure packets are never
accepted. The key-id field then carries a hash of the cluster name: clusters do not cross-talk by
mistake (it is not security).

Known limits: replay state lives in bounded LRUs, so a packet from a sender id evicted long ago (a
process that restarted thousands of sender-ids back) or a stream id evicted from the seen-streams
memory would open again; the protocol layer above refuses such stale messages by incarnation/epoch.
Not thread-safe: use each opener from one thread (the agent's event loop).
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Iterator, Mapping, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossiprec.errors import ConfigError, SecurityError
from gossiprec.security.keyring import KEY_ID_SIZE, Keyring, KeySet, key_id

MAGIC = b"GR"
VERSION = 1
KIND_DATAGRAM = 0x01
KIND_STREAM = 0x02
KIND_PLAIN_DATAGRAM = 0x81
KIND_PLAIN_STREAM = 0x82
SENDER_ID_SIZE = 16
TAG_SIZE = 16
_HEADER = struct.Struct(">2sBB8s16sQ")
HEADER_SIZE = _HEADER.size  # 36
OVERHEAD = HEADER_SIZE + TAG_SIZE  # 52: what sealing adds to a payload
MAX_COUNTER = 2**63
"""Sealing refuses counter values >= this; a sender that gets there must restart (new boot id)."""
_LEN = struct.Struct(">I")
_TAIL = struct.Struct(">8s16sQ")  # key id, sender id, counter: the header after magic/version/kind
_U64 = struct.Struct(">Q")
_DATAGRAM_PREFIX = MAGIC + bytes((VERSION, KIND_DATAGRAM))  # how every sealed datagram starts
FRAME_PREFIX_SIZE = _LEN.size
HKDF_INFO = b"gossiprec-v1"

REASONS: tuple[str, ...] = ("too_large", "truncated", "bad_magic", "bad_version", "unknown_key",
                            "auth_failed", "replay")
"""Every reason an :class:`OpenError` can carry."""

log = logging.getLogger(__name__)


class OpenError(SecurityError):
    """A packet or frame was refused. ``reason`` is one of :data:`REASONS`; ``detail`` says more."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class SealError(SecurityError):
    """This node cannot seal: ``reason`` is "too_large", "no_key" or "exhausted"."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class Aead(Protocol):
    """What we need of an AEAD cipher (``cryptography``'s AESGCM has this shape)."""

    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...
    def decrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...


AeadFactory = Callable[[bytes], Aead]
"""Builds a cipher from a 32-byte subkey; injectable so tests can count decryptions."""


@dataclass(frozen=True, slots=True)
class CryptoLimits:
    """Bounds on sizes and state. Every size check happens before any cryptographic work."""

    max_payload: int = 1400
    """Largest datagram plaintext, bytes; the largest datagram accepted is this + :data:`OVERHEAD`."""
    max_frame_payload: int = 4 * 1024 * 1024
    """Largest stream-frame plaintext, bytes (state transfers chunk below this)."""
    replay_window: int = 1024
    """Counters tracked below the highest seen per sender (reordering tolerated within it)."""
    max_senders: int = 4096
    """Sender ids whose replay window is kept (LRU); size it well above the cluster size."""
    max_subkeys: int = 4096
    """Derived receive subkeys cached (LRU) per (key id, sender id)."""
    max_seen_streams: int = 16384
    """Stream sender ids remembered to refuse a replayed connection (LRU)."""

    def __post_init__(self) -> None:
        for name in ("max_payload", "max_frame_payload", "replay_window", "max_senders",
                     "max_subkeys", "max_seen_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CryptoLimits.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_frame_payload + OVERHEAD > 2**32 - 1:
            raise ConfigError("CryptoLimits.max_frame_payload must fit a 32-bit length prefix")

    @property
    def max_datagram(self) -> int:
        return self.max_payload + OVERHEAD

    @property
    def max_frame(self) -> int:
        return self.max_frame_payload + OVERHEAD


def _cluster_bytes(cluster: str) -> bytes:
    raw = cluster.encode("utf-8")
    if not 1 <= len(raw) <= 255:
        raise ConfigError(f"cluster name must be 1..255 bytes of UTF-8, got {len(raw)}")
    return raw


def derive_subkey(master: bytes, sender_id: bytes, cluster: bytes, kind: int) -> bytes:
    """The per-sender subkey: HKDF-SHA256(master, salt=sender_id, info="gossiprec-v1"+kind+cluster)."""
    hkdf = HKDF(algorithm=hashes.SHA256(), length=32, salt=sender_id,
                info=HKDF_INFO + bytes([kind]) + cluster)
    return hkdf.derive(master)


def _nonce(kind: int, counter: int) -> bytes:
    return bytes((0, 0, 0, kind)) + _U64.pack(counter)


def _insecure_tag(cluster: bytes) -> bytes:
    return hashlib.sha256(b"gossiprec-insecure\x00" + cluster).digest()[:KEY_ID_SIZE]


class RejectCounter(Mapping[str, int]):
    """Counts of refused packets by reason; every reason present (0 until seen) for metrics."""

    def __init__(self) -> None:
        self._counts: dict[str, int] = dict.fromkeys(REASONS, 0)

    def record(self, reason: str) -> None:
        self._counts[reason] = self._counts.get(reason, 0) + 1

    @property
    def total(self) -> int:
        return sum(self._counts.values())

    def __getitem__(self, reason: str) -> int:
        return self._counts[reason]

    def __iter__(self) -> Iterator[str]:
        return iter(self._counts)

    def __len__(self) -> int:
        return len(self._counts)

    def __repr__(self) -> str:
        return f"RejectCounter({self._counts!r})"


class RejectLog:
    """At most one log line per reason per ``interval_s``; lines carry how many were suppressed.

    The caller passes ``now`` (seconds, any monotonic clock); nothing here reads a clock.
    """

    def __init__(self, logger: logging.Logger | None = None, interval_s: float = 10.0) -> None:
        if interval_s <= 0:
            raise ConfigError("RejectLog interval_s must be > 0")
        self.logger = logger if logger is not None else log
        self.interval_s = interval_s
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def note(self, err: OpenError, now: float, peer: object = None) -> bool:
        """Log ``err`` unless its reason was logged less than ``interval_s`` ago. True if logged."""
        last = self._last.get(err.reason)
        if last is not None and now - last < self.interval_s:
            self._suppressed[err.reason] = self._suppressed.get(err.reason, 0) + 1
            return False
        n = self._suppressed.pop(err.reason, 0)
        self._last[err.reason] = now
        more = f" (+{n} more since the last report)" if n else ""
        src = f" from {peer}" if peer is not None else ""
        self.logger.warning("refused packet%s: %s%s", src, err, more)
        return True


class ReplayWindow:
    """Sliding anti-replay window (RFC 4303 / WireGuard style) over a 64-bit counter.

    Per sender id: the highest counter seen and a bitmap of the ``size`` counters below it; duplicates
    and counters older than the window are refused, reordering within it is accepted. The opener keeps
    one per sender in a bounded LRU.
    """

    __slots__ = ("size", "highest", "bitmap", "_mask")

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self.highest = -1
        self.bitmap = 0  # bit i set: counter (highest - i) was accepted
        self._mask = (1 << size) - 1

    def check(self, counter: int) -> str | None:
        """None if ``counter`` may be accepted, else why not. Changes nothing."""
        if counter > self.highest:
            return None
        back = self.highest - counter
        if back >= self.size:
            return f"counter {counter} is older than the window (highest {self.highest}, window {self.size})"
        if (self.bitmap >> back) & 1:
            return f"counter {counter} was already accepted"
        return None

    def update(self, counter: int) -> None:
        """Mark ``counter`` accepted; call only after :meth:`check` passed and the packet authenticated."""
        if counter > self.highest:
            shift = counter - self.highest
            self.bitmap = ((self.bitmap << shift) | 1) & self._mask if shift < self.size else 1
            self.highest = counter
        else:
            self.bitmap |= 1 << (self.highest - counter)


@dataclass(frozen=True, slots=True)
class _Header:
    kind: int
    key_id: bytes
    sender_id: bytes
    counter: int


class _Base:
    """Shared header parsing, key lookup and subkey derivation."""

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool,
                 limits: CryptoLimits | None, aead_factory: AeadFactory | None) -> None:
        if insecure and keyring is not None:
            raise ConfigError("insecure mode and a keyring are exclusive: drop --insecure to use the keys")
        if not insecure and keyring is None:
            raise ConfigError("no keyring: pass a keyring, or insecure=True (agent flag --insecure) to "
                              "run unencrypted on a trusted network")
        self.keyring = keyring
        self.insecure = insecure
        self.cluster = cluster
        self._cluster = _cluster_bytes(cluster)
        self._ad_suffix = bytes([len(self._cluster)]) + self._cluster
        self._insecure_tag = _insecure_tag(self._cluster)
        self.limits = limits if limits is not None else CryptoLimits()
        self._aead: AeadFactory = aead_factory if aead_factory is not None else AESGCM

    def _subkey_cipher(self, master: bytes, sender_id: bytes, kind: int) -> Aead:
        return self._aead(derive_subkey(master, sender_id, self._cluster, kind))


# --- sending ---------------------------------------------------------------------------------------

class _SealerCore(_Base):
    def __init__(self, keyring: Keyring | None, cluster: str, *, kind: int, sender_id: bytes | None,
                 insecure: bool, limits: CryptoLimits | None, aead_factory: AeadFactory | None,
                 start_counter: int, max_payload: int) -> None:
        super().__init__(keyring, cluster, insecure=insecure, limits=limits, aead_factory=aead_factory)
        if sender_id is None:
            sender_id = os.urandom(SENDER_ID_SIZE)
        if len(sender_id) != SENDER_ID_SIZE:
            raise ConfigError(f"sender id must be {SENDER_ID_SIZE} bytes")
        if not 0 <= start_counter <= MAX_COUNTER:
            raise ConfigError("start_counter out of range")
        self.sender_id = bytes(sender_id)
        self._kind = kind | (0x80 if insecure else 0)
        self._counter = itertools.count(start_counter)
        self._max_payload = max_payload
        self._keyset: KeySet | None = None
        self._nonce_prefix = bytes((0, 0, 0, self._kind))
        # (key id, cipher, header up to the counter) swapped as one reference so a concurrent reader
        # never pairs them wrongly
        self._active: tuple[bytes, Aead | None, bytes] = (self._insecure_tag, None,
                                                          self._header_prefix(self._insecure_tag))

    def _header_prefix(self, kid: bytes) -> bytes:
        """The header's first 28 bytes (all but the counter) for packets sealed under ``kid``."""
        return _HEADER.pack(MAGIC, VERSION, self._kind, kid, self.sender_id, 0)[:-8]

    def _seal(self, payload: bytes) -> bytes:
        if len(payload) > self._max_payload:
            raise SealError("too_large", f"payload of {len(payload)} bytes exceeds the limit of "
                                         f"{self._max_payload}; split it or raise the limit on every node")
        if not self.insecure:
            assert self.keyring is not None
            ks = self.keyring.keyset
            if ks is not self._keyset:
                self._rekey(ks)
        _, cipher, prefix = self._active
        counter = next(self._counter)
        if counter >= MAX_COUNTER:
            raise SealError("exhausted", "nonce counter reached 2**63; restart this process to get a "
                                         "new boot id")
        c8 = _U64.pack(counter)
        header = prefix + c8  # == _HEADER.pack(MAGIC, VERSION, kind, kid, sender_id, counter)
        if cipher is None:
            return header + payload
        return header + cipher.encrypt(self._nonce_prefix + c8, payload, header + self._ad_suffix)

    def _rekey(self, ks: KeySet) -> None:
        primary = ks.primary
        if primary is None:
            raise SealError("no_key", "the keyring has no primary key; install one with "
                                      "`gossiprec keys install KEY`")
        kid = key_id(primary)
        if kid != self._active[0] or self._active[1] is None:
            self._active = (kid, self._subkey_cipher(primary, self.sender_id, self._kind),
                            self._header_prefix(kid))
        self._keyset = ks


class Sealer(_SealerCore):
    """Seals datagrams with the keyring's current primary key (followed live, no restart needed).

    ``sender_id`` defaults to a fresh random boot id; pass one only in tests. One per process.
    """

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool = False,
                 boot_id: bytes | None = None, limits: CryptoLimits | None = None,
                 aead_factory: AeadFactory | None = None, start_counter: int = 0) -> None:
        lim = limits if limits is not None else CryptoLimits()
        super().__init__(keyring, cluster, kind=KIND_DATAGRAM, sender_id=boot_id, insecure=insecure,
                         limits=lim, aead_factory=aead_factory, start_counter=start_counter,
                         max_payload=lim.max_payload)

    @property
    def boot_id(self) -> bytes:
        return self.sender_id

    def seal(self, payload: bytes) -> bytes:
        """One datagram: header + ciphertext + tag. Raises :class:`SealError`."""
        return self._seal(payload)

    def new_stream(self) -> StreamSealer:
        """A sealer for one direction of one stream connection (own sender id and counters)."""
        return StreamSealer(self.keyring, self.cluster, insecure=self.insecure, limits=self.limits,
                            aead_factory=self._aead)


class StreamSealer(_SealerCore):
    """Seals length-prefixed frames for one direction of one stream (fresh random sender id)."""

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool = False,
                 limits: CryptoLimits | None = None, aead_factory: AeadFactory | None = None,
                 stream_id: bytes | None = None, start_counter: int = 0) -> None:
        lim = limits if limits is not None else CryptoLimits()
        super().__init__(keyring, cluster, kind=KIND_STREAM, sender_id=stream_id, insecure=insecure,
                         limits=lim, aead_factory=aead_factory, start_counter=start_counter,
                         max_payload=lim.max_frame_payload)

    def seal_frame(self, payload: bytes) -> bytes:
        """``u32 length`` + sealed frame, ready to write to the stream."""
        body = self._seal(payload)
        return _LEN.pack(len(body)) + body


# --- receiving -------------------------------------------------------------------------------------

class _OpenerCore(_Base):
    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool,
                 limits: CryptoLimits | None, aead_factory: AeadFactory | None,
                 rejects: RejectCounter | None) -> None:
        super().__init__(keyring, cluster, insecure=insecure, limits=limits, aead_factory=aead_factory)
        self.rejects = rejects if rejects is not None else RejectCounter()

    def _fail(self, reason: str, detail: str) -> OpenError:
        self.rejects.record(reason)
        return OpenError(reason, detail)

    def _parse(self, data: bytes, kind: int, limit: int) -> _Header:
        n = len(data)
        if n > limit:
            raise self._fail("too_large", f"{n} bytes, limit {limit}")
        want_kind = kind | (0x80 if self.insecure else 0)
        if n < HEADER_SIZE:
            raise self._fail("truncated", f"{n} bytes is shorter than the {HEADER_SIZE}-byte header")
        magic, version, got_kind, kid, sender, counter = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise self._fail("bad_magic", "not a gossiprec packet")
        if got_kind != want_kind:
            raise self._fail("bad_magic", _kind_mismatch(got_kind, want_kind))
        if version != VERSION:
            raise self._fail("bad_version", f"version {version}, this node speaks {VERSION}; "
                                            "run the same gossiprec version on every node")
        if self.insecure:
            if kid != self._insecure_tag:
                raise self._fail("unknown_key", "plain packet from another cluster name")
        elif n < OVERHEAD:
            raise self._fail("truncated", f"{n} bytes is shorter than header + tag ({OVERHEAD})")
        return _Header(got_kind, kid, sender, counter)

    def _master(self, kid: bytes) -> bytes:
        assert self.keyring is not None
        master = self.keyring.keyset.get(kid)
        if master is None:
            raise self._fail("unknown_key", f"key id {kid.hex()} is not in the keyring; install the "
                                            "key this sender uses, or rotate it off the sender")
        return master

    def _decrypt(self, cipher: Aead, data: bytes, h: _Header) -> bytes:
        try:
            return cipher.decrypt(_nonce(h.kind, h.counter), data[HEADER_SIZE:],
                                  bytes(data[:HEADER_SIZE]) + self._ad_suffix)
        except InvalidTag:
            raise self._fail("auth_failed", f"tag mismatch (key {h.key_id.hex()}): forged, corrupted, "
                                            "or sealed for another cluster name") from None


def _kind_mismatch(got: int, want: int) -> str:
    names = {KIND_DATAGRAM: "sealed datagram", KIND_STREAM: "sealed stream frame",
             KIND_PLAIN_DATAGRAM: "plain (--insecure) datagram",
             KIND_PLAIN_STREAM: "plain (--insecure) stream frame"}
    got_name = names.get(got, f"unknown kind 0x{got:02x}")
    hint = ""
    if got & 0x80 and not want & 0x80:
        hint = "; the sender runs --insecure but this node has a key"
    elif want & 0x80 and got in names and not got & 0x80:
        hint = "; the sender has a key but this node runs --insecure"
    return f"got a {got_name}, expected a {names[want]}{hint}"


class Opener(_OpenerCore):
    """Opens datagrams from any sender: checks, decrypts, refuses replays.

    Not thread-safe; use from one thread (the agent's event loop).
    """

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool = False,
                 limits: CryptoLimits | None = None, aead_factory: AeadFactory | None = None,
                 rejects: RejectCounter | None = None) -> None:
        super().__init__(keyring, cluster, insecure=insecure, limits=limits, aead_factory=aead_factory,
                         rejects=rejects)
        self._subkeys: OrderedDict[tuple[bytes, bytes], Aead] = OrderedDict()
        self._windows: OrderedDict[bytes, ReplayWindow] = OrderedDict()
        self._max_datagram = self.limits.max_datagram
        self._seen_streams: OrderedDict[bytes, None] = OrderedDict()

    def open(self, data: bytes) -> tuple[bytes, bytes]:
        """``(boot_id, plaintext)`` of a datagram, or raise :class:`OpenError` (and count it)."""
        # Fast path, the steady state: a well-formed datagram from a known sender (window and subkey
        # cached) with a fresh counter. It makes exactly the checks of the full path below, in the same
        # order, and anything unusual (including every refusal but a bad tag) takes the full path. It
        # runs for every datagram, on cold caches when the agent is idle: its Python part is kept short.
        if type(data) is bytes and not self.insecure and OVERHEAD <= len(data) <= self._max_datagram \
                and data[:4] == _DATAGRAM_PREFIX:
            kid, sender, counter = _TAIL.unpack_from(data, 4)
            window = self._windows.get(sender)
            ck = (kid, sender)
            cipher = self._subkeys.get(ck)
            if window is not None and cipher is not None and counter > window.highest \
                    and kid in self.keyring.keyset.by_id:  # type: ignore[union-attr]
                try:
                    plaintext = cipher.decrypt(_nonce(KIND_DATAGRAM, counter), data[HEADER_SIZE:],
                                               data[:HEADER_SIZE] + self._ad_suffix)
                except InvalidTag:
                    raise self._fail("auth_failed", f"tag mismatch (key {kid.hex()}): forged, corrupted, "
                                                    "or sealed for another cluster name") from None
                window.update(counter)
                self._windows.move_to_end(sender)
                self._subkeys.move_to_end(ck)
                return sender, plaintext
        h = self._parse(data, KIND_DATAGRAM, self.limits.max_datagram)
        if self.insecure:
            return h.sender_id, bytes(data[HEADER_SIZE:])
        master = self._master(h.key_id)
        window = self._windows.get(h.sender_id)
        if window is not None:
            why = window.check(h.counter)
            if why is not None:
                raise self._fail("replay", why)
        ck = (h.key_id, h.sender_id)
        cipher = self._subkeys.get(ck)
        cached = cipher is not None
        if cipher is None:
            cipher = self._subkey_cipher(master, h.sender_id, h.kind)
        plaintext = self._decrypt(cipher, data, h)
        # authentic from here on: only now touch replay state and caches
        if window is None:
            window = ReplayWindow(self.limits.replay_window)
            self._windows[h.sender_id] = window
            if len(self._windows) > self.limits.max_senders:
                self._windows.popitem(last=False)
        else:
            self._windows.move_to_end(h.sender_id)
        window.update(h.counter)
        if cached:
            self._subkeys.move_to_end(ck)
        else:
            self._subkeys[ck] = cipher
            if len(self._subkeys) > self.limits.max_subkeys:
                self._subkeys.popitem(last=False)
        return h.sender_id, plaintext

    def new_stream(self) -> StreamOpener:
        """An opener for one direction of one stream connection, sharing counters and replay memory."""
        return StreamOpener(self)

    def _stream_seen(self, sender_id: bytes) -> bool:
        return sender_id in self._seen_streams

    def _remember_stream(self, sender_id: bytes) -> None:
        self._seen_streams[sender_id] = None
        if len(self._seen_streams) > self.limits.max_seen_streams:
            self._seen_streams.popitem(last=False)

    @property
    def tracked_senders(self) -> int:
        return len(self._windows)

    @property
    def cached_subkeys(self) -> int:
        return len(self._subkeys)


class StreamOpener:
    """Sans-IO reader of one stream direction: feed bytes, get authenticated frame payloads.

    Frames must carry one sender id and counters 0, 1, 2, ...; a sender id already seen on another
    connection is refused as a replay. The first refusal poisons the opener: every later call raises
    the same error, and the caller must close the connection.
    """

    def __init__(self, parent: Opener) -> None:
        self._p = parent
        self._buf = bytearray()
        self._ciphers: dict[bytes, Aead] = {}
        self.stream_id: bytes | None = None
        self._next_counter = 0
        self._error: OpenError | None = None

    def receive_data(self, data: bytes) -> None:
        """Append bytes read from the stream (no parsing happens here)."""
        if self._error is not None:
            raise self._error
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete frame's payload, None if more bytes are needed; raises on a bad frame."""
        if self._error is not None:
            raise self._error
        try:
            return self._next_frame()
        except OpenError as exc:
            self._error = exc
            self._buf.clear()
            raise

    def feed(self, data: bytes) -> list[bytes]:
        """:meth:`receive_data` then every complete frame's payload."""
        self.receive_data(data)
        frames: list[bytes] = []
        while (frame := self.next_frame()) is not None:
            frames.append(frame)
        return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _next_frame(self) -> bytes | None:
        p = self._p
        buf = self._buf
        if len(buf) < FRAME_PREFIX_SIZE:
            return None
        (n,) = _LEN.unpack_from(buf)
        limit = p.limits.max_frame
        if n > limit:  # before waiting for (or buffering) the body
            raise p._fail("too_large", f"stream frame of {n} bytes, limit {limit}")
        if n < (HEADER_SIZE if p.insecure else OVERHEAD):
            raise p._fail("truncated", f"stream frame length {n} is shorter than the minimum")
        if len(buf) < FRAME_PREFIX_SIZE + n:
            return None
        frame = bytes(buf[FRAME_PREFIX_SIZE:FRAME_PREFIX_SIZE + n])
        h = p._parse(frame, KIND_STREAM, limit)
        if self.stream_id is None:
            if p._stream_seen(h.sender_id):
                raise p._fail("replay", "stream id already used by another connection")
        elif h.sender_id != self.stream_id:
            raise p._fail("replay", "stream id changed within a connection")
        if h.counter != self._next_counter:
            raise p._fail("replay", f"stream counter {h.counter}, expected {self._next_counter}")
        if p.insecure:
            payload = frame[HEADER_SIZE:]
        else:
            master = p._master(h.key_id)
            cipher = self._ciphers.get(h.key_id)
            if cipher is None:
                cipher = p._subkey_cipher(master, h.sender_id, h.kind)
            payload = p._decrypt(cipher, frame, h)
            self._ciphers[h.key_id] = cipher
        if self.stream_id is None:
            self.stream_id = h.sender_id
            p._remember_stream(h.sender_id)
        self._next_counter += 1
        del buf[:FRAME_PREFIX_SIZE + n]
        return payload
