"""Sharded jobs recovered in place: ResilientTrainer on a device mesh (dp x tp DTensor tensor parallelism,
HSDP with FSDP2), real agents and trainer processes, a rank SIGKILLed in forward, in backward, in the
optimizer step and between steps, or SIGSTOPped before a tensor-parallel all-reduce; the spare takes
the rank, receives its shard from the lost rank's replica peer, and every rank's final local state is
bit-identical to the failure-free run of the same job, resumed at the newest step every shard had
committed (no committed step lost).

CI runs one job per layout with several faults in a row (and the two failure-free references); the
whole matrix (every fault alone, in each layout) runs with ``GOSSIPREC_SHARDED_FULL=1``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from gossiprec.core.election import StateReport, elect
from gossiprec.core.topology import Member
from gossiprec.errors import ConfigError
from gossiprec.harness.faults import Fault
from gossiprec.trainer.collectives.sharded import MeshSpec
from tests.support.sharded import STEPS, check_job as _check, reference as _reference

FULL = bool(os.environ.get("GOSSIPREC_SHARDED_FULL"))


# ------------------------------------------------------------------------------------------ no processes
def test_mesh_spec_gives_the_agents_topology_and_job_table() -> None:
    tp = MeshSpec((2, 2), ("dp", "tp"))
    assert tp.topology().replica_groups == ((0, 2), (1, 3))  # ranks of one tp coordinate hold one shard
    assert tp.job_toml() == '[job]\ntopology = "grid"\ndp = 2\ntp_pp = 2\nallow_shrink = false\n'
    hsdp = MeshSpec((2, 3), ("replicate", "shard"))
    assert hsdp.topology().replica_groups == ((0, 3), (1, 4), (2, 5))
    assert MeshSpec((4,), ("dp",)).job_toml().startswith('[job]\ntopology = "ddp"')
    tp.check_view(4, [[1, 3], [0, 2]])  # any order
    with pytest.raises(ConfigError, match="not the mesh's") as exc:
        tp.check_view(4, [[0, 1, 2, 3]])  # a plain DDP job spec
    assert 'tp_pp = 2' in str(exc.value)  # says what to write
    with pytest.raises(ConfigError, match="not the mesh's"):
        tp.check_view(6, [[0, 3], [1, 4], [2, 5]])
    # replicate along the second dimension: groups no job spec grid expresses
    with pytest.raises(ConfigError, match="put the replicate dimension first"):
        MeshSpec((2, 2), ("tp", "dp"), "dp").job_toml()
    for bad in ({"shape": (2, 0), "names": ("a", "b")}, {"shape": (2, 2), "names": ("a",)},
                {"shape": (2, 2), "names": ("a", "a")}, {"shape": (2, 2), "names": ("a", "b"), "replicate": "c"},
                {"shape": (2,), "names": ("a",), "device": "xpu"}):
        with pytest.raises(ConfigError):
            MeshSpec(**bad)  # type: ignore[arg-type]
    assert (tp.backend, MeshSpec((2,), ("dp",), device="cuda").backend) == ("gloo", "nccl")


def test_a_sharded_trainer_takes_a_mesh_and_a_build_instead_of_objects() -> None:
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.loop import ResilientTrainer

    spec = MeshSpec((2, 2), ("dp", "tp"))
    for kwargs in ({"mesh": spec}, {"build": lambda mesh: {}}, {"mesh": (2, 2), "build": lambda mesh: {}}):
        with pytest.raises(ConfigError, match="mesh=MeshSpec"):
            ResilientTrainer(None, TrainerConfig(), control=object(), key=b"k" * 32, **kwargs)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mesh=MeshSpec"):
        ResilientTrainer({"x": object()}, TrainerConfig(), control=object(), key=b"k" * 32,  # type: ignore[dict-item]
                         mesh=spec, build=lambda mesh: {})
    # the groups' backend follows the mesh's device: a CUDA mesh on gloo, or a CPU one on NCCL, is refused
    for device, backend in (("cuda", "gloo"), ("cpu", "nccl")):
        with pytest.raises(ConfigError, match=f"runs on {'nccl' if device == 'cuda' else 'gloo'}"):
            ResilientTrainer(None, TrainerConfig(backend=backend), control=object(), key=b"k" * 32,
                             mesh=MeshSpec((2, 2), ("dp", "tp"), device=device), build=lambda mesh: {})


def test_the_mesh_groups_bind_and_seal_as_the_trainer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The managed world gets the trainer's address (gloo binds there: on hosts of their own the host
    name's address reached no peer, and epoch 0 never formed) and its keys (the store's values sealed)."""
    import gossiprec.trainer.collectives.managed as managed
    from gossiprec.trainer.keys import TransferKeys
    from gossiprec.trainer.collectives.sharded import ShardedWorld

    seen: dict[str, Any] = {}

    def fake_init(rank: int, world_size: int, **kw: Any) -> Any:
        seen.update(kw, rank=rank)
        raise RuntimeError("stop here")

    monkeypatch.setattr(managed, "init_managed_world", fake_init)
    world = ShardedWorld(MeshSpec((2, 2), ("dp", "tp")), lambda mesh: {}, timeout=10, poll_interval=0.01,
                         slow_after=None, on_slow=None)
    keys = TransferKeys.fixed(b"k" * 32)
    world.host, world.keys = "10.0.0.7", keys
    with pytest.raises(RuntimeError, match="stop here"):
        world.build(3)
    assert seen["host"] == "10.0.0.7" and seen["keys"] is keys and seen["rank"] == 3


