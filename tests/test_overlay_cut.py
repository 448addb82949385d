"""Tests of the monitoring overlay (:mod:`gossiprec.core.overlay`) and multi-node cut detection
(:mod:`gossiprec.core.cut`).

The overlay is a pure function of ``(config_id, nodes, K)``, checked for determinism, inverse
observer/subject relations, observer counts and the joiner's would-be observers. The cut detector is
driven with alerts at chosen virtual times and asked ``evaluate(now)``; the tests assert both the
proposal and the wake-up time it returns (when it is worth asking again), never sleeping.
"""

from __future__ import annotations

import itertools
import math

import pytest

from gossiprec.core.cut import CutDetector
from gossiprec.core.overlay import Overlay, watermarks
from gossiprec.core.view import JOIN, REMOVE, Change

SETTLE = 0.15
UNSTABLE = 2.0


def names(n: int) -> list[str]:
    return [f"n{i:03d}" for i in range(n)]


def detector(ov: Overlay) -> CutDetector:
    return CutDetector(ov, SETTLE, UNSTABLE)


# -- watermarks -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, h, low",
    [(1, 1, 1), (2, 2, 1), (3, 3, 2), (4, 4, 2), (5, 5, 2), (6, 6, 2), (7, 7, 2), (8, 8, 2), (9, 9, 2),
     (10, 9, 3)],
)
def test_watermark_table(d: int, h: int, low: int) -> None:
    assert watermarks(d) == (h, low)
    assert h == math.ceil(0.9 * d - 1e-9)
    assert 1 <= low <= h and (low < h or h == 1)


def test_watermarks_for_no_observer_and_large_d() -> None:
    assert watermarks(0) == (1, 1)
    assert watermarks(-3) == (1, 1)
    assert watermarks(20) == (18, 6)
    assert watermarks(100) == (90, 30)


# -- overlay ----------------------------------------------------------------------------------------


def test_build_is_deterministic_and_ignores_input_order() -> None:
    nodes = names(40)
    a = Overlay.build("cfg-a", nodes)
    b = Overlay.build("cfg-a", list(reversed(nodes)))
    assert a.nodes == b.nodes == tuple(nodes)
    for x in nodes:
        assert a.observers(x) == b.observers(x)
        assert a.subjects(x) == b.subjects(x)


def test_build_depends_on_the_config_id() -> None:
    nodes = names(40)
    a = Overlay.build("cfg-a", nodes)
    b = Overlay.build("cfg-b", nodes)
    differ = sum(1 for x in nodes if set(a.observers(x)) != set(b.observers(x)))
    assert differ > 30  # a new view reshuffles who watches whom


@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 11, 12, 40, 100])
def test_observer_counts_and_inverse_relations(n: int) -> None:
    nodes = names(n)
    ov = Overlay.build("cfg", nodes)
    assert ov.k == max(0, min(10, n - 1))
    pairs_obs = set()
    pairs_sub = set()
    for x in nodes:
        obs = ov.observers(x)
        assert x not in obs
        assert len(set(obs)) == len(obs)  # distinct
        assert set(obs) <= set(nodes)
        assert len(obs) <= ov.k
        if n > 1:
            assert len(obs) >= 1  # every member is watched
        pairs_obs |= {(o, x) for o in obs}
        pairs_sub |= {(x, s) for s in ov.subjects(x)}
        assert ov.thresholds(x) == watermarks(len(obs))
    assert pairs_obs == pairs_sub  # o observes x  <=>  x is a subject of o
    assert ov.observers("stranger") == () and ov.subjects("stranger") == ()


def test_large_overlay_has_close_to_k_observers() -> None:
    ov = Overlay.build("cfg", names(200))
    counts = [len(ov.observers(x)) for x in ov.nodes]
    assert ov.k == 10
    assert sum(counts) / len(counts) >= 9.0
    assert min(counts) >= 5
    # load is flat: nobody observes far more than K subjects
    assert max(len(ov.subjects(x)) for x in ov.nodes) <= 10


