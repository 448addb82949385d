"""Keyring: the AES-256 keys a gossiprec agent seals and opens packets with.

Theory of operation
-------------------
A keyring holds up to ``MAX_KEYS`` 32-byte keys. Each key is named by its *key id*: the first 8 bytes of
SHA-256 of the key, shown as 16 hex digits. The id travels in clear in every packet header so a receiver
finds the right key without trial decryption; it reveals nothing useful about the key. Exactly one key is
the *primary*: senders seal with it. Every installed key is accepted for opening.

Keys are rotated live, the way Serf users know it, in three cluster-wide steps, each applied on every
node before the next starts::

    gossiprec keys install < new.key   # every node now opens packets sealed with old or new
    gossiprec keys use NEWKEYID        # every node now seals with new (and still opens old)
    gossiprec keys remove OLDKEYID     # old packets are refused from here on

``install`` reads the key from stdin (``gossiprec keys generate | gossiprec keys install``) or from
``--key-file``; a key given as an argument works but is warned about, since every local user can read
a process's arguments (``/proc/<pid>/cmdline``). ``use`` warns (unless ``--installed-everywhere``) that
a node sealing with a key its peers lack is refused by all of them, and so evicted.

The CLI edits the keyring file; a running agent picks the change up on SIGHUP or when it sees the file's
identity (inode, size, mtime) change, via :meth:`Keyring.load_if_changed`. A reload that fails (bad
permissions, malformed file) raises and leaves the keys in memory untouched, so a typo never locks a
running agent out of its cluster.

The file is JSON (``{"format": "gossiprec-keyring", "version": 1, "primary": KEY, "keys": [KEY, ...]}``,
keys in standard base64), written atomically (temporary file in the same directory, fsync, rename) with
mode 0600. Loading refuses a file that group or others may access, with the ``chmod`` that fixes it.

The in-memory state is one immutable :class:`KeySet` swapped by a single reference assignment, so readers
(the sealer on every packet) take a consistent snapshot without locks: ``ks = keyring.keyset``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
import os
import secrets
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from gossiprec.errors import SecurityError

KEY_SIZE = 32
"""Bytes in a key (AES-256)."""
KEY_ID_SIZE = 8
"""Bytes in a key id (prefix of SHA-256 of the key)."""
MAX_KEYS = 64
"""Most keys a keyring holds; rotation needs two, this only bounds a runaway file."""
MAX_FILE_BYTES = 64 * 1024
"""Largest keyring file we read; a real one is a few hundred bytes."""
FILE_FORMAT = "gossiprec-keyring"
FILE_VERSION = 1


class KeyringError(SecurityError):
    """A key or keyring file is malformed, unsafe, or an operation on it is not allowed."""


def key_id(key: bytes) -> bytes:
    """The 8-byte id of ``key``: first bytes of its SHA-256."""
    return hashlib.sha256(key).digest()[:KEY_ID_SIZE]


def key_id_hex(key: bytes) -> str:
    """The id of ``key`` as 16 lowercase hex digits (how ids are shown and typed)."""
    return key_id(key).hex()


def encode_key(key: bytes) -> str:
    """A key as standard base64 text (44 characters)."""
    _check_key_bytes(key)
    return base64.b64encode(key).decode("ascii")


def generate_key() -> str:
    """A fresh random key from the OS CSPRNG, as base64 text."""
    return encode_key(secrets.token_bytes(KEY_SIZE))


def decode_key(text: str) -> bytes:
    """Parse base64 key text; raise :class:`KeyringError` saying what is wrong and how to fix it."""
    stripped = text.strip()
    if not stripped:
        raise KeyringError("empty key; create one with `gossiprec keys generate`")
    try:
        raw = base64.b64decode(stripped, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise KeyringError(
            f"key is not valid base64 ({exc}); expected the 44-character text printed by "
            "`gossiprec keys generate`"
        ) from exc
    if len(raw) != KEY_SIZE:
        raise KeyringError(
            f"key decodes to {len(raw)} bytes, expected {KEY_SIZE} (AES-256); "
            "create a valid key with `gossiprec keys generate`"
        )
    return raw


def _check_key_bytes(key: bytes) -> None:
    if not isinstance(key, (bytes, bytearray)) or len(key) != KEY_SIZE:
        raise KeyringError(f"a key must be {KEY_SIZE} bytes")


@dataclass(frozen=True, slots=True)
class KeyInfo:
    """What ``keys list`` shows about one key (never the key itself)."""

    key_id: str
    primary: bool


@dataclass(frozen=True, slots=True)
class KeySet:
    """An immutable snapshot of a keyring: keys in install order and the primary's id."""

    keys: tuple[bytes, ...] = ()
    primary_id: bytes | None = None
    by_id: Mapping[bytes, bytes] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        ids = {key_id(k): bytes(k) for k in self.keys}
        if len(ids) != len(self.keys):
            raise KeyringError("duplicate key in keyring")
        if self.primary_id is not None and self.primary_id not in ids:
            raise KeyringError("primary key is not among the installed keys")
        if self.keys and self.primary_id is None:
            raise KeyringError("a non-empty keyring needs a primary key")
        object.__setattr__(self, "by_id", ids)

    @property
    def primary(self) -> bytes | None:
        """The primary key (seals), or None for an empty keyring."""
        return None if self.primary_id is None else self.by_id[self.primary_id]

    def get(self, kid: bytes) -> bytes | None:
        """The key with id ``kid``, or None if not installed."""
        return self.by_id.get(kid)