_NEVER_FORWARDED = """
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from gossiprec.trainer.collectives.managed import init_managed_world
from gossiprec.trainer.collectives.sharded import MeshSpec, ShardedWorld

init_managed_world(0, 1, timeout=10)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
for layer in model:
    fully_shard(layer, mesh=mesh)
fully_shard(model, mesh=mesh)
world = ShardedWorld(MeshSpec((1,), ("shard",)), lambda mesh: {}, timeout=10, poll_interval=0.01,
                     slow_after=None, on_slow=None)
print("reset", world.reset_modules({"model": model}))
"""


def test_an_fsdp_model_that_never_ran_a_forward_needs_no_reset() -> None:
    # a spare that took a rank and was interrupted before its first forward (in the replica check or the
    # commit barrier) once died in reset_modules: FSDP2's reset_iter_state needs the state of a forward
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _NEVER_FORWARDED], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0 and "reset 0" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("lost", [0, 1, 2, 3])
def test_the_donor_of_a_lost_shard_is_its_replica_peer(lost: int) -> None:
    topo = MeshSpec((2, 2), ("dp", "tp")).topology()
    prev = {r: f"n{r}" for r in range(4)}
    members = [Member(f"n{r}", "trainer", r, f"h{r}", "r0") for r in range(4) if r != lost]
    members.append(Member("s", "spare", None, "hs", "r0"))
    reports = {f"n{r}": StateReport(f"n{r}", r, 5, None, 6800) for r in range(4) if r != lost}
    plan = elect(1, members, prev, reports, topo)
    peer = next(r for g in topo.replica_groups if lost in g for r in g if r != lost)
    assert plan.rank_of("s") == lost  # the spare takes the lost coordinate: no other rank moves
    assert {x.donor_node for x in plan.transfers} == {f"n{peer}"}
    assert all(x.receiver_node == "s" for x in plan.transfers)


# ------------------------------------------------------------------------------------------ real jobs
def _crash_before_start(gate: Path, spare: str) -> list[Any]:
    """Actions: once every process is up (before start()), crash ``spare``'s host; once n0's agent holds
    a view without it, open ``gate`` (the trainers' ``--start-gate``)."""
    from gossiprec.harness.job import LocalJob
    from gossiprec.harness.scenario import Action
    from gossiprec.local.client import ControlClient
    from gossiprec.local.protocol import ViewBrief

    def members(job: LocalJob) -> set[str]:
        with ControlClient(str(job.path("n0", ".sock"))) as c:
            view = c.status().get("view")
        return {m.node for m in ViewBrief.from_wire(view).members} if view is not None else set()

    return [Action(f"crash of {spare}'s host", lambda job: all(job.path(n, ".ready").exists() for n in job.names),
                   lambda job: job.crash(spare)),
            Action("the ranks start", lambda job: members(job) == set(job.names) - {spare},
                   lambda job: gate.touch())]