def test_small_job_members_are_watched_by_all_others() -> None:
    # K = N - 1: random rings would repeat predecessors (a member of a job of 8 would get ~4.5 distinct
    # observers, in a job of 3 often just one), so small jobs use the complete graph
    for n, cid in itertools.product((3, 5, 8, 11), ("cfg", "cfg-a", "cfg-b")):
        ov = Overlay.build(cid, names(n))
        for x in ov.nodes:
            assert set(ov.observers(x)) == set(ov.nodes) - {x}, (n, cid, x)


def test_k_max_caps_the_rings() -> None:
    ov = Overlay.build("cfg", names(50), k_max=3)
    assert ov.k == 3
    assert all(1 <= len(ov.observers(x)) <= 3 for x in ov.nodes)
    assert Overlay.build("cfg", names(50), k_max=0).observers("n000") == ()


def test_joiner_observers_are_the_predecessors_it_would_have() -> None:
    nodes = names(30)
    ov = Overlay.build("cfg", nodes)
    for j in ("joiner", "zz-late", "a-first", "n0155"):
        jo = ov.joiner_observers(j)
        assert jo == ov.joiner_observers(j)  # deterministic
        assert 1 <= len(jo) <= ov.k and len(set(jo)) == len(jo)
        assert set(jo) <= set(nodes)
        # the same nodes that will observe it once it is a member (K unchanged: N > K)
        grown = Overlay.build("cfg", nodes + [j])
        assert jo == grown.observers(j)
        assert ov.thresholds(j, joining=True) == watermarks(len(jo))


def test_joiner_observers_of_a_tiny_view() -> None:
    assert Overlay.build("cfg", ["solo"]).joiner_observers("j") == ("solo",)
    assert Overlay.build("cfg", []).joiner_observers("j") == ()
    two = Overlay.build("cfg", ["a", "b"])
    assert set(two.joiner_observers("j")) <= {"a", "b"} and two.joiner_observers("j")


# -- cut detection: helpers ----------------------------------------------------------------------------


def full_observers(ov: Overlay, want: int = 10) -> list[str]:
    return [x for x in ov.nodes if len(ov.observers(x)) == want]


def independent_pair(ov: Overlay) -> tuple[str, str]:
    """Two subjects with K distinct observers each, neither observing the other."""
    full = full_observers(ov)
    for a, b in itertools.combinations(full, 2):
        if a not in ov.observers(b) and b not in ov.observers(a):
            return a, b
    raise AssertionError("no independent pair in this overlay")


def mutual_pair(ov: Overlay) -> tuple[str, str]:
    """Two subjects that observe each other, each with at least 3 observers and H == d (d <= 9)."""
    for a, b in itertools.combinations(ov.nodes, 2):
        da, db = len(ov.observers(a)), len(ov.observers(b))
        if a in ov.observers(b) and b in ov.observers(a) and 3 <= da <= 9 and 3 <= db <= 9:
            return a, b
    raise AssertionError("no mutual pair in this overlay")


def alert_all(cd: CutDetector, subject: str, t0: float, step: float = 0.01,
              skip: tuple[str, ...] = ()) -> float:
    t = t0
    for o in cd.overlay.observers(subject):
        if o in skip:
            continue
        assert cd.alert(o, subject, REMOVE, False, t)
        t += step
    return t - step


# -- cut detection ----------------------------------------------------------------------------------


def test_no_alerts_means_nothing_to_do() -> None:
    cd = detector(Overlay.build("cfg", names(20)))
    assert cd.evaluate(0.0) == ([], None)


