"""One root exception type; every error gossiprec raises derives from it.

Foreign exceptions are translated at the boundary (``raise XError(...) from exc``) so that users catch
one type. Messages say what went wrong and what to do about it.
"""

from __future__ import annotations


class GossiprecError(Exception):
    """Root of every exception raised by gossiprec."""


class ConfigError(GossiprecError, ValueError):
    """A configuration value is missing, out of range or inconsistent."""


class DecodeError(GossiprecError):
    """Bytes from the network do not form a valid message. Counted and dropped by the agent."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


class ProtocolError(GossiprecError):
    """A local caller used a state machine in a way its protocol does not allow."""


class SecurityError(GossiprecError):
    """Authentication, decryption, replay or key-management failure."""


class FencedError(GossiprecError):
    """This member is on the minority side of a partition (or was removed) and must not act."""


class RecoveryError(GossiprecError):
    """In-place recovery could not complete (no donor, transfer failed, rebuild failed)."""


class TransferError(RecoveryError):
    """A state transfer was interrupted, corrupted or refused."""


class InvariantViolation(GossiprecError, AssertionError):
    """A protocol invariant was broken (raised by the simulator's checker)."""
