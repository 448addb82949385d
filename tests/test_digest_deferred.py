"""The replicas' comparison after a recovery, deferred off the first step (background snapshots): the
first step runs no collective of the check and hashes nothing; the state its commit captured is hashed
on a thread while the next step computes and compared at that step's all-reduce of gradients. A replica
restored wrong (one byte of its state changed after the recovery) still raises ``ReplicaMismatch``,
naming the entry and the rank, for the state of the first commit after the recovery. (A difference the
first step erases, say a last mantissa bit of an Adam moment that ``0.9 * m + 0.1 * g`` rounds away,
is not reported: the replicas are identical at the compared step.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.checks import ReplicaChecks
import gossiprec.trainer.state.digest as digest_module
from gossiprec.trainer.state.digest import PendingDigest, ReplicaMismatch, SnapshotDigest, digest_of_snapshot, gmac32
from gossiprec.trainer.state.header import tensor_bytes
from gossiprec.trainer.state.snapshots import Snapshots

TARGET = 6
"""The step the recovery resumes at: the first step after it is 7, the comparison runs in step 8."""


class Position:
    def __init__(self) -> None:
        self.index = TARGET

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = sd["index"]


_SEEDED = threading.Lock()
"""Ranks in threads share torch's global generator: build one rank's model at a time."""


def _rank_objects() -> tuple[torch.nn.Module, torch.optim.Optimizer, Position, dict[str, Any]]:
    with _SEEDED:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = Position()
    for p in model.parameters():  # optimizer state exists: the recovery restored a trained state
        p.grad = torch.ones_like(p)
    opt.step()
    return model, opt, data, training_state(model, opt, data=data, rng=False)


def _run(corrupt: str | None, world: int = 2) -> tuple[list[BaseException | None], list[list[int]]]:
    """``world`` ranks (threads) recover at ``TARGET``, then train two steps the way the trainer's loop
    does (all-reduce -> checks -> optimizer step -> commit). Rank 1 changes one byte of ``corrupt``
    right after the recovery. Returns each rank's error and, per rank, the steps at which the check
    ran a collective."""
    barrier = threading.Barrier(world)
    parts: dict[int, torch.Tensor] = {}
    errors: list[BaseException | None] = [None] * world
    calls: list[list[int]] = [[] for _ in range(world)]

    def rank(r: int) -> None:
        model, opt, data, objects = _rank_objects()
        snaps = Snapshots(objects, background=True, copies=1)  # (owned by this thread, as the loop's)
        checks = ReplicaChecks(objects, snaps, enabled=True, every=0)
        checks.groups = (tuple(range(world)),)
        step = TARGET

        def collective(t: torch.Tensor, op: str) -> bool:
            calls[r].append(step + 1)
            parts[r] = t.clone()
            barrier.wait()
            total = sum(parts.values())
            barrier.wait()
            t.copy_(total)
            return True

        try:
            snaps.commit(TARGET)  # what the recovery commits (the receiver) or holds (a survivor)
            checks.expect("after the recovery into epoch 1", TARGET, overlap=True, defer=True)
            if r == 1 and corrupt is not None:  # restored wrong: one byte of one tensor
                t = dict(model.named_parameters()).get(corrupt)
                if t is None:
                    t = opt.state[model[0].weight][corrupt]
                tensor_bytes(t)[3] ^= 0x01  # (float32: an exponent bit of element 0, x4 or /4)
            for _ in range(2):
                for p in model.parameters():
                    p.grad = torch.full_like(p, 0.5)  # the averaged gradients: equal on every rank
                snaps.settle()
                snaps.update_late(list(model.parameters()))
                if checks.pending:
                    checks.run(collective, r, world)
                opt.step()
                data.index += 1
                step += 1
                snap = snaps.commit(step)
                checks.commit_taken(step, snap)
        except BaseException as exc:  # noqa: BLE001 (reported to the test)
            errors[r] = exc
            if not isinstance(exc, ReplicaMismatch):  # (every rank raises that one, after the same collectives)
                barrier.abort()
        finally:
            snaps.close()

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return errors, calls


@pytest.mark.parametrize("corrupt", ["0.weight", "1.bias", "exp_avg"])
def test_a_replica_restored_wrong_raises_at_the_second_step_for_the_first_commit(corrupt: str) -> None:
    errors, calls = _run(corrupt)
    # no collective of the check in the first step (7); the comparison (the summary, then the full rows
    # that name the entries) runs at step 8's all-reduce, before its optimizer step
    assert calls == [[TARGET + 2] * 2] * 2, calls
    assert all(isinstance(e, ReplicaMismatch) for e in errors), errors
    e = errors[0]
    assert isinstance(e, ReplicaMismatch)
    # the state compared is the first commit's after the recovery (step 7), and rank 1 is named; a moment
    # restored wrong has moved its parameter in that step too
    entries = (f"model/{corrupt}",) if corrupt != "exp_avg" else ("model/0.weight", "optimizer/state/0/exp_avg")
    assert (e.step, e.entries, e.ranks) == (TARGET + 1, entries, (1,))
    assert (f"replicas hold different state at step {TARGET + 1} (after the recovery into epoch 1, as its "
            f"first step {TARGET + 1} committed it): {entries[0]} (ranks [1])") in str(e)


def test_identical_replicas_pass_with_one_collective_in_the_second_step() -> None:
    errors, calls = _run(None, world=3)
    assert errors == [None, None, None]
    assert calls == [[TARGET + 2]] * 3


def test_the_snapshot_digest_equals_the_live_one_and_names_the_same_entries() -> None:
    model, opt, data, objects = _rank_objects()
    snaps = Snapshots(objects, background=True, copies=1)
    snaps.update_late(list(model.parameters()))
    snap = snaps.commit(3)  # the late tensors' copies run on the copier's thread
    digest = SnapshotDigest(snap, lambda: snaps.copier.wait(take=False)).result()
    snaps.settle()
    # what a rank whose commit holds live views computes instead (the same values: one comparison)
    assert digest == PendingDigest(objects, 3, late=snaps.late, hasher=gmac32).result()
    crc = digest_of_snapshot(snaps.commit(3, checksum=True))
    assert digest.names == crc.names and digest.values != crc.values
    snaps.close()


def test_gmac32_is_a_checksum_of_the_bytes_in_pieces_too(monkeypatch: pytest.MonkeyPatch) -> None:
    data = bytearray(range(256)) * 40
    value = gmac32(memoryview(data))
    assert value == gmac32(memoryview(bytes(data))) and 0 <= value < 2 ** 32
    data[5000] ^= 0x80
    assert gmac32(memoryview(data)) != value
    monkeypatch.setattr(digest_module, "GMAC_PIECE", 4096)  # (the real piece is 1 GiB)
    pieces = gmac32(memoryview(data))
    data[9000] ^= 0x01  # a byte of the last piece
    assert gmac32(memoryview(data)) != pieces


@pytest.mark.slow
def test_a_job_that_ends_after_the_first_step_compares_in_finish(tmp_path: Path) -> None:
    # the kill at step 5, one step after it: the comparison deferred to step 7's all-reduce never comes,
    # so finish() runs it, and every recovered rank's record says it passed
    env = {k: v for k, v in os.environ.items() if not k.startswith("GOSSIPREC_")}
    out = subprocess.run(
        [sys.executable, "-m", "gossiprec.bench.recovery", "--ranks", "2", "--hidden", "16", "--trials", "1",
         "--step-ms", "30", "--kill-at", "5", "--post-steps", "1", "--trial-timeout", "90", "--json",
         "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=150, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    trial = json.loads(out.stdout)["per_trial"][0]
    assert trial["error"] is None and trial["final_step"] == [6] and trial["replicas_identical"] is True
    assert trial["first_step_s"] is not None and trial["second_step_s"] is None  # (no second step)
    records = [json.loads(line) for line in (tmp_path / "trial0" / "timeline.jsonl").read_text().splitlines()]
    digests = {r["role"]: r["digest"] for r in records if r["kind"] == "recovery"}
    assert digests == {"donor": "ok", "receiver": "ok"}, digests