def test_single_subject_is_proposed_only_after_settle() -> None:
    ov = Overlay.build("cfg", names(40))
    s = full_observers(ov)[0]
    h, low = ov.thresholds(s)
    assert (h, low) == (9, 3)
    cd = detector(ov)
    obs = ov.observers(s)
    t = 10.0
    for i, o in enumerate(obs[:h]):
        t = 10.0 + 0.02 * i
        assert cd.alert(o, s, REMOVE, False, t)
        changes, wake = cd.evaluate(t)
        assert changes == []
        if i + 1 < low:
            assert wake is None  # nothing unstable, nothing stable: no reason to wake up
    assert cd.count(s) == h
    changes, wake = cd.evaluate(t)
    assert changes == [] and wake == pytest.approx(t + SETTLE)
    assert cd.evaluate(t + SETTLE - 1e-6)[0] == []
    changes, wake = cd.evaluate(t + SETTLE)
    assert changes == [Change(s, REMOVE)]
    assert wake is None
    # one more voice about a subject that is stable already changes no proposal: it is counted, but the
    # window stays closed (a late observer does not delay the change) ...
    assert cd.alert(obs[h], s, REMOVE, False, t + 1.0)
    assert cd.count(s) == h + 1
    assert cd.evaluate(t + 1.0)[0] == [Change(s, REMOVE)]
    # ... while news about another subject restarts the settle window
    other = next(x for x in ov.nodes if x != s and x not in obs)
    assert cd.alert(ov.observers(other)[0], other, REMOVE, False, t + 1.0)
    assert cd.evaluate(t + 1.0 + SETTLE / 2)[0] == []
    assert cd.evaluate(t + 1.0 + SETTLE)[0] == [Change(s, REMOVE)]


def test_unstable_subject_blocks_until_unstable_timeout() -> None:
    ov = Overlay.build("cfg", names(40))
    a, b = independent_pair(ov)
    cd = detector(ov)
    t_a = alert_all(cd, a, 5.0)
    _, low = ov.thresholds(b)
    t_b = 5.5
    for o in ov.observers(b)[:low]:  # exactly L: unstable, not stable
        assert cd.alert(o, b, REMOVE, False, t_b)
    assert cd.count(a) == 10 and cd.count(b) == low
    # settled, but b is unstable: wait, and say until when
    first = t_b + SETTLE
    changes, wake = cd.evaluate(first)
    assert changes == []
    assert wake == pytest.approx(first + UNSTABLE)
    assert cd.evaluate(first + UNSTABLE - 0.01)[0] == []
    changes, wake = cd.evaluate(first + UNSTABLE)
    assert changes == [Change(a, REMOVE)]  # b stopped blocking; it is not part of the proposal
    assert t_a < first


def test_a_doubted_subject_holds_the_proposal_until_its_alerts_come_or_the_timeout() -> None:
    # SWIM suspects b (it failed with a, but its observers' first accusations are still on their way):
    # the proposal waits for b's alerts, so both land in one view change
    ov = Overlay.build("cfg", names(40))
    a, b = independent_pair(ov)
    cd = CutDetector(ov, SETTLE, UNSTABLE, doubt_timeout=UNSTABLE)
    cd.doubt(b, 4.9)
    cd.doubt("not-a-member", 4.9)  # (ignored: no observers in this view)
    t_a = alert_all(cd, a, 5.0)
    changes, wake = cd.evaluate(t_a + SETTLE)
    assert changes == [] and wake == pytest.approx(4.9 + UNSTABLE)
    t_b = alert_all(cd, b, 5.6)
    assert cd.evaluate(t_b + SETTLE)[0] == sorted([Change(a, REMOVE), Change(b, REMOVE)], key=lambda c: c.node)
    # a doubt that no alert follows (a refuted rumour) stops holding the proposal after the timeout
    cd2 = CutDetector(ov, SETTLE, UNSTABLE, doubt_timeout=UNSTABLE)
    cd2.doubt(b, 4.9)
    alert_all(cd2, a, 5.0)
    assert cd2.evaluate(4.9 + UNSTABLE - 0.01)[0] == []
    assert cd2.evaluate(4.9 + UNSTABLE)[0] == [Change(a, REMOVE)]


