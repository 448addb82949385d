"""Cross-replica state digests: the same state gives the same digest however it is computed, and a
mismatch names the entries and the ranks that differ (the trainer-level checks run end to end in
``tests/test_recovery_faults.py``)."""

from __future__ import annotations

import random

import pytest
import torch

from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.state.digest import (
    PendingDigest, ReplicaMismatch, StateDigest, describe, differing_groups, digest_of_snapshot, rows_tensor,
    tree_entries,
)
from gossiprec.trainer.objects import training_state


class Position:
    def __init__(self) -> None:
        self.index = 7

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = sd["index"]


def _objects(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.BatchNorm1d(5), torch.nn.Linear(5, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 6)).sum().backward()
    opt.step()
    return model, opt, training_state(model, opt, data=Position())


def test_the_threaded_digest_equals_the_checksummed_snapshots() -> None:
    model, opt, objects = _objects()
    late = {p.data_ptr() for p in model.parameters()} | {v.data_ptr() for st in opt.state.values()
                                                          for v in st.values()}
    threaded = PendingDigest(objects, 3, late=late).result()
    direct = PendingDigest(objects, 3).result()
    snap = digest_of_snapshot(capture_state(objects, step=3, checksum=True))
    assert threaded == direct == snap
    assert "model/1.running_mean" in snap.names and "rng/python" in snap.names and "data/index" in snap.names
    random.random()  # one draw moves the Python generator, and only that entry
    moved = PendingDigest(objects, 3).result()
    assert [n for n, a, b in zip(snap.names, snap.values, moved.values, strict=True) if a != b] == ["rng/python"]
    assert moved.summary()[:2] == snap.summary()[:2] and moved.summary()[2] != snap.summary()[2]


def test_tree_entries_split_each_object_by_its_top_level_keys() -> None:
    names = [n for n, _ in tree_entries({"data": {"index": 3, "epoch": 1}, "scalar": 5})]
    assert names == ["data/index", "data/epoch", "scalar"]


def test_only_groups_whose_rows_differ_are_reported() -> None:
    rows = torch.stack([rows_tensor((3, 1, v), r, 4)[r] for r, v in enumerate((9, 9, 4, 5))])
    assert differing_groups(rows, [(0, 1), (2, 3)]) == [(2, 3)]
    assert differing_groups(rows, [(0,), (1,), (2,), (3,)]) == []  # no replica: nothing to compare


def test_a_mismatch_names_the_entries_and_the_odd_ranks_out() -> None:
    digest = StateDigest(4, ("model/w", "optimizer/state/0/exp_avg", "rng/numpy"), (1, 2, 3))
    full = torch.tensor([[1, 2, 3], [1, 2, 3], [1, 2, 8], [1, 2, 3],   # group (0..3): rank 2's numpy differs
                         [5, 6, 7], [5, 0, 7]])                          # group (4, 5): a tie, rank 5 is named
    err = describe(digest, full, [(0, 1, 2, 3), (4, 5)], "after the recovery into epoch 2")
    assert isinstance(err, ReplicaMismatch) and err.step == 4
    assert err.entries == ("rng/numpy", "optimizer/state/0/exp_avg") and err.ranks == (2, 5)
    msg = str(err)
    assert msg.startswith("replicas hold different state at step 4 (after the recovery into epoch 2): "
                          "rng/numpy (ranks [2]), optimizer/state/0/exp_avg (ranks [5])")
    assert "seed every random generator alike" in msg and ".data" in msg


def test_digest_of_snapshot_needs_checksums() -> None:
    _, _, objects = _objects()
    with pytest.raises(ValueError, match="checksum=True"):
        digest_of_snapshot(capture_state(objects, step=0, checksum=False))


def test_a_digest_less_excluded_entries() -> None:
    d = StateDigest(2, ("model/bn.running_mean", "model/w", "rng/numpy"), (1, 2, 3))
    assert d.without(()) is d
    assert d.without(("model/bn.", "rng/")) == StateDigest(2, ("model/w",), (2,))


class _World:
    """``n`` ranks in threads whose collective sums a tensor over all of them (an all-reduce)."""

    def __init__(self, n: int) -> None:
        import threading

        self.n = n
        self.barrier = threading.Barrier(n)
        self.parts: dict[int, torch.Tensor] = {}
        self.calls: list[tuple[int, tuple[int, ...]]] = []

    def collective(self, rank: int):  # type: ignore[no-untyped-def]
        def allreduce(t: torch.Tensor, op: str) -> bool:
            assert op == "sum"
            self.calls.append((rank, tuple(t.shape)))
            self.parts[rank] = t.clone()
            self.barrier.wait()
            shapes = {tuple(p.shape) for p in self.parts.values()}
            assert len(shapes) == 1, f"ranks all-reduce different shapes {shapes}"  # gloo would abort here
            total = sum(self.parts.values())
            self.barrier.wait()
            t.copy_(total)
            return True
        return allreduce


def _run_checks(objects_per_rank: list[dict], groups: tuple[tuple[int, ...], ...]) -> list[BaseException | None]:
    import threading

    from gossiprec.trainer.state.checks import ReplicaChecks
    from gossiprec.trainer.state.snapshots import Snapshots

    world = _World(len(objects_per_rank))
    out: list[BaseException | None] = [None] * world.n

    def rank(r: int) -> None:
        checks = ReplicaChecks(objects_per_rank[r], Snapshots(objects_per_rank[r], background=True), enabled=True,
                               every=0)
        checks.groups = groups
        checks.expect("at the start", 0, overlap=False)
        try:
            checks.run(world.collective(r), r, world.n)
        except BaseException as exc:  # noqa: BLE001 (reported to the test)
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world.n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out


def test_groups_with_different_entry_counts_compare_in_one_width() -> None:
    # group (0, 1) trains a bigger model than group (2, 3) (shards of different shapes): a value differs
    # in group (2, 3), so every rank sends its full rows, in one width for all
    big = [_objects(seed=0)[2] for _ in range(2)]
    small = []
    for r in range(2):
        torch.manual_seed(0)
        model = torch.nn.Linear(3, 2)
        if r == 1:
            with torch.no_grad():
                model.bias.add_(1.0)
        small.append({"model": model, "data": Position()})
    errors = _run_checks(big + small, ((0, 1), (2, 3)))
    assert all(isinstance(e, ReplicaMismatch) for e in errors), errors
    assert [(e.entries, e.ranks) for e in errors] == [((), (2, 3))] * 2 + [(("model/bias",), (3,))] * 2  # type: ignore[union-attr]


def test_identical_replicas_pass_with_one_small_collective() -> None:
    errors = _run_checks([_objects(seed=0)[2] for _ in range(3)], ((0, 1, 2),))
    assert errors == [None, None, None]
