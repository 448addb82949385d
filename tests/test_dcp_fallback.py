"""DCP checkpoints (gossiprec.trainer.checkpoint.DcpCheckpoints) for what recovery in place cannot cover.

Without processes: which checkpoint is complete (a torn one, a missing marker or file, a directory still
under its temporary name: the previous complete one is the newest), retention, and a save and load of
real objects (an optimizer that never stepped gets its state without running its step hooks).

Sharded jobs (4 ranks of a 2 x 2 mesh, the harness's trainers, real agents):

- every holder of shard 0 killed at once (ranks 0 and 2 of the HSDP mesh, two spares): the plan is
  ``checkpoint``, every rank loads the newest complete DCP checkpoint through ``on_no_replica``, and the
  job ends byte-identical to the failure-free run (batches are functions of the step: the steps redone
  give the same state), its records saying the steps lost;
- a job with no spare loses a rank and stops (exit 75); the same job started again (fresh processes,
  the same checkpoint directory) resumes from the newest complete checkpoint and ends byte-identical to
  the failure-free run.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Iterator

import pytest

from gossiprec.errors import ConfigError
from gossiprec.harness.faults import Fault
from gossiprec.trainer.checkpoint import MARKER, DcpCheckpoints
from gossiprec.trainer.exits import JobStopped
from gossiprec.trainer.recovery import NoReplica
from tests.support.sharded import STEPS, reference as _reference


# ------------------------------------------------------------------------------------------ no processes
def _fake(ck: DcpCheckpoints, step: int, files: dict[str, bytes] | None = None, *, marker: bool = True,
          temp: bool = False) -> Path:
    """A checkpoint directory of ``step`` as a save leaves it (``marker``: completed; ``temp``: still
    under its temporary name)."""
    files = files if files is not None else {".metadata": b"m" * 10, "__0_0.distcp": b"x" * 100}
    path = ck.directory / f".tmp-step-{step:08d}" if temp else ck.path(step)
    path.mkdir(parents=True)
    for name, data in files.items():
        (path / name).write_bytes(data)
    if marker:
        (path / MARKER).write_text(json.dumps({"step": step, "files": {n: len(d) for n, d in files.items()}}))
    return path


def test_only_complete_checkpoints_count(tmp_path: Path) -> None:
    ck = DcpCheckpoints(tmp_path / "ck", every=2)
    assert ck.latest() is None and ck.steps() == []  # no directory yet
    _fake(ck, 2)
    _fake(ck, 4)
    assert ck.steps() == [2, 4] and ck.latest() == 4
    _fake(ck, 6, temp=True)  # still under its temporary name (rank 0 died before the rename)
    assert ck.latest() == 4
    _fake(ck, 8, marker=False)  # renamed by hand, never completed
    assert ck.latest() == 4
    torn = _fake(ck, 10)
    (torn / "__0_0.distcp").unlink()  # a shard file missing
    assert ck.latest() == 4
    short = _fake(ck, 12)
    (short / "__0_0.distcp").write_bytes(b"x" * 50)  # cut short
    assert ck.latest() == 4
    other = _fake(ck, 14)
    (other / MARKER).write_text(json.dumps({"step": 13, "files": {".metadata": 10}}))  # another step's marker
    (ck.directory / "step-00000016").mkdir()
    (ck.directory / "step-00000016" / MARKER).write_text("{not json")
    assert ck.latest() == 4 and ck.steps() == [2, 4]
    assert not ck.complete(6) and not ck.complete(8) and ck.complete(4)
    for bad in ({"every": -1}, {"every": 1.5}, {"keep": 0}, {"keep": True}):
        with pytest.raises(ConfigError):
            DcpCheckpoints(tmp_path, **bad)  # type: ignore[arg-type]


class _FakeRank:
    """What DcpCheckpoints reads of a ResilientTrainer, for a data-parallel rank (no mesh)."""

    def __init__(self, objects: dict[str, Any], rank: int = 0) -> None:
        self.objects, self.rank, self.step, self.role, self.sharded = objects, rank, 0, "trainer", None
        self.epoch, self.records = 0, []  # type: ignore[var-annotated]
        self.phases: list[int] = []

    @contextlib.contextmanager
    def checkpointing(self) -> Iterator[None]:
        self.phases.append(self.step)
        yield


def _objects(seed: int) -> dict[str, Any]:
    import torch

    from gossiprec.trainer.objects import JobState

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    job = JobState()
    job.world_size = 2
    return {"model": model, "optimizer": opt, "gossiprec": job}


def _train(objects: dict[str, Any], steps: int) -> None:
    import torch

    for s in range(steps):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(s))
        objects["model"](x).pow(2).mean().backward()
        objects["optimizer"].step()
        objects["optimizer"].zero_grad()


def _tensors(objects: dict[str, Any]) -> list[Any]:
    opt = objects["optimizer"]
    out = [p.detach().clone() for p in objects["model"].parameters()]
    for p in objects["model"].parameters():
        out += [v.clone() for v in opt.state[p].values()]
    return out


def test_save_keeps_the_newest_and_a_fresh_optimizer_loads_without_stepping(tmp_path: Path) -> None:
    import torch

    ck = DcpCheckpoints(tmp_path / "ck", every=2, keep=2)
    objects = _objects(0)
    rank = _FakeRank(objects)
    for step in range(1, 8):
        _train(objects, 1)
        rank.step = step
        saved = ck.maybe_save(rank)  # type: ignore[arg-type]
        assert saved == (step if step % 2 == 0 else None)
        if step == 4:
            at4 = _tensors(objects)
    assert rank.phases == [2, 4, 6]  # inside rt.checkpointing()
    assert ck.maybe_save(rank) is None  # step 7: not a multiple
    rank.step = 6
    assert ck.maybe_save(rank) is None  # saved already
    assert ck.steps() == [4, 6] and sorted(os.listdir(ck.directory)) == ["step-00000004", "step-00000006"]
    # a step reached by a recovery is not saved until the recovery's first step has committed (a spare
    # that took its rank in it goes on into its next step: it would not join the save)
    recovered = DcpCheckpoints(tmp_path / "after-recovery", every=2)
    rank.step, rank.epoch = 6, 3
    assert recovered.maybe_save(rank) is None and rank.phases == [2, 4, 6]  # type: ignore[arg-type]
    rank.records = [SimpleNamespace(epoch=2)]
    assert recovered.maybe_save(rank) is None  # type: ignore[arg-type]
    rank.records.append(SimpleNamespace(epoch=3))
    assert recovered.maybe_save(rank) == 6 and recovered.steps() == [6]  # type: ignore[arg-type]
    rank.epoch, rank.records = 0, []
    other = _FakeRank(objects, rank=1)
    other.step = 8
    assert DcpCheckpoints(ck.directory, every=1).save(other) == 8  # type: ignore[arg-type]
    assert ck.steps() == [4, 6]  # rank 1 of a data-parallel job writes nothing: rank 0 writes the replicated state
    abandoned = _fake(ck, 5, temp=True)  # a save cut short: its temporary directory stays behind

    fresh = _objects(1)  # other weights, and an optimizer that never stepped
    calls: list[str] = []
    fresh["optimizer"].register_step_pre_hook(lambda *_: calls.append("pre"))
    fresh["optimizer"].register_step_post_hook(lambda *_: calls.append("post"))
    fresh["gossiprec"].world_size = 0
    assert ck.on_no_replica(NoReplica(3, 0, 2, ((0, 1),), "test", objects=fresh)) == 6
    rank.step = 4  # (the loaded state is step 6's)
    ck.load(fresh, 4)
    got = _tensors(fresh)
    assert len(got) == len(at4) and all(torch.equal(a, b) for a, b in zip(got, at4))
    assert calls == [] and fresh["gossiprec"].world_size == 2  # no step hook ran; the trainer's entry came back
    # the state is laid out as a trained optimizer's (same keys, same order): snapshots compare it byte for byte
    trained = objects["optimizer"].state_dict()["state"]
    assert [list(v) for v in fresh["optimizer"].state_dict()["state"].values()] == [list(v) for v in trained.values()]
    _train(fresh, 1)
    assert calls == ["pre", "post"]  # the hooks are still there

    # the next save removes the abandoned directory and keeps the newest two
    rank.step = 8
    assert ck.save(rank) == 8  # type: ignore[arg-type]
    assert sorted(os.listdir(ck.directory)) == ["step-00000006", "step-00000008"] and not abandoned.exists()


def test_ranks_wait_for_each_others_files_until_a_failure_aborts_the_save(tmp_path: Path) -> None:
    import threading

    from gossiprec.trainer.checkpoint import _files_written
    from gossiprec.trainer.collectives.groups import CollectiveAborted

    (tmp_path / ".written-e3-1").touch()  # rank 1's file from a save of epoch 3, cut short
    aborted = threading.Event()
    threading.Timer(0.3, aborted.set).start()
    with pytest.raises(CollectiveAborted, match="interrupted"):
        _files_written(tmp_path, 4, 0, 2, aborted.is_set)  # epoch 4: the old file does not count
    threading.Timer(0.2, (tmp_path / ".written-e5-1").touch).start()
    _files_written(tmp_path, 5, 0, 2, lambda: False)  # returns once rank 1 has written
    assert sorted(os.listdir(tmp_path)) == [".written-e3-1", ".written-e4-0", ".written-e5-0", ".written-e5-1"]


def test_no_complete_checkpoint_stops_the_job(tmp_path: Path) -> None:
    ck = DcpCheckpoints(tmp_path / "none")
    _fake(ck, 3, marker=False)
    with pytest.raises(JobStopped, match="holds no complete checkpoint"):
        ck.on_no_replica(NoReplica(2, 0, 4, ((0, 2),), "shard 0 lost with every holder", objects={}))


# ------------------------------------------------------------------------------------------ sharded jobs
EVERY = 3
"""Checkpoints at steps 3 and 6 of the 9 steps."""


def _dcp_args(ck: Path, *more: str) -> tuple[str, ...]:
    return ("--model", "lm", "--dcp", str(ck), "--dcp-every", str(EVERY), *more)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["hsdp", "tp"])
def test_every_holder_of_a_shard_lost_loads_the_newest_checkpoint(layout: str, tmp_path: Path, ref_dir: Path) -> None:
    """Ranks 0 and 2 (both holders of shard 0: replica group (0, 2) of either mesh) die between steps 7
    and 8: no replica of that shard is left, so every rank of the new world (the two spares in their
    places) loads step 6's checkpoint and the job trains steps 7 to 9 again, ending as the failure-free run."""
    from gossiprec.harness.sharded import run_sharded

    ck = tmp_path / "ck"
    kills = [Fault("n0", "kill", 7, "committed"), Fault("n2", "kill", 7, "committed")]
    res = run_sharded(layout, STEPS, kills, spares=2, workdir=str(tmp_path / "job"), timeout=300.0,
                      trainer_args=_dcp_args(ck))
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [STEPS], (res, where)
    assert res["states"] == _reference(layout, ref_dir, "--model", "lm"), (res, where)
    loads = [r for r in res["records"] if r["action"] == "checkpoint"]
    assert loads and {r["role"] for r in loads} == {"checkpoint"}, (res["records"], where)
    last = max(r["epoch"] for r in loads)
    final = [r for r in loads if r["epoch"] == last]
    assert sorted(r["rank"] for r in final) == [0, 1, 2, 3], (final, where)
    assert {r["target_step"] for r in final} == {6}, (final, where)
    # the survivors had committed step 7: one step lost (the spares lost nothing: they held nothing)
    assert {r["rank"]: r["lost_steps"] for r in final} == {0: 0, 1: 1, 2: 0, 3: 1}, (final, where)
    assert {res["assignment"][0], res["assignment"][2]} == {"n4", "n5"}, (res, where)
    assert DcpCheckpoints(ck).steps() == [6, 9], (os.listdir(ck), where)  # step 9 saved after the reload


