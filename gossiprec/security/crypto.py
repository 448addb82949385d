"""Sealing and opening of gossiprec datagrams and stream frames (AES-256-GCM), sans-IO.

Theory of operation
-------------------
Wire layout (big-endian), the same for every packet (sealing format :data:`VERSION` = 2)::

    magic "GR" (2) | version (1) | kind (1) | key id (8) | sender id (16) | counter (8) | receiver (8) | body
    \\____________________________________ header, 44 bytes, in clear ___________________________/

``kind`` says datagram or stream frame, sealed or plain. For a sealed packet ``body`` is the AES-GCM
ciphertext plus its 16-byte tag; the associated data is the whole header followed by the
length-prefixed cluster name, so a packet from another cluster, version or kind never opens, and no
header byte can be changed without the tag failing. ``receiver`` names the member a datagram is for
(:func:`receiver_tag` of the address it was sent to, the receiver's advertised ``host:port``): an
opener that knows its own address refuses a datagram sealed for another member (``wrong_receiver``,
before any cryptography), so a datagram captured on its way to one member and replayed to another
never opens. Stream frames carry zeros there (a stream may be opened to a seed's operator-given name,
which its receiver cannot know); their replay protection is the stream id (below).

Nonces never repeat. Every sender draws a random 16-byte *sender id* (for datagrams: one per process,
the boot id; for streams: one per connection direction) and seals with a subkey
``HKDF-SHA256(master, salt=sender id, info=b"gossiprec-v1" + kind + cluster)`` under the nonce
``000000 kind counter64``. The counter only grows and sealing stops at 2**63, so a (subkey, nonce)
pair is never used twice, even across restarts (a new process has a new boot id) and key rotations
(the counter runs on across keys).

Opening checks, cheapest first, and stops at the first failure: size limit (before looking at any
byte), header truncation, magic and kind, version, tag truncation, receiver, key id known to the
keyring, replay (:class:`ReplayWindow` for datagrams, consecutive counters for streams:
:class:`StreamOpener`), then the AEAD tag. Only a packet that authenticates updates the replay state
and the caches, so forged traffic can evict nothing. A datagram from a sender id not seen yet costs a
subkey derivation before its tag can be checked; forgeries under the clear-text key id with fresh
sender ids would make every packet cost that, so derivations for unknown senders draw on a token
bucket (``CryptoLimits.new_sender_rate`` and ``new_sender_burst``, when the opener is given a clock):
known senders never wait for it, a new sender id from a source address that delivered authentic
datagrams before (a member restarting in place) draws on a second bucket that forgeries from elsewhere
cannot empty, and past its bucket a packet from an unknown sender is refused (``throttled``) as
cheaply as garbage. Refusals raise :class:`OpenError` (a
:class:`~gossiprec.errors.SecurityError`) whose ``reason`` is one of :data:`REASONS`, counted in a
:class:`RejectCounter`; :class:`RejectLog` rate-limits the log lines.

A stream starts with an *opening frame*: an empty payload sealed under counter 0, the smallest frame
there is. A :class:`StreamOpener` checks every frame's header as soon as its 44 bytes arrive (and
refuses a first frame of any other length right there), and asks for no more bytes
than the frame in hand needs (:meth:`StreamOpener.wanted`): a peer that holds no key gets a connection
to hold at most one opening frame's worth of bytes, and only an authenticated peer may declare a large
frame.

Keys rotate live: the opener looks the key id up in the keyring on every packet, and the sealer
re-derives its subkey whenever the keyring's primary changes (see :mod:`gossiprec.security.keyring`).
Insecure mode (``--insecure`` only) uses the same header with plain kinds, no tag, no replay and no
receiver check; a keyed opener refuses plain kinds (``bad_magic``), so a key set means insecure
packets are never accepted. The key-id field then carries a hash of the cluster name: clusters do not
cross-talk by mistake (it is not security).

Known limits: replay state lives in bounded LRUs, so a packet from a sender id evicted long ago (a
process that restarted thousands of sender-ids back) or a stream id evicted from the seen-streams
memory would open again; the protocol layer above refuses such stale messages by incarnation/epoch.
A stream captured on its way to one member and replayed to another opens there once (streams are not
bound to their receiver, see above). Not thread-safe: use each opener from one thread (the agent's
event loop).
"""