def test_counts_follow_every_change_of_the_tallies() -> None:
    # the counts are cached between changes of the tallies: a retraction after an evaluation is seen
    ov = Overlay.build("cfg", names(40))
    a = full_observers(ov)[0]
    cd = detector(ov)
    t = alert_all(cd, a, 1.0)
    assert cd.evaluate(t + SETTLE)[0] == [Change(a, REMOVE)]
    for o in ov.observers(a)[:5]:
        assert cd.alert(o, a, REMOVE, True, t + 0.2)
    assert cd.evaluate(t + 0.2 + SETTLE)[0] == []
    assert cd.unstable(a) and not cd.unstable(ov.observers(a)[0])


def test_unstable_subject_reaching_h_joins_the_proposal() -> None:
    ov = Overlay.build("cfg", names(40))
    a, b = independent_pair(ov)
    cd = detector(ov)
    alert_all(cd, a, 1.0)
    obs_b = ov.observers(b)
    h, low = ov.thresholds(b)
    for o in obs_b[:low]:
        cd.alert(o, b, REMOVE, False, 1.2)
    assert cd.evaluate(1.5)[0] == []  # blocked by b
    for o in obs_b[low:h]:
        cd.alert(o, b, REMOVE, False, 1.6)
    assert cd.evaluate(1.6 + SETTLE)[0] == sorted([Change(a, REMOVE), Change(b, REMOVE)],
                                                  key=lambda c: c.node)


def test_alerts_from_non_observers_are_ignored() -> None:
    ov = Overlay.build("cfg", names(40))
    s = full_observers(ov)[0]
    strangers = [x for x in ov.nodes if x not in ov.observers(s) and x != s]
    cd = detector(ov)
    for x in strangers:
        assert cd.alert(x, s, REMOVE, False, 1.0) is False
    assert cd.alert("not-a-member", s, REMOVE, False, 1.0) is False
    assert cd.count(s) == 0
    assert cd.evaluate(100.0) == ([], None)
    assert cd.last_change == float("-inf")  # ignored alerts do not delay anything
    # nor can a member speak as a joiner's observer unless it is one
    j = "joiner"
    not_jo = [x for x in ov.nodes if x not in ov.joiner_observers(j)]
    assert cd.alert(not_jo[0], j, JOIN, False, 1.0) is False
    assert cd.count(j, JOIN) == 0


def test_duplicate_alert_and_retraction() -> None:
    ov = Overlay.build("cfg", names(40))
    s = full_observers(ov)[0]
    obs = ov.observers(s)
    cd = detector(ov)
    assert cd.alert(obs[0], s, REMOVE, True, 0.5) is False  # nothing to retract
    assert cd.alert(obs[0], s, REMOVE, False, 1.0)
    assert cd.alert(obs[0], s, REMOVE, False, 1.1) is False  # counted once
    assert cd.count(s) == 1
    alert_all(cd, s, 1.2, skip=(obs[0],))
    assert cd.count(s) == 10
    assert cd.alert(obs[1], s, REMOVE, True, 2.0)
    assert cd.alert(obs[2], s, REMOVE, True, 2.0)
    assert cd.count(s) == 8  # below H = 9
    assert cd.last_change == 2.0
    assert cd.evaluate(10.0)[0] == []  # unstable (between L and H), never stable
    assert cd.alert(obs[1], s, REMOVE, True, 2.1) is False  # already retracted
    assert cd.alert(obs[1], s, REMOVE, False, 3.0)
    assert cd.evaluate(3.0 + SETTLE)[0] == [Change(s, REMOVE)]


def test_retraction_below_l_stops_blocking_at_once() -> None:
    ov = Overlay.build("cfg", names(40))
    a, b = independent_pair(ov)
    cd = detector(ov)
    alert_all(cd, a, 1.0)
    _, low = ov.thresholds(b)
    obs_b = ov.observers(b)
    for o in obs_b[:low]:
        cd.alert(o, b, REMOVE, False, 1.1)
    assert cd.evaluate(1.5)[0] == []
    cd.alert(obs_b[0], b, REMOVE, True, 1.6)  # b recovered in one observer's eyes: below L
    assert cd.count(b) == low - 1
    assert cd.evaluate(1.6 + SETTLE)[0] == [Change(a, REMOVE)]