@pytest.mark.slow
@pytest.mark.parametrize("layout,more", [("hsdp", ()), ("tp", ()), ("hsdp", ("--seed-per-shard",))],
                         ids=["hsdp", "tp", "hsdp-seed-per-shard"])
def test_a_stopped_job_started_again_resumes_from_its_checkpoint(layout: str, more: tuple[str, ...], tmp_path: Path,
                                                                ref_dir: Path) -> None:
    """No spare: rank 3 dies after step 7, the plan stops the job and the survivors exit 75; step 6's
    checkpoint is the newest complete one. The same job started again (fresh processes and agents, the
    same checkpoint directory) resumes there and ends as the failure-free run. ``--seed-per-shard``: the
    RNG differs between the two shard ranks of a replica (their dropout masks differ; FSDP2 averages
    the gradients): each rank gets its own back, not one written for all."""
    from gossiprec.harness.sharded import run_sharded

    ck = tmp_path / "ck"
    first = run_sharded(layout, STEPS, [Fault("n3", "kill", 7, "committed")], spares=0,
                        workdir=str(tmp_path / "first"), timeout=300.0, trainer_args=_dcp_args(ck, *more), stops=True)
    where = f"(logs in {first['workdir']})"
    assert first["states"] == {}, (first, where)  # nobody finished
    exits = first["exits"]
    assert {n: exits[n] for n in ("n0", "n1", "n2")} == {"n0": 75, "n1": 75, "n2": 75} and exits["n3"], (first, where)
    assert DcpCheckpoints(ck).latest() == 6, (os.listdir(ck), where)
    # later saves that never completed are never loaded: one still under its temporary name (marker and
    # all), one renamed without its marker (each a copy of step 6's files: loaded, it would end elsewhere)
    torn = [ck / ".tmp-step-00000007", ck / "step-00000008"]
    for path in torn:
        shutil.copytree(ck / "step-00000006", path)
    (torn[1] / MARKER).unlink()
    again = run_sharded(layout, STEPS, spares=0, workdir=str(tmp_path / "again"), timeout=300.0,
                        trainer_args=_dcp_args(ck, *more))
    where = f"(logs in {again['workdir']})"
    assert again["final_step"] == [STEPS], (again, where)
    assert again["resumed"] == {r: 6 for r in range(4)}, (again, where)
    assert again["states"] == _reference(layout, ref_dir, "--model", "lm", *more), (again, where)
    # the restarted run trained steps 7 to 9 only, and saved step 9
    assert {r: [s for s, _ in c] for r, c in again["commits"].items()} == {r: [7, 8, 9] for r in range(4)}, where
    assert sorted(os.listdir(ck)) == ["step-00000006", "step-00000009"], (os.listdir(ck), where)  # torn ones removed


