"""The host memory of commits: two copies, one copy in place, or none (live views), and what each serves.

Each test drives :class:`~gossiprec.trainer.state.snapshots.Snapshots` as the training loop does (commit, the
next step's forward and backward, the settle before the optimizer step) and checks which steps can be
served or reloaded at every moment, bit for bit against a full copy, and the host bytes each mode keeps.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
import torch

from gossiprec.errors import ConfigError, RecoveryError
from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.snapshots import Snapshots


class Cursor:
    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, Any]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.index = int(sd["index"])


def _job(hidden: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer, Cursor, dict[str, Any]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(0.2), torch.nn.Linear(hidden, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cursor = Cursor()
    return model, opt, cursor, training_state(model, opt, data=cursor)


def _backward(model: torch.nn.Module, opt: torch.optim.Optimizer, cursor: Cursor) -> None:
    """Forward and backward: moves BatchNorm statistics, the RNG and the data position, not the
    parameters or the optimizer state."""
    opt.zero_grad()
    model(torch.randn(8, 16)).pow(2).mean().backward()
    cursor.index += 1


def _state(objects: dict[str, Any], step: int) -> bytes:
    return capture_state(objects, step=step, checksum=False).payload()


def _step(snaps: Snapshots, model: torch.nn.Module, opt: torch.optim.Optimizer, cursor: Cursor,
          step: int) -> None:
    """One step of the loop from commit ``step - 1``: compute, settle, optimizer step, commit."""
    _backward(model, opt, cursor)
    snaps.settle()
    if snaps.background:
        snaps.update_late([p for p in model.parameters() if p.requires_grad])
    opt.step()
    snaps.commit(step)


def _state_bytes(objects: dict[str, Any]) -> int:
    return capture_state(objects, step=0, checksum=False).header.total_nbytes


@pytest.mark.parametrize("copies", [2, 1, 0])
def test_each_mode_serves_the_last_commit_bit_for_bit(copies: int) -> None:
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=copies)
    snaps.commit(0)
    for step in range(1, 4):
        _step(snaps, model, opt, cursor, step)
    committed = _state(objects, 3)
    _backward(model, opt, cursor)  # step 4 computes (no optimizer step yet): then a failure
    snap = snaps.at(3)
    assert snap is not None and snap.payload() == committed
    snaps.begin_recovery()
    snaps.restore(snap)  # undoes the RNG, BatchNorm and cursor of step 4
    assert _state(objects, 3) == committed
    assert snaps.steps() == ([2, 3] if copies == 2 else [3])


def test_host_memory_is_two_one_or_almost_no_copies() -> None:
    kept = {}
    for copies in (2, 1, 0):
        model, opt, cursor, objects = _job(hidden=256)
        snaps = Snapshots(objects, background=True, copies=copies)
        snaps.commit(0)
        for step in range(1, 4):
            _step(snaps, model, opt, cursor, step)
        snaps.settle()
        kept[copies] = snaps.host_bytes()
        total = _state_bytes(objects)
    late = sum(p.nbytes * 3 for p in model.parameters())  # parameters, exp_avg, exp_avg_sq
    assert kept[2] == 2 * kept[1] and 0.99 * total <= kept[1] <= total
    assert kept[0] <= total - late  # only buffers, RNG and data position are copied
    assert kept[0] < kept[1] / 10


def test_one_copy_keeps_the_previous_step_when_the_view_change_is_already_known() -> None:
    # a commit that finds a newer view: no optimizer step comes before the recovery, so the copy of the
    # previous step stays and this step is held as the live tensors: a plan may name either
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=1)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    _backward(model, opt, cursor)
    snaps.settle()
    snaps.update_late(list(model.parameters()))
    s1 = snaps.at(1)
    assert s1 is not None
    one = s1.payload()
    opt.step()
    snaps.commit(2, keep_previous=True)
    two = _state(objects, 2)
    late = sum(p.nbytes * 3 for p in model.parameters())  # parameters, exp_avg, exp_avg_sq: not copied again
    assert snaps.steps() == [1, 2] and snaps.host_bytes() <= 2 * _state_bytes(objects) - late
    at2 = snaps.at(2)
    assert at2 is not None and at2.payload() == two  # served from the live tensors
    s1b = snaps.at(1)
    assert s1b is not None and s1b.payload() == one
    snaps.begin_recovery()
    snaps.restore(s1b)  # the plan resumes at 1: back to it
    assert _state(objects, 1) == one
    assert snaps.at(2) is None and snaps.steps() == [1]  # the live tensors no longer hold step 2
    _step(snaps, model, opt, cursor, 2)  # training goes on into the one copy
    assert snaps.steps() == [2] and snaps.held[0].live == ()


def test_one_copy_gives_up_the_previous_step_once_its_buffer_is_rewritten() -> None:
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=1)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    _step(snaps, model, opt, cursor, 2)
    assert snaps.at(1) is None and snaps.steps() == [2]


def test_no_copies_holds_the_live_state_until_the_next_optimizer_step() -> None:
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=0)
    assert not snaps.background  # nothing to copy in the background
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    committed = _state(objects, 1)
    snap = snaps.at(1)
    assert snap is not None and snap.live and snap.payload() == committed
    _backward(model, opt, cursor)
    assert snaps.at(1) is not None  # forward and backward leave it valid
    opt.step()  # the optimizer step of step 2 overwrites it: only a roll forward (commit 2) helps now
    assert snaps.at(1) is None and snaps.steps() == []
    snaps.commit(2)
    assert snaps.steps() == [2]


def test_a_checksummed_commit_of_live_tensors_carries_their_crcs() -> None:
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=0)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    snap = snaps.commit(2, checksum=True)
    assert snap.live and snap.header == capture_state(objects, step=2, checksum=True).header


def test_snapshot_copies_is_validated() -> None:
    assert TrainerConfig(snapshot_copies=1).snapshot_copies == 1
    for bad in (3, -1, True, "1"):
        with pytest.raises(ConfigError, match="snapshot_copies"):
            TrainerConfig(snapshot_copies=bad)  # type: ignore[arg-type]
    with pytest.raises(ConfigError):
        Snapshots({}, background=True, copies=5)


class _Control:
    """The control calls a committing trainer makes, recorded."""

    path = "/nonexistent"
    node = "n0"

    def __init__(self) -> None:
        self.states: list[tuple[int, int | None]] = []

    def set_state(self, step: int, inflight: int | None = None, *_: Any, wait: bool = False) -> None:
        self.states.append((step, inflight))

    def report(self, *_: Any, **__: Any) -> None:
        pass


def test_a_commit_that_keeps_the_previous_step_reports_both_to_the_election() -> None:
    # committed = the kept copy, inflight = this step (StateReport.servable): the election then resumes
    # at the newest step every replica group holds, and the report hold (trainer still "finishing")
    # waits for the recovery to begin
    from gossiprec.trainer.loop import ResilientTrainer

    model, opt, cursor, objects = _job()
    control = _Control()
    rt = ResilientTrainer(objects, TrainerConfig(snapshot_copies=1), control=control,  # type: ignore[arg-type]
                          key=bytes(32))
    rt._commit_snapshot(0)
    for _ in range(2):
        _backward(model, opt, cursor)
        rt.snapshots.settle()
        rt.snapshots.update_late(list(model.parameters()))
        opt.step()
        rt.commit()
    assert control.states == [(0, None), (1, None), (2, None)]
    _backward(model, opt, cursor)
    rt.snapshots.settle()
    opt.step()
    rt._follower.newest_group = 1  # a newer view is known when step 3 commits
    rt.commit()
    assert control.states[-1] == (2, 3) and rt.step == 3 and rt.snapshots.steps() == [2, 3]
    rt.snapshots.begin_recovery()
    snap = rt.snapshots.at(2)
    assert snap is not None
    rt.snapshots.restore(snap)  # the plan resumes at 2: step 3 is gone, and the agent is told
    assert control.states[-1] == (2, None) and rt.snapshots.steps() == [2]
    rt.close()


def test_one_copy_being_written_is_served_only_once_complete(monkeypatch: pytest.MonkeyPatch) -> None:
    # a donor asks for the last commit while the copier thread is still writing it into the one copy:
    # it waits for the copy and gets the whole step, never a half-written buffer
    import threading

    from gossiprec.trainer.state import capture, snapshots

    model, opt, cursor, objects = _job(hidden=256)
    snaps = Snapshots(objects, background=True, copies=1)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    gate, started = threading.Event(), threading.Event()
    run = capture.DeferredCopies.run

    def slow_run(self: capture.DeferredCopies) -> None:
        started.set()
        gate.wait(10)
        run(self)

    monkeypatch.setattr(capture.DeferredCopies, "run", slow_run)
    monkeypatch.setattr(snapshots, "BACKGROUND_MIN_BYTES", 0)  # to the thread at once
    _backward(model, opt, cursor)
    snaps.settle()
    snaps.update_late(list(model.parameters()))
    opt.step()
    snaps.commit(2)
    committed = _state(objects, 2)
    assert started.wait(10)  # the thread is inside the copy
    served: list[bytes] = []

    def donor() -> None:
        snap = snaps.at(2)
        served.append(snap.payload() if snap is not None else b"")

    t = threading.Thread(target=donor)
    t.start()
    t.join(0.2)
    assert t.is_alive() and not served  # waits for the copy
    gate.set()
    t.join(10)
    assert served == [committed]


def test_one_torn_copy_leaves_nothing_and_the_next_commit_copies_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    from gossiprec.errors import RecoveryError
    from gossiprec.trainer.state import snapshots

    monkeypatch.setattr(snapshots, "BACKGROUND_MIN_BYTES", 0)
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=1)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    _backward(model, opt, cursor)
    snaps.settle()
    snaps.update_late(list(model.parameters()))
    opt.step()
    snaps.commit(2)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)  # changed before the copy finished: the one copy is torn
    with pytest.raises(RecoveryError, match="background_snapshot=False"):
        snaps.settle()
    assert snaps.steps() == [] and not snaps.background
    snaps.commit(3)  # everything inside the commit now
    snap = snaps.at(3)
    assert snap is not None and snap.payload() == _state(objects, 3)


def test_a_donor_asking_during_a_reload_of_live_tensors_waits_and_gets_them(monkeypatch: pytest.MonkeyPatch) -> None:
    # reloading a live snapshot copies each live tensor onto itself, which moves its version counter; a
    # donor thread asking in that moment must wait for the record to be taken again, not be refused
    import threading

    from gossiprec.trainer.state import snapshots

    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=True, copies=0)
    snaps.commit(0)
    _step(snaps, model, opt, cursor, 1)
    committed = _state(objects, 1)
    _backward(model, opt, cursor)
    snaps.begin_recovery()
    real = snapshots.restore_state
    got: list[Any] = []
    asking: list[threading.Thread] = []

    def restore_and_ask(*args: Any, **kwargs: Any) -> int:
        copied = real(*args, **kwargs)  # counters moved: valid() would say no right now
        t = threading.Thread(target=lambda: got.append(snaps.at(1)))
        t.start()
        t.join(0.1)
        assert t.is_alive()  # blocked until the restore has taken the record again
        asking.append(t)
        return copied

    monkeypatch.setattr(snapshots, "restore_state", restore_and_ask)
    snap = snaps.at(1)
    assert snap is not None
    snaps.restore(snap)
    asking[0].join(10)
    assert got[0] is not None and got[0].payload() == committed


# --- one copy in a sharded job: the last commit held live until the commit barrier ------------------------
def _sharded_step(snaps: Snapshots, model: torch.nn.Module, opt: torch.optim.Optimizer, cursor: Cursor,
                  step: int) -> None:
    """A sharded step from commit ``step - 1``: the commit barrier passed (harden), compute (forward and
    backward), optimizer step, commit (a sharded job has no background copies)."""
    snaps.harden()
    _backward(model, opt, cursor)
    opt.step()
    snaps.commit(step)


def _sharded_job() -> tuple[torch.nn.Module, torch.optim.Optimizer, Cursor, dict[str, Any], Snapshots]:
    model, opt, cursor, objects = _job()
    snaps = Snapshots(objects, background=False, copies=1)
    snaps.hold_live = True
    snaps.commit(0)
    return model, opt, cursor, objects, snaps


def test_a_sharded_commit_holds_its_step_live_beside_the_previous_copy_until_harden() -> None:
    model, opt, cursor, objects, snaps = _sharded_job()
    _sharded_step(snaps, model, opt, cursor, 1)
    one = _state(objects, 1)
    _sharded_step(snaps, model, opt, cursor, 2)
    two = _state(objects, 2)
    late = sum(p.nbytes * 3 for p in model.parameters())  # parameters, exp_avg, exp_avg_sq: held live
    assert snaps.steps() == [1, 2] and snaps.kept_previous() == 1
    assert snaps.host_bytes() <= _state_bytes(objects) + (_state_bytes(objects) - late)  # 1x, and the small rest
    s1, s2 = snaps.at(1), snaps.at(2)
    assert s1 is not None and s1.payload() == one and s2 is not None and s2.payload() == two
    buffers = [t.data_ptr() for t in s1.tensors]
    _backward(model, opt, cursor)  # the next step's compute (BatchNorm, RNG, cursor move) ...
    assert snaps.harden() == 2  # ... after the barrier: step 2 is copied over step 1, into its buffers
    assert snaps.steps() == [2] and snaps.kept_previous() is None and snaps.harden() is None
    hard = snaps.at(2)
    assert hard is not None and hard.payload() == two and hard.live == ()
    assert sum(p in buffers for p in (t.data_ptr() for t in hard.tensors)) >= len(list(model.parameters())) * 3
    assert snaps.host_bytes() <= _state_bytes(objects)
    opt.step()  # the optimizer may move the tensors now: the copy stays step 2
    hard = snaps.at(2)
    assert hard is not None and hard.payload() == two


def test_harden_refuses_a_live_step_whose_tensors_changed_after_its_commit() -> None:
    model, opt, cursor, objects, snaps = _sharded_job()
    zero = _state(objects, 0)
    _sharded_step(snaps, model, opt, cursor, 1)
    with torch.no_grad():
        next(model.parameters()).mul_(2.0)  # written between two steps, outside the optimizer step
    with pytest.raises(RecoveryError, match="snapshot_copies=2"):
        snaps.harden()
    assert snaps.steps() == [0]
    s0 = snaps.at(0)
    assert s0 is not None and s0.payload() == zero


def test_a_reload_of_the_older_copy_drops_the_live_step() -> None:
    model, opt, cursor, objects, snaps = _sharded_job()
    zero = _state(objects, 0)
    _sharded_step(snaps, model, opt, cursor, 1)
    s0 = snaps.at(0)
    assert s0 is not None
    snaps.begin_recovery()
    snaps.restore(s0)  # a plan resumed at 0 (another replica group never committed 1)
    assert _state(objects, 0) == zero and snaps.steps() == [0] and snaps.harden() is None
    _sharded_step(snaps, model, opt, cursor, 1)  # training goes on: 0 copied, 1 live
    assert snaps.steps() == [0, 1]


_FSDP_ROLLBACK = """
import json, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from gossiprec.trainer.collectives.managed import init_managed_world
from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.capture import capture_deferred, capture_state
from gossiprec.trainer.state.snapshots import Snapshots, late_tensors

