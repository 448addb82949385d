"""Tests of the whole agreement core, :class:`gossiprec.core.node.Node`.

Two levels:

- one ``Node`` driven by hand on a virtual clock (``tick`` at ``next_deadline``; what it sends is
  dropped or inspected): hostile bytes, messages about other views, and how an observer turns a silent
  subject into an alert;
- end-to-end runs of the simulator's agreement scenarios through
  :func:`gossiprec.sim.agree.run_agreement` with 8-16 nodes and 8-15 virtual seconds each (well under a
  second of wall time per run), asserting the figures it reports. For ``partition`` the minority is
  read from the one call the scenario makes to :meth:`gossiprec.sim.network.Network.partition`.
"""

from __future__ import annotations

import math
import random
from typing import Any, Iterator

import pytest

from gossiprec.core.config import Config
from gossiprec.core.events import AlertRaised
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.overlay import Overlay
from gossiprec.core.topology import JobTopology
from gossiprec.core.consensus import change_rows
from gossiprec.core.view import REMOVE, Change, View, ViewMember, changes_digest
from gossiprec.core.wire import (
    PROTOCOL_VERSION, UNREACHABLE, Ack, Alert, Dead, Decided, Hello, IndirectPing, Nack, Ping, Votes, ViewDelta,
    ViewRequest, ViewState, decode_packet, encode_packet,
)
from gossiprec.sim.agree import AgreeParams, run_agreement
from gossiprec.sim.network import Network
from tests.support.hangs import hang_observer, hung_alerts_of

CFG = Config.profile("lan")
NAMES = [f"n{i}" for i in range(6)]


def view0(names: list[str] = NAMES) -> View:
    return View.initial([ViewMember(n, n, "trainer", i) for i, n in enumerate(names)],
                        JobTopology.ddp(len(names)))


def make_node(name: str = "n0", view: View | None = None, seed: int = 7, now: float = 0.0) -> Node:
    v = view or view0()
    base = {n: MemberInfo(n, n, 1) for n in v.nodes}
    return Node(CFG, name, name, incarnation=1, rng=random.Random(seed), now=now, view=v, members=base,
                member_order=v.nodes)


def run_alone(node: Node, until: float) -> list[tuple[float, Any]]:
    """Tick ``node`` at each of its deadlines up to ``until``; nobody answers. Returns its events."""
    events: list[tuple[float, Any]] = []
    t = 0.0
    while True:
        t = node.next_deadline()
        if t > until:
            return events
        node.tick(t)
        node.take_sends()
        events += [(t, e) for e in node.take_events()]


def sent_messages(node: Node) -> list[tuple[str, Any]]:
    out = []
    for s in node.take_sends():
        for m in decode_packet(s.payload, CFG.max_stream):
            out.append((s.addr, m))
    return out


# -- one node, by hand -------------------------------------------------------------------------------


GARBAGE = [
    b"",
    b"\xff",
    b"\x00" * 64,
    bytes(range(256)),
    bytes((0x92, PROTOCOL_VERSION)) + b"\x91\x92\x63\x01",  # [version, [[99, 1]]]: unknown message type
    bytes((0x92, PROTOCOL_VERSION + 1)) + b"\x91\x91\x01",  # unknown protocol version
    b"\xdd\xff\xff\xff\xff",  # array header claiming 4 billion items, no items
    bytes((0x92, PROTOCOL_VERSION)) + b"\x91\x9c\x14" + b"\xc0" * 11,  # an Alert with every field nil
]


def test_garbage_bytes_are_counted_and_the_node_survives() -> None:
    node = make_node()
    before = node.view
    for i, data in enumerate(GARBAGE):
        node.receive(data, 0.01 * i)
        node.receive(data, 0.01 * i, reliable=True)
    dropped = {k: v for k, v in node.counters.items() if k.startswith("rx_dropped_")}
    assert sum(dropped.values()) == 2 * len(GARBAGE)
    assert {"rx_dropped_truncated", "rx_dropped_malformed", "rx_dropped_unknown_type",
            "rx_dropped_bad_version"} <= set(dropped)
    assert node.view is before and node.fenced == ""
    assert node.take_events() == []
    # and it still works: it keeps probing its subjects
    node.tick(node.next_deadline())
    assert node.take_sends()


def test_malformed_view_state_is_counted_and_ignored() -> None:
    node = make_node()
    before = node.view
    node.receive(encode_packet([ViewState([5, 1, 2, 3, 4, 5, 5])]), 0.1, reliable=True)
    node.receive(encode_packet([ViewState([9, [], [0, [], False, 1], None, None, "", 9])]), 0.2, reliable=True)
    assert node.counters["rx_bad_view"] == 2
    assert node.view is before


def test_view_state_with_truncated_basis_does_not_crash_the_node() -> None:
    node = make_node()
    bad = ViewState([3, [["n0", "n0", "trainer", 0, "", ""]], [1, [[0]], False, 1], None,
                     [[], [], [1], [], None], "", 3])
    node.receive(encode_packet([bad]), 0.1, reliable=True)
    assert node.counters.get("rx_bad_view") == 1
    assert node.view is not None and node.view.epoch == 0