from __future__ import annotations

import hashlib
import itertools
import os
import struct
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Protocol

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossiprec.errors import ConfigError, SecurityError
from gossiprec.security.keyring import KEY_ID_SIZE, Keyring, KeySet, key_id
from gossiprec.security.refusals import REASONS as REASONS
from gossiprec.security.refusals import OpenError as OpenError
from gossiprec.security.refusals import RejectCounter as RejectCounter
from gossiprec.security.refusals import RejectLog as RejectLog
from gossiprec.security.refusals import ReplayWindow as ReplayWindow
from gossiprec.security.refusals import TokenBucket as TokenBucket

MAGIC = b"GR"
VERSION = 2
"""The sealing format: 2 binds every datagram to its receiver and opens every stream with an empty
frame; a packet of another format is refused (``bad_version``)."""
KIND_DATAGRAM = 0x01
KIND_STREAM = 0x02
KIND_PLAIN_DATAGRAM = 0x81
KIND_PLAIN_STREAM = 0x82
SENDER_ID_SIZE = 16
TAG_SIZE = 16
RECEIVER_SIZE = 8
NO_RECEIVER = bytes(RECEIVER_SIZE)
"""The receiver field of a packet bound to no receiver (stream frames)."""
_HEADER = struct.Struct(">2sBB8s16sQ8s")
HEADER_SIZE = _HEADER.size  # 44
OVERHEAD = HEADER_SIZE + TAG_SIZE  # 60: what sealing adds to a payload
MAX_COUNTER = 2**63
"""Sealing refuses counter values >= this; a sender that gets there must restart (new boot id)."""
_LEN = struct.Struct(">I")
_TAIL = struct.Struct(">8s16sQ8s")  # key id, sender id, counter, receiver: the header after magic/version/kind
_U64 = struct.Struct(">Q")
_DATAGRAM_PREFIX = MAGIC + bytes((VERSION, KIND_DATAGRAM))  # how every sealed datagram starts
FRAME_PREFIX_SIZE = _LEN.size
HKDF_INFO = b"gossiprec-v1"

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
    new_sender_rate: float = 512.0
    """Subkey derivations per second for datagrams from sender ids not seen yet (an opener with a clock
    only). A member's boot id costs one derivation per receiver and per life of the member, so a whole
    cluster restarting is learned in ``members / rate`` seconds at worst; a flood of forgeries costs at
    most this many derivations a second."""
    new_sender_burst: int = 1024
    """Derivations for unknown senders allowed back to back before the rate applies."""

    def __post_init__(self) -> None:
        for name in ("max_payload", "max_frame_payload", "replay_window", "max_senders",
                     "max_subkeys", "max_seen_streams", "new_sender_burst"):
            if getattr(self, name) < 1:
                raise ConfigError(f"CryptoLimits.{name} must be >= 1, got {getattr(self, name)}")
        if not self.new_sender_rate > 0:
            raise ConfigError(f"CryptoLimits.new_sender_rate must be > 0, got {self.new_sender_rate}")
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


_THROTTLED = ("a new sender while more new senders arrive than CryptoLimits.new_sender_rate allows "
              "(forgeries under the cluster's key id?); a genuine sender's next packets get through")


def receiver_tag(addr: str) -> bytes:
    """The receiver field of a datagram sent to ``addr`` (the receiver's advertised ``host:port``)."""
    tag = hashlib.sha256(b"gossiprec-receiver\x00" + addr.encode("utf-8")).digest()[:RECEIVER_SIZE]
    return tag if tag != NO_RECEIVER else b"\x00" * (RECEIVER_SIZE - 1) + b"\x01"


