"""Ed25519 signing keys of one agent: what the core's per-member signatures are made with.

What it decides: nothing about trust (which key belongs to which member is :mod:`gossiprec.core.auth`'s
key book); only how a signature is made and checked, and how an operator's persistent key is kept.
By default each agent makes a fresh key pair at start (:meth:`Ed25519Crypto.generate`), never written
to disk: a restarted process is a new member with a new key, admitted again through the view. An
operator who pins members' public keys (the job spec's ``[public_keys]`` table) gives each agent a
persistent key instead (``--signing-key PATH``, :func:`load_signing_key`): a PKCS#8 PEM file of mode
0600, created on first use, refused when group or others may read it (the key must then be treated as
leaked). ``gossiprec keys public --signing-key PATH --name N`` prints the line to pin. Public keys
are the 32 raw bytes (hex in files); signatures 64 bytes.

Signatures are made and checked with libsodium (PyNaCl): on this project's machines it verifies in
about half the CPU time of OpenSSL's Ed25519 through ``cryptography`` (54 against 106 us, sign 20
against 31 us), and every agent checks a few signatures per member per recovery. Ed25519 signatures are
deterministic (RFC 8032), so both make the same bytes; libsodium's check is the stricter one (it
refuses small-order keys and non-canonical signatures, which no honest agent makes). Key files stay
``cryptography``'s PEM.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import (
    Encoding, NoEncryption, PrivateFormat, PublicFormat, load_pem_private_key,
)
from nacl.bindings import crypto_sign_open
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.signing import SigningKey

from gossiprec.errors import SecurityError
from gossiprec.security.keyring import atomic_write_private, read_private_file

MAX_KEY_FILE = 4096
"""Bytes a signing-key file may hold (an Ed25519 PEM is 119)."""
SIGNATURE_SIZE = 64
PUBLIC_KEY_SIZE = 32


class SigningKeyError(SecurityError):
    """A signing-key file or a pinned public key that cannot be used (the message says what to do)."""


@dataclass(slots=True)
class Ed25519Crypto:
    """An agent's own Ed25519 key (for :class:`gossiprec.core.auth.KeyBook`)."""

    private: Ed25519PrivateKey
    public_key: bytes = b""
    _signer: SigningKey = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.public_key = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)
        self._signer = SigningKey(self.private.private_bytes(Encoding.Raw, PrivateFormat.Raw, NoEncryption()))

    @classmethod
    def generate(cls) -> "Ed25519Crypto":
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self._signer.sign(data).signature

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        if len(key) != PUBLIC_KEY_SIZE or len(sig) != SIGNATURE_SIZE:
            return False
        try:
            crypto_sign_open(sig + data, key)
        except (BadSignatureError, CryptoError, ValueError, TypeError):
            return False
        return True


def public_hex(crypto: Ed25519Crypto) -> str:
    return crypto.public_key.hex()


def parse_public_key(text: object, where: str) -> bytes:
    """A pinned public key: 64 hex digits (what ``gossiprec keys public`` prints)."""
    try:
        key = bytes.fromhex(text) if isinstance(text, str) else b""
    except ValueError:
        key = b""
    if len(key) != 32:
        raise SigningKeyError(f"{where}: expected an Ed25519 public key as 64 hex digits (print one with "
                              f"`gossiprec keys public --signing-key PATH`), got {text!r}")
    try:
        Ed25519PublicKey.from_public_bytes(key)
    except ValueError:
        raise SigningKeyError(f"{where}: {text!r} is not a valid Ed25519 public key") from None
    return key


def load_signing_key(path: str | os.PathLike[str], *, create: bool = True) -> tuple[Ed25519Crypto, bool]:
    """The agent's persistent key at ``path`` and whether it was created just now (absent and
    ``create``). Refused: a symlink, a file group or others may access, anything but an Ed25519 PEM."""
    p = Path(path)
    try:
        raw, _ = read_private_file(
            p, "signing key", MAX_KEY_FILE, SigningKeyError,
            f"it must be treated as leaked; make a new one (remove {p}, start the agent again, and pin the new "
            f"public key in the job spec), or if no one else can have read it, `chmod 600 {p}`")
    except FileNotFoundError:
        if not create:
            raise SigningKeyError(f"signing key {p} does not exist; create it with "
                                  f"`gossiprec keys public --signing-key {p}`") from None
        crypto = Ed25519Crypto.generate()
        pem = crypto.private.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        try:
            atomic_write_private(p, pem)
        except SecurityError as exc:
            raise SigningKeyError(f"cannot create signing key {p}: {exc}") from None
        return crypto, True
    try:
        key = load_pem_private_key(raw, password=None)
    except (ValueError, TypeError) as exc:
        raise SigningKeyError(f"signing key {p} is not an unencrypted PEM private key ({exc}); is this the "
                              "right file? Remove it to have the agent make a new one") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise SigningKeyError(f"signing key {p} holds a {type(key).__name__}, not an Ed25519 key; remove it "
                              "to have the agent make a new one")
    return Ed25519Crypto(key), False


def cmd_public(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    """``gossiprec keys public``: print (creating the key if absent) the line that pins this node."""
    crypto, created = load_signing_key(args.signing_key)
    if created:
        print(f"created a new signing key at {args.signing_key} (mode 0600)", file=err)
    name = args.name or "NODE"
    print(f'{name} = "{public_hex(crypto)}"', file=out)
    if not args.name:
        print("add this line under [public_keys] in the job spec, with NODE the member's name", file=err)
    return 0


def add_public_cli(add: Callable[..., Any]) -> None:
    """Register ``keys public`` through the ``gossiprec keys`` CLI's ``add(name, handler, help)``."""
    p: argparse.ArgumentParser = add(
        "public", cmd_public, "print this node's public signing key, as the line to pin in the job spec's "
        "[public_keys] table (creates the key file, mode 0600, when absent)")
    p.add_argument("--signing-key", metavar="PATH", required=True, help="the agent's signing key file")
    p.add_argument("--name", metavar="NODE", default=None, help="the member's name in the job spec")

