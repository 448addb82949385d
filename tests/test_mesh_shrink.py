"""A mesh job shrinks by whole replica groups: no spare left and ``allow_shrink``, a lost rank's replica
group is dropped, the other groups train on with the replicate dimension one smaller, and the state
they end with is the one a job that shrank at the same step ends with.

The reference never runs gossiprec's shrink: plain torchrun trains the 2 x 2 job without failures to
the step the shrink resumed at and saves it with torch's distributed checkpoint; a second torchrun of
the two surviving ranks loads it on a 1 x 2 mesh (each rank taking the schedule, data position and RNG
of the surviving replica's rank at its shard coordinate) and trains to the end. Batches are functions
of (step or data position, data-parallel coordinate): after the shrink the survivors are replica 0 of
the new mesh and read replica 0's batches, as the reference's ranks do. The same two torchruns, resumed
on the whole 2 x 2 mesh, end as the failure-free run does: the checkpoint round trip is exact.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from gossiprec.core.election import StateReport, elect
from gossiprec.core.topology import JobTopology, Member
from gossiprec.errors import ConfigError
from gossiprec.harness.faults import Fault
from gossiprec.trainer.collectives.sharded import MeshSpec, ShardedWorld
from gossiprec.trainer.exits import JobStopped, MeshShrinkRefused
from tests.support.sharded import plain_torchrun, shrunk_reference

from tests.support.sharded import STEPS  # noqa: E402 (the same steps as the reference it compares with)
LM = ("--model", "lm")


# -- the mesh a shrink leaves ----------------------------------------------------------------------------


def test_a_mesh_resized_keeps_every_dimension_but_the_replicate_one() -> None:
    hsdp = MeshSpec((2, 2), ("replicate", "shard"))
    assert hsdp.resized(2) == MeshSpec((1, 2), ("replicate", "shard"))
    assert hsdp.resized(4) is hsdp
    last = MeshSpec((2, 3), ("tp", "dp"), replicate="dp")
    assert last.resized(4) == MeshSpec((2, 2), ("tp", "dp"), replicate="dp")
    assert [last.coordinate(r) for r in (0, 4, 5)] == [(0, 0), (1, 1), (1, 2)]
    with pytest.raises(MeshShrinkRefused, match="no mesh with the same shard dimension"):
        hsdp.resized(3)
    with pytest.raises(MeshShrinkRefused, match="replicate: a, b"):
        MeshSpec((2, 2, 2), ("a", "b", "c"), replicate=("a", "b")).resized(4)


def test_a_spare_joining_a_shrunk_job_accepts_its_view_and_a_wrong_mesh_is_still_refused() -> None:
    hsdp = MeshSpec((3, 2), ("replicate", "shard"))
    hsdp.check_view(4, [[0, 2], [1, 3]])  # the job shrank from 3 replica groups to 2
    with pytest.raises(ConfigError, match="is not the mesh's"):
        hsdp.check_view(4, [[0, 1], [2, 3]])
    with pytest.raises(ConfigError, match="is not the mesh's"):
        hsdp.check_view(3, [[0, 1, 2]])


def test_a_rank_that_would_move_along_a_sharded_dimension_is_refused() -> None:
    """A survivor's local shards are its old coordinate's: a plan that gives it another shard coordinate
    (or another rank of the same mesh) is refused before anything is retired."""
    world = ShardedWorld(MeshSpec((2, 2), ("replicate", "shard")), lambda mesh: {}, timeout=1.0, poll_interval=0.01,
                         slow_after=None, on_slow=None)
    world.rank, world.mesh = 3, object()  # built as rank 3: replica 1, shard 1
    with pytest.raises(MeshShrinkRefused, match=r"at \{'replicate': 0, 'shard': 0\}"):
        world.build(0, 2)
    with pytest.raises(MeshShrinkRefused, match="same mesh"):
        world.build(2, 4)
    assert world.world is None and world.retired == []  # nothing retired


def test_the_optimizer_gate_counts_the_optimizers_of_the_objects_built_now() -> None:
    """After a shrink's rebuild a step rolled forward is complete once the new optimizer stepped: the old
    one, which never steps again, is not waited for."""
    import torch

    from gossiprec.trainer.gate import OptimizerGate

    gate = OptimizerGate(SimpleNamespace(sharded=None), snapshots=None, follower=None,  # type: ignore[arg-type]
                         announce=print, report=print, interrupted=bool, poll=print, recovery_timeout=1.0)
    w = torch.nn.Parameter(torch.zeros(2))
    for _ in range(2):  # built, then built again
        opt = torch.optim.SGD([w], lr=0.1)
        gate.hook({"model": torch.nn.Linear(1, 1), "optimizer": opt})
    assert gate.optimizers == 1
    gate._rolling = 5
    w.grad = torch.ones(2)
    opt.step()  # (the pre-hook returns at once: no sharded world)
    assert gate.rolled(5)


def test_the_job_spec_of_a_shrinking_mesh_says_so() -> None:
    table = MeshSpec((2, 2), ("replicate", "shard")).job_toml(allow_shrink=True, min_replicas=2)
    assert table == '[job]\ntopology = "grid"\ndp = 2\ntp_pp = 2\nallow_shrink = true\nmin_replicas = 2\n'
    with pytest.raises(ConfigError, match="min_replicas=3"):
        MeshSpec((2, 2), ("replicate", "shard")).job_toml(min_replicas=3)


def test_every_launcher_carries_allow_shrink_for_a_mesh(tmp_path: Path) -> None:
    """``gossiprec spec --mesh ... --allow-shrink`` (and torchrun's ``allow_shrink=1``, through the same
    writer) and ``gossiprec run --nnodes ... --mesh ... --allow-shrink`` give view 0 the mesh's replica
    groups with shrinking allowed."""
    from gossiprec.agent.jobspec import load_view0
    from gossiprec.agent.spec import Slot, to_toml
    from gossiprec.core.bootstrap import BootParams
    from gossiprec.core.mesh import parse_mesh

    slots = [Slot(f"n{i}", f"h{i}", 0, f"127.0.0.{i + 1}:7000", "trainer" if i < 4 else "spare",
                  i if i < 4 else None) for i in range(5)]
    spec = tmp_path / "job.toml"
    spec.write_text(to_toml(slots, allow_shrink=True, mesh="replicate=2,shard=2"))
    want = JobTopology.grid(2, 2, allow_shrink=True)
    assert load_view0(str(spec)).topology == want
    boot = BootParams(5, 1, ("127.0.0.1:7000",), allow_shrink=True, mesh=parse_mesh("replicate=2,shard=2"))
    assert boot.topology() == want


def test_a_shrink_that_changes_a_local_shard_is_refused_with_exit_75() -> None:
    """A survivor whose state does not fit its objects rebuilt on the smaller mesh (a sharding that
    depends on the replicate dimension) stops the job in good order, naming the mismatch."""
    from gossiprec.trainer.recovery import Recovery, _Pending
    from gossiprec.trainer.state.receive import LayoutMismatch

    plan = elect(1, [Member(f"n{r}", "trainer", r, f"h{r}", "r0") for r in (0, 2, 3)], {r: f"n{r}" for r in range(4)},
                 {f"n{r}": StateReport(f"n{r}", r, 5, None, 6800) for r in (0, 2, 3)},
                 JobTopology.grid(2, 2, allow_shrink=True))
    assert plan.action == "shrink" and plan.rank_of("n2") == 0

    def mismatch(*_a: Any) -> None:
        raise LayoutMismatch("model.w: shape (4, 8) here, (2, 8) in the state")

    trainer = SimpleNamespace(node="n2", role="trainer", on_no_replica=None, prepare_rank=lambda rank, world: True)
    follower = SimpleNamespace(planned_at={})
    recovery = Recovery(trainer, job=None, follower=follower, snaps=None, checks=SimpleNamespace(), peers=None,  # type: ignore[arg-type]
                        closed=None, link=SimpleNamespace(report=lambda s, p: None), commit=lambda s: None)  # type: ignore[arg-type]
    recovery._move_state = mismatch  # type: ignore[method-assign]
    with pytest.raises(MeshShrinkRefused, match=r"local shards do not keep their shapes.*model\.w") as exc:
        recovery._apply_plan(plan, _Pending("test", 0.0))
    assert isinstance(exc.value, JobStopped)


# -- jobs --------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("layout,lost,copies", [("hsdp", "n1", "1"), ("tp", "n3", "1"), ("hsdp", "n2", "0")])
def test_a_mesh_job_shrinks_by_a_replica_group_to_the_state_of_a_job_that_shrank(layout: str, lost: str, copies: str,
                                                                                 tmp_path: Path) -> None:
    """2 x 2, no spare, ``allow_shrink``: the lost rank's replica group goes (its other rank is released
    and exits 0), the other group trains on as a 1 x 2 mesh to the end, and each of its ranks ends with
    the reference's state and commits its losses, bit for bit; with one snapshot copy and with none.
    (The released rank's leaving is a view change too: it usually supersedes the shrink's plan while the
    survivors build its groups, and they apply the next plan on the mesh they rebuilt.)"""
    from gossiprec.bench.sharded_overhead import training_digest
    from gossiprec.harness.sharded import run_sharded

    res = run_sharded(layout, STEPS, [Fault(lost, "kill", 5, "forward")], spares=0, workdir=str(tmp_path / "job"),
                      timeout=300.0, trainer_args=(*LM, "--snapshot-copies", copies), allow_shrink=True,
                      finish_ranks=2)
    where = f"(logs in {res['workdir']})"
    work = Path(res["workdir"])
    lost_rank = int(lost[1:])
    survivor = 1 - lost_rank // 2  # the other replica group (rank = replica * 2 + shard)
    kept = {0: f"n{2 * survivor}", 1: f"n{2 * survivor + 1}"}
    released = f"n{2 * (1 - survivor) + 1 - lost_rank % 2}"
    assert res["assignment"] == kept and res["final_step"] == [STEPS], (res["assignment"], where)
    assert res["exits"][released] == 0 and res["exits"][lost] not in (0, None), (res["exits"], where)
    assert "Released: this rank was released" in (work / f"{released}.log").read_text(), where
    assert all(code == 0 for node, code in res["exits"].items() if node in kept.values()), (res["exits"], where)
    assert res["mesh"] == {0: [1, 2], 1: [1, 2]}, where
    # on_resize saw the new mesh; once per recovery applied: a newer view that interrupts a recovery after
    # its group was built, before its first step, restores the target step again, and on_resize with it
    # (gossiprec.trainer.recovery, "Shrink")
    assert sorted(res["resizes"]) == [0, 1], where
    assert all(calls and all(c == [4, 2, [1, 2]] for c in calls) for calls in res["resizes"].values()), (
        res["resizes"], where)
    shrinks = [r for r in res["records"] if r["previous_world_size"] == 4]
    assert {(r["node"], r["rank"], r["world_size"]) for r in shrinks} == {(n, r, 2) for r, n in kept.items()}, where
    # the host memory kept for recovery is the new objects' alone (the old ones' snapshots are let go):
    # with one copy the rank's state once plus the small rest again, with none the small rest
    import torch

    from gossiprec.harness.tiny_lm import BUFFER_BYTES

    for r, kept_bytes in res["kept_bytes"].items():
        least = res["state_bytes"][r] if copies == "1" else 0
        assert least <= kept_bytes <= least + torch.get_rng_state().numel() + BUFFER_BYTES, (r, res, where)
    targets = {r["target_step"] for r in shrinks}
    assert len(targets) == 1 and targets <= {3, 4}, (targets, where)

    ref = shrunk_reference(layout, targets.pop(), survivor, tmp_path / "ref", *LM)
    got = {r: training_digest(work / f"{node}.state") for r, node in kept.items()}
    assert got == {r: rep["digest"] for r, rep in ref.items()}, (got, where)
    assert got[0] != got[1]  # (two shards: the digest sees them)
    for r in kept:
        after = {int(s): v for s, v in ref[r]["losses"].items()}
        assert after and {s: res["losses"][r][s] for s in after} == after, (r, where)


@pytest.mark.long  # the reference tool itself; the shrink tests use it
@pytest.mark.slow
def test_the_checkpoint_round_trip_of_the_reference_is_exact(tmp_path: Path) -> None:
    """The reference's saving and loading change nothing: resumed on the whole 2 x 2 mesh, it ends as the
    failure-free run does (and the shrunk reference differs from it)."""
    whole = plain_torchrun("hsdp", 4, tmp_path / "whole", "--steps", str(STEPS), *LM)
    ckpt = tmp_path / "ckpt"
    plain_torchrun("hsdp", 4, tmp_path / "before", "--steps", "4", "--ckpt-out", str(ckpt), *LM)
    resumed = plain_torchrun("hsdp", 4, tmp_path / "resumed", "--steps", str(STEPS), "--ckpt-in", str(ckpt),
                        "--resume-at", "4", *LM)
    assert {r: rep["digest"] for r, rep in resumed.items()} == {r: rep["digest"] for r, rep in whole.items()}
    shrunk = plain_torchrun("hsdp", 2, tmp_path / "shrunk", "--steps", str(STEPS), "--ckpt-in", str(ckpt),
                       "--resume-at", "4", "--from-replica", "1", *LM)
    assert shrunk[0]["digest"] != whole[0]["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("allow_shrink,min_replicas", [(False, 1), (True, 2)])
def test_a_mesh_job_that_may_not_shrink_stops_with_exit_75(allow_shrink: bool, min_replicas: int,
                                                           tmp_path: Path) -> None:
    """No spare and no shrink allowed, or a shrink below ``min_replicas``: the job stops in good order,
    every trainer left exits 75 (a scheduler requeues it)."""
    from gossiprec.harness.sharded import run_sharded

    res = run_sharded("hsdp", STEPS, [Fault("n1", "kill", 3, "forward")], spares=0, workdir=str(tmp_path / "job"),
                      timeout=240.0, allow_shrink=allow_shrink,
                      min_replicas=min_replicas, until_exit=True, may_fail={"n0", "n2", "n3"})
    where = f"(logs in {res['workdir']})"
    assert res["assignment"] == {}, where
    assert {n: res["exits"][n] for n in ("n0", "n2", "n3")} == {"n0": 75, "n2": 75, "n3": 75}, (res["exits"], where)
    log = (Path(res["workdir"]) / "n2.log").read_text()
    assert ("min_replicas=2" if allow_shrink else "shrinking is disabled") in log, where