def test_agreement_messages_about_another_view_are_counted_not_applied() -> None:
    node = make_node()
    v = node.view
    assert v is not None
    node.take_sends()
    old = Votes(v.epoch, "0123456789abcdef", b"\x01" * 16, b"\x3f")
    node.receive(encode_packet([old]), 0.1)
    assert node.counters["rx_other_epoch"] == 1
    assert node.consensus.votes == {}
    assert [m for _, m in sent_messages(node) if isinstance(m, ViewRequest)] == []
    # a message from a later epoch: this node is behind, so it asks two live peers for the current view
    node.receive(encode_packet([Votes(v.epoch + 3, "0123456789abcdef", b"\x01" * 16, b"\x3f")]), 0.2)
    assert node.counters["rx_other_epoch"] == 2
    requests = [(a, m) for a, m in sent_messages(node) if isinstance(m, ViewRequest)]
    assert len(requests) == 2 and requests[0][0] != requests[1][0]
    for addr, req in requests:
        assert addr in v.nodes and addr != "n0" and req.epoch == 0 and req.src == "n0"
    # rate-limited: another one at once asks nobody
    node.receive(encode_packet([Votes(v.epoch + 3, "0123456789abcdef", b"\x01" * 16, b"\x3f")]), 0.25)
    assert [m for _, m in sent_messages(node) if isinstance(m, ViewRequest)] == []


def _decide(node: Node, changes: list[Change], now: float) -> None:
    """Feed ``node`` the decision of its current view (as a peer's Decided message would)."""
    v = node.view
    assert v is not None
    msg = Decided(v.epoch, v.config_id, changes_digest(v.epoch, v.config_id, changes), change_rows(changes))
    node.receive(encode_packet([msg]), now)


def test_a_member_behind_catches_up_by_delta_not_by_the_full_view() -> None:
    v0 = view0()
    ahead, behind = make_node("n1", v0), make_node("n0", v0)
    _decide(ahead, [Change("n5", REMOVE)], 0.1)
    _decide(ahead, [Change("n4", REMOVE)], 0.2)
    assert ahead.view is not None and ahead.view.epoch == 2
    ahead.take_sends()
    ahead.receive(encode_packet([ViewRequest(0, v0.config_id, "n0", "n0")]), 0.3)
    replies = [m for a, m in sent_messages(ahead) if a == "n0"]
    assert len(replies) == 1 and isinstance(replies[0], ViewDelta), replies
    delta = replies[0]
    assert (delta.epoch, delta.config, len(delta.steps)) == (0, v0.config_id, 2)
    behind.take_events()
    behind.receive(encode_packet([delta]), 0.4, reliable=True)
    assert behind.view is not None and behind.view == ahead.view
    assert behind.view.config_id == ahead.view.config_id
    installed = [e for e in behind.take_events() if type(e).__name__ == "ViewInstalled"]
    assert [(e.epoch, e.removed) for e in installed] == [(2, ("n4",))]
    # the same delta again is stale news; a member it does not lead from gets nothing
    behind.receive(encode_packet([delta]), 0.5, reliable=True)
    assert behind.counters["rx_stale_view"] == 1 and behind.view.epoch == 2
    # a requester on an epoch we hold no history for (here: a joiner, config "") gets the full view
    ahead.receive(encode_packet([ViewRequest(0, "", "n9", "n9")]), 0.6)
    replies = [m for a, m in sent_messages(ahead) if a == "n9"]
    assert len(replies) == 1 and isinstance(replies[0], ViewState)
    assert View.from_wire(replies[0].view) == ahead.view
    # a member already up to date is sent nothing
    ahead.receive(encode_packet([ViewRequest(2, ahead.view.config_id, "n0", "n0")]), 0.7)
    assert [m for a, m in sent_messages(ahead) if a == "n0"] == []


def test_a_delta_that_does_not_reproduce_its_config_id_is_refused() -> None:
    v0 = view0()
    node = make_node("n0", v0)
    rows = change_rows([Change("n5", REMOVE)])
    forged = ViewDelta(0, v0.config_id, (("0123456789abcdef", rows),))
    node.receive(encode_packet([forged]), 0.1, reliable=True)
    assert node.counters["rx_bad_view"] == 1 and node.view is v0
    true_next = v0.next([Change("n5", REMOVE)])
    node.receive(encode_packet([ViewDelta(0, v0.config_id, ((true_next.config_id, rows),))]), 0.2, reliable=True)
    assert node.view == true_next


def _hung_alerts(lagging_phase: str, until: float, heard_from: float = 0.1, aged: bool = False,
                 answers: bool = True, **agreement: Any) -> list[tuple[float, str]]:
    """Drive n0 of a 6-trainer view: n1..n4 wait in the step-5 all-reduce, n5 sits in ``lagging_phase``
    after committing step 4 from t = 0.1 on (n0 hears of it from ``heard_from`` on; ``aged``: with its
    age on the wire); returns (time, subject) of n0's hang alerts up to ``until``."""
    from gossiprec.core.wire import PHASES, Progress

    node = hang_observer(NAMES, **agreement)  # (n5 answers only once it is heard from)
    communicate, lagging = PHASES.index("communicate"), PHASES.index(lagging_phase)
    node.set_progress(5, communicate, 100, 0.0)

    def gossip(t: float, version: int) -> list[Progress]:
        msgs = [Progress(n, 1, version, 5, communicate, 100) for n in ("n1", "n2", "n3", "n4")]
        if t >= heard_from - 1e-9:
            msgs.append(Progress("n5", 1, version, 4, lagging, 100))
        return msgs

    def answer(m: Ping, at: float) -> Ack | None:
        if m.target != "n5":
            return Ack(m.seq, m.target, 1, 5, communicate, 100)
        if answers and at >= heard_from - 1e-9:
            return Ack(m.seq, "n5", 1, 4, lagging, 100, round((at - 0.1) * 1000) if aged else 0)
        return None

    return hung_alerts_of(node, until, gossip, answer)