def _insecure_tag(cluster: bytes) -> bytes:
    return hashlib.sha256(b"gossiprec-insecure\x00" + cluster).digest()[:KEY_ID_SIZE]


@dataclass(frozen=True, slots=True)
class _Header:
    kind: int
    key_id: bytes
    sender_id: bytes
    counter: int
    receiver: bytes


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
        """The header's first 28 bytes (all but counter and receiver) for packets sealed under ``kid``."""
        return _HEADER.pack(MAGIC, VERSION, self._kind, kid, self.sender_id, 0, NO_RECEIVER)[:-16]

    def _seal(self, payload: bytes, receiver: bytes = NO_RECEIVER) -> bytes:
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
        header = prefix + c8 + receiver  # == _HEADER.pack(MAGIC, VERSION, kind, kid, sender_id, counter, receiver)
        if cipher is None:
            return header + payload
        return header + cipher.encrypt(self._nonce_prefix + c8, payload, header + self._ad_suffix)

    def _rekey(self, ks: KeySet) -> None:
        primary = ks.primary
        if primary is None:
            raise SealError("no_key", "the keyring has no primary key; install one with "
                                      "`gossiprec keys install` (key on stdin) and `gossiprec keys use KEYID`")
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
        self._tags: dict[str, bytes] = {}

    @property
    def boot_id(self) -> bytes:
        return self.sender_id

    def seal(self, payload: bytes, to: str | None = None) -> bytes:
        """One datagram for the member at ``to`` (its advertised ``host:port``; None: bound to no
        receiver, which an opener that knows its own address refuses): header + ciphertext + tag.
        Raises :class:`SealError`."""
        if to is None:
            return self._seal(payload)
        tag = self._tags.get(to)
        if tag is None:
            if len(self._tags) >= 8192:
                self._tags.clear()
            tag = self._tags[to] = receiver_tag(to)
        return self._seal(payload, tag)

    def new_stream(self) -> StreamSealer:
        """A sealer for one direction of one stream connection (own sender id and counters)."""
        return StreamSealer(self.keyring, self.cluster, insecure=self.insecure, limits=self.limits,
                            aead_factory=self._aead)


