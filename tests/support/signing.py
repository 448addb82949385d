"""Signing machines in tests: a pinned key book over the keyed-digest stand-in, optionally counting what
it verifies (to show a copy is not verified twice), and a pump whose machines all sign."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from gossiprec.core.auth import DigestCrypto, KeyBook


@dataclass
class Counting:
    """The keyed-digest stand-in, remembering what it verified."""

    inner: DigestCrypto
    verified: list[bytes] = field(default_factory=list)

    @property
    def public_key(self) -> bytes:
        return self.inner.public_key

    def sign(self, data: bytes) -> bytes:
        return self.inner.sign(data)

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        self.verified.append(data)
        return self.inner.verify(key, data, sig)


def pins_of(names: Any) -> dict[str, bytes]:
    """Each name's public key, as a job spec's ``[public_keys]`` table pins it."""
    return {n: DigestCrypto.for_name(n).public_key for n in names}


def pinned_book(name: str, pins: Mapping[str, bytes], *, counting: bool = False) -> KeyBook:
    """``name``'s key book with every key pinned (no claims): ``counting`` wraps its crypto in :class:`Counting`."""
    crypto = DigestCrypto.for_name(name)
    return KeyBook(name, Counting(crypto) if counting else crypto, pinned=dict(pins), claims=False)


def sign_all(pump: Any, book: Any) -> Any:
    """Give every machine of ``pump`` its ``book(name)`` and flush what it queued unsigned."""
    for name, m in pump.machines.items():
        m.auth = book(name)
        m.auth.counters = m.counters  # as the node does: one set of counters
        pump.flush(name)
    return pump