CI_JOBS = {
    # a kill in backward (FSDP-free: the data-parallel all-reduce of local shards waits), then a rank
    # stopped before its row-parallel layer: its tensor-parallel peer waits inside the TP all-reduce
    "tp": [Fault("n3", "kill", 3, "backprop"), Fault("n2", "stop", 6, "forward")],
    # a kill in forward (peers in the FSDP all-gather), in the optimizer step (after the clip-norm
    # all-reduce), and between two steps while the other replica group (ranks 0 and 1, held before their
    # clip-norm all-reduce until the plan) has not committed that step: rank 3 (n4) rolls its commit of
    # step 7 back to its copy of step 6 (a reload of FSDP2's DTensors once kept the newer step's tensors)
    "hsdp": [Fault("n3", "kill", 3, "forward"), Fault("n1", "kill", 5, "optimizer"),
             Fault("n0", "hold", 7, "clip"), Fault("n5", "hold", 7, "clip"), Fault("n2", "kill", 7, "committed")],
}
HOLD_PROTOCOL = {"hang_floor": 4.0}
"""The held ranks stall, by design, until the plan, and its agents hold their reports for it ``report_hold``
(2 s: they may still commit the step they are in). With the default hang floor (0.6 s) their observers
accused them after about 1.2 s, and the removal as hung raced the plan: once (CI, 2026-12-08) it won,
both held ranks were removed, shard 0 was left with no holder, and the job stopped instead of recovering."""


@pytest.mark.slow
@pytest.mark.parametrize("layout", sorted(CI_JOBS))
def test_sharded_job_spares_take_lost_shards_bit_identical(layout: str, tmp_path: Path, ref_dir: Path) -> None:
    from gossiprec.harness.sharded import run_sharded

    faults = CI_JOBS[layout]
    kw: dict[str, Any] = {}
    if layout == "tp":
        # first a spare's host dies before any rank has called start(): the ranks come up in view 1 with
        # no group built and nothing committed, and must train from their initial state (they once
        # failed every plan of view 1, "resumes at step 0 from this rank, but it holds steps []")
        spare = f"n{4 + len(faults)}"
        kw = {"actions": _crash_before_start(tmp_path / "go", spare), "may_fail": {spare},
              "trainer_args": ["--start-gate", str(tmp_path / "go")]}
    res = run_sharded(layout, STEPS, faults, spares=len(faults) + bool(kw), workdir=str(tmp_path / "job"),
                      timeout=300.0, protocol=HOLD_PROTOCOL if layout == "hsdp" else None, **kw)
    _check(res, _reference(layout, ref_dir))
    assert len(res["actions"]) == len(kw.get("actions", ())), res
    by_rank_cause = {f["phase"]: f["causes"] for f in res["faults"]}
    if layout == "tp":  # the stopped rank's tensor-parallel peer (rank 3, same dp row) waited in the TP all-reduce
        assert "allreduce" in by_rank_cause["forward"][3], res
    else:  # the killed rank's shard peer (rank 2) waited in the forward all-gather
        assert "all_gather" in by_rank_cause["forward"][2], res
        # n2's death came with rank 3 a commit ahead of ranks 0 and 1 (held): the job resumed at step 6
        last = next(f for f in res["faults"] if f["node"] == "n2")
        assert {(r["rank"], r["target_step"], r["lost_steps"]) for r in last["records"] if r["rank"] == 3} \
            == {(3, 6, 1)}, res


HANGS = [
    # n2 hangs in forward, before its row-parallel all-reduce: its TP peer n3 waits inside it, the other
    # replica in the gradient all-reduce
    Fault("n2", "hang", 3, "forward"),
    # later, n1 hangs in backward after waiting in that step's TP all-reduce for n0 (slowed just before
    # it): it had reported "waiting" earlier in the step. (If a view change comes first, n1 stays in its
    # step while the others recover, and is judged behind them.)
    Fault("n0", "slow", 6, "forward"), Fault("n1", "hang", 6, "backprop"),
]


