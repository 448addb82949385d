"""Ed25519 signing keys of one agent: what the core's per-member signatures are made with.

What it decides: nothing about trust (which key belongs to which member is :mod:`gossiprec.core.auth`'s
key book); only how a signature is made and checked. Each agent makes a fresh key pair at start
(:meth:`Ed25519Crypto.generate`), never written to disk: a restarted process is a new member with a
new key, admitted again through the view. Public keys are the 32 raw bytes; signatures 64 bytes.
Verifying objects are cached per public key (building one costs about as much as a verification).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

MAX_VERIFIERS = 4096
"""Public-key objects kept (cleared when full)."""


@dataclass(slots=True)
class Ed25519Crypto:
    """An agent's own Ed25519 key (for :class:`gossiprec.core.auth.KeyBook`)."""

    private: Ed25519PrivateKey
    public_key: bytes = b""
    _publics: dict[bytes, Ed25519PublicKey] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.public_key = self.private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    @classmethod
    def generate(cls) -> "Ed25519Crypto":
        return cls(Ed25519PrivateKey.generate())

    def sign(self, data: bytes) -> bytes:
        return self.private.sign(data)

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        pub = self._publics.get(key)
        if pub is None:
            if len(key) != 32:
                return False
            try:
                pub = Ed25519PublicKey.from_public_bytes(key)
            except ValueError:
                return False
            if len(self._publics) >= MAX_VERIFIERS:
                self._publics.clear()
            self._publics[key] = pub
        try:
            pub.verify(sig, data)
        except InvalidSignature:
            return False
        return True