class Keyring:
    """A mutable holder of a :class:`KeySet`, optionally bound to a file.

    Not thread-safe for writers: mutate from one thread (the agent's event loop). Readers may read
    :attr:`keyset` from anywhere.
    """

    def __init__(self, keys: list[bytes] | None = None, primary: bytes | None = None,
                 path: str | os.PathLike[str] | None = None) -> None:
        keys = [bytes(k) for k in (keys or [])]
        for k in keys:
            _check_key_bytes(k)
        if primary is None and keys:
            primary = keys[0]
        self.keyset = KeySet(tuple(keys), None if primary is None else key_id(primary))
        self.path: Path | None = None if path is None else Path(path)
        self._fingerprint: tuple[int, int, int, int] | None = None

    # --- queries -------------------------------------------------------------------------------
    @property
    def primary(self) -> bytes | None:
        return self.keyset.primary

    def get(self, kid: bytes) -> bytes | None:
        return self.keyset.get(kid)

    def __len__(self) -> int:
        return len(self.keyset.keys)

    def __contains__(self, key: object) -> bool:
        return isinstance(key, (bytes, bytearray)) and key_id(bytes(key)) in self.keyset.by_id

    def list(self) -> list[KeyInfo]:
        """Installed keys in install order, primary flagged."""
        ks = self.keyset
        return [KeyInfo(key_id(k).hex(), key_id(k) == ks.primary_id) for k in ks.keys]

    # --- operations ----------------------------------------------------------------------------
    def install(self, key: bytes) -> bool:
        """Add ``key`` (accepted for opening). The first key of an empty keyring becomes primary.

        Returns False if it was already installed (nothing changes).
        """
        _check_key_bytes(key)
        ks = self.keyset
        if key_id(key) in ks.by_id:
            return False
        if len(ks.keys) >= MAX_KEYS:
            raise KeyringError(f"keyring already holds {MAX_KEYS} keys; remove unused keys first")
        primary = ks.primary_id if ks.primary_id is not None else key_id(key)
        self.keyset = KeySet(ks.keys + (bytes(key),), primary)
        return True

    def use(self, key_or_id: bytes) -> None:
        """Make an installed key (given as key bytes or 8-byte id) the primary."""
        kid = self._resolve(key_or_id)
        self.keyset = KeySet(self.keyset.keys, kid)

    def remove(self, key_or_id: bytes) -> None:
        """Remove an installed key; the primary cannot be removed."""
        kid = self._resolve(key_or_id)
        ks = self.keyset
        if kid == ks.primary_id:
            raise KeyringError(
                f"refusing to remove the primary key {kid.hex()}: senders still seal with it; make "
                "another key primary first (`gossiprec keys use OTHERKEY`)"
            )
        self.keyset = KeySet(tuple(k for k in ks.keys if key_id(k) != kid), ks.primary_id)

    def _resolve(self, key_or_id: bytes) -> bytes:
        kid = key_or_id if len(key_or_id) == KEY_ID_SIZE else key_id(key_or_id)
        if kid not in self.keyset.by_id:
            raise KeyringError(
                f"key {kid.hex()} is not installed; install it first (`gossiprec keys install --key-file FILE`, "
                "or the key on stdin)"
            )
        return kid

    # --- persistence ---------------------------------------------------------------------------
    def to_json(self) -> dict[str, Any]:
        ks = self.keyset
        return {
            "format": FILE_FORMAT,
            "version": FILE_VERSION,
            "primary": None if ks.primary is None else encode_key(ks.primary),
            "keys": [encode_key(k) for k in ks.keys],
        }

    @classmethod
    def from_json(cls, doc: object, where: str = "keyring") -> Keyring:
        if not isinstance(doc, dict) or doc.get("format") != FILE_FORMAT:
            raise KeyringError(f"{where} is not a gossiprec keyring (missing \"format\": \"{FILE_FORMAT}\")")
        if doc.get("version") != FILE_VERSION:
            raise KeyringError(f"{where} has version {doc.get('version')!r}; this gossiprec reads "
                               f"version {FILE_VERSION}; upgrade gossiprec or recreate the keyring")
        raw_keys = doc.get("keys")
        if not isinstance(raw_keys, list) or not all(isinstance(k, str) for k in raw_keys):
            raise KeyringError(f"{where}: \"keys\" must be a list of base64 strings")
        if len(raw_keys) > MAX_KEYS:
            raise KeyringError(f"{where} holds {len(raw_keys)} keys, at most {MAX_KEYS} allowed")
        keys: list[bytes] = []
        for i, text in enumerate(raw_keys):
            try:
                k = decode_key(text)
            except KeyringError as exc:
                raise KeyringError(f"{where}: key #{i}: {exc}") from None
            if k in keys:
                raise KeyringError(f"{where}: key #{i} ({key_id_hex(k)}) appears twice; delete one")
            keys.append(k)
        primary_text = doc.get("primary")
        if primary_text is None:
            if keys:
                raise KeyringError(f"{where}: \"primary\" is missing; set it with `gossiprec keys use KEY`")
            return cls()
        if not isinstance(primary_text, str):
            raise KeyringError(f"{where}: \"primary\" must be a base64 string")
        try:
            primary = decode_key(primary_text)
        except KeyringError as exc:
            raise KeyringError(f"{where}: primary: {exc}") from None
        if primary not in keys:
            raise KeyringError(f"{where}: the primary key {key_id_hex(primary)} is not in \"keys\"; "
                               "add it to \"keys\" or pick an installed key as primary")
        return cls(keys, primary)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """Read a keyring file, refusing one that group/others may access or that is malformed."""
        ring = cls(path=path)
        ring.reload()
        return ring

    def reload(self, path: str | os.PathLike[str] | None = None) -> None:
        """Re-read the file unconditionally (SIGHUP). On any error the keys in memory are kept."""
        p = self._path(path)
        doc, fp = _read_private_json(p)
        fresh = Keyring.from_json(doc, where=f"keyring file {p}")
        self.keyset = fresh.keyset
        self.path = p
        self._fingerprint = fp

    def load_if_changed(self, path: str | os.PathLike[str] | None = None) -> bool:
        """Reload if the file's (device, inode, size, mtime) changed since the last load or save.

        One ``stat`` when nothing changed. Returns True when new keys were loaded. Raises
        :class:`KeyringError` (keeping the current keys) if the changed file is unsafe or malformed.
        """
        p = self._path(path)
        try:
            st = os.stat(p)
        except OSError as exc:
            raise KeyringError(f"cannot stat keyring file {p}: {exc.strerror}; keeping the current "
                               "keys") from exc
        if _fingerprint(st) == self._fingerprint and p == self.path:
            return False
        self.reload(p)
        return True

    def save(self, path: str | os.PathLike[str] | None = None) -> None:
        """Write the keyring atomically with mode 0600 (temp file, fsync, rename, fsync dir)."""
        p = self._path(path)
        data = (json.dumps(self.to_json(), indent=2) + "\n").encode("utf-8")
        atomic_write_private(p, data)
        self.path = p
        self._fingerprint = _fingerprint(os.stat(p))

    def _path(self, path: str | os.PathLike[str] | None) -> Path:
        if path is not None:
            return Path(path)
        if self.path is None:
            raise KeyringError("this keyring is not bound to a file; pass a path")
        return self.path


