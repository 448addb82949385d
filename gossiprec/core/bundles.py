"""Signed bundles: many members' own signatures of one payload, relayed as one message.

What it decides: how the signed single words of a view (:class:`~gossiprec.core.wire.StateClaim`,
:class:`~gossiprec.core.wire.PlanConfirm`, :class:`~gossiprec.core.wire.Vote`) are gathered for gossip,
and which of a bundle's members a receiver must still check.

With a key book every member's report, plan digest and fast vote is its own signed message, and relaying
each one alone costs a decode, a dispatch and a dedup per member per hop (tens of thousands per recovery at
64 members). A bundle carries, for one payload (a report's values, a digest), a bitmap over a *chunk* of
the view's sorted members (``first`` ... ``first + chunk - 1``) and, in bit order, each of those members'
signatures of its own single message. Nothing is aggregated in a signature: a receiver rebuilds each
member's single message (its name from the view index) and checks it with the key book exactly as if it
had come alone, so a bundle proves no more than its members' messages would. A bit already counted for
that payload costs nothing, not even a look at its signature (the saving: gossip mostly delivers what is
known; what counts is the member's word, which is already held); the bits counted
merge into the receiver's own bundle of that chunk, re-broadcast under one gossip key per (kind, payload,
chunk) with the merged transmit count of a bitmap aggregate.

Chunks: at most :data:`~gossiprec.core.wire.BUNDLE_MAX` members, fewer where the MTU needs it, so one
bundle of 64-byte Ed25519 signatures fills at most half a packet (piggybacked news and progress share it).
"""

from __future__ import annotations

from typing import Callable, Iterator

from gossiprec.core.wire import BUNDLE_MAX, ClaimBundle, ConfirmBundle, PlanDigest, Report, VoteBundle, Votes

SIG_ROOM = 66
"""Bytes one signature takes in a bundle at most (64, and its msgpack header)."""
HEAD_ROOM = 96
"""Bytes a bundle's other fields take at most (a claim's: epoch, config, three steps, first, bitmap)."""

MERGED = frozenset((Votes, Report, PlanDigest, ClaimBundle, ConfirmBundle, VoteBundle))
"""Broadcasts that grow by merging (gossip keeps their transmit count, see ``BroadcastQueue.queue``)."""


def chunk_size(mtu: int) -> int:
    """Members per bundle: a bundle of full-size signatures within half an ``mtu``."""
    return max(1, min(BUNDLE_MAX, (mtu // 2 - HEAD_ROOM) // SIG_ROOM))


def fresh(first: int, bitmap: bytes, sigs: tuple[bytes, ...], counted: int, n: int) -> list[tuple[int, bytes]] | None:
    """(view index, signature) of each member the bundle names that ``counted`` (a bitmap over the view)
    lacks, below ``n``; None when the bitmap and the signatures do not pair up (a malformed bundle:
    nothing in it counts). A member counted already costs nothing, whatever signature comes with it."""
    bits = int.from_bytes(bitmap, "little")
    if bits.bit_count() != len(sigs):
        return None
    want = (bits << first) & ~counted & ((1 << n) - 1)
    out = []
    while want:
        low = want & -want
        # its signature: the one after those of the bits below it
        out.append((low.bit_length() - 1, sigs[(bits & ((low >> first) - 1)).bit_count()]))
        want ^= low
    return out


def chunks(bits: int, size: int) -> Iterator[int]:
    """The chunks (by number) that ``bits``, a bitmap over the view, touches."""
    mask = (1 << size) - 1
    c = 0
    while bits:
        if bits & mask:
            yield c
        bits >>= size
        c += 1


def gather(chunk: int, size: int, n: int,
           sig_of: Callable[[int], bytes | None]) -> tuple[int, bytes, tuple[bytes, ...]]:
    """(first, bitmap, sigs) of chunk ``chunk``: every member index whose ``sig_of`` is known."""
    first = chunk * size
    bits = 0
    sigs = []
    for j in range(min(size, n - first)):
        sig = sig_of(first + j)
        if sig is not None:
            bits |= 1 << j
            sigs.append(sig)
    return first, bits.to_bytes((size + 7) // 8, "little"), tuple(sigs)