def test_hang_alert_comes_when_the_threshold_passes_counted_from_first_hearing() -> None:
    """The stall clock of a lagging rank starts when its (step, phase) was first heard, and the alert is
    raised the moment the threshold has passed since then, not at a later watchdog round."""
    hung = _hung_alerts("compute", 2.0)
    # threshold = max(hang_floor 1 s, 3 x 100 ms): due at 0.1 + 1.0, judged on n5's answer to a probe sent
    # then (refreshes take turns, one per probe round); the watchdog alone runs at 0.5 + k/4
    assert hung and hung[0][1] == "n5" and 1.1 - 1e-6 <= hung[0][0] <= 1.1 + 2 * CFG.probe_interval, hung
    assert {s for _, s in hung} == {"n5"}


@pytest.mark.parametrize("aged", [True, False])
def test_the_stall_clock_is_dated_by_the_age_on_the_wire(aged: bool) -> None:
    """Observers hear of a stall at different moments (their probes and gossip differ); the age each
    ack carries (how long the owner's (step, phase) has been current) dates the stall alike for all:
    the alert comes at stall start + threshold, however late this observer heard of it."""
    hung = _hung_alerts("compute", 3.0, heard_from=0.6, aged=aged)
    expected = 1.1 if aged else 1.6  # stalled at 0.1, heard at 0.6; threshold max(1 s, 3 x 100 ms)
    # then judged on its answer to a probe sent once the threshold passed (ages are whole ms)
    assert hung and hung[0][1] == "n5" and expected - 1e-3 <= hung[0][0] <= expected + 2 * CFG.probe_interval, hung


def test_a_rank_that_does_not_answer_is_not_judged_hung() -> None:
    """Hung means alive but stuck. A rank that answers no probe (crashed) is the probes' business: its
    progress, relayed by others with an age that says it stalled long ago, must not raise a hang alert
    (in a correlated crash that alert came early for one victim and split the change in two)."""
    assert _hung_alerts("compute", 3.0, aged=True, answers=False) == []


def test_a_rank_saving_a_checkpoint_is_not_taken_for_hung() -> None:
    assert _hung_alerts("checkpoint", 5.0) == []  # 4.9 s behind the others, well past max(1 s, 3 x step)
    late = _hung_alerts("checkpoint", 3.0, checkpoint_timeout=2.0)  # ... until checkpoint_timeout
    assert late and late[0][1] == "n5" and late[0][0] == pytest.approx(2.1, abs=1e-6), late


def test_alert_from_a_non_observer_does_not_count() -> None:
    node = make_node()
    v = node.view
    assert v is not None
    ov = Overlay.build(v.config_id, v.nodes, 10)
    subject = "n3"
    strangers = [x for x in v.nodes if x not in ov.observers(subject) and x != subject]
    observer = ov.observers(subject)[0]
    for x in strangers:
        node.receive(encode_packet([Alert(v.epoch, v.config_id, x, subject, REMOVE, UNREACHABLE, False,
                                          "", "", "")]), 0.1)
    assert node.cut.count(subject) == 0
    node.receive(encode_packet([Alert(v.epoch, v.config_id, observer, subject, REMOVE, UNREACHABLE, False,
                                      "", "", "")]), 0.2)
    assert node.cut.count(subject) == 1


def test_a_late_copy_of_a_retracted_alert_does_not_count_again() -> None:
    """Alerts are numbered per observer: a copy that arrives after its observer's retraction (a late
    datagram, a relay's echo) is stale, and a new alert after the retraction counts again."""
    node = make_node()
    v = node.view
    assert v is not None
    subject = "n3"
    observer = Overlay.build(v.config_id, v.nodes, 10).observers(subject)[0]

    def alert(seq: int, retract: bool, t: float) -> None:
        node.receive(encode_packet([Alert(v.epoch, v.config_id, observer, subject, REMOVE, UNREACHABLE, retract,
                                          "", "", "", seq)]), t)

    alert(5, False, 0.1)
    assert node.cut.count(subject) == 1
    alert(6, True, 0.2)
    assert node.cut.count(subject) == 0
    alert(5, False, 0.3)  # the first alert again, late
    assert node.cut.count(subject) == 0 and node.counters["rx_alert_stale"] == 1
    alert(7, False, 0.4)  # its observer alerts again
    assert node.cut.count(subject) == 1


def _subject_and_gossiper(node: Node) -> tuple[str, str]:
    v = node.view
    assert v is not None
    z = Overlay.build(v.config_id, v.nodes, 10).subjects(node.name)[0]
    other = next(x for x in v.nodes if x not in (node.name, z))
    return z, other


def test_observer_alerts_a_subject_that_stopped_answering() -> None:
    node = make_node()
    z, _ = _subject_and_gossiper(node)
    events = run_alone(node, 10.0)
    alerted = {e.subject for _, e in events if isinstance(e, AlertRaised)}
    assert z in alerted
    v = node.view
    assert v is not None
    assert alerted <= set(Overlay.build(v.config_id, v.nodes, 10).subjects(node.name))  # only its own