init_managed_world(0, 1, timeout=10)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4), torch.nn.LayerNorm(4))
for block in (model[0], model[2]):
    fully_shard(block, mesh=mesh)
fully_shard(model, mesh=mesh)  # the LayerNorm: parameters at the root
opt = torch.optim.AdamW(model.parameters(), lr=0.01)
objects = training_state(model, opt)

def step(k):
    model(torch.full((2, 4), float(k))).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()

def state():
    return capture_state(objects, step=0, checksum=False).payload()

step(0)  # the optimizer's state exists
snaps = Snapshots(objects, background=False, copies=1)
snaps.hold_live = True
snaps.commit(0)
step(1)
snaps.commit(1)  # step 1 held live beside the copy of step 0
one = state()
live = snaps.held[-1]
out = {"owners": sum(o is not None for o in getattr(live, "owners", ())), "live": len(live.live)}
assert snaps.harden() == 1  # at step 2's optimizer step (every rank committed 1): 1 copied over 0
step(2)
out["live_valid_after_step"] = live.valid()
snaps.commit(2)  # 1 (copy) and 2 (live)
snaps.begin_recovery()  # a plan resumes at 1: another replica group never committed 2
hard = snaps.at(1)
snaps.restore(hard)
out["restored"] = state() == one
out["steps"] = snaps.steps()
params = [p for g in opt.param_groups for p in g["params"]]
_, deferred = capture_deferred(objects, step=3, defer=late_tensors(objects, params))
step(3)  # the optimizer step before the background copies ran: a torn snapshot
out["modified"] = len(deferred.modified())
print(json.dumps(out))
"""


def test_fsdp2_rollback_to_the_older_copy_restores_parameters_and_moments() -> None:
    """FSDP2's DTensors: the optimizer step moves the DTensor's in-place version counter, not its local
    shard's, so a reload that skipped tensors "unchanged since the snapshot" by the shard's counter kept
    the newer step's parameters and moments (with the older step counter): a rank rolled back from a
    commit its replica group made and the other group did not trained on from a mix of two steps. The
    same counter makes a live snapshot invalid after the optimizer step and finds a torn background copy."""
    import subprocess
    import sys
    from pathlib import Path

    out = subprocess.run([sys.executable, "-c", _FSDP_ROLLBACK], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    # 6 parameters held live, each with exp_avg and exp_avg_sq: shards of DTensors; their step counters are not
    assert (res["owners"], res["live"]) == (18, 24), res
    assert res["live_valid_after_step"] is False, res
    assert res["restored"] is True and res["steps"] == [1], res
    assert res["modified"] == res["live"], res