class StreamSealer(_SealerCore):
    """Seals length-prefixed frames for one direction of one stream (fresh random sender id); the first
    :meth:`seal_frame` puts the stream's opening frame (an empty payload, counter 0) before its own."""

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool = False,
                 limits: CryptoLimits | None = None, aead_factory: AeadFactory | None = None,
                 stream_id: bytes | None = None, start_counter: int = 0) -> None:
        lim = limits if limits is not None else CryptoLimits()
        super().__init__(keyring, cluster, kind=KIND_STREAM, sender_id=stream_id, insecure=insecure,
                         limits=lim, aead_factory=aead_factory, start_counter=start_counter,
                         max_payload=lim.max_frame_payload)
        self._opened = False

    def seal_frame(self, payload: bytes) -> bytes:
        """``u32 length`` + sealed frame, ready to write to the stream (after the opening frame, the
        first time)."""
        if len(payload) > self._max_payload:
            self._seal(payload)  # raises too_large before the opening frame spends a counter
        opening = b""
        if not self._opened:
            first = self._seal(b"")
            opening = _LEN.pack(len(first)) + first
            self._opened = True
        body = self._seal(payload)
        return opening + _LEN.pack(len(body)) + body


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

    def _parse(self, data: bytes | bytearray, kind: int, limit: int, at: int = 0,
               n: int | None = None) -> _Header:
        """The header of the ``n``-byte packet at ``data[at:]`` (``n`` defaults to all of ``data``; only
        the header's bytes need to be there): every check that needs no key."""
        if n is None:
            n = len(data) - at
        if n > limit:
            raise self._fail("too_large", f"{n} bytes, limit {limit}")
        want_kind = kind | (0x80 if self.insecure else 0)
        if n < HEADER_SIZE:
            raise self._fail("truncated", f"{n} bytes is shorter than the {HEADER_SIZE}-byte header")
        magic, version, got_kind, kid, sender, counter, receiver = _HEADER.unpack_from(data, at)
        if magic != MAGIC:
            raise self._fail("bad_magic", "not a gossiprec packet")
        if got_kind != want_kind:
            raise self._fail("bad_magic", _kind_mismatch(got_kind, want_kind))
        if version != VERSION:
            raise self._fail("bad_version", f"sealing format {version}, this node speaks {VERSION}; "
                                            "run the same gossiprec version on every node")
        if self.insecure:
            if kid != self._insecure_tag:
                raise self._fail("unknown_key", "plain packet from another cluster name")
        elif n < OVERHEAD:
            raise self._fail("truncated", f"{n} bytes is shorter than header + tag ({OVERHEAD})")
        return _Header(got_kind, kid, sender, counter, receiver)

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

    ``receiver``: this node's advertised ``host:port`` (settable later, :meth:`set_receiver`); datagrams
    sealed for any other receiver are refused. None: the receiver field is not checked. ``clock``
    (seconds, monotonic): with one, derivations for unknown senders are rate limited (see
    :class:`CryptoLimits`); None: they are not. Not thread-safe; use from one thread (the agent's event
    loop).
    """

    def __init__(self, keyring: Keyring | None, cluster: str, *, insecure: bool = False,
                 limits: CryptoLimits | None = None, aead_factory: AeadFactory | None = None,
                 rejects: RejectCounter | None = None, receiver: str | None = None,
                 clock: Callable[[], float] | None = None) -> None:
        super().__init__(keyring, cluster, insecure=insecure, limits=limits, aead_factory=aead_factory,
                         rejects=rejects)
        self._subkeys: OrderedDict[tuple[bytes, bytes], Aead] = OrderedDict()
        self._windows: OrderedDict[bytes, ReplayWindow] = OrderedDict()
        self._max_datagram = self.limits.max_datagram
        self._seen_streams: OrderedDict[bytes, None] = OrderedDict()
        self._clock = clock
        self._bucket = TokenBucket(self.limits.new_sender_rate, self.limits.new_sender_burst)
        self._known_bucket = TokenBucket(self.limits.new_sender_rate, self.limits.new_sender_burst)
        self._known_sources: OrderedDict[object, None] = OrderedDict()
        """Source addresses that delivered an authentic datagram (LRU): a member that restarts there
        draws on its own bucket, which forgeries from other addresses cannot empty."""
        self.derivations = 0
        """Subkeys derived for datagrams (one per new sender and key), the cost a forgery can force."""
        self.receiver: str | None = None
        self._rtag: bytes | None = None
        self.set_receiver(receiver)

    def set_receiver(self, addr: str | None) -> None:
        """From now on, accept only datagrams sealed for ``addr`` (None: any receiver)."""
        self.receiver = addr
        self._rtag = None if addr is None or self.insecure else receiver_tag(addr)

    def open(self, data: bytes, source: object = None) -> tuple[bytes, bytes]:
        """``(boot_id, plaintext)`` of a datagram, or raise :class:`OpenError` (and count it).
        ``source``: where it came from (any hashable, e.g. the UDP peer address), for the rate limit."""
        granted = False  # a token for an unknown sender was taken already
        # Fast path, the steady state: a well-formed datagram for this node from a known sender (window
        # and subkey cached) with a fresh counter. It makes exactly the checks of the full path below, in
        # the same order, and anything unusual (including every refusal but a bad tag) takes the full
        # path. It runs for every datagram, on cold caches when the agent is idle: its Python part is
        # kept short.
        if type(data) is bytes and not self.insecure and OVERHEAD <= len(data) <= self._max_datagram \
                and data[:4] == _DATAGRAM_PREFIX:
            kid, sender, counter, rtag = _TAIL.unpack_from(data, 4)
            window = self._windows.get(sender)
            ck = (kid, sender)
            cipher = self._subkeys.get(ck)
            if window is not None and cipher is not None and counter > window.highest \
                    and (rtag == self._rtag or self._rtag is None) \
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
            if window is None and cipher is None and self._clock is not None \
                    and (rtag == self._rtag or self._rtag is None) \
                    and kid in self.keyring.keyset.by_id:  # type: ignore[union-attr]
                # an unknown sender that passes every check before the rate limit: the same refusal
                # as the full path's, without its parsing (the cost of a forgery flood)
                if not self._bucket_for(source).take(self._clock()):
                    raise self._fail("throttled", _THROTTLED)
                granted = True
        h = self._parse(data, KIND_DATAGRAM, self.limits.max_datagram)
        if self.insecure:
            return h.sender_id, bytes(data[HEADER_SIZE:])
        if self._rtag is not None and h.receiver != self._rtag:
            raise self._fail("wrong_receiver", f"sealed for receiver {h.receiver.hex()}, this node is "
                                               f"{self.receiver} ({self._rtag.hex()}): replayed from "
                                               "another member's traffic, or sent to an address this "
                                               "node does not advertise")
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
            if self._clock is not None and not granted and not self._bucket_for(source).take(self._clock()):
                raise self._fail("throttled", _THROTTLED)
            self.derivations += 1
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
            if source is not None:
                self._known_sources[source] = None
                self._known_sources.move_to_end(source)
                if len(self._known_sources) > self.limits.max_senders:
                    self._known_sources.popitem(last=False)
        return h.sender_id, plaintext

    def _bucket_for(self, source: object) -> TokenBucket:
        return self._known_bucket if source is not None and source in self._known_sources else self._bucket

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

    Frames must carry one sender id and counters 0, 1, 2, ...; the first is the opening frame (empty,
    consumed here); a sender id already seen on another connection is refused as a replay. Each step
    checks what it can as soon as its bytes are there: the length prefix, then the header, then the
    tag. :meth:`wanted` says how many bytes the next step needs: a reader that reads no more than that
    never buffers more than the frame in hand. The first refusal poisons the opener: every later call
    raises the same error (counted once), and the caller must close the connection.
    """

    def __init__(self, parent: Opener) -> None:
        self._p = parent
        self._buf = bytearray()
        self._ciphers: dict[bytes, Aead] = {}
        self.stream_id: bytes | None = None
        self._next_counter = 0
        self._error: tuple[str, str] | None = None
        """(reason, detail) of the refusal, kept without the exception: a stored exception holds its
        traceback, whose frames hold this opener and the refused bytes."""
        self._frame_len = -1  # declared length of the frame in hand; -1: its prefix is not read yet
        self._header: _Header | None = None  # its header, once checked

    @property
    def authenticated(self) -> bool:
        """True once the opening frame authenticated: the peer holds a cluster key."""
        return self.stream_id is not None

    @property
    def frame_size(self) -> int:
        """Bytes the frame in hand occupies once complete (prefix included), as far as known."""
        if self._frame_len < 0:
            return FRAME_PREFIX_SIZE + self._opening_size()
        return FRAME_PREFIX_SIZE + self._frame_len

    def wanted(self) -> int:
        """How many more bytes the next check needs (at least 1)."""
        if self._frame_len < 0:
            need = FRAME_PREFIX_SIZE
        elif self._header is None:
            need = FRAME_PREFIX_SIZE + HEADER_SIZE
        else:
            need = FRAME_PREFIX_SIZE + self._frame_len
        return max(1, need - len(self._buf))

    def receive_data(self, data: bytes) -> None:
        """Append bytes read from the stream (no parsing happens here; read :meth:`wanted` bytes at a
        time to bound the buffer)."""
        self._raise_if_poisoned()
        self._buf += data

    def next_frame(self) -> bytes | None:
        """The next complete frame's payload, None if more bytes are needed; raises on a bad frame."""
        self._raise_if_poisoned()
        try:
            return self._next_frame()
        except OpenError as exc:
            self._error = (exc.reason, exc.detail)
            self._buf = bytearray()
            self._header = None
            raise

    def feed(self, data: bytes) -> list[bytes]:
        """:meth:`receive_data` then every complete frame's payload, taking ``data`` in the pieces
        :meth:`wanted` asks for (a bad header is refused before the bytes after it are buffered)."""
        frames: list[bytes] = []
        view = memoryview(data)
        while True:
            n = self.wanted()
            self.receive_data(bytes(view[:n]))
            view = view[n:]
            while (frame := self.next_frame()) is not None:
                frames.append(frame)
            if not view:
                return frames

    @property
    def buffered(self) -> int:
        return len(self._buf)

    def _raise_if_poisoned(self) -> None:
        if self._error is not None:
            raise OpenError(*self._error)

    def _opening_size(self) -> int:
        return HEADER_SIZE if self._p.insecure else OVERHEAD

    def _next_frame(self) -> bytes | None:
        p = self._p
        buf = self._buf
        while True:
            if self._frame_len < 0:
                if len(buf) < FRAME_PREFIX_SIZE:
                    return None
                (n,) = _LEN.unpack_from(buf)
                limit = p.limits.max_frame
                if n > limit:
                    raise p._fail("too_large", f"stream frame of {n} bytes, limit {limit}")
                if n < self._opening_size():
                    raise p._fail("truncated", f"stream frame length {n} is shorter than the minimum")
                self._frame_len = n
            n = self._frame_len
            if self._header is None:
                if len(buf) < FRAME_PREFIX_SIZE + HEADER_SIZE:
                    return None
                self._header = self._check_header(p._parse(buf, KIND_STREAM, p.limits.max_frame,
                                                           FRAME_PREFIX_SIZE, n))
                if self.stream_id is None and n != self._opening_size():
                    # refused with no more than the header buffered (which named a format this node reads)
                    raise p._fail("too_large", f"first stream frame of {n} bytes; a connection opens "
                                               f"with the {self._opening_size()}-byte opening frame")
            if len(buf) < FRAME_PREFIX_SIZE + n:
                return None
            h = self._header
            frame = bytes(buf[FRAME_PREFIX_SIZE:FRAME_PREFIX_SIZE + n])
            if p.insecure:
                payload = frame[HEADER_SIZE:]
            else:
                master = p._master(h.key_id)
                cipher = self._ciphers.get(h.key_id)
                if cipher is None:
                    cipher = p._subkey_cipher(master, h.sender_id, h.kind)
                payload = p._decrypt(cipher, frame, h)
                self._ciphers[h.key_id] = cipher
            del buf[:FRAME_PREFIX_SIZE + n]
            self._frame_len = -1
            self._header = None
            self._next_counter += 1
            if self.stream_id is None:  # the opening frame: the peer holds a key
                self.stream_id = h.sender_id
                p._remember_stream(h.sender_id)
                continue
            return payload

    def _check_header(self, h: _Header) -> _Header:
        p = self._p
        if self.stream_id is None:
            if p._stream_seen(h.sender_id):
                raise p._fail("replay", "stream id already used by another connection")
        elif h.sender_id != self.stream_id:
            raise p._fail("replay", "stream id changed within a connection")
        if h.counter != self._next_counter:
            raise p._fail("replay", f"stream counter {h.counter}, expected {self._next_counter}")
        if not p.insecure:
            p._master(h.key_id)  # an unknown key is refused before the body is read
        return h
