"""Anti-entropy: SWIM's exchange of whole member tables (push-pull), and what a received row is worth.

What it decides: what a push-pull carries (every member's address, incarnation, status, role and
latest progress) and what a received one changes in a :class:`~gossiprec.core.membership.Membership`'s
table. A push-pull goes to one random live member every ``Config.pushpull_period(n)`` (it grows with N,
so that the load per member stays flat), on the reliable stream; one that is not a reply is answered
with our own; a joiner sends one to its seeds (``join=True``), our key claim ahead of it, and the seed's
answer carries the key claims the seed has bound ahead of its rows.

With per-member signatures a row is only a relayed copy of its member's own word: it carries the
signature of that member's Alive at the row's incarnation (each member keeps the latest signed Alive of
every other, also one that told it nothing new: a joiner learns the members from such rows), and is taken
like that Alive, so it can never move a member to another address or raise its incarnation in another's
name. Its progress (version, step, phase, step time, collectives) is the member's own signed
:class:`~gossiprec.core.wire.Progress` at the row's incarnation, signature and all (a member's progress at
an older incarnation is left out), checked like a gossiped one: a forged row cannot freeze a member's
progress or put it ahead. A row about a member the receiver does not know, without a signature it can
check (the sender never got one, or the member's key is not bound here yet), makes the member known at
incarnation 0: probed, and outranked by any word of its own. The row's suspicion, death or departure is
the sender's table, which nobody signed, and changes nothing: those travel as signed Suspect and Dead
messages. Without signatures a row is taken as an Alive, a Suspect by the sender, a Dead by the sender
or the member's own leave, by its status.
"""

from __future__ import annotations

from typing import Iterable

from gossiprec.core.auth import claims_of
from gossiprec.core.member_port import MembershipPort
from gossiprec.core.records import MemberInfo
from gossiprec.core.wire import DEAD, SUSPECT, Alive, Dead, KeyClaim, Progress, PushPull, Suspect


def pushpull(m: MembershipPort, join: bool, reply: bool) -> PushPull:
    rows = []
    for r in m.members():
        if r.name == m.name:
            p: Progress | None = m.signed_progress() if m.my_progress.version > 0 else None
        else:
            p = m.said(r.name)
        a = m.signed_alive(r.name)
        sig = a.sig if a is not None and a.incarnation == r.incarnation else b""
        if p is None or p.incarnation != r.incarnation:
            # (a row's progress is at the row's incarnation: an older one, signed at its own, is left out)
            rows.append((r.name, r.addr, r.incarnation, r.status, r.role, 0, -1, 0, 0, 0, 0, sig, b""))
        else:
            rows.append((r.name, r.addr, r.incarnation, r.status, r.role, p.version, p.step, p.phase,
                         p.step_ms, p.coll, p.wait_ms, sig, p.sig))
    return PushPull(m.name, m.addr, join, reply, tuple(rows))


def join(m: MembershipPort, seed_addrs: Iterable[str]) -> None:
    msg = pushpull(m, join=True, reply=False)
    for addr in seed_addrs:
        if addr != m.addr:
            m.send_addr(addr, msg, reliable=True, before=claims_of(m.auth))


def pushpull_round(m: MembershipPort) -> None:
    peers = m.random_peers(1)
    if peers:
        rec = m.member(peers[0])
        if rec is not None:
            m.send_addr(rec.addr, pushpull(m, False, False), reliable=True)


def keep_signed(m: MembershipPort, alive: Alive, rec: MemberInfo) -> None:
    """Keep the signature of an Alive that told ``m`` nothing new (``rec`` is its record, at the same
    incarnation) where ``m`` holds that incarnation unsigned: from view 0, or an ack to its own probe.
    Its push-pull rows then carry it, and a joiner learns the member from them."""
    a = m.signed_alive(alive.name)
    if (a is None or not a.sig or a.incarnation < alive.incarnation) and alive.addr == rec.addr \
            and alive.role == rec.role and m.auth is not None and m.auth.check(alive.name, alive):
        m.keep_alive(alive)


def on_pushpull(m: MembershipPort, msg: PushPull, now: float) -> None:
    if not msg.reply:
        auth = m.auth  # a joiner gets the keys we bound ahead of the rows, so that it can check them at once
        keys = () if auth is None or not msg.join else tuple(
            KeyClaim(n, k) for n, k in auth.keys.items() if m.member(n) is not None)
        m.send_addr(msg.src_addr, pushpull(m, msg.join, True), reliable=True, before=keys)
    auth = m.auth
    signed = auth is not None
    for name, addr, inc, status, role, pver, step, phase, step_ms, coll, wait_ms, sig, psig in msg.members:
        if status <= SUSPECT:
            alive = Alive(name, addr, inc, role, sig)
            if auth is not None and m.member(name) is None and not (sig and auth.check(name, alive)):
                # unknown here, and not provably its word (no signature kept, or its key not yet bound):
                # known at incarnation 0, which any word of its own outranks
                m.on_alive(Alive(name, addr, 0, role), now, proven=True)
            else:
                m.on_alive(alive, now)
            if status == SUSPECT and not signed:
                m.on_suspect(Suspect(name, inc, msg.src), now)
        elif signed:
            pass  # a table's row is nobody's signed word for a suspicion, a death or a leave
        elif status == DEAD:
            if m.member(name) is not None:
                m.on_dead(Dead(name, inc, msg.src), now)
        else:
            m.on_dead(Dead(name, inc, name), now)
        if pver > 0:
            # (checked as gossip)
            m.on_progress(Progress(name, inc, pver, step, phase, step_ms, coll, wait_ms, psig), now)
