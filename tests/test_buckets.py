"""Gradient buckets: layout, a fixed issue order, results equal to the flat all-reduce, interruption.

Two ranks are two threads of this process on a real gloo group (as in ``tests/test_groups.py``); each
runs its own copy of a model through backward, with the buckets' hooks issuing the all-reduces.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

import pytest
import torch

from gossiprec.errors import ConfigError
from gossiprec.trainer.collectives.buckets import GradientBuckets
from gossiprec.trainer.collectives.groups import (
    CollectiveAborted, EpochGroup, EpochGroups, connect_store, start_store_server,
)
from gossiprec.trainer.collectives.buckets import rank_ordered_mean

HOST = "127.0.0.1"


def _two_ranks(epoch: int, groups: list[EpochGroups]) -> list[EpochGroup]:
    out: list[Any] = [None, None]

    def build(r: int) -> None:
        out[r] = groups[r].build(epoch, r, 2)

    t = threading.Thread(target=build, args=(1,))
    t.start()
    build(0)
    t.join(10)
    return out


@pytest.fixture()
def pair() -> Any:
    _store, port = start_store_server(HOST)
    groups = [EpochGroups(connect_store(HOST, port), timeout=10) for _ in range(2)]
    return groups, _two_ranks(0, groups)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def _backward(model: torch.nn.Module, rank: int) -> None:
    g = torch.Generator().manual_seed(100 + rank)
    model.zero_grad()
    model(torch.randn(16, 32, generator=g)).pow(2).mean().backward()


def _both(fn: Callable[[int], Any]) -> list[Any]:
    out: list[Any] = [None, None]
    errors: list[BaseException] = []

    def run(r: int) -> None:
        try:
            out[r] = fn(r)
        except BaseException as exc:  # reported by the test thread
            errors.append(exc)

    t = threading.Thread(target=run, args=(1,))
    t.start()
    run(0)
    t.join(20)
    if errors:
        raise errors[0]
    return out


def _buckets(model: torch.nn.Module, group: EpochGroup, exact: bool, bucket_bytes: int = 8192) -> GradientBuckets:
    return GradientBuckets(model.parameters(), exact=exact, bucket_bytes=bucket_bytes,
                           issue=lambda t, op: group.allreduce(t, op, async_op=True),
                           rank_world=lambda: (group.rank, group.world_size))


def test_buckets_fill_in_reverse_order_up_to_the_cap_and_split_on_dtype() -> None:
    model = _model()
    b = GradientBuckets(model.parameters(), issue=lambda t, op: None, rank_world=lambda: (0, 1),
                        bucket_bytes=64 * 64 * 4)
    # parameters: 0.w 0.b 2.w 2.b 4.w 4.b; the last first; 2.w alone fills a bucket
    assert b.buckets == [[5, 4, 3], [2], [1, 0]]
    b.remove()
    mixed = [torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4, dtype=torch.float64))]
    b = GradientBuckets(mixed, issue=lambda t, op: None, rank_world=lambda: (0, 1))
    assert b.buckets == [[1], [0]]
    b.remove()
    with pytest.raises(ConfigError):
        GradientBuckets([], issue=lambda t, op: None, rank_world=lambda: (0, 1))


@pytest.mark.parametrize("exact", [True, False])
def test_bucketed_gradients_equal_the_flat_all_reduce_bit_for_bit(pair: Any, exact: bool) -> None:
    _groups, ranks = pair
    models = [_model(), _model()]
    # the flat path's result, computed from each rank's own gradients
    local = []
    for r, m in enumerate(models):
        _backward(m, r)
        local.append(torch.cat([p.grad.reshape(-1) for p in m.parameters()]))
    expected = rank_ordered_mean(local) if exact else (local[0] + local[1]) / 2
    buckets = [_buckets(m, g, exact) for m, g in zip(models, ranks, strict=True)]
    assert len(buckets[0].buckets) > 2

    def step(r: int) -> bool:
        _backward(models[r], r)  # the hooks issue the buckets as backward goes
        issued = len(buckets[r]._pending)
        ok = buckets[r].finish(list(models[r].parameters()), lambda pending: pending.wait())
        return ok and issued == len(buckets[r].buckets)

    for _ in range(2):  # twice: the second step reuses the buffers
        assert _both(step) == [True, True]
        for m in models:
            got = torch.cat([p.grad.reshape(-1) for p in m.parameters()])
            assert torch.equal(got, expected)


def test_the_issue_order_is_the_bucket_order_whatever_order_gradients_arrive_in(pair: Any) -> None:
    _groups, ranks = pair
    params = [[torch.nn.Parameter(torch.zeros(1000)) for _ in range(4)] for _ in range(2)]
    issued: list[list[int]] = [[], []]

    def issue_for(r: int) -> Any:
        def issue(t: torch.Tensor, op: str) -> Any:
            issued[r].append(t.numel())
            return ranks[r].allreduce(t, op, async_op=True)
        return issue

    buckets = [GradientBuckets(params[r], issue=issue_for(r), rank_world=lambda: (0, 1), bucket_bytes=4000)
               for r in range(2)]
    for r in range(2):
        for i, p in enumerate(params[r]):
            p.grad = torch.full((1000,), float(10 * r + i))
    orders = [[0, 1, 2, 3], [3, 2, 1, 0]]  # rank 1 finishes the buckets in the other order

    def step(r: int) -> bool:
        for i in orders[r]:
            buckets[r]._hook_for(i)(params[r][i])
        return buckets[r].finish(params[r], lambda pending: pending.wait())

    assert _both(step) == [True, True]
    for r in range(2):
        assert [float(p.grad[0]) for p in params[r]] == [5.0, 6.0, 7.0, 8.0]  # (i + (10 + i)) / 2


def test_an_aborted_bucket_raises_in_finish_and_its_buffers_are_dropped(pair: Any) -> None:
    groups, ranks = pair
    model = _model()
    b = _buckets(model, ranks[0], exact=False)
    _backward(model, 0)  # rank 1 never takes part: the buckets stay pending
    assert b._pending
    timer = threading.Timer(0.05, lambda: groups[0].abort(0, "peer gone"))
    timer.start()
    with pytest.raises(CollectiveAborted, match="peer gone"):
        b.finish(list(model.parameters()), lambda pending: pending.wait())
    assert b._buffers == [None] * len(b.buckets) and not b._pending
    _backward(model, 0)  # the next step on an aborted group: the hooks do not raise into backward
    with pytest.raises(CollectiveAborted):
        b.finish(list(model.parameters()), lambda pending: pending.wait())
    # let the stranded collectives of rank 0 finish so nothing hangs at teardown
    other = _model()
    b1 = _buckets(other, ranks[1], exact=False)
    _backward(other, 1)
    b1.finish(list(other.parameters()), lambda pending: pending.wait())


def test_a_known_view_change_stops_the_issue_and_two_backwards_are_refused() -> None:
    model = _model()
    b = GradientBuckets(model.parameters(), issue=lambda t, op: None, rank_world=lambda: (0, 1))
    _backward(model, 0)
    assert b.finish(list(model.parameters()), lambda pending: None) is False
    # the step is redone after the recovery: one backward is a fresh step, not a second one
    _backward(model, 0)
    assert b.finish(list(model.parameters()), lambda pending: None) is False
    _backward(model, 0)
    model(torch.randn(2, 32)).sum().backward()  # accumulation: a second backward in one step
    with pytest.raises(ConfigError, match="gradient accumulation"):
        b.finish(list(model.parameters()), lambda pending: None)
    with pytest.raises(ConfigError, match="other parameters"):
        b.finish(list(model.parameters())[1:], lambda pending: None)
