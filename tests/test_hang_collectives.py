"""The hang check inside a step: progress names the collective each rank has reached (``coll``, the
collectives it entered in its step), and only the rank the others wait for is judged hung.

One :class:`~gossiprec.core.node.Node` (n0, a trainer of a 6-trainer view, every other one its subject)
is driven by hand on a virtual clock: the others' progress arrives by gossip every 50 ms, and each answers
n0's probes with its position and the age of that position. Layout of the tensor-parallel hang (dp x tp,
step 5): n5 stalled in forward before collective 1 (its TP all-reduce), its TP peer n4 inside
collective 1, and the other replica (n0..n3) in the gradient all-reduce (collective 5).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import pytest

from gossiprec.core.config import Config
from gossiprec.core.wire import PHASES, Ack, Ping, Progress
from tests.support.hangs import hang_observer, hung_alerts_of

CFG = Config.profile("lan")
NAMES = [f"n{i}" for i in range(6)]
COMPUTE, COMMUNICATE, WAITING, CHECKPOINT, RECOVERING = (PHASES.index(p) for p in (
    "compute", "communicate", "waiting", "checkpoint", "recovering"))
STALL_AT = 0.1
"""When the positions below become current (before it, every rank is at step 5, collective 0, compute)."""
Position = tuple[int, int, int]  # (step, coll, phase)


def hung_alerts(positions: dict[str, Position], until: float, *, unknown: frozenset[str] = frozenset(),
                silent: frozenset[str] = frozenset(), **agreement: float) -> list[tuple[float, str]]:
    """Drive n0 with the others at ``positions`` from :data:`STALL_AT` on (n0's own is ``positions["n0"]``);
    ``unknown``: members n0 never hears progress from (outside its sample); ``silent``: members whose
    answers to n0's probes are lost (their progress still comes by gossip). Returns (time, subject) of
    n0's hang alerts up to ``until``."""
    node = hang_observer(NAMES, **agreement)
    start: Position = (5, 0, COMPUTE)
    mine = [start]

    def at(name: str, t: float) -> Position:
        return positions[name] if t >= STALL_AT - 1e-9 else start

    def own(t: float) -> None:
        if at("n0", t) != mine[0]:
            mine[0] = at("n0", t)
            node.set_progress(mine[0][0], mine[0][2], 100, t, mine[0][1])

    def gossip(t: float, version: int) -> list[Progress]:
        return [Progress(n, 1, version, at(n, t)[0], at(n, t)[2], 100, at(n, t)[1])
                for n in NAMES[1:] if n not in unknown]

    def answer(m: Ping, now: float) -> Ack | None:
        if m.target in unknown or m.target in silent:
            return None
        step, coll, phase = at(m.target, now)
        age = round(max(0.0, now - STALL_AT) * 1000) if now >= STALL_AT else round(now * 1000)
        return Ack(m.seq, m.target, 1, step, phase, 100, age, coll)

    node.set_progress(5, COMPUTE, 100, 0.0)
    return hung_alerts_of(node, until, gossip, answer, own)


def tp_hang(peer_phase: int, coll: bool = True) -> dict[str, Position]:
    """The tensor-parallel hang of the module docstring; ``peer_phase``: what n4 reports inside
    collective 1 (``compute`` until its wait is slow enough to report ``waiting``); ``coll=False``: every
    count 0, as progress without collective counts reads."""
    k = (lambda c: c) if coll else (lambda c: 0)
    return {"n0": (5, k(5), WAITING), "n1": (5, k(5), WAITING), "n2": (5, k(5), WAITING),
            "n3": (5, k(5), WAITING), "n4": (5, k(1), peer_phase), "n5": (5, k(0), COMPUTE)}


@pytest.mark.parametrize("peer_phase", [COMPUTE, WAITING], ids=["peer-not-yet-waiting", "peer-waiting"])
def test_only_the_rank_before_the_collective_is_judged_hung(peer_phase: int) -> None:
    alerts = hung_alerts(tp_hang(peer_phase), 4.0)
    # threshold max(1 s floor, 3 x 100 ms) from the stall at 0.1 s, once n5 has answered a probe within
    # answered_within (0.5 s) of it; and n5 alone
    assert alerts and alerts[0][1] == "n5" and 1.1 - 1e-6 <= alerts[0][0] <= 1.1 + 0.5, alerts
    assert {s for _, s in alerts} == {"n5"}, alerts


def test_without_the_counts_the_peer_inside_the_collective_was_judged_too() -> None:
    """What the counts fix: by (step, phase) alone, n5 (stalled before the TP all-reduce) and its peer
    n4 (inside it, not yet reporting ``waiting``) are at the same position, behind the other replica, so
    the healthy n4 could be alerted: here n5's answers are lost (a rank is judged only on its own answer),
    so n4 is the only one n0 can judge; with the counts n4 is ahead of n5 and not judged."""
    assert "n4" in {s for _, s in hung_alerts(tp_hang(COMPUTE, coll=False), 4.0, silent=frozenset({"n5"}))}
    assert hung_alerts(tp_hang(COMPUTE), 4.0, silent=frozenset({"n5"})) == []


def test_a_waiting_rank_is_not_judged_when_the_one_it_waits_for_is_outside_the_sample() -> None:
    """At O(K) samples an observer may not hear of the stalled rank at all: the ranks that report
    ``waiting`` wait inside a collective for someone, so none of them is taken for the hung one."""
    assert hung_alerts(tp_hang(WAITING), 4.0, unknown=frozenset({"n5"})) == []


@pytest.mark.parametrize("layout", [
    {n: (5, 3, COMPUTE) for n in NAMES},  # every rank stalled at the same point (a slow store, a GC)
    {n: (5, 3, WAITING) for n in NAMES},  # every rank inside the same slow collective
    {n: (5, 3, CHECKPOINT) for n in NAMES},  # a checkpoint every rank takes
], ids=["compute", "waiting", "checkpoint"])
def test_a_stall_every_rank_shares_is_no_ones_hang(layout: dict[str, Position]) -> None:
    assert hung_alerts(layout, 5.0) == []


def test_two_ranks_stalled_at_different_collectives_only_the_lower_is_judged() -> None:
    """Neither waits (both outside a collective): the one further behind is the one the others wait for;
    the other is judged only if it is still stalled once that one is gone (not here)."""
    layout = {**tp_hang(WAITING), "n4": (5, 2, COMPUTE), "n5": (5, 1, COMPUTE)}
    assert {s for _, s in hung_alerts(layout, 4.0)} == {"n5"}


def test_a_rank_that_stays_in_its_step_while_the_others_recover_is_judged() -> None:
    """A view change aborts every collective, so the others recover; a rank stuck outside any collective
    never notices, and the new epoch's groups wait for it. It is behind the recovering ranks from when
    they began to recover (here at the stall), and alone, after twice the threshold (the view must reach
    its agent first)."""
    layout = {**{n: (5, 0, RECOVERING) for n in NAMES}, "n5": (5, 2, COMPUTE)}
    alerts = hung_alerts(layout, 4.0)
    assert alerts and 2.1 - 1e-6 <= alerts[0][0] <= 2.1 + 0.5, alerts
    assert {s for _, s in alerts} == {"n5"}, alerts


def test_ranks_that_all_recover_or_wait_in_the_new_groups_are_no_ones_hang() -> None:
    """Every rank recovering (building the new groups, fetching state), or some waiting inside a slow
    collective while the rest recover: nobody is judged."""
    assert hung_alerts({n: (5, 0, RECOVERING) for n in NAMES}, 4.0) == []
    assert hung_alerts({**{n: (5, 0, RECOVERING) for n in NAMES}, "n5": (5, 2, WAITING)}, 4.0) == []


def test_the_collective_count_dates_the_stall() -> None:
    """A rank that enters collective after collective is moving, though its (step, phase) stays the same:
    its stall clock starts at the last collective it entered."""
    from gossiprec.core.progress import ProgressBook

    book = ProgressBook()
    book.heard(Progress("n5", 1, 1, 5, COMPUTE, 100, 0), 0.0, False, 0)
    book.heard(Progress("n5", 1, 2, 5, COMPUTE, 100, 0), 0.5, False, 0)
    assert book.get("n5").since == 0.0  # the same position: the stall clock keeps running
    book.heard(Progress("n5", 1, 3, 5, COMPUTE, 100, 1), 0.7, False, 0)
    info = book.get("n5")
    assert (info.coll, info.since) == (1, 0.7)  # entered collective 1: a new position
    book.heard(Progress("n5", 1, 0, 5, COMPUTE, 100, 1), 0.9, True, 300)
    assert book.get("n5").since == pytest.approx(0.6)  # an ack's age dates it earlier, never later
    assert [p.coll for p in book.take_turns(1)] == [1]  # gossiped on with its count


@contextmanager
def _reporting_trainer(sharded: bool) -> Iterator[tuple[Any, Callable[[], tuple[int, int, str]]]]:
    """The reporting half of a trainer on a real progress page, and what its agent reads from it."""
    import shutil
    import tempfile

    from gossiprec.local.progress import ProgressPage, page_path_for
    from gossiprec.trainer.agent_link import AgentLink
    from gossiprec.trainer.identity import RankIdentity
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.redo import RedoGuard

    d = tempfile.mkdtemp(prefix="grp", dir="/tmp")
    try:
        path = page_path_for(f"{d}/a.sock")
        with ProgressPage.create(path) as agent_side, ProgressPage.open(path) as page:
            rt = object.__new__(ResilientTrainer)
            rt._link = AgentLink(None, on_lost=print)  # type: ignore[arg-type]
            rt._link._page, rt._link.step_ms = page, 100
            rt.install(RankIdentity(step=4))
            rt.sharded = object() if sharded else None
            rt._redo = RedoGuard()  # unarmed: no recovery happened, so no step is being redone

            def seen() -> tuple[int, int, str]:
                rec = agent_side.read()
                assert rec is not None
                return rec.step, rec.coll, PHASES[rec.phase]

            yield rt, seen
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_the_trainer_counts_collectives_per_step_and_stops_waiting_when_one_completes() -> None:
    """What a trainer writes to its page: every collective entered moves the count (reset per step); a
    slow one reports ``waiting`` until it completes, then the phase it was in (a rank that stalls later
    in the step, outside any collective, must not read as waiting)."""
    with _reporting_trainer(sharded=False) as (rt, seen):
        rt._entered()  # before any report: counted, nothing written
        rt._link.report(5, "compute")
        assert seen() == (5, 0, "compute")  # a new step: the count starts again
        rt._entered()
        rt._entered()
        assert seen() == (5, 2, "compute")
        rt._on_slow()
        assert seen() == (5, 2, "waiting")
        rt._link.resumed()
        assert seen() == (5, 2, "compute")
        rt._link.resumed()  # (not waiting: nothing changes)
        assert seen() == (5, 2, "compute")
        rt._link.report(5, "optimizer")
        assert seen() == (5, 2, "optimizer")  # the same step keeps its count
        rt._link.report(6, "compute")
        assert seen() == (6, 0, "compute")


def test_a_sharded_rank_reads_as_communicating_from_its_first_collective_on() -> None:
    """In a sharded step the library never sees the optimizer step, and any collective may be the step's
    last: from the first one on, the rank reports ``communicate``, a phase in which its agent holds the
    state report of a view installed meanwhile until the rank commits or recovers (else a survivor that
    commits the step just after reporting it in flight is rolled back a step)."""
    from gossiprec.core.aggregate import FINISHING

    with _reporting_trainer(sharded=True) as (rt, seen):
        rt._link.report(5, "compute")
        assert seen() == (5, 0, "compute") and PHASES.index("compute") not in FINISHING
        rt._entered()
        assert seen() == (5, 1, "communicate") and PHASES.index("communicate") in FINISHING
        rt._entered()
        rt._on_slow()
        rt._link.resumed()  # a slow collective's end goes back to communicating, not to compute
        assert seen() == (5, 2, "communicate")
        rt._link.report(6, "compute")
        assert seen() == (6, 0, "compute")