def _run_until_a_streak(node: Node, dead: str, ready: bool) -> float:
    """Tick ``node`` at its deadlines, acking every probe except those of ``dead``, until ``dead`` has a
    failure streak (``ready``: and a silence, since it last answered or else since the view's install,
    that already spans confirm_after); returns the time. No alert may come before that."""
    t = 0.0
    while t < 3.0:
        t = node.next_deadline()
        node.tick(t)
        for send in node.take_sends():
            for m in decode_packet(send.payload, 1 << 20):
                if isinstance(m, Ping) and m.target != dead:
                    node.receive(encode_packet([Ack(m.seq, m.target, 1, -1, 0, 0)]), t)
                elif isinstance(m, IndirectPing):  # the helper is up, the target silent: Nack
                    node.receive(encode_packet([Nack(m.seq, send.addr)]), t)
        assert not [e for e in node.take_events() if isinstance(e, AlertRaised)]
        obs = node.observer
        start = obs.streak.get(dead, math.inf)
        if start <= t and (not ready or dead in obs.ready):
            quiet = t - obs.answered.get(dead, 0.0)  # (the view was installed at 0)
            assert (quiet >= node.acfg.confirm_after) == ready
            return t
    raise AssertionError(f"no streak of {dead} by {t}: {node.observer.streak}")


def test_watchdog_rides_on_the_probe_ticks() -> None:
    """The 4 Hz watchdog runs in ticks that happen anyway (the probe timer's) instead of waking an idle
    agent four more times a second; it still runs at least every 0.25 s."""
    node = make_node()
    runs: list[float] = []
    watch = node._watch

    def counted(now: float) -> None:
        runs.append(now)
        watch(now)

    node._watch = counted  # type: ignore[method-assign]
    ticks = 0
    t = 0.0
    while t < 5.0:
        t = node.next_deadline()
        node.tick(t)
        ticks += 1
        for send in node.take_sends():
            for m in decode_packet(send.payload, 1 << 20):
                if isinstance(m, Ping):  # everyone answers at once: no probe timeouts to wake for
                    node.receive(encode_packet([Ack(m.seq, m.target, 1, -1, 0, 0)]), t)
        node.take_events()
    gaps = [b - a for a, b in zip(runs, runs[1:])]
    assert len(runs) >= 18 and max(gaps) <= 0.25 + 1e-9, runs
    probes = 5.0 / node.swim.config.probe_interval
    assert ticks <= probes + 3, (ticks, probes)  # no wake-ups of its own (it had 4 a second)


@pytest.mark.parametrize("ready", [True, False])
def test_observer_confirms_another_observers_alert_as_soon_as_its_own_silence_suffices(ready: bool) -> None:
    """An observer whose own failed probes of a subject already span ``confirm_after`` confirms another
    observer's alert the moment it arrives (the confirmations' spread is the tail of the view change);
    one whose failures are younger waits for more evidence."""
    node = make_node()
    v = node.view
    assert v is not None
    z = Overlay.build(v.config_id, v.nodes, 10).subjects(node.name)[0]
    t = _run_until_a_streak(node, z, ready)
    other = next(x for x in Overlay.build(v.config_id, v.nodes, 10).observers(z) if x != node.name)
    node.receive(encode_packet([Alert(v.epoch, v.config_id, other, z, REMOVE, UNREACHABLE, False, "", "", "")]),
                 t)
    alerts = [(e.subject, e.at) for e in node.take_events() if isinstance(e, AlertRaised)]
    assert alerts == ([(z, t)] if ready else [])


@pytest.mark.parametrize("answered, installed, confirmed", [
    (0.1, 0.0, 1.3), (1.0, 0.0, 1.45), (None, 0.0, 1.3), (None, 1.0, 1.45)])
def test_a_confirmation_counts_the_silence_since_the_subject_last_answered(
        answered: float | None, installed: float, confirmed: float) -> None:
    """Confirming another observer's alert takes a failed probe and ``confirm_after`` (0.4 s) of silence
    since the subject last answered *us*. An observer that probes the subject rarely (one of its K
    subjects per round) confirms at its first failed probe when the subject has been silent that long,
    instead of first building a streak of its own (on loopback that streak was the last alert's 0.5 s
    lag); one that heard the subject 0.3 s ago waits for a later failure. A subject that never answered
    us since it became ours (every view change reshuffles the rings) is silent since that view's
    install: on loopback, waiting for a streak of our own instead was the 9th alert's 0.3-0.6 s lag
    after a kill soon after a rejoin."""
    from gossiprec.core.events import ProbeResult

    node = make_node(now=installed)  # this view (and z as our subject) came at `installed`
    v = node.view
    assert v is not None
    ov = Overlay.build(v.config_id, v.nodes, 10)
    z = ov.subjects(node.name)[0]
    other = next(x for x in ov.observers(z) if x != node.name)
    if answered is not None:
        node.observer.on_probe(ProbeResult(z, True, answered), answered)
    node.receive(encode_packet([Alert(v.epoch, v.config_id, other, z, REMOVE, UNREACHABLE, False, "", "", "")]),
                 1.1)
    alerts = []
    for t in (1.3, 1.45, 1.6):  # failed probes; the first starts the streak
        node.observer.on_probe(ProbeResult(z, False, t), t)
        alerts += [e.at for e in node.take_events() if isinstance(e, AlertRaised) and e.subject == z]
    assert node.observer.streak[z] == 1.3
    assert alerts == [confirmed]  # a streak of our own would have needed until 1.3 + 0.4


def test_observer_alerts_a_subject_it_learned_is_dead_by_gossip() -> None:
    node = make_node()
    z, other = _subject_and_gossiper(node)
    # someone else declared z dead, and only the Dead rumour reached us (it replaces Suspect under the same
    # broadcast key); SWIM's round robin skips dead members, so the node must probe z itself
    node.receive(encode_packet([Dead(z, 1, other)]), 0.0)
    events = run_alone(node, 10.0)
    assert z in {e.subject for _, e in events if isinstance(e, AlertRaised)}


