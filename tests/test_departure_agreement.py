"""Agreement on announced departures (a trainer's exit bell: its agent leaves at once, signed): fast, and
still one view change for departures that come together.

Simulated with :func:`gossiprec.sim.agree.build_cluster` (16 members, 2 spares, ``lan`` timings, real
consensus and digest signatures) on the simulator's default network: 0.2 ms one-way latency plus an
exponential jitter of mean 0.1 ms, no loss (a loopback- or LAN-like network). A departure is what the
agent does when the bell rings: ``leave`` (its signed word to every member), then the process is gone
50 ms later (its agent's drain).
"""

from __future__ import annotations

from typing import Any

import pytest

from gossiprec.core.config import AgreementConfig
from gossiprec.core.events import ViewInstalled
from gossiprec.core.machine import Machine
from gossiprec.sim.agree import AgreeParams, build_cluster
from gossiprec.sim.cluster import SimCluster

T0 = 2.0
DRAIN = 0.05


def _cluster(seed: int) -> tuple[SimCluster[Machine], list[tuple[float, int, Any]]]:
    """16 members run until T0; the list gets every (time, member, ViewInstalled) from then on."""
    cl, _, _ = build_cluster(AgreeParams(scenario="crash", nodes=16, spares=2, seed=seed))
    seen: list[tuple[float, int, Any]] = []
    cl.observers.append(lambda now, i, ev: seen.append((now, i, ev)) if isinstance(ev, ViewInstalled) else None)
    cl.run_until(T0)
    return cl, seen


def _depart(seed: int, leavers: list[int], gaps: list[float]) -> tuple[list[int], list[tuple[float, int, Any]]]:
    """Members ``leavers`` announce their departure, the k-th ``gaps[k]`` seconds after the one before
    (the first at T0). Returns the survivors and every (time, member, ViewInstalled) they saw."""
    cl, seen = _cluster(seed)

    def leave(i: int) -> None:
        node = cl.nodes[i]
        node.machine.leave(cl.now)
        cl._flush(node)  # what the agent's pump does after machine.leave: send at once

    t = T0
    for i, gap in zip(leavers, gaps):
        t += gap
        cl.at(t, lambda i=i: leave(i))  # type: ignore[misc]
        cl.at(t + DRAIN, lambda i=i: cl.crash(i))  # type: ignore[misc]
    cl.run_until(T0 + 3.0)
    survivors = [i for i in range(16) if i not in leavers]
    return survivors, [(now, i, ev) for now, i, ev in seen if i in survivors]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_one_departure_is_agreed_within_ten_milliseconds(seed: int) -> None:
    survivors, seen = _depart(seed, [3], [0.0])
    assert sorted(i for _, i, _ in seen) == survivors  # one view change, on every survivor
    assert all(ev.epoch == 1 and ev.removed == ("n00003",) for _, _, ev in seen)
    assert all(ev.fast for _, _, ev in seen if ev.decided_here)  # the fast round, no classic round
    last = max(now for now, _, _ in seen)
    assert last - T0 < 0.010, f"installed everywhere {1000 * (last - T0):.2f} ms after the departure"


@pytest.mark.parametrize("gaps", [[0.0, 0.0, 0.0], [0.0, 0.001, 0.001], [0.0, 0.0015, 0.0015], [0.0, 0.003]])
def test_departures_within_a_few_milliseconds_go_in_one_fast_view_change(gaps: list[float]) -> None:
    # all ranks of a host crash, each with its own agent: the bells ring within a few ms of each other
    leavers = [3, 7, 11][:len(gaps)]
    for seed in (1, 2):
        survivors, seen = _depart(seed, leavers, gaps)
        names = tuple(sorted(f"n{i:05d}" for i in leavers))
        assert sorted(i for _, i, _ in seen) == survivors, f"seed {seed}: {[(i, ev.epoch) for _, i, ev in seen]}"
        assert all(ev.epoch == 1 and ev.removed == names for _, _, ev in seen), f"seed {seed}"
        assert all(ev.fast for _, _, ev in seen if ev.decided_here), f"seed {seed}: a classic round"
        last = max(now for now, _, _ in seen)
        assert last - (T0 + sum(gaps)) < 0.010, f"seed {seed}: {1000 * (last - T0):.2f} ms"


def test_a_departure_as_the_window_closes_waits_for_no_fallback_timeout() -> None:
    # the second bell rings just as the first departure's settle window closes: some members vote for the
    # first alone, others for both. Neither cut can reach a fast quorum, and waiting fallback_timeout
    # (0.6 s and more) for the classic round would cost far more than the window saved: it starts at once
    acfg = AgreementConfig()
    for seed in (1, 2, 3):
        survivors, seen = _depart(seed, [3, 7], [0.0, acfg.settle_departed])
        first = min(now for now, _, _ in seen)
        assert first - T0 < 0.1, f"seed {seed}: first view {1000 * (first - T0):.1f} ms after the departure"
        gone = {x for _, _, ev in seen for x in ev.removed}
        assert gone == {"n00003", "n00007"}, f"seed {seed}: {gone}"
        done = max(now for now, _, ev in seen if "n00007" in ev.removed)
        assert done - T0 < acfg.fallback_timeout, f"seed {seed}: {1000 * (done - T0):.1f} ms"


def test_a_silent_rack_still_goes_in_one_view_change() -> None:
    # a rack that loses power rings no bell: its members are removed on their observers' alerts, with the
    # normal settle window (untouched by the departures' short one), all in one view change
    rack = [3, 7, 11]
    for seed in (1, 2):
        cl, seen = _cluster(seed)
        for i in rack:
            cl.crash(i)
        cl.run_until(T0 + 4.0)
        names = tuple(sorted(f"n{i:05d}" for i in rack))
        assert {ev.removed for _, _, ev in seen} == {names}, f"seed {seed}: {[ev.removed for _, _, ev in seen]}"
        assert sorted(i for _, i, _ in seen) == [i for i in range(16) if i not in rack], f"seed {seed}"
