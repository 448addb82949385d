"""SWIM's probe protocol with Lifeguard's self-blame: direct, indirect and verifying probes, and answers.

What it decides: which probes this member sends (a round of the schedule, :mod:`~gossiprec.core.probing`;
a suspect's verification), the outcome of each (:class:`~gossiprec.core.events.ProbeResult`), whether a
failed probe makes its target suspect, and this member's health score. Inputs: the probe timers, and
pings, acks, indirect pings and nacks from other members; it answers pings (its ack carries this member's
progress and its age) and relays indirect ones.

A probe pings its target; no ack within ``probe_timeout`` (scaled by health): ``indirect_checks`` helpers
ping it for us and answer ack or nack. No ack by the end of the indirect window: the target becomes
suspect, unless our own health is poor (missing nacks mean our side is the problem) or the timer fired
late (we were paused): then this member blames itself. A verification (a suspicion ran out) probes
directly and indirectly at once, then declares the target dead or re-arms the suspicion. A member never
heard from is not judged while the startup grace lasts. It sees its membership through
:class:`~gossiprec.core.member_port.MembershipPort`.
"""

from __future__ import annotations

from collections import deque
from typing import Iterable

from gossiprec.core.auth import sign_if
from gossiprec.core.events import ProbeResult
from gossiprec.core.member_port import DIRECT, INDIRECT_END, PROBE, RELAY_NACK, MembershipPort
from gossiprec.core.probing import Probe, ProbeSchedule, Relay, age_ms
from gossiprec.core.wire import (
    DEAD, LEFT, SUSPECT, Ack, Alive, Dead, IndirectPing, Message, Nack, Ping, Progress, Suspect,
)