@pytest.mark.parametrize("direct_max, direct", [(32, True), (5, False)])
def test_own_alert_goes_straight_to_every_member_of_a_small_view(direct_max: int, direct: bool) -> None:
    """In a view of at most ``direct_votes_max`` members an observer's own alert goes to every other
    member in one hop (the subject aside): the other observers check the subject at once and everyone
    counts the H-th alert at about the same moment. Larger views leave it to gossip (O(N^2) otherwise)."""
    from gossiprec.core.config import AgreementConfig
    from gossiprec.core.events import ProbeResult

    v = view0()
    base = {n: MemberInfo(n, n, 1) for n in v.nodes}
    node = Node(CFG, "n0", "n0", incarnation=1, rng=random.Random(7), now=0.0, view=v, members=base,
                member_order=v.nodes, agreement=AgreementConfig(direct_votes_max=direct_max))
    z = Overlay.build(v.config_id, v.nodes, 10).subjects("n0")[0]
    node.take_sends()
    t = 0.05
    while t < 1.2:  # failed probes only, until the streak spans alert_after
        node.observer.on_probe(ProbeResult(z, False, t), t)
        t += 0.1
    assert [e.subject for e in node.take_events() if isinstance(e, AlertRaised)] == [z]
    got = {addr for addr, m in sent_messages(node) if isinstance(m, Alert) and m.subject == z
           and m.observer == "n0"}
    # unicasts to all but us and z; without them, at most the gossip round's few random members
    others = set(v.nodes) - {"n0", z}
    assert (got == others) if direct else (len(got) < len(others))


# -- end-to-end scenarios ------------------------------------------------------------------------------


def agree(**kw: Any) -> dict[str, Any]:
    return run_agreement(AgreeParams(**kw))


@pytest.mark.parametrize("nodes, seed, duration", [(8, 2, 8.0), (12, 1, 10.0), (16, 3, 10.0)])
def test_crash_is_removed_in_one_view_change(nodes: int, seed: int, duration: float) -> None:
    r = agree(scenario="crash", nodes=nodes, spares=2, seed=seed, duration=duration)
    assert r["invariant_violations"] == 0
    assert len(r["expected_removed"]) == 1
    assert r["removed_all_expected"]
    assert r["removed"] == r["expected_removed"]
    assert r["removal_epochs"] == [1]
    assert r["healthy_removed"] == []
    assert r["agree_s"]["max"] is not None and r["agree_s"]["max"] < 3.5
    assert r["views_decided"] == 1


def test_simultaneous_crashes_land_in_one_view_change() -> None:
    r = agree(scenario="crash", nodes=16, spares=3, seed=2, duration=10.0, crash=2)
    assert r["invariant_violations"] == 0
    assert len(r["expected_removed"]) == 2
    assert r["removed"] == r["expected_removed"]
    assert r["removal_epochs"] == [1]  # one cut with both, not a cascade
    assert r["agree_s"]["max"] is not None and r["agree_s"]["max"] < 3.5


def test_hung_trainer_is_removed_and_no_healthy_node() -> None:
    r = agree(scenario="hang", nodes=12, spares=2, seed=1, duration=12.0)
    assert r["invariant_violations"] == 0
    assert len(r["expected_removed"]) == 1
    assert r["removed"] == r["expected_removed"]
    assert r["healthy_removed"] == []
    assert r["removal_epochs"] == [1]
    assert r["agree_s"]["max"] is not None and r["agree_s"]["max"] < 3.5
    # training resumed after the view change
    assert r["training_step"] > 12.0 / 0.3 * 0.5


def test_straggler_is_not_removed() -> None:
    r = agree(scenario="straggler", nodes=12, spares=2, seed=1, duration=10.0)
    assert r["invariant_violations"] == 0
    assert len(r["stragglers"]) == 1 and list(r["stragglers"].values())[0] >= 1, r["stragglers"]  # reported
    assert r["removed"] == [] and r["healthy_removed"] == []
    assert r["views_decided"] == 0
    assert r["fenced"] == []


@pytest.mark.parametrize("nodes, seed", [(8, 1), (12, 3)])
def test_exact_split_decides_nothing(nodes: int, seed: int) -> None:
    r = agree(scenario="split", nodes=nodes, spares=2, seed=seed, duration=10.0, heal_after=100.0)
    assert r["invariant_violations"] == 0
    assert r["views_decided"] == 0
    assert r["removed"] == []


def test_late_spares_join() -> None:
    nodes, spares = 12, 2
    r = agree(scenario="join", nodes=nodes, spares=spares, seed=1, duration=10.0)
    assert r["invariant_violations"] == 0
    assert r["joined"] == [f"n{i:05d}" for i in range(nodes - spares, nodes)]
    assert r["removed"] == []
    assert r["views_decided"] >= 1


def test_same_params_same_result() -> None:
    p = dict(scenario="crash", nodes=10, spares=2, seed=5, duration=8.0)
    a, b = agree(**p), agree(**p)
    for r in (a, b):
        r.pop("wall_s")
        r.pop("cpu_s")
    assert a == b
    c = agree(**{**p, "seed": 6})
    c.pop("wall_s")
    c.pop("cpu_s")
    assert c != a  # and the seed matters


PARTITION_SEEDS = (1, 2, 3)


