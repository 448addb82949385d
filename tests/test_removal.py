"""The one reading of "this node left the agreed view" that both launchers act on."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, AsyncIterator

from gossiprec.agent.removal import Readmitted, Removed, membership_changes
from gossiprec.core.events import Fenced, Unfenced, ViewInstalled


def view(epoch: int, *members: str) -> ViewInstalled:
    return ViewInstalled(epoch, f"c{epoch}", members, (), (), False, False, 0.0)


async def stream(items: list[object]) -> AsyncIterator[object]:
    for item in items:
        yield item


def changes(agent: Any, items: list[object]) -> list[object]:
    async def collect() -> list[object]:
        return [c async for c in membership_changes(agent, stream(items))]
    return asyncio.run(collect())


def agent(in_view: bool) -> Any:
    return SimpleNamespace(name="a", machine=SimpleNamespace(view={"a", "b"} if in_view else {"b"}))


def test_a_view_without_us_is_one_removal_and_the_agents_fence_after_it_is_not_a_second() -> None:
    got = changes(agent(True), [view(1, "a", "b"), view(2, "b"), Fenced(2, "removed from the view", 0.0)])
    assert got == [Removed("removed from the view of epoch 2", "")]


def test_the_agents_removal_fence_alone_is_the_removal() -> None:
    got = changes(agent(True), [Fenced(3, "removed from the view", 0.0)])
    assert got == [Removed("removed from the view (epoch 3)", "")]


def test_a_fence_before_the_removal_is_carried_and_unfenced_clears_it() -> None:
    got = changes(agent(True), [Fenced(1, "no quorum", 0.0), view(2, "b")])
    assert got == [Removed("removed from the view of epoch 2", "no quorum")]
    got = changes(agent(True), [Fenced(1, "no quorum", 0.0), Unfenced(1, 0.0), view(2, "b")])
    assert got == [Removed("removed from the view of epoch 2", "")]


def test_a_joiner_outside_the_view_is_not_removed_until_it_was_a_member() -> None:
    got = changes(agent(False), [view(1, "b"), view(2, "a", "b"), view(3, "b")])
    assert got == [Readmitted(2), Removed("removed from the view of epoch 3", "")]


def test_readmission_after_a_removal_resets_the_fence_and_a_later_removal_is_told_again() -> None:
    got = changes(agent(True), [Fenced(1, "no quorum", 0.0), view(2, "b"), view(3, "a", "b"),
                                view(4, "a", "b"), view(5, "b"), Fenced(5, "removed from the view", 0.0)])
    assert got == [Removed("removed from the view of epoch 2", "no quorum"), Readmitted(3),
                   Removed("removed from the view of epoch 5", "")]


def test_the_agents_own_departure_is_the_last_change_told() -> None:
    from gossiprec.agent.hub import AgentLeaving
    from gossiprec.agent.removal import Leaving
    got = changes(agent(True), [AgentLeaving("b", "other", False, 0.0), AgentLeaving("a", "stopped", True, 0.0),
                                view(2, "b")])
    assert got == [Leaving("stopped", True)]