@pytest.mark.slow
def test_a_rank_lost_during_a_save_leaves_it_torn_and_the_job_recovers(tmp_path: Path, ref_dir: Path) -> None:
    """Rank 1 dies as step 6's save begins, while the others wait in DCP's first collective: their save
    is interrupted (it returns None), the next step recovers in place (the spare takes rank 1 from rank
    3, nothing committed lost), step 6 is never complete, and step 9's save removes its torn directory."""
    from gossiprec.harness.sharded import run_sharded

    ck = tmp_path / "ck"
    res = run_sharded("hsdp", STEPS, [Fault("n1", "kill", 6, "checkpoint")], spares=1,
                      workdir=str(tmp_path / "job"), timeout=300.0, trainer_args=_dcp_args(ck))
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [STEPS] and res["states"] == _reference("hsdp", ref_dir, "--model", "lm"), (res, where)
    fault = res["faults"][0]
    assert fault["fired"] and {r["target_step"] for r in fault["records"]} == {6}, (fault, where)
    assert all(r["lost_steps"] == 0 and r["action"] == "resume" for r in fault["records"]), (fault, where)
    # (rank 1's report is the spare's: it took the rank after step 6)
    assert res["saved"] == {0: [3, 9], 1: [9], 2: [3, 9], 3: [3, 9]}, (res["saved"], where)
    assert sorted(os.listdir(ck)) == ["step-00000003", "step-00000009"], (os.listdir(ck), where)


@pytest.mark.slow
def test_a_spare_that_joins_at_step_0_does_not_resume(tmp_path: Path, ref_dir: Path) -> None:
    """A job with checkpoints on and none saved yet loses rank 3 in its first step: the spare takes the
    rank at step 0 and goes on into step 1 with the others, who passed their resume long before (a
    resume of its own would be an all-reduce nobody joins)."""
    from gossiprec.harness.sharded import run_sharded

    res = run_sharded("hsdp", STEPS, [Fault("n3", "kill", 1, "forward")], spares=1, workdir=str(tmp_path / "job"),
                      timeout=300.0, trainer_args=_dcp_args(tmp_path / "ck"))
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [STEPS] and res["states"] == _reference("hsdp", ref_dir, "--model", "lm"), (res, where)
    assert res["assignment"][3] == "n4" and res["resumed"] == {r: None for r in range(4)}, (res, where)
    assert {r["target_step"] for r in res["faults"][0]["records"]} == {0}, (res["faults"], where)
    assert res["saved"] == {r: [3, 6, 9] for r in range(4)}, (res["saved"], where)
