"""An independent audit of "no view decided without a quorum of its predecessor", from the wire.

What it decides: whether a member that installed view ``e + 1`` as its own decision had been delivered
what that decision needs: on the fast path, votes for the decided change set from ``fast_quorum`` members
of view ``e``; in a classic round it coordinated, Accepted from a ``majority`` of view ``e``. It counts
them itself, from the packets the simulated network delivered to that member (:attr:`SimCluster.wiretaps
<gossiprec.sim.cluster.SimCluster.wiretaps>`), never from the member's consensus state: a vote-merging
bug in the core must not be counted the same wrong way.

Inputs: every delivered datagram (only those that may hold a ``Votes``, ``Vote``, ``VoteBundle`` or
``Accepted`` message are unpacked: the byte pair that opens such a message must occur in it; only those
messages are read), and the member's ``ViewInstalled``.
Per member and epoch it keeps the OR of the vote bitmaps delivered for each (config, digest) (a bundle's
bits count where it carries a signature for each), and the acceptors of each (config, digest, round) it
coordinated; a restarted member starts afresh.

At a decision the change set is rebuilt from the event (its removals, and its joiners with the identity
the simulator gave them); its digest names what was decided, and the predecessor view with that change
set must give the view installed (:meth:`View.next`, recomputed here). The decider's own vote or accept
counts without a packet: it is the one that never crosses the network. The quorum sizes are computed here
from their definitions too, not asked of the view.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import msgpack

from gossiprec.core.events import ViewInstalled
from gossiprec.core.machine import Machine
from gossiprec.core.view import JOIN, REMOVE, Change, View, changes_digest
from gossiprec.core.wire import Accepted, Message, Vote, VoteBundle, Votes
from gossiprec.sim.cluster import SimCluster


def _opening(cls: type[Message]) -> bytes:
    """The first two bytes of every encoded ``cls`` message: a fixarray of its fields and the type id."""
    n = len(cls.FIELDS) + 1
    assert n < 16 and cls.TYPE < 128
    return bytes((0x90 | n, cls.TYPE))


_VOTES = _opening(Votes)
_ACCEPTED = _opening(Accepted)
_VOTE = _opening(Vote)
_BUNDLE = _opening(VoteBundle)
_VOTES_TYPE, _ACCEPTED_TYPE, _VOTE_TYPE, _BUNDLE_TYPE = Votes.TYPE, Accepted.TYPE, Vote.TYPE, VoteBundle.TYPE
_BUNDLE_ROW = len(VoteBundle.FIELDS) + 1
_VOTES_ROW = len(Votes.FIELDS) + 1
_ACCEPTED_ROW = len(Accepted.FIELDS) + 1
_VOTE_ROW = len(Vote.FIELDS) + 1
# the rows are read by position:
assert Votes.FIELDS == ("epoch", "config", "digest", "bitmap")
assert Accepted.FIELDS == ("epoch", "config", "round", "coordinator", "digest", "acceptor", "sig")
assert Vote.FIELDS == ("epoch", "config", "digest", "voter", "sig")
assert VoteBundle.FIELDS == ("epoch", "config", "digest", "first", "bitmap", "sigs")


def fast_quorum(n: int) -> int:
    """Fast Paxos with a majority classic quorum (as Rapid): ``n - floor((n - 1) / 4)``."""
    return n - (n - 1) // 4


def majority(n: int) -> int:
    return n // 2 + 1


@dataclass(slots=True)
class _Heard:
    """What the network delivered to one machine (one process: a restart gets a new record)."""

    machine: Machine
    view: View | None
    """The view this machine holds, as this audit derived it."""
    votes: dict[int, dict[tuple[str, bytes], int]] = field(default_factory=dict)
    """epoch -> (config, digest) -> OR of the vote bitmaps delivered."""
    accepts: dict[int, dict[tuple[str, bytes, int], set[str]]] = field(default_factory=dict)
    """epoch -> (config, digest, round) -> acceptors whose Accepted reached this machine (as coordinator,
    or gossiped where ballots are signed)."""
    voters: dict[int, dict[tuple[str, bytes], set[str]]] = field(default_factory=dict)
    """epoch -> (config, digest) -> members whose signed Vote reached this machine."""
    bundled: dict[int, dict[tuple[str, bytes], int]] = field(default_factory=dict)
    """epoch -> (config, digest) -> view indexes whose signed vote reached this machine in a VoteBundle."""


class QuorumAudit:
    """Fed every delivery (:meth:`delivered`) and every ``ViewInstalled`` (:meth:`installed`)."""

    def __init__(self, cluster: SimCluster[Machine], identity: Callable[[str], tuple[str, str, str]]) -> None:
        """``identity(name) -> (addr, host, rack)``: what a joining node announces of itself."""
        self.cluster = cluster
        self.identity = identity
        self._heard: dict[int, _Heard] = {}
        self._views: dict[str, View] = {}
        """Config id -> view, for every view derived (or, not decided here, read from its holder)."""
        self._next: dict[tuple[str, bytes], View] = {}
        for i, node in enumerate(cluster.nodes):
            self._record(i)
            if node.machine.view is not None:
                self._views[node.machine.view.config_id] = node.machine.view

    def _record(self, idx: int) -> _Heard:
        machine = self.cluster.nodes[idx].machine
        rec = self._heard.get(idx)
        if rec is None or rec.machine is not machine:
            rec = self._heard[idx] = _Heard(machine, machine.view)
        return rec

    def delivered(self, now: float, idx: int, payload: bytes, reliable: bool) -> None:
        # a type id as an int first: a byte search with no buffer to take (the pair only where it occurs)
        if not ((_VOTES_TYPE in payload and _VOTES in payload) or (_VOTE_TYPE in payload and _VOTE in payload)
                or (_ACCEPTED_TYPE in payload and _ACCEPTED in payload)
                or (_BUNDLE_TYPE in payload and _BUNDLE in payload)):
            return
        try:  # [version, [[type, *fields], ...]]: the simulated nodes' own traffic, read as the wire has it
            items = msgpack.unpackb(payload, raw=False)[1]
        except Exception:
            return
        rec: _Heard | None = None
        me = self.cluster.names[idx]
        for item in items:
            if not isinstance(item, list) or not item:
                continue
            if item[0] == _VOTES_TYPE and len(item) == _VOTES_ROW:
                _, epoch, config, digest, bitmap = item
                rec = rec or self._record(idx)
                per = rec.votes.setdefault(epoch, {})
                per[(config, digest)] = per.get((config, digest), 0) | int.from_bytes(bitmap, "little")
            elif item[0] == _VOTE_TYPE and len(item) == _VOTE_ROW:
                _, epoch, config, digest, voter, _ = item
                rec = rec or self._record(idx)
                rec.voters.setdefault(epoch, {}).setdefault((config, digest), set()).add(voter)
            elif item[0] == _BUNDLE_TYPE and len(item) == _BUNDLE_ROW:
                # as a Vote each: a bit counts where the bundle carries a signature for it (the node
                # refuses a bundle whose bits and signatures do not pair up, and so does this)
                _, epoch, config, digest, first, bitmap, sigs = item
                if not isinstance(bitmap, bytes) or not isinstance(sigs, list) or type(first) is not int:
                    continue
                bits = int.from_bytes(bitmap, "little")
                if bits.bit_count() != len(sigs) or not all(isinstance(s, bytes) and s for s in sigs):
                    continue
                rec = rec or self._record(idx)
                per = rec.bundled.setdefault(epoch, {})
                per[(config, digest)] = per.get((config, digest), 0) | bits << first
            elif item[0] == _ACCEPTED_TYPE and len(item) == _ACCEPTED_ROW and (item[4] == me or item[7]):
                _, epoch, config, rnd, _, digest, acceptor, _ = item
                rec = rec or self._record(idx)
                rec.accepts.setdefault(epoch, {}).setdefault((config, digest, rnd), set()).add(acceptor)

    def installed(self, idx: int, ev: ViewInstalled) -> str | None:
        """Record the view ``idx`` installed; for its own decision, what is wrong with it (None: nothing)."""
        rec = self._record(idx)
        prev, problem = rec.view, None
        new = self._views.get(ev.config_id)
        if ev.decided_here:
            problem, derived = self._audit(idx, rec, prev, ev)
            new = derived or new
        if new is None:
            held = rec.machine.view
            if held is not None and held.config_id == ev.config_id:
                new = self._views.setdefault(held.config_id, held)
        rec.view = new
        for old in [e for e in rec.votes if e < ev.epoch]:
            del rec.votes[old]
        for old in [e for e in rec.bundled if e < ev.epoch]:
            del rec.bundled[old]
        for old in [e for e in rec.accepts if e < ev.epoch]:
            del rec.accepts[old]
        return problem

    def _audit(self, idx: int, rec: _Heard, prev: View | None,
               ev: ViewInstalled) -> tuple[str | None, View | None]:
        me = self.cluster.names[idx]
        if prev is None or prev.epoch + 1 != ev.epoch:
            return f"{me} decided epoch {ev.epoch}, but the view it held before is not known here", None
        changes = [Change(r, REMOVE) for r in ev.removed]
        changes += [Change(j, JOIN, *self.identity(j)) for j in ev.joined]
        digest = changes_digest(prev.epoch, prev.config_id, changes)
        nv = self._next.get((prev.config_id, digest))
        if nv is None:
            nv = self._next[(prev.config_id, digest)] = prev.next(changes)
        if nv.config_id != ev.config_id:
            return (f"{me} installed {ev.config_id} as epoch {ev.epoch}, but view {prev.config_id} with the "
                    f"decided changes gives {nv.config_id}"), None
        nv = self._views.setdefault(nv.config_id, nv)
        pos = prev.index(me)
        if ev.fast:
            bits = rec.votes.get(prev.epoch, {}).get((prev.config_id, digest), 0)
            bits |= rec.bundled.get(prev.epoch, {}).get((prev.config_id, digest), 0)
            bits &= (1 << len(prev)) - 1
            if pos is not None:
                bits |= 1 << pos
            for voter in rec.voters.get(prev.epoch, {}).get((prev.config_id, digest), ()):
                i = prev.index(voter)
                if i is not None:
                    bits |= 1 << i
            if bits.bit_count() < fast_quorum(len(prev)):
                return (f"{me} decided epoch {ev.epoch} on the fast path without a fast quorum: "
                        f"{bits.bit_count()} votes delivered (its own included) < {fast_quorum(len(prev))}"), nv
            return None, nv
        best = 0
        for (config, d, _), acceptors in rec.accepts.get(prev.epoch, {}).items():
            if config == prev.config_id and d == digest:
                best = max(best, len({a for a in acceptors if a in prev} | {me}))
        if best < majority(len(prev)):
            return (f"{me} decided epoch {ev.epoch} without a majority of accepts: at most {best} in a round "
                    f"(its own included) < {majority(len(prev))}"), nv
        return None, nv