@pytest.fixture(scope="module")
def partitions() -> Iterator[dict[int, tuple[dict[str, Any], set[str], set[str]]]]:
    """seed -> (result, minority names, majority names) of a partition that never heals."""
    out: dict[int, tuple[dict[str, Any], set[str], set[str]]] = {}
    with pytest.MonkeyPatch.context() as mp:
        for seed in PARTITION_SEEDS:
            calls: list[list[set[int]]] = []
            original = Network.partition

            def record(self: Network, groups: Any, one_way: bool = False, calls: list[list[set[int]]] = calls,
                       original: Any = original) -> None:
                calls.append([set(g) for g in groups])
                original(self, groups, one_way)

            mp.setattr(Network, "partition", record)
            r = agree(scenario="partition", nodes=12, spares=2, seed=seed, duration=15.0, heal_after=100.0)
            mp.setattr(Network, "partition", original)
            assert len(calls) == 1 and len(calls[0]) == 2
            small, large = sorted(calls[0], key=len)
            out[seed] = (r, {f"n{i:05d}" for i in small}, {f"n{i:05d}" for i in large})
    yield out


def test_partition_majority_removes_only_minority_members(
        partitions: dict[int, tuple[dict[str, Any], set[str], set[str]]]) -> None:
    for seed, (r, minority, majority) in partitions.items():
        assert len(minority) == (12 - 1) // 2 and len(majority) == 12 - len(minority)
        assert r["invariant_violations"] == 0, seed
        removed = set(r["removed"])
        assert removed, seed  # the majority side did decide
        assert removed <= minority, (seed, removed - minority)
        assert not set(r["fenced"]) & majority, seed  # the majority keeps training
        assert r["views_decided"] >= 1


def test_partition_majority_removes_the_whole_minority(
        partitions: dict[int, tuple[dict[str, Any], set[str], set[str]]]) -> None:
    # members already dead in SWIM when the first view change lands are watched again in the next epoch
    for seed, (r, minority, _) in partitions.items():
        assert set(r["removed"]) == minority, seed


def test_partition_minority_fences(
        partitions: dict[int, tuple[dict[str, Any], set[str], set[str]]]) -> None:
    for seed, (r, minority, _) in partitions.items():
        assert set(r["fenced"]) == minority, seed


# -- state reports and the job's end, on a small virtual network -----------------------------------------


class MiniNet:
    """Nodes that deliver to each other at once (addr = name), on one virtual clock; ``down`` nodes
    neither send nor receive."""

    def __init__(self, names: list[str], spares: int = 1, *, auth: Any = None, drop: Any = None,
                 **acfg: Any) -> None:
        """``auth``: name -> that node's key book (default none); ``drop``: (time, message) -> whether the
        network loses it (default: nothing is lost; what is lost is kept in ``dropped``)."""
        from gossiprec.core.config import AgreementConfig

        members = [ViewMember(n, n, "trainer" if i < len(names) - spares else "spare",
                              i if i < len(names) - spares else None) for i, n in enumerate(names)]
        v = View.initial(members, JobTopology.ddp(len(names) - spares))
        base = {n: MemberInfo(n, n, 1) for n in v.nodes}
        self.nodes = {n: Node(CFG, n, n, incarnation=1, rng=random.Random(i), now=0.0, view=v, members=base,
                              member_order=v.nodes, agreement=AgreementConfig(**acfg),
                              auth=auth(n) if auth is not None else None)
                      for i, n in enumerate(names)}
        self.drop = drop
        self.dropped: list[tuple[float, str, Any]] = []
        self.now = 0.0
        self.down: set[str] = set()
        self.lose: Any = None
        """(sender, receiver, message) -> whether that message is lost on its way (default: none is)."""
        self.events: list[tuple[float, str, Any]] = []
        self.sent: list[tuple[float, str, Any]] = []

    def _deliver(self) -> None:
        moved = True
        while moved:
            moved = False
            for name, node in self.nodes.items():
                for s in node.take_sends():
                    moved = True
                    if name in self.down or s.addr in self.down:
                        continue
                    payload, kept = s.payload, []
                    for m in decode_packet(s.payload, CFG.max_stream):
                        if (self.drop is not None and self.drop(self.now, m)) or (
                                self.lose is not None and self.lose(name, s.addr, m)):
                            self.dropped.append((self.now, name, m))
                        else:
                            kept.append(m)
                            self.sent.append((self.now, name, m))
                    if self.drop is not None or self.lose is not None:
                        payload = encode_packet(kept) if kept else b""
                    if payload:
                        self.nodes[s.addr].receive(payload, self.now, s.reliable)
                self.events += [(self.now, name, e) for e in node.take_events()]

    def run(self, until: float) -> None:
        self._deliver()
        while True:
            name, t = min(((n, nd.next_deadline()) for n, nd in self.nodes.items() if n not in self.down),
                          key=lambda x: x[1])
            if t > until:
                self.now = until
                return
            self.now = max(self.now, t)
            self.nodes[name].tick(self.now)
            self._deliver()

    def plans(self) -> dict[str, Any]:
        from gossiprec.core.events import PlanReady

        return {n: e.plan for _, n, e in self.events if isinstance(e, PlanReady)}


def _in_optimizer(net: MiniNet, step: int) -> None:
    from gossiprec.core.wire import PHASES

    for name, node in net.nodes.items():
        if node.view is not None and node.view.member(name).role == "trainer":  # type: ignore[union-attr]
            node.set_state(step - 1, None, 1000)
            node.set_progress(step, PHASES.index("optimizer"), 100, net.now)