def _fingerprint(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def read_private_file(path: Path, what: str, limit: int, error: type[SecurityError], leaked: str,
                      ) -> tuple[bytes, os.stat_result]:
    """The bytes of a secret file (a keyring, a signing key) and the stat of the very file read.
    Refused with ``error``: a symlink, anything but a regular file, a mode that lets group or others in
    (``leaked``: what to do then), more than ``limit`` bytes. FileNotFoundError passes through."""
    flags = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise error(f"cannot open {what} {path}: {exc.strerror} (a symlink is refused; point at the file "
                    "itself)") from exc
    try:
        st = os.fstat(fd)  # check the file we opened, not whatever the path names a moment later
        if not stat.S_ISREG(st.st_mode):
            raise error(f"{what} {path} is not a regular file")
        if os.name == "posix" and st.st_mode & 0o077:
            raise error(f"{what} {path} has mode {stat.S_IMODE(st.st_mode):04o}: group or others can access "
                        f"it, so {leaked}")
        if st.st_size > limit:
            raise error(f"{what} {path} is {st.st_size} bytes, more than a {what} can be ({limit}); is this "
                        "the right file?")
        with os.fdopen(fd, "rb", closefd=True) as f:
            fd = -1
            raw = f.read(limit + 1)
    finally:
        if fd >= 0:
            os.close(fd)
    if len(raw) > limit:  # it grew since the fstat
        raise error(f"{what} {path} is more than {limit} bytes; is this the right file?")
    return raw, st


def _read_private_json(path: Path) -> tuple[object, tuple[int, int, int, int]]:
    try:
        raw, st = read_private_file(
            path, "keyring file", MAX_FILE_BYTES, KeyringError,
            f"its keys must be treated as leaked; fix with `chmod 600 {path}` (and rotate the keys if others "
            "may have read them)")
    except FileNotFoundError as exc:
        raise KeyringError(f"keyring file {path} does not exist; create it with `gossiprec keys generate | "
                           f"gossiprec keys install --keyring {path}` (the key on stdin, never on a command "
                           "line)") from exc
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise KeyringError(f"keyring file {path} is not valid JSON ({exc}); restore it from a backup "
                           "or recreate it with `gossiprec keys install`") from exc
    return doc, _fingerprint(st)


def atomic_write_private(path: Path, data: bytes) -> None:
    directory = path.parent
    if not directory.exists():
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = directory / f".{path.name}.tmp-{secrets.token_hex(6)}"
    flags = (os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(tmp, flags, 0o600)
    except OSError as exc:
        raise KeyringError(f"cannot create {tmp}: {exc.strerror}; check that {directory} is "
                           "writable") from exc
    try:
        try:
            if hasattr(os, "fchmod"):
                os.fchmod(fd, 0o600)  # umask can only narrow the mode; make it exact anyway
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    if hasattr(os, "O_DIRECTORY"):
        try:
            dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return
        try:
            os.fsync(dfd)
        except OSError:
            pass
        finally:
            os.close(dfd)
