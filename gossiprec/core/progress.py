"""Other members' training progress, as this node last heard it (acks, gossip, push-pull).

What it decides: the (step, phase, collectives entered, step time) on record for each member, how fresh
it is (``seen_at``) and since when that position (step, phase, collectives) is current (``since``: the
start of a stall, for the hang check), and which records ride on the next outgoing packet (round robin).

Sources: an ack's progress is the owner's own word, with the age of its position (``stall_ms``), and
always replaces ours; gossiped records (a version per owner update) replace ours only when newer. Both
date a stall late, never early, so the earliest estimate is kept while the position stays the same.

With per-member signatures a gossiped record (relayed, or a push-pull row) counts only as its owner's
signed word (:attr:`ProgressBook.vouch`, checked only for news: an older or repeated copy changes nothing
and costs no verification), and what we relay is that word as it came (:attr:`ProgressBook.said`, its
signature with it), never a record rebuilt from an ack.
"""

from __future__ import annotations

from typing import Callable

from gossiprec.core.records import ProgressInfo
from gossiprec.core.wire import Progress


class ProgressBook:
    """The progress records of one membership machine (its own progress is the machine's)."""

    __slots__ = ("records", "said", "names", "vouch", "_cursor")

    def __init__(self) -> None:
        self.records: dict[str, ProgressInfo] = {}
        self.said: dict[str, Progress] = {}
        """Each member's latest gossiped :class:`Progress` that we took, as it came (what we relay)."""
        self.names: list[str] = []
        """Members with a record, in the order first heard (the piggyback round robin's order)."""
        self.vouch: Callable[[Progress], bool] | None = None
        """Whether a gossiped record that is news is its owner's signed word (counts a refusal); None:
        nothing is checked (no key book)."""
        self._cursor = 0

    def get(self, name: str) -> ProgressInfo | None:
        return self.records.get(name)

    def forget(self, name: str) -> None:
        self.records.pop(name, None)  # (its name leaves the round robin when its turn comes)
        self.said.pop(name, None)

    def heard(self, msg: Progress, now: float, direct: bool, stall_ms: int) -> None:
        """``msg`` arrived: from its owner's ack (``direct``, with the age ``stall_ms``) or by gossip."""
        cur = self.records.get(msg.name)
        if not direct:
            if cur is not None and (msg.incarnation, msg.version) <= (cur.incarnation, cur.version):
                return  # no news (a relayed copy of what we hold, or older): nothing to check
            vouch = self.vouch
            if vouch is not None and not vouch(msg):
                return  # not its owner's word: changes nothing (counted by ``vouch``)
            self.said[msg.name] = msg
        if cur is None:
            self.names.append(msg.name)
        version = msg.version if not direct else (cur.version if cur is not None else 0)
        # the stall clock starts when the owner's position began: an ack's age dates it; gossip only
        # says it was current by now (both err late, never early, so the earliest estimate is the best)
        since = now - stall_ms / 1000.0
        if cur is not None and cur.step == msg.step and cur.phase == msg.phase and cur.coll == msg.coll:
            since = min(since, cur.since)  # the same position again: the stall clock keeps running
            if direct:
                self.records[msg.name] = ProgressInfo(cur.incarnation, cur.version, cur.step, cur.phase,
                                                      msg.step_ms, now, since, cur.coll)
                return
        self.records[msg.name] = ProgressInfo(msg.incarnation, version, msg.step, msg.phase, msg.step_ms, now,
                                              since, msg.coll)

    def take_turns(self, want: int) -> list[Progress]:
        """The next ``want`` records of the round robin, as their owners' messages (the latest gossiped one
        of each, signature and all; a member heard of only by acks is skipped)."""
        out: list[Progress] = []
        names, said = self.names, self.said
        while names and want > 0:
            if self._cursor >= len(names):
                self._cursor = 0
            name = names[self._cursor]
            if name not in self.records:
                names.pop(self._cursor)
                continue
            self._cursor += 1
            want -= 1
            msg = said.get(name)
            if msg is not None and msg.version > 0:
                out.append(msg)
        return out
