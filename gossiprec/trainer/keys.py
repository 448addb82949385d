"""The keys the trainer's own network traffic is authenticated with, and how they follow a rotation.

Two channels leave a trainer: state transfers (:mod:`gossiprec.trainer.transfer.wire`) and the
rendezvous of each epoch's process group on a member's TCPStore (:class:`SealedStore`). Both are
authenticated with the cluster's keyring, the same file the agent seals its packets with, handed down
by ``gossiprec run`` as a *path* (``GOSSIPREC_KEYRING``) or, with ``gossiprec run --keyring-fd``, down an
inherited *descriptor* (``GOSSIPREC_KEYRING_FD`` names its number): the key itself never enters an
environment.

Rotation works as for the agent (:mod:`gossiprec.security.keyring`): the primary key signs (a
receiver's requests, the values this process writes to a store), every installed key is accepted for
checking (a donor opens a request with whichever installed key authenticates it and answers under
that key; a store value names the id of the key that sealed it). The file is looked at again
(one ``stat``) whenever a key is needed, so a trainer started before a rotation follows it, and a spare
started after a full rotation (install, use, remove) is served by survivors started before it.

**The descriptor** is for a trainer that cannot read the file (another user, another mount namespace, a
container): the launcher, which reads the file, writes the keyring down a pipe whose read end only its
child inherits, and writes it again whenever its agent reloads a changed keyring (a file descriptor of
the keyring itself could not follow a rotation: the file is replaced by a rename). The messages are
the launch contract's (:mod:`gossiprec.local.launch`); :meth:`TransferKeys.from_fd` reads the first one
at once and the later ones in a thread of its own, swapping the keys in one
assignment. The descriptor is made non-inheritable on arrival, so the trainer's own children get nothing.

An ``--insecure`` cluster has no keyring: :meth:`TransferKeys.insecure` derives a key from the cluster
name, which anyone can compute: it guards against accidents (two jobs on one network), not attackers.
A trainer refuses it when its agent says the cluster is keyed (``ResilientTrainer.start``).

**The store.** A TCPStore has no authentication and lets any client list its keys, so no key name can
be a secret. :class:`SealedStore` wraps it: every value is written as ``key id | value | tag``, the tag a
GMAC over the full key name and the value, and a read whose tag does not check under an installed key
raises. An outsider who can reach the store can still delete or overwrite values (a denial of service,
which reaching the port allows anyway) but cannot make a rank read a value of its making: no forged
peer address reaches gloo. ``add`` counters cannot be sealed; gloo's rendezvous uses only
``set``/``get``/``wait``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from datetime import timedelta
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from gossiprec.errors import ConfigError, SecurityError
from gossiprec.local.launch import FIRST_KEYS_TIMEOUT, KEYRING_FD_ENV, read_keyring_message
from gossiprec.security.keyring import Keyring

log = logging.getLogger(__name__)

KEY_SIZE = 32
KID_SIZE = 8
TAG_SIZE = 16
STORE_INFO = b"gossiprec-store-v1\x00"


def _kid(key: bytes) -> bytes:
    return hashlib.sha256(key).digest()[:KID_SIZE]


def insecure_key(cluster: str) -> bytes:
    """The key of an ``--insecure`` cluster named ``cluster`` (public: anyone can compute it)."""
    return hashlib.sha256(b"gossiprec-insecure-transfer\x00" + cluster.encode()).digest()


class TransferKeys:
    """The keys a trainer signs with (:meth:`primary`) and accepts (:meth:`accepted`). Thread-safe.

    Build it with :meth:`from_file` (a keyring file, followed as it rotates), :meth:`fixed` (one key
    given by the caller) or :meth:`insecure` (derived from the cluster name: :attr:`keyed` is False).
    """

    def __init__(self, *, ring: Keyring | None = None, key: bytes | None = None, keyed: bool = True,
                 source: str = "") -> None:
        if (ring is None) == (key is None):
            raise ConfigError("TransferKeys takes a keyring or one key")
        if key is not None and (not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE):
            raise ConfigError(f"a transfer key must be {KEY_SIZE} bytes")
        self._ring = ring
        self._key = None if key is None else bytes(key)
        self.keyed = keyed
        """False for the cluster-name key of an ``--insecure`` cluster."""
        self.source = source
        """Where the keys come from, for messages (a path, "given", "cluster name")."""
        self._lock = threading.Lock()
        self.reloaded = threading.Event()
        """Set each time a keyring arrived down the descriptor after the first (tests wait on it)."""

    @classmethod
    def from_fd(cls, fd: int) -> TransferKeys:
        """The keyring arriving on descriptor ``fd`` (see the module docstring), followed as the launcher
        sends it again; :class:`~gossiprec.errors.ConfigError` if nothing usable arrives."""
        hint = "start the trainer with `gossiprec run --keyring-fd`, which opens it"
        try:
            os.set_inheritable(fd, False)  # the trainer's own children get nothing
            os.set_blocking(fd, True)
        except OSError as exc:
            raise ConfigError(f"{KEYRING_FD_ENV}={fd} is not an open descriptor ({exc.strerror}): {hint}") from None
        try:
            ring = read_keyring_message(fd, time.monotonic() + FIRST_KEYS_TIMEOUT)
        except (OSError, SecurityError, ValueError) as exc:
            raise ConfigError(f"no keyring on descriptor {fd} ({KEYRING_FD_ENV}): {exc}; {hint}") from None
        if ring is None:
            raise ConfigError(f"descriptor {fd} ({KEYRING_FD_ENV}) closed before a keyring arrived: {hint}")
        if ring.primary is None:
            raise ConfigError(f"the keyring on descriptor {fd} has no primary key; run `gossiprec keys use KEY`")
        keys = cls(ring=ring, source=f"descriptor {fd}")
        threading.Thread(target=keys._follow, args=(fd,), name="gossiprec-keyring-fd", daemon=True).start()
        return keys

    def _follow(self, fd: int) -> None:
        """Take every later keyring from ``fd`` until the launcher closes it (the keys in hand stay)."""
        assert self._ring is not None
        while True:
            try:
                ring = read_keyring_message(fd, None)
            except SecurityError as exc:  # a well-framed message with a bad keyring: wait for the next
                log.warning("a keyring from descriptor %d was refused, keeping the current keys: %s", fd, exc)
                continue
            except (OSError, ValueError) as exc:  # the stream is broken: nothing later can be trusted
                log.warning("keyring descriptor %d failed (%s): keeping the current keys for good", fd, exc)
                return
            if ring is None:
                return
            if ring.primary is None:
                log.warning("a keyring from descriptor %d has no primary key; keeping the current keys", fd)
                continue
            self._ring.keyset = ring.keyset  # one reference: readers see the old keys or the new
            log.info("transfer keys replaced from descriptor %d: %d key(s)", fd, len(ring))
            self.reloaded.set()

    @classmethod
    def from_file(cls, path: str) -> TransferKeys:
        """The keyring at ``path``; :class:`~gossiprec.errors.SecurityError` if it cannot be read."""
        ring = Keyring.load(path)
        if ring.primary is None:
            raise ConfigError(f"keyring {path} has no primary key; run `gossiprec keys use KEY`")
        return cls(ring=ring, source=str(path))

    @classmethod
    def fixed(cls, key: bytes) -> TransferKeys:
        return cls(key=key, source="given")

    @classmethod
    def insecure(cls, cluster: str) -> TransferKeys:
        return cls(key=insecure_key(cluster), keyed=False, source=f"cluster name {cluster!r}")

    def _refresh(self) -> None:
        ring = self._ring
        if ring is None or ring.path is None:
            return
        with self._lock:
            try:
                if ring.load_if_changed():
                    log.info("transfer keys reloaded from %s: %d key(s)", ring.path, len(ring))
            except SecurityError as exc:  # a bad edit keeps the keys in memory, as the agent does
                log.warning("keyring reload failed, keeping the current keys: %s", exc)

    def primary(self) -> bytes:
        """The key to sign with now."""
        self._refresh()
        if self._key is not None:
            return self._key
        assert self._ring is not None
        key = self._ring.primary
        if key is None:
            raise ConfigError(f"keyring {self.source} has no primary key; run `gossiprec keys use KEY`")
        return key

    def accepted(self) -> list[bytes]:
        """Every key accepted for checking, the primary first."""
        primary = self.primary()
        if self._ring is None:
            return [primary]
        ks = self._ring.keyset  # one snapshot: a replacement may land meanwhile
        primary = ks.primary or primary
        return [primary, *(k for k in ks.keys if k != primary)]

    def by_id(self, kid: bytes) -> bytes | None:
        """The accepted key with id ``kid`` (first 8 bytes of its SHA-256), if any."""
        return next((k for k in self.accepted() if _kid(k) == kid), None)


def _store_aead(key: bytes) -> AESGCM:
    hkdf = HKDF(algorithm=hashes.SHA256(), length=KEY_SIZE, salt=None, info=STORE_INFO)
    return AESGCM(hkdf.derive(key))


_NONCE = bytes(12)
"""One nonce for every store value: GMAC authenticates, it encrypts nothing, and each (key name, value)
pair is what the tag covers."""


def seal_value(keys: TransferKeys, name: str, value: bytes) -> bytes:
    """``value`` as :class:`SealedStore` writes it under ``name``: key id | value | tag."""
    key = keys.primary()
    kid = _kid(key)
    tag = _store_aead(key).encrypt(_NONCE, b"", name.encode() + b"\x00" + kid + value)
    return kid + value + tag


def open_value(keys: TransferKeys, name: str, sealed: bytes) -> bytes:
    """The value :func:`seal_value` sealed under ``name``; :class:`SecurityError` if it does not check."""
    if len(sealed) < KID_SIZE + TAG_SIZE:
        raise SecurityError(f"store value {name!r} is not sealed (too short): written by something that is not "
                            "a trainer of this cluster")
    kid, value, tag = sealed[:KID_SIZE], sealed[KID_SIZE:-TAG_SIZE], sealed[-TAG_SIZE:]
    key = keys.by_id(kid)
    if key is None:
        raise SecurityError(f"store value {name!r} is sealed with key {kid.hex()}, which this trainer's keyring "
                            f"({keys.source}) does not hold: another cluster's, or a rotation not applied here")
    try:
        _store_aead(key).decrypt(_NONCE, tag, name.encode() + b"\x00" + kid + value)
    except InvalidTag:
        raise SecurityError(f"store value {name!r} failed authentication: forged or altered by something that "
                            "is not a trainer of this cluster") from None
    return bytes(value)


def sealed_store(inner: Any, keys: TransferKeys, context: str = "") -> Any:
    """A :class:`SealedStore` over the torch store ``inner`` (imports torch). ``context`` is prepended to
    every name the tags cover: the prefix that layers above ``inner`` add (a managed group's), so that a
    value copied from one group's names to another's fails authentication."""
    import torch.distributed as dist

    class SealedStore(dist.Store):
        """Values sealed on ``set``, checked on ``get`` (see the module docstring); everything else passes
        through to the TCPStore. The Python object must outlive every C++ user (a PrefixStore, a process
        group): :class:`~gossiprec.trainer.collectives.groups.EpochGroups` keeps it."""

        def __init__(self) -> None:
            super().__init__()
            self.inner = inner

        def set(self, key: str, value: bytes) -> None:  # type: ignore[override]  # torch passes bytes (stub: str)
            self.inner.set(key, seal_value(keys, context + key, bytes(value)))

        def get(self, key: str) -> bytes:
            return open_value(keys, context + key, bytes(self.inner.get(key)))

        def wait(self, keys_: list[str], timeout: timedelta | None = None) -> None:
            if timeout is None:
                self.inner.wait(keys_)
            else:
                self.inner.wait(keys_, timeout)

        def check(self, keys_: list[str]) -> bool:
            return bool(self.inner.check(keys_))

        def add(self, key: str, n: int) -> int:
            return int(self.inner.add(key, n))

        def compare_set(self, key: str, expected: bytes, desired: bytes) -> bytes:  # type: ignore[override]  # as set
            raise ConfigError("compare_set is not supported on a sealed store")

        def deleteKey(self, key: str) -> bool:  # noqa: N802 - the C++ name the trampoline calls
            return bool(self.inner.delete_key(key))

        def getNumKeys(self) -> int:  # noqa: N802
            return int(self.inner.num_keys())

        def set_timeout(self, timeout: timedelta) -> None:
            self.inner.set_timeout(timeout)

    return SealedStore()
