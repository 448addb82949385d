"""``gossiprec keys``: the command that edits a keyring file and prints an agent's public signing key.

``generate`` prints a new random key; ``install``, ``use`` and ``remove`` are the three steps of a live
rotation (see :mod:`gossiprec.security.keyring`), ``list`` shows the key ids; ``public`` prints the line
that pins an agent's signing key in a job spec (:mod:`gossiprec.security.signing`). Every action edits or
reads the file and exits: a running agent picks the change up itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Callable, TextIO

from gossiprec.errors import SecurityError
from gossiprec.security.keyring import (
    KEY_ID_SIZE, Keyring, KeyringError, decode_key, generate_key, key_id, key_id_hex,
)
from gossiprec.security.signing import add_public_cli

PROG = "gossiprec keys"


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
    add_public_cli(add)

    if default_path is not None:
        keys.set_defaults(keyring_outer=default_path)
    return keys


def _print_help(parser: argparse.ArgumentParser) -> int:
    parser.print_help(sys.stderr)
    return 2