def test_accusations_from_the_member_being_removed_do_not_fence_the_healthy_side() -> None:
    # n1 stops hearing anyone (its agent starved on a loaded host) and accuses both others, then its
    # whole node stops (SIGSTOP): its alerts can never be retracted. Each healthy member's cut (remove n1)
    # keeps the other, which SWIM holds alive; the stale word of the member this very cut removes must not
    # make it look unreachable, or both withhold the cut, nobody votes, and both fence, dropping the only
    # copies of the state (seen under load in test_recovery_fenced).
    from gossiprec.core.events import Fenced, ViewInstalled

    net = MiniNet(["n0", "n1", "n2"], spares=1)
    net.run(1.0)
    net.lose = lambda src, dst, m: dst == "n1"
    t = 1.0
    while net.nodes["n0"].cut.count("n0") == 0 or net.nodes["n0"].cut.count("n2") == 0:
        assert t < 10.0, "n1 never accused both"
        t += 0.05
        net.run(t)
    net.lose = None
    net.down.add("n1")
    assert net.nodes["n0"].cut.unstable("n2") and net.nodes["n2"].cut.unstable("n0")  # and nobody retracts
    net.run(t + 15.0)
    fenced = [(n, e.reason) for _, n, e in net.events if isinstance(e, Fenced)]
    assert not fenced, fenced
    for name in ("n0", "n2"):
        node = net.nodes[name]
        assert node.view is not None and node.view.nodes == ("n0", "n2"), (name, node.view)
        assert not node.counters.get("cut_withheld_unreachable"), (name, node.counters)
    assert sorted(n for _, n, e in net.events if isinstance(e, ViewInstalled)) == ["n0", "n2"]


def test_a_report_waits_for_the_step_its_trainer_is_finishing() -> None:
    from gossiprec.core.wire import PHASES, Report

    net = MiniNet(["n0", "n1", "n2", "n3"])
    net.run(1.0)
    _in_optimizer(net, 5)  # every trainer is in the optimizer step of step 5, committed 4
    net.nodes["n1"].leave(net.now)  # its trainer died: the agent announces its own departure
    net.run(1.5)
    assert all(net.nodes[n].view.epoch == 1 for n in ("n0", "n2", "n3"))  # type: ignore[union-attr]
    assert not net.plans() and not [m for _, src, m in net.sent if isinstance(m, Report) and src != "n1"]
    for n in ("n0", "n2"):  # they commit step 5; n2 then stops to recover
        net.nodes[n].set_state(5, None, 1000)
    net.nodes["n2"].set_progress(5, PHASES.index("recovering"), 100, net.now)
    net.run(1.6)
    plans = net.plans()
    assert set(plans) == {"n0", "n2", "n3"} and len({p.digest() for p in plans.values()}) == 1
    assert plans["n0"].target_step == 5  # nothing committed is lost
    assert all(net.nodes[n].counters.get("report_hold_expired", 0) == 0 for n in net.nodes)


@pytest.mark.parametrize("hold", [0.0, 2.0])
def test_a_report_goes_out_at_once_or_when_the_hold_expires(hold: float) -> None:
    net = MiniNet(["n0", "n1", "n2", "n3"], report_hold=hold)
    net.run(1.0)
    _in_optimizer(net, 5)
    net.nodes["n1"].leave(net.now)
    net.run(1.0 + hold + 0.5)  # the trainers never get further (a stuck optimizer step)
    plans = net.plans()
    assert set(plans) == {"n0", "n2", "n3"} and plans["n0"].target_step == 4  # what they had
    assert (net.nodes["n0"].counters.get("report_hold_expired", 0) == 1) == (hold > 0)
    planned_at = min(t for t, _, e in net.events if type(e).__name__ == "PlanReady")
    left_at = 1.0
    assert (planned_at - left_at >= hold) and planned_at - left_at < hold + 0.5, planned_at


def test_the_job_end_reaches_every_member_and_nothing_is_decided_after_it() -> None:
    from gossiprec.core.events import JobFinished, ViewInstalled

    net = MiniNet(["n0", "n1", "n2", "n3", "n4"], spares=2)
    net.run(1.0)
    net.nodes["n0"].finish(30, net.now)
    net.run(1.1)
    done = {n: e for _, n, e in net.events if isinstance(e, JobFinished)}
    assert set(done) == set(net.nodes) and all(e.step == 30 and e.source == "n0" for e in done.values())
    for n in ("n0", "n1", "n2"):  # the trainers leave; the spares must not take their ranks
        net.nodes[n].leave(net.now)
    net.run(4.0)
    assert not [e for _, _, e in net.events if isinstance(e, ViewInstalled)] and not net.plans()
    assert not net.nodes["n3"].fenced and not net.nodes["n4"].fenced


def test_only_a_trainer_of_the_view_can_end_the_job() -> None:
    from gossiprec.core.events import JobFinished

    net = MiniNet(["n0", "n1", "n2", "n3"], spares=1)
    net.run(1.0)
    net.nodes["n3"].finish(30, net.now)  # a spare's word: it trains nothing
    net.run(1.2)
    assert not [e for _, _, e in net.events if isinstance(e, JobFinished)]
    assert net.nodes["n3"].counters.get("rx_job_done_not_a_trainer") == 1
    assert all(node.finished is None for node in net.nodes.values())
    # nor does one that names a spare as its sender count, wherever it comes from
    from gossiprec.core.wire import JobDone, encode_packet

    net.nodes["n0"].receive(encode_packet([JobDone(0, 30, "n3")]), net.now)
    assert net.nodes["n0"].finished is None and net.nodes["n0"].counters.get("rx_job_done_not_a_trainer") == 1


