"""The hang verdict rests on the subject's own word, heard once its threshold has passed.

The case (test_sharded_recovery's tensor-parallel hangs, where it made a flaky test): n4 is slowed at
(step 5, collective 1, compute) from 0.1 s to just under its threshold (1 s) while its TP peer n5 waits
inside collective 2 for it;
then n5 hangs before collective 3 and n4 enters it and waits for n5. The other replica (n0..n3) waits in
the gradient all-reduce (collective 5) throughout. Observer n0 hears n4's relayed progress a second late
(``LAG``), so by gossip n4 still sits where it was slowed; n4's stall there, dated by its acks from 0.1 s,
passes the threshold at 1.1 s, just after n4 moved on. Judged on an answer from before it moved (within
``answered_within``), n4, which only waits, was alerted, before anyone alerted n5, the rank that hangs.
"""

from __future__ import annotations

from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.events import AlertRaised
from gossiprec.core.wire import HUNG, PHASES, Ack, Ping, Progress, decode_packet, encode_packet
from tests.support.hangs import ROUND, hang_observer

CFG = Config.profile("lan")
NAMES = [f"n{i}" for i in range(6)]
COMPUTE, WAITING = PHASES.index("compute"), PHASES.index("waiting")
Position = tuple[int, int, int]  # (step, coll, phase)
LAG = 1.0
"""How late n0 hears n4's progress by gossip."""
VERDICT_WITHIN = 2 * CFG.probe_interval + 1e-3
"""How long after its threshold a subject is judged: a probe sent then must be answered (refreshes take
turns, one per probe round, with the other subjects behind the frontier)."""
MOVED = 1.095
"""When n4's slow stall ends (it enters collective 2, completes it with n5 and enters collective 3): just
before its threshold passes (1.1 s), after its last answer before that."""

Timeline = dict[str, list[tuple[float, Position]]]
"""Each rank's positions, from when each became current."""
TP_HANG: Timeline = {
    **{n: [(0.0, (5, 0, COMPUTE)), (0.1, (5, 5, WAITING))] for n in NAMES[:4]},
    # slowed before collective 2; then inside collective 3, reporting "waiting" after 0.25 s
    "n4": [(0.0, (5, 0, COMPUTE)), (0.1, (5, 1, COMPUTE)), (MOVED, (5, 3, COMPUTE)), (MOVED + 0.25, (5, 3, WAITING))],
    # waits for n4 inside collective 2; then hangs before collective 3
    "n5": [(0.0, (5, 0, COMPUTE)), (0.1, (5, 2, WAITING)), (MOVED, (5, 2, COMPUTE))],
}


def at(timeline: Timeline, name: str, t: float) -> tuple[int, float, Position]:
    """``name``'s (version, since, position) at ``t`` (a version per position, as its agent numbers them)."""
    rows = timeline[name]
    i = max(i for i, (start, _) in enumerate(rows) if start <= t + 1e-9)
    return i + 1, rows[i][0], rows[i][1]


def drive(timeline: Timeline, until: float, lag: float = LAG) -> list[tuple[float, str, bool]]:
    """n0 hears each member's progress by gossip every round (n4's ``lag`` late), and every probe is
    answered with the target's position now and its age (its own Progress riding on the ack, as it does
    on every packet). Returns (time, subject, retracted) of n0's hung alerts and their retractions."""
    node = hang_observer(NAMES)
    out: list[tuple[float, str, bool]] = []
    t, mine = 0.0, None
    alerted: set[str] = set()
    while t < until:
        version, since, pos = at(timeline, "n0", t)
        if pos != mine:
            mine = pos
            node.set_progress(pos[0], pos[2], 100, t, pos[1])
        gossip = []
        for n in NAMES[1:]:
            heard = t - lag if n == "n4" else t
            if heard >= 0:
                version, _, (step, coll, phase) = at(timeline, n, heard)
                gossip.append(Progress(n, 1, version, step, phase, 100, coll))
        node.receive(encode_packet(gossip), t)
        end = round(t + ROUND, 6)
        while node.next_deadline() <= end:
            now = node.next_deadline()
            node.tick(now)
            for send in node.take_sends():
                for m in decode_packet(send.payload, 1 << 20):
                    if isinstance(m, Ping):
                        version, since, (step, coll, phase) = at(timeline, m.target, now)
                        ack = Ack(m.seq, m.target, 1, step, phase, 100, round((now - since) * 1000), coll)
                        node.receive(encode_packet([ack, Progress(m.target, 1, version, step, phase, 100, coll)]),
                                     now)
            for e in node.take_events():
                if isinstance(e, AlertRaised) and e.reason == "hung":
                    out.append((now, e.subject, False))
            now_alerted = {s for s, reason in node.observer.alerted.items() if reason == HUNG}
            out += [(now, s, True) for s in sorted(alerted - now_alerted)]
            alerted = now_alerted
        t = end
    return out


def hung_alerts(timeline: Timeline, until: float) -> list[tuple[float, str]]:
    return [(when, s) for when, s, retracted in drive(timeline, until) if not retracted]


def test_the_rank_waiting_for_a_hung_peer_is_not_judged_on_its_stale_progress() -> None:
    """n4's relayed progress says it is stalled (since 0.1 s) when its threshold passes, and it had
    answered a probe within ``answered_within`` before, while still slowed: only its answer after the
    threshold counts, and that says it moved on (and soon that it waits). n5 is the one alerted, after its
    own threshold (stalled from ``MOVED``) and its answer to a probe sent then."""
    alerts = hung_alerts(TP_HANG, 4.0)
    assert [s for _, s in alerts] == ["n5"], alerts
    assert MOVED + 1.0 - 1e-6 <= alerts[0][0] <= MOVED + 1.0 + VERDICT_WITHIN, alerts


def test_a_hang_alert_is_retracted_when_its_subject_is_seen_to_move() -> None:
    """n4 stalls before collective 2 for 1.5 s (past its 1 s threshold: alerted) and then gets going
    again (its peer waited inside the collective all along): once n0 hears it moved, it takes its alert
    back (another observer's alert of the same stall may still carry the change; ours no longer does)."""
    going = [(1.6, (5, 3, COMPUTE)), (1.7, (5, 5, WAITING))]
    timeline = {**TP_HANG, "n4": [(0.0, (5, 0, COMPUTE)), (0.1, (5, 1, COMPUTE)), *going],
                "n5": [(0.0, (5, 0, COMPUTE)), (0.1, (5, 2, WAITING)), *going]}
    events = drive(timeline, 3.0, lag=0.0)
    assert [(s, retracted) for _, s, retracted in events] == [("n4", False), ("n4", True)], events
    (raised, _, _), (retracted, _, _) = events
    assert 1.1 - 1e-6 <= raised <= 1.1 + VERDICT_WITHIN, events
    # heard by gossip within a round, retracted at the next watchdog round at most
    assert 1.6 - 1e-6 <= retracted <= 1.6 + ROUND + AgreementConfig().watch_interval + 1e-6, events