def test_interleaved_alerts_of_two_failures_land_in_one_proposal() -> None:
    ov = Overlay.build("cfg", names(40))
    a, b = independent_pair(ov)
    cd = detector(ov)
    oa, ob = list(ov.observers(a)), list(ov.observers(b))
    t = 2.0
    proposals = []
    for x, y in itertools.zip_longest(oa, ob):
        for obs, subj in ((x, a), (y, b)):
            if obs is None:
                continue
            t += 0.05  # the alerts of a correlated failure trickle in, closer than `settle`
            cd.alert(obs, subj, REMOVE, False, t)
            changes, _ = cd.evaluate(t)
            if changes:
                proposals.append(changes)
            # a node also re-evaluates just before the next alert arrives
            changes, _ = cd.evaluate(t + 0.049)
            if changes:
                proposals.append(changes)
    assert proposals == []  # never one of them alone
    changes, wake = cd.evaluate(t + SETTLE)
    assert changes == sorted([Change(a, REMOVE), Change(b, REMOVE)], key=lambda c: c.node)
    assert wake is None


def test_implicit_alert_from_a_failed_observer_of_a_failed_subject() -> None:
    ov = Overlay.build("cfg", names(6))
    x, y = mutual_pair(ov)
    hx, _ = ov.thresholds(x)
    hy, _ = ov.thresholds(y)
    assert hx == len(ov.observers(x)) and hy == len(ov.observers(y))  # every observer is needed
    cd = detector(ov)
    # x and y both fail; each is the other's observer, so neither alert can come from them
    alert_all(cd, x, 1.0, skip=(y,))
    t = alert_all(cd, y, 1.1, skip=(x,))
    assert cd.count(x) == hx - 1 and cd.count(y) == hy - 1  # real alerts fall one short
    changes, _ = cd.evaluate(t + SETTLE)
    assert changes == sorted([Change(x, REMOVE), Change(y, REMOVE)], key=lambda c: c.node)


def test_no_implicit_alert_from_a_healthy_observer() -> None:
    ov = Overlay.build("cfg", names(6))
    x, y = mutual_pair(ov)
    cd = detector(ov)
    t = alert_all(cd, x, 1.0, skip=(y,))  # only x fails; y is healthy and simply did not alert (yet)
    assert cd.evaluate(t + SETTLE)[0] == []
    assert cd.evaluate(t + SETTLE + UNSTABLE + 100.0)[0] == []  # never proposed on too few alerts
    assert cd.alert(y, x, REMOVE, False, t + 200.0)
    assert cd.evaluate(t + 200.0 + SETTLE)[0] == [Change(x, REMOVE)]


def test_join_alerts_use_joiner_observers_and_carry_the_address() -> None:
    ov = Overlay.build("cfg", names(30))
    j = "joiner"
    jo = ov.joiner_observers(j)
    h, _ = ov.thresholds(j, joining=True)
    cd = detector(ov)
    for i, o in enumerate(jo[:h]):
        assert cd.alert(o, j, JOIN, False, 1.0 + 0.01 * i, addr="addr-j", host="hj", rack="rj")
    t = 1.0 + 0.01 * (h - 1)
    assert cd.count(j, JOIN) == h
    assert cd.count(j, REMOVE) == 0
    assert cd.evaluate(t)[0] == []
    assert cd.evaluate(t + SETTLE)[0] == [Change(j, JOIN, "addr-j", "hj", "rj")]


def test_remove_and_join_in_one_proposal_sorted() -> None:
    ov = Overlay.build("cfg", names(40))
    s = full_observers(ov)[-1]
    j = "a-joiner"  # sorts before every member
    cd = detector(ov)
    alert_all(cd, s, 1.0)
    for o in ov.joiner_observers(j):
        cd.alert(o, j, JOIN, False, 1.05, addr="addr-j")
    changes, _ = cd.evaluate(1.05 + SETTLE)
    assert changes == [Change(j, JOIN, "addr-j"), Change(s, REMOVE)]