def test_a_report_held_for_a_view_that_removed_us_is_dropped() -> None:
    net = MiniNet(["n0", "n1", "n2", "n3"])
    net.run(1.0)
    _in_optimizer(net, 5)
    net.nodes["n1"].leave(net.now)
    net.run(1.2)
    n0 = net.nodes["n0"]
    assert n0.aggregates.held_until is not None  # held for view 1
    n0.aggregates.start_view(n0.view, net.now)  # what a newer view's install does
    assert n0.aggregates.held_until is None
    n0.tick(net.now + 1.0)  # the hold's timer fires with nothing to report: no error
    assert n0.counters.get("machine_errors", 0) == 0


def test_a_process_holding_a_view_that_lists_it_also_asks_peers_for_news_after_its_first_hello() -> None:
    # its observers may all be gone (a restart from the job spec holds view 0) or every Hello lost: from
    # its second Hello round on it also asks two live members for newer news; at its very start (a job's
    # first start, everyone on view 0) it asks nobody
    node = make_node()
    assert [m for _, m in sent_messages(node) if isinstance(m, ViewRequest)] == []
    asked: list[Any] = []
    while not asked:
        t = node.next_deadline()
        assert t < node.acfg.hello_for, "no ViewRequest within hello_for"
        node.tick(t)
        asked = [m for _, m in sent_messages(node) if isinstance(m, ViewRequest)]
    assert t >= node.acfg.join_retry and asked[0].src == "n0" and asked[0].epoch == 0


def test_a_fenced_member_unfences_only_after_asking_for_news_in_its_healthy_window() -> None:
    # a catch-up sent just before the window opens rate-limits the one the window would send: the window
    # waits for a question actually sent, so a view that removed this member can come back first
    node = make_node()
    v = node.view
    assert v is not None
    node.fencing.fence("no decision within fence_after", 0.0)
    node.catchup.catch_up(0.0)
    node.take_sends()
    node.fencing.maybe_unfence(v, 0.1)  # rate-limited: nothing asked
    node.fencing.maybe_unfence(v, 0.1 + node.acfg.unfence_after + 0.05)
    assert node.fenced, "unfenced without having asked for news"
    assert [m for _, m in sent_messages(node) if isinstance(m, ViewRequest)] != []
    node.fencing.maybe_unfence(v, 0.2 + 2 * node.acfg.unfence_after)
    assert not node.fenced


def test_view_pushes_to_names_outside_the_view_are_bounded_per_interval() -> None:
    # a Hello names its sender and its address freely: a key holder inventing names must not make a
    # member send its view to any address without limit (nor grow its memory of whom it pushed to)
    v0 = view0()
    ahead = make_node("n1", v0)
    _decide(ahead, [Change("n5", REMOVE)], 0.1)
    assert ahead.view is not None and ahead.view.epoch == 1
    ahead.take_sends()
    budget = len(ahead.view) + 8

    def hellos(names: list[str], now: float) -> int:
        for n in names:
            ahead.receive(encode_packet([Hello(n, f"victim-{n}", 1, 0, v0.config_id)]), now)
        return sum(1 for a, _ in sent_messages(ahead) if a.startswith("victim-"))

    interval = ahead.acfg.catchup_interval
    assert hellos([f"x{i}" for i in range(200)], 0.2) == budget
    assert hellos([f"y{i}" for i in range(50)], 0.2 + interval / 2) == 0
    assert hellos(["x0"], 0.2 + interval / 2) == 0  # once per name per interval
    assert hellos([f"z{i}" for i in range(200)], 0.2 + interval * 1.01) == budget
    assert len(ahead.catchup.pushed_view) <= budget + len(ahead.view)
    # a member of the view is never held back by the outsiders' budget
    ahead.receive(encode_packet([Hello("n0", "n0", 1, 0, v0.config_id)]), 0.2 + interval * 1.02)
    assert [m for a, m in sent_messages(ahead) if a == "n0"]


def test_a_removed_member_rejoins_only_once_its_trainer_dropped_its_state() -> None:
    # A trainer removed as hung cannot answer its removal; its launcher kills it after a grace. Had its
    # agent rejoined as a spare meanwhile, the next election could hand a rank to that hung trainer: a
    # wasted view change, and another to remove it again (seen under load in
    # test_ranks_hung_inside_a_step_are_the_ones_evicted). A trainer that answers drops its state, and
    # then its node asks to join again.
    from gossiprec.core.wire import JoinRequest

    net = MiniNet(["n0", "n1", "n2", "n3"])
    net.run(4.0)  # past hello_for: n1 is no new process when it learns of its removal
    for name in ("n0", "n1", "n2"):
        net.nodes[name].set_state(5, None, 1000)
    net.lose = lambda src, dst, m: "n1" in (src, dst)
    t = 4.0
    while "n1" in (net.nodes["n0"].view or ()):
        assert t < 30.0, "n1 was never removed"
        t += 0.25
        net.run(t)
    net.lose = None
    healed = net.now
    net.run(healed + 8.0)
    n1 = net.nodes["n1"]
    assert n1.view is not None and "n1" not in n1.view  # it learned that it was removed ...
    asked = [m for at, src, m in net.sent if src == "n1" and isinstance(m, JoinRequest) and at >= healed]
    assert not asked and n1.counters.get("join_held_for_trainer", 0) > 0  # ... and asks nothing yet
    n1.set_state(0, None, 0)  # its trainer dropped the state of its old rank: a spare now
    net.run(net.now + 8.0)
    for name in ("n0", "n2", "n3", "n1"):
        v = net.nodes[name].view
        assert v is not None and (m := v.member("n1")) is not None and m.role == "spare", (name, v)