@pytest.mark.slow
def test_ranks_hung_inside_a_step_are_the_ones_evicted(tmp_path: Path, ref_dir: Path) -> None:
    """Hangs that the rank's own agent cannot see (the trainer sleeps: it runs and its agent answers),
    found from the collective each rank has reached: each time exactly the hung rank is evicted, a spare
    takes it, and the job ends bit-identical with nothing committed lost."""
    from gossiprec.harness.sharded import run_sharded

    res = run_sharded("tp", STEPS, HANGS, spares=2, workdir=str(tmp_path / "job"), timeout=300.0)
    hangs = [f for f in res["faults"] if f["kind"] == "hang"]
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [STEPS] and res["states"] == _reference("tp", ref_dir), (res, where)
    work = Path(res["workdir"])
    records = [json.loads(line) for p in work.glob("*.records") for line in p.read_text().splitlines() if line]
    for hang in hangs:
        assert hang["fired"], (hang, where)
        fired_at = json.loads((work / f"{hang['node']}.fault").read_text())["t"]
        # the first recovery after the hang gave the hung rank to another node (a spare: the final
        # assignment below); plans superseded before their first step write no record
        rank = int(hang["node"][1:])
        after = [r for r in records if r["planned_at"] >= fired_at and r["rank"] == rank]
        assert after, (hang, where)
        first = min(r["epoch"] for r in after)
        assert {r["node"] for r in after if r["epoch"] == first} != {hang["node"]}, (hang, where)
        assert all(r["lost_steps"] == 0 for r in records if r["epoch"] == first), (hang, where)
    assert "allreduce" in hangs[0]["causes"][3], (hangs[0], where)  # its TP peer waited inside the TP all-reduce
    # the other two kept their nodes and ranks; the hung ones' ranks went to the spares
    final = res["assignment"]
    assert (final[0], final[3]) == ("n0", "n3") and {final[1], final[2]} == {"n4", "n5"}, (res, where)


SNAPSHOT_FREE = [
    # n3 dies in backward, before its data-parallel all-reduces: with no clip-norm all-reduce after
    # them, ranks 0 and 2 finish theirs and reach the ready barrier while rank 1 cannot; without the
    # barrier they would step and commit 3, rank 1 could not, and no step would be held by every shard
    # (the plan: checkpoint). With it the job resumes at 2
    Fault("n3", "kill", 3, "backprop"),
    # n1 dies in its optimizer step's pre-hook, before the barrier, after a stall (so that every other
    # rank is surely in the barrier by then, its gradients complete): the job resumes at 5, rolled
    # forward, which nobody had committed (a survivor still short of the barrier when the view changed
    # would make it 4, rightly)
    Fault("n1", "slow", 5, "optimizer"), Fault("n1", "kill", 5, "optimizer"),
    # between two steps: the survivors serve step 7 from their live tensors
    Fault("n2", "kill", 7, "committed"),
]


@pytest.mark.slow
def test_a_snapshot_free_sharded_job_resumes_where_every_shard_can(tmp_path: Path, ref_dir: Path) -> None:
    """snapshot_copies=0 in a mesh job: no copy of parameters or optimizer state is kept; the ready
    barrier before each optimizer step keeps the replica groups from committing apart."""
    from gossiprec.harness.sharded import run_sharded

    args = ("--no-clip", "--snapshot-copies", "0")
    kills = sum(f.kind == "kill" for f in SNAPSHOT_FREE)
    res = run_sharded("tp", STEPS, SNAPSHOT_FREE, spares=kills, workdir=str(tmp_path / "job"), timeout=300.0,
                      trainer_args=args)
    _check(res, _reference("tp", ref_dir, "--no-clip"), copies=0)
    where = f"(logs in {res['workdir']})"
    targets = [{r["target_step"] for r in f["records"]} for f in res["faults"]]
    assert targets == [{2}, {5}, {5}, {7}], (targets, where)


FULL_MATRIX = [(model, layout, kind, phase, copies) for model in ("mlp", "lm") for layout in ("tp", "hsdp")
               for copies in (1, 0)
               for kind, phase in (("kill", "forward"), ("kill", "backprop"), ("kill", "optimizer"),
                                   ("kill", "committed"), ("stop", "forward"), ("stop", "backprop"))]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the whole matrix: set GOSSIPREC_SHARDED_FULL=1")
@pytest.mark.parametrize("model,layout,kind,phase,copies", FULL_MATRIX)
def test_sharded_fault_matrix(model: str, layout: str, kind: str, phase: str, copies: int, tmp_path: Path,
                              ref_dir: Path) -> None:
    from gossiprec.harness.sharded import run_sharded
    from gossiprec.harness.tiny_lm import BUFFER_BYTES

    res = run_sharded(layout, STEPS, [Fault("n3", kind, 4, phase)], spares=1, workdir=str(tmp_path / "job"),
                      timeout=300.0, trainer_args=("--model", model, "--snapshot-copies", str(copies)))
    _check(res, _reference(layout, ref_dir, "--model", model), copies, buffers=BUFFER_BYTES if model == "lm" else 0)
