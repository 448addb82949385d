"""The member table of one membership machine: every member it knows, as immutable records.

What it keeps, not what it decides (:mod:`gossiprec.core.membership` decides): for each member name the
latest :class:`~gossiprec.core.records.MemberInfo` (address, incarnation, status, role), the number of
live members (alive or suspect, this node included), when each member's status last changed, and a
stable order of all names for random picks and the probe round robin (the base's order, then newcomers
in the order they appeared).

Layers: ``base`` is a mapping that may be shared, read-only, by every node of a simulated cluster (10,000
tables of 10,000 records each would not fit in memory); ``own`` holds this node's changes over it. A
member forgotten after ``dead_reap`` is shadowed by :data:`GONE` in ``own``, so that its base record does
not show through. Records are immutable, so sharing them is safe.
"""

from __future__ import annotations

from typing import Mapping

from gossiprec.core.records import MemberInfo, RandomSource
from gossiprec.core.wire import DEAD

GONE = MemberInfo("", "", 0, DEAD)
"""The marker of a forgotten member in ``own`` (its status is DEAD, so it is never taken for live)."""


class MemberTable:
    """Base records under this node's own changes, with the live count and the name order."""

    __slots__ = ("base", "own", "base_order", "extra_order", "_ordered", "changed_at", "n_live")

    def __init__(self, me: MemberInfo, members: Mapping[str, MemberInfo] | None,
                 member_order: tuple[str, ...] | None, members_live: int | None) -> None:
        self.base: Mapping[str, MemberInfo] = members if members is not None else {}
        """Shared records (read only)."""
        self.own: dict[str, MemberInfo] = {}
        """This node's records over ``base`` (hot paths read both layers directly)."""
        self.base_order: tuple[str, ...] = member_order if member_order is not None else tuple(self.base)
        self.extra_order: list[str] = []
        """Names not in ``base_order``, in the order they appeared."""
        self._ordered: set[str] = set()  # names in extra_order (the base order is fixed)
        self.changed_at: dict[str, float] = {}
        """When each member's status last changed (only members whose status changed here)."""
        # members_live lets a simulator share one count across 10,000 tables instead of recounting
        self.n_live = members_live if members_live is not None else sum(1 for m in self.base.values() if m.live)
        """Members believed alive or suspect, including this node."""
        name = me.name
        if self.base.get(name) is None:
            self.extra_order.append(name)
            self._ordered.add(name)
            self.n_live += 1
        elif not self.base[name].live:
            self.n_live += 1
        self.own[name] = me

    def member(self, name: str) -> MemberInfo | None:
        rec = self.own.get(name)
        if rec is None:
            rec = self.base.get(name)
        return None if rec is None or rec is GONE else rec

    def set(self, rec: MemberInfo, now: float) -> None:
        """Record ``rec`` (keeping the live count and the order)."""
        old = self.member(rec.name)
        if old is None and rec.name not in self._ordered and rec.name not in self.base:
            self._ordered.add(rec.name)
            self.extra_order.append(rec.name)
        was_live = old is not None and old.live
        if was_live != rec.live:
            self.n_live += 1 if rec.live else -1
        self.own[rec.name] = rec
        if old is None or old.status != rec.status:
            self.changed_at[rec.name] = now

    def forget(self, name: str, incarnation: int) -> bool:
        """Forget a member that is still dead or left at ``incarnation``; False if it came back since."""
        rec = self.member(name)
        if rec is not None and not rec.live and rec.incarnation == incarnation:
            self.own[name] = GONE
            self.changed_at.pop(name, None)
            return True
        return False

    def records(self) -> list[MemberInfo]:
        """Every known member record (sorted by name)."""
        names = set(self.base_order) | set(self.extra_order)
        out = [m for m in (self.member(n) for n in names) if m is not None]
        return sorted(out, key=lambda m: m.name)

    def random_live(self, rng: RandomSource, k: int, me: str, exclude: str | None) -> list[str]:
        """Up to ``k`` distinct random live members other than ``me`` and ``exclude`` (a bounded number of
        draws from the name order, not a scan: O(k) however large the table)."""
        pool = self.base_order
        extra = self.extra_order
        n_base = len(pool)
        n = n_base + len(extra)
        out: list[str] = []
        if n == 0:
            return out
        tries = 0
        while len(out) < k and tries < 4 * k + 8:
            tries += 1
            idx = rng.randrange(0, n)
            name = pool[idx] if idx < n_base else extra[idx - n_base]
            if name == me or name == exclude or name in out:
                continue
            rec = self.member(name)
            if rec is not None and rec.live:
                out.append(name)
        return out
