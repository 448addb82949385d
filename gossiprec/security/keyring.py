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

import argparse
import base64
import binascii
import hashlib
import json
import os
import secrets
import stat
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, TextIO

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
PROG = "gossiprec keys"


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


# --- CLI -----------------------------------------------------------------------------------------

def parse_key_arg(text: str) -> bytes:
    """A CLI KEY argument: base64 key text (44 chars) or a 16-hex-digit key id -> key or id bytes."""
    t = text.strip()
    if len(t) == 2 * KEY_ID_SIZE:
        try:
            return bytes.fromhex(t)
        except ValueError:
            pass
    return decode_key(t)


def _keyring_path(args: argparse.Namespace) -> Path:
    p = getattr(args, "keyring", None) or getattr(args, "keyring_outer", None)
    if p is None:
        raise KeyringError("no keyring path: pass --keyring PATH")
    return Path(p).expanduser()


def _load_or_empty(path: Path) -> Keyring:
    if not path.exists() and not path.is_symlink():
        return Keyring(path=path)
    return Keyring.load(path)


def _cmd_generate(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    print(generate_key(), file=out)
    return 0


def _read_key_text(args: argparse.Namespace, err: TextIO) -> str:
    """The KEY of ``install``: from ``--key-file``, stdin (no KEY, or ``-``), or the argument (warned)."""
    if args.key_file is not None:
        if args.key is not None:
            raise KeyringError("give the key once: either --key-file or KEY")
        p = Path(args.key_file).expanduser()
        try:
            with open(p, encoding="ascii") as f:
                return f.read(4096)
        except (OSError, UnicodeDecodeError) as exc:
            raise KeyringError(f"cannot read the key from {p}: {exc}") from None
    if args.key is None or args.key == "-":
        return sys.stdin.readline(4096)
    print(f"{PROG}: warning: a key on the command line is readable by every local user while this runs "
          f"(/proc/<pid>/cmdline) and stays in shell history; pipe it instead: `{PROG} generate | "
          f"{PROG} install`, or `{PROG} install --key-file FILE`", file=err)
    return str(args.key)


def _cmd_install(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    key = decode_key(_read_key_text(args, err))
    path = _keyring_path(args)
    ring = _load_or_empty(path)
    kid = key_id_hex(key)
    if not ring.install(key):
        print(f"key {kid} is already installed in {path}; nothing to do", file=out)
        return 0
    ring.save(path)
    if ring.keyset.primary_id == key_id(key):
        print(f"installed key {kid} in {path} as the primary (the keyring was empty)", file=out)
    else:
        print(f"installed key {kid} in {path}; it is accepted for opening. Once it is installed on "
              f"every node, make it primary with `{PROG} use {kid}`", file=out)
    return 0


def _cmd_use(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = _keyring_path(args)
    ring = Keyring.load(path)
    target = parse_key_arg(args.key)
    ring.use(target)
    ring.save(path)
    kid = ring.keyset.primary_id
    assert kid is not None
    if not args.installed_everywhere:
        print(f"{PROG}: warning: this node now seals with key {kid.hex()}; every peer that has not "
              f"installed it refuses this node's packets and evicts it. Check `{PROG} list` on every node "
              "first (pass --installed-everywhere once you have)", file=err)
    others = [i.key_id for i in ring.list() if not i.primary]
    hint = f"; once every node uses it, retire old keys with `{PROG} remove {others[0]}`" if others else ""
    print(f"primary key of {path} is now {kid.hex()}{hint}", file=out)
    return 0


def _cmd_remove(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = _keyring_path(args)
    ring = Keyring.load(path)
    target = parse_key_arg(args.key)
    kid = target if len(target) == KEY_ID_SIZE else key_id(target)
    ring.remove(target)
    ring.save(path)
    print(f"removed key {kid.hex()} from {path}; packets sealed with it are now refused", file=out)
    return 0


def _cmd_list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    path = _keyring_path(args)
    ring = Keyring.load(path)
    infos = ring.list()
    if args.json:
        primary = ring.keyset.primary_id
        print(json.dumps({"keyring": str(path),
                          "primary": None if primary is None else primary.hex(),
                          "keys": [{"key_id": i.key_id, "primary": i.primary} for i in infos]}),
              file=out)
        return 0
    if not infos:
        print(f"{path}: no keys installed", file=out)
        return 0
    print(f"{path}: {len(infos)} key(s)", file=out)
    for i in infos:
        print(f"  {i.key_id}{'  primary' if i.primary else ''}", file=out)
    return 0


Handler = Callable[[argparse.Namespace, TextIO, TextIO], int]


def _wrap(handler: Handler) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        out, err = sys.stdout, sys.stderr
        try:
            return handler(args, out, err)
        except SecurityError as exc:
            print(f"{PROG}: error: {exc}", file=err)
            return 1
    run.__name__ = handler.__name__
    return run


def add_cli(subparsers: Any, default_path: str | None = None) -> argparse.ArgumentParser:
    """Add ``keys {generate,install,use,remove,list,public}`` to an argparse sub-parsers object.

    Each action sets ``func``: ``args.func(args) -> int`` (exit code; errors print to stderr and
    return 1). ``--keyring PATH`` is accepted before or after the action; ``default_path`` is used
    when it is absent.
    """
    keys: argparse.ArgumentParser = subparsers.add_parser(
        "keys", help="manage the keyring (generate, install, use, remove, list)",
        description="Manage the AES-256 keys that seal gossiprec traffic. Rotate live with "
                    "install (all nodes) -> use (all nodes) -> remove (all nodes).")
    keys.add_argument("--keyring", dest="keyring_outer", metavar="PATH", default=None,
                      help=f"keyring file (default: {default_path})")
    keys.set_defaults(func=lambda _args: _print_help(keys))
    actions = keys.add_subparsers(dest="keys_action", metavar="ACTION")

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--keyring", metavar="PATH", default=None, help="keyring file")

    def add(name: str, handler: Handler, help_text: str) -> argparse.ArgumentParser:
        p = actions.add_parser(name, help=help_text, description=help_text, parents=[common])
        p.set_defaults(func=_wrap(handler))
        return p

    add("generate", _cmd_generate, "print a new random key (base64); installs nothing")
    install = add("install", _cmd_install, "add a key (accepted for opening), read from stdin "
                  f"(`{PROG} generate | {PROG} install`) or --key-file; a KEY argument is visible to "
                  "every local user")
    install.add_argument("key", metavar="KEY", nargs="?", default=None,
                         help="the key (discouraged: use stdin or --key-file); '-': stdin")
    install.add_argument("--key-file", metavar="FILE", default=None, help="read the key from FILE")
    use = add("use", _cmd_use, "make an installed key primary (used to seal); KEY is the key or its id. "
              "Install it on every node first: peers without it evict this node")
    use.add_argument("key", metavar="KEY")
    use.add_argument("--installed-everywhere", action="store_true",
                     help="the key is installed on every node (silences the warning)")
    add("remove", _cmd_remove, "remove a key that is not primary; KEY is the key or its id"
        ).add_argument("key", metavar="KEY")
    add("list", _cmd_list, "show installed key ids and which one is primary"
        ).add_argument("--json", action="store_true", help="machine-readable output")
    from gossiprec.security.signing import add_public_cli  # imports cryptography: only with the CLI
    add_public_cli(add)

    if default_path is not None:
        keys.set_defaults(keyring_outer=default_path)
    return keys


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