class Prober:
    """The probes of one membership, and its answers to others' probes."""

    __slots__ = ("m", "probes", "relays", "seq", "direct", "first_acked", "schedule")

    def __init__(self, m: MembershipPort, now: float) -> None:
        self.m = m
        self.probes: dict[int, Probe] = {}
        self.relays: dict[int, Relay] = {}
        self.seq = m.rng.randrange(1, 2**31)
        self.direct: deque[tuple[float, int]] = deque()
        """Direct deadlines (deadline, probe sequence number), in order: see :meth:`probe`."""
        self.first_acked: dict[str, int] = {}
        """The lowest incarnation each member answered one of our probes at (a process only refutes upwards:
        an answer below a member's current incarnation came from an older process of it)."""
        self.schedule = sched = ProbeSchedule(now + m.rng.random() * m.config.probe_interval)
        sched.token = m.set_timer(sched.next_at, PROBE, None)

    # ------------------------------------------------------------------ timers
    def tick(self, now: float, left: bool) -> None:
        """Direct deadlines that have passed (their timeouts run unless this member left)."""
        direct = self.direct
        while direct and direct[0][0] <= now:
            when, seq = direct.popleft()
            if not left:
                self.direct_timeout(seq, now, now - when > self.m.config.starve_slack)

    def next_direct(self) -> float | None:
        """The earliest direct deadline of a probe not answered yet."""
        direct = self.direct
        if direct:
            probes = self.probes
            while direct and direct[0][1] not in probes:  # answered already
                direct.popleft()
        return direct[0][0] if direct else None

    # ------------------------------------------------------------------ probing
    def start_round(self, now: float, late: bool) -> None:
        m = self.m
        cfg, sched, table = m.config, self.schedule, m.table
        batch = sched.batch(cfg.probe_batch)
        if late:
            m.awareness.apply(+2)
        target = sched.next_target(table, m.rng, m.name)
        probed = [] if target is None else [target]
        while probed and len(probed) < batch:
            extra = sched.next_target(table, m.rng, m.name)
            if extra is None or extra in probed:
                break  # fewer targets than probe_batch: a shorter round, the same rate for each
            probed.append(extra)
        for name in probed:
            self.probe(name, now, verify=False)
        sched.round_at = now
        sched.next_at = now + m.awareness.scale(cfg.probe_interval) * max(1, len(probed))
        sched.token = m.set_timer(sched.next_at, PROBE, None)
        for name in sched.extras(target):
            if m.member(name) is not None:
                self.probe(name, now, verify=False)

    def set_focus(self, names: Iterable[str], turns: Iterable[str], now: float) -> None:
        """See :meth:`Membership.set_focus` (``now``: the membership's latest time)."""
        m = self.m
        sched = self.schedule
        if sched.set_focus(set(names) - {m.name}, set(turns) - {m.name}):
            soon = max(now, sched.round_at + m.awareness.scale(m.config.probe_interval))
            if soon < sched.next_at:
                m.cancel_timer(sched.token)
                sched.next_at = soon
                sched.token = m.set_timer(soon, PROBE, None)

    def probe(self, target: str, now: float, verify: bool) -> None:
        m = self.m
        rec = m.member(target)
        if rec is None or rec.status == LEFT:
            return
        self.seq += 1
        seq = self.seq
        self.probes[seq] = Probe(target, rec.addr, now, verify, rec.incarnation)
        msgs: list[Message] = [Ping(seq, target, m.name, m.addr)]
        if rec.status == SUSPECT:  # buddy system: tell the suspect at once
            msgs.append(sign_if(m.auth, Suspect(target, rec.incarnation, m.name)))
        elif rec.status == DEAD:
            # only probed when the agreement layer watches it closely (a subject that may come back): if it
            # answers, it learns it was declared dead and refutes; a healed partition's members, declared
            # dead longer than gossip_to_dead ago, would otherwise never hear it
            msgs.append(sign_if(m.auth, Dead(target, rec.incarnation, m.name)))
        m.send_packet(rec.addr, msgs, piggyback=True, dest=target)
        if verify:
            self._send_indirect(seq, now)
            m.set_timer(now + m.awareness.scale(m.config.verify_timeout), INDIRECT_END, seq)
        else:
            # Ack deadlines of successive probes are (nearly always) increasing: a FIFO instead of the
            # timer heap, so an answered probe costs no heap work (it is skipped when reached).
            deadline = now + m.awareness.scale(m.config.probe_timeout)
            if not self.direct or deadline >= self.direct[-1][0]:
                self.direct.append((deadline, seq))
            else:
                self.probes[seq].timer = m.set_timer(deadline, DIRECT, seq)

    def _send_indirect(self, seq: int, now: float) -> None:
        m = self.m
        probe = self.probes[seq]
        probe.indirect_sent = True
        helpers = m.table.random_live(m.rng, m.config.indirect_checks, m.name, probe.target)
        probe.expected_nacks = len(helpers)
        for helper in helpers:
            rec = m.member(helper)
            if rec is not None:
                msg = IndirectPing(seq, probe.target, probe.addr, m.name, m.addr, True)
                m.send_packet(rec.addr, [msg], piggyback=True, dest=helper)

    def direct_timeout(self, seq: int, now: float, late: bool) -> None:
        m = self.m
        probe = self.probes.get(seq)
        if probe is None or probe.acked:
            return
        if m.unproven(probe.target, now):
            # a view-0 member whose agent may not be up yet: probed (an answer proves it is up), but its
            # silence is neither reported nor suspected, nor held against our own health
            del self.probes[seq]
            m.counters["probes_unanswered_in_grace"] = m.counters.get("probes_unanswered_in_grace", 0) + 1
            return
        self._send_indirect(seq, now)
        m.set_timer(now + m.awareness.scale(m.config.indirect_timeout), INDIRECT_END, seq)

    def probe_end(self, seq: int, now: float, late: bool) -> None:
        m = self.m
        probe = self.probes.pop(seq, None)
        if probe is None or probe.acked:
            return
        m.emit(ProbeResult(probe.target, False, now))
        missing = max(0, probe.expected_nacks - probe.nacks)
        if late:
            # We were not running while the answers came in: our fault, not the target's.
            m.awareness.apply(+2)
            if probe.verify:
                m.rearm_suspicion(probe.target, now)
            return
        # Lifeguard: blame ourselves only for nacks that never came (or when no helper was asked).
        m.awareness.apply(missing if probe.expected_nacks else 1)
        rec = m.member(probe.target)
        if rec is None or not rec.live or rec.incarnation != probe.incarnation:
            return
        if probe.verify:
            m.declare_dead(probe.target, rec.incarnation, now)
            return
        if m.awareness.score >= m.config.accuse_health_limit:
            m.counters["accusations_withheld"] = m.counters.get("accusations_withheld", 0) + 1
            return
        m.on_suspect(sign_if(m.auth, Suspect(probe.target, rec.incarnation, m.name)), now)

    # ------------------------------------------------------------------ others' probes, and answers
    def on_ping(self, msg: Ping, now: float) -> None:
        m = self.m
        if msg.target != m.name:
            m.counters["rx_misdirected_ping"] = m.counters.get("rx_misdirected_ping", 0) + 1
            return
        m.heard_from(msg.src)
        p, age = m.my_progress, age_ms(now - m.progress_since)
        ack = Ack(msg.seq, m.name, m.incarnation, p.step, p.phase, p.step_ms, age, p.coll, p.wait_ms)
        m.send_packet(msg.src_addr, [ack], piggyback=True, dest=msg.src)

    def on_ack(self, msg: Ack, now: float) -> None:
        m = self.m
        m.heard_from(msg.src)
        relay = self.relays.get(msg.seq)
        if relay is not None:
            if not relay.done:
                relay.done = True
                fwd = Ack(relay.orig_seq, *(getattr(msg, f) for f in Ack.FIELDS[1:]))  # the answer as it came
                m.send_packet(relay.requester_addr, [fwd], piggyback=False)
            return
        probe = self.probes.get(msg.seq)
        if probe is None or probe.acked or msg.src != probe.target:
            return
        probe.acked = True
        del self.probes[msg.seq]
        first = self.first_acked.get(msg.src)
        if first is None or msg.incarnation < first:
            self.first_acked[msg.src] = msg.incarnation
        if probe.timer:
            m.cancel_timer(probe.timer)
        m.awareness.apply(-1)
        m.emit(ProbeResult(probe.target, True, now))
        if msg.step >= 0:  # (the ack's sender is the probe's target, never this node)
            m.on_progress(Progress(msg.src, msg.incarnation, 0, msg.step, msg.phase, msg.step_ms, msg.coll,
                                   msg.wait_ms), now,
                          True, msg.stall_ms)
        rec = m.member(msg.src)
        if rec is not None and msg.incarnation > rec.incarnation:
            # The ack proves a newer incarnation: as good as its Alive (here; others need the signed one).
            m.on_alive(Alive(rec.name, rec.addr, msg.incarnation, rec.role), now, proven=True)
        elif probe.verify:
            m.rearm_suspicion(probe.target, now)

    def on_indirect(self, msg: IndirectPing, now: float) -> None:
        m = self.m
        self.seq += 1
        seq = self.seq
        self.relays[seq] = Relay(msg.src_addr, msg.seq, msg.nack)
        m.send_packet(msg.target_addr, [Ping(seq, msg.target, m.name, m.addr)], piggyback=False)
        m.set_timer(now + m.config.nack_fraction * m.config.probe_timeout, RELAY_NACK, seq)

    def on_nack(self, msg: Nack, now: float) -> None:
        probe = self.probes.get(msg.seq)
        if probe is not None:
            probe.nacks += 1

    def relay_nack(self, seq: int) -> None:
        relay = self.relays.pop(seq, None)
        if relay is not None and not relay.done and relay.nack:
            self.m.send_packet(relay.requester_addr, [Nack(relay.orig_seq, self.m.name)], piggyback=False)
