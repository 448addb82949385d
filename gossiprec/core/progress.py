"""Other members' training progress, as this node last heard it (acks, gossip, push-pull).

What it decides: the (step, phase, collectives entered, step time) on record for each member, how fresh
it is (``seen_at``) and since when that position (step, phase, collectives) is current (``since``: the
start of a stall, for the hang check), and which records ride on the next outgoing packet (round robin).

Sources: an ack's progress is the owner's own word, with the age of its position (``stall_ms``), and
always replaces ours; gossiped records (a version per owner update) replace ours only when newer. Both
date a stall late, never early, so the earliest estimate is kept while the position stays the same.

With per-member signatures a gossiped record (relayed, or a push-pull row) counts only as its owner's
signed word (:attr:`ProgressBook.vouch`), and what we relay is that word as it came (:attr:`ProgressBook.said`,
its signature with it), never a record rebuilt from an ack. Only the records this member reads are checked
as they arrive: those of its hang check's sample (:attr:`ProgressBook.read`: its subjects and observers,
a few of the view). News of any other member waits unchecked (``pending``, its newest) and is checked only
if it is read after all (a status query, a sample that grew): most of the records a member relays it
never checks, since its receivers check what they read. An older or repeated copy costs nothing either
way. A forged record is refused where it is read, and counted, and the owner's records stand. Held
unchecked, a forged newer version does hide its owner's later records from a member that does not read
them (and is relayed by it), but never from one that does: those check every record on arrival, and the
owner's own pings and acks reach every member whose sample holds it.
"""

from __future__ import annotations

from typing import Callable

from gossiprec.core.records import ProgressInfo
from gossiprec.core.wire import Progress


class ProgressBook:
    """The progress records of one membership machine (its own progress is the machine's)."""

    __slots__ = ("records", "said", "names", "vouch", "pending", "read", "_cursor")

    def __init__(self) -> None:
        self.records: dict[str, ProgressInfo] = {}
        """Each member's record as checked (or from its own ack); read through :meth:`get`."""
        self.said: dict[str, Progress] = {}
        """Each member's latest gossiped :class:`Progress` that we took, as it came (what we relay)."""
        self.pending: dict[str, tuple[Progress, float, bool]] = {}
        """Gossiped news of members not in ``read``, not checked yet: (record, when it arrived, whether an
        ack of its owner came since); newer than ``records``, checked if read."""
        self.read: frozenset[str] | None = None
        """The members whose records are checked as they arrive (the hang check's sample); None: all."""
        self.names: list[str] = []
        """Members with a record, in the order first heard (the piggyback round robin's order)."""
        self.vouch: Callable[[Progress], bool] | None = None
        """Whether a gossiped record is its owner's signed word (counts a refusal); None: nothing is
        checked (no key book)."""
        self._cursor = 0

    def get(self, name: str) -> ProgressInfo | None:
        """``name``'s record (news held unchecked is checked now, and taken or refused)."""
        if name in self.pending:
            self._settle(name)
        return self.records.get(name)

    def forget(self, name: str) -> None:
        self.records.pop(name, None)  # (its name leaves the round robin when its turn comes)
        self.said.pop(name, None)
        self.pending.pop(name, None)

    def heard(self, msg: Progress, now: float, direct: bool, stall_ms: int) -> None:
        """``msg`` arrived: from its owner's ack (``direct``, with the age ``stall_ms``) or by gossip."""
        name = msg.name
        if direct:
            held = self.pending.get(name)
            if held is not None and not held[2]:
                # the owner's ack says where it stands now; the news that came before it is checked only
                # when read, and then only for its version (see ``_settle``)
                self.pending[name] = (held[0], held[1], True)
            self._take(msg, now, True, stall_ms, held is not None)
            return
        cur = self.records.get(name)
        key = (msg.incarnation, msg.version)
        if cur is not None and key <= (cur.incarnation, cur.version):
            return  # no news (a relayed copy of what we hold, or older): nothing to check
        vouch = self.vouch
        if vouch is None or self.read is None or name in self.read:
            held_before = name in self.pending
            if held_before:  # (news held from before it was read)
                self._settle(name)
                cur = self.records.get(name)
                if cur is not None and key <= (cur.incarnation, cur.version):
                    return
            if vouch is not None and not vouch(msg):
                return  # not its owner's word: changes nothing (counted by ``vouch``)
            self.said[name] = msg
            self._take(msg, now, False, 0, held_before)
            return
        held = self.pending.get(name)
        if held is not None and key <= (held[0].incarnation, held[0].version):
            return  # no newer than the news already waiting
        if cur is None and held is None:
            self.names.append(name)
        self.pending[name] = (msg, now, False)
        self.said[name] = msg

    def _settle(self, name: str) -> None:
        """Check the news held for ``name``: taken as it arrived, or refused (counted by ``vouch``)."""
        msg, at, acked = self.pending.pop(name)
        vouch = self.vouch
        if vouch is not None and not vouch(msg):
            if self.said.get(name) is msg:
                del self.said[name]  # not its owner's word: not relayed either
        elif not acked:
            self._take(msg, at, False, 0, True)
        else:
            # an ack of its owner came after it: the ack's position stands, the news only moves the version
            # on (as it would have, checked on arrival before that ack)
            cur = self.records[name]
            if (msg.incarnation, msg.version) > (cur.incarnation, cur.version):
                self.records[name] = ProgressInfo(msg.incarnation, msg.version, cur.step, cur.phase, cur.step_ms,
                                                  cur.seen_at, cur.since, cur.coll, cur.wait_ms)

    def _take(self, msg: Progress, now: float, direct: bool, stall_ms: int, listed: bool) -> None:
        """Record ``msg`` (``listed``: its name joined the round robin when its news was held)."""
        cur = self.records.get(msg.name)
        if cur is None and not listed:
            self.names.append(msg.name)
        version = msg.version if not direct else (cur.version if cur is not None else 0)
        # the stall clock starts when the owner's position began: an ack's age dates it; gossip only
        # says it was current by now (both err late, never early, so the earliest estimate is the best)
        since = now - stall_ms / 1000.0
        if cur is not None and cur.step == msg.step and cur.phase == msg.phase and cur.coll == msg.coll:
            since = min(since, cur.since)  # the same position again: the stall clock keeps running
            if direct:
                self.records[msg.name] = ProgressInfo(cur.incarnation, cur.version, cur.step, cur.phase,
                                                      msg.step_ms, now, since, cur.coll, msg.wait_ms)
                return
        self.records[msg.name] = ProgressInfo(msg.incarnation, version, msg.step, msg.phase, msg.step_ms, now,
                                              since, msg.coll, msg.wait_ms)

    def take_turns(self, want: int) -> list[Progress]:
        """The next ``want`` records of the round robin, as their owners' messages (the latest gossiped one
        of each, signature and all, checked or not; a member heard of only by acks is skipped)."""
        out: list[Progress] = []
        names, said = self.names, self.said
        while names and want > 0:
            if self._cursor >= len(names):
                self._cursor = 0
            name = names[self._cursor]
            if name not in self.records and name not in self.pending:
                names.pop(self._cursor)
                continue
            self._cursor += 1
            want -= 1
            msg = said.get(name)
            if msg is not None and msg.version > 0:
                out.append(msg)
        return out
