"""Recovery under every kind of fault, end to end, and the pieces the fault runs rest on.

The end-to-end tests start real agents and trainer processes on loopback (the harness's
orchestrator, :func:`~gossiprec.harness.scenario.run_scenario`) and inject faults from inside the
trainers at exact phases of exact steps (:class:`~gossiprec.harness.faults.FaultInjector`): a
SIGKILL in the forward pass, with the gradient all-reduce in flight, in the optimizer step and
between steps; a donor killed while a slowed receiver streams its state; a SIGSTOPped (hung) trainer
with no spare left, so the world shrinks; a trainer frozen inside the all-reduce; and a shard whose
only holder dies, so every rank reloads the checkpoint.
Every run must end bit-identical to the failure-free run (model, optimizer, data position, RNG).
Each run is bounded by its ``timeout``.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from gossiprec.core.config import AgreementConfig
from gossiprec.harness.faults import Fault, FaultInjector
from tests.support.second_plan import second_plan_run
from gossiprec.harness.scenario import run_scenario
from gossiprec.harness.workload import build, load_checkpoint, objects_of, reference_state, save_checkpoint
from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.trainer.collectives.groups import CollectiveAborted, EpochGroups, start_store_server, wait_interruptible


# --------------------------------------------------------------------------------------------------
# the pieces


def test_fault_spec_round_trip_and_validation() -> None:
    f = Fault("n3", "stop", 40, "communicate")
    assert f.spec() == "stop@communicate:40"
    assert Fault.parse("n3", f.spec()) == f
    for bad in ("kill", "kill@compute", "kill@compute:x", "pause@compute:3", "kill@backward:3"):
        with pytest.raises(ConfigError):
            Fault.parse("n0", bad)
    assert Fault("n0").phase is None  # sent by the orchestrator


def test_fault_injector_fires_once_at_its_phase_and_records_it(tmp_path: Path) -> None:
    sent: list[tuple[int, int]] = []
    record = tmp_path / "n1.fault"
    hook = FaultInjector([Fault("", "kill", 5, "communicate"), Fault("", "stop", 7, "compute")], record,
                         send=lambda pid, sig: sent.append((pid, sig)))
    hook(5, "compute")
    hook(4, "communicate")
    assert sent == [] and not record.exists()
    hook(5, "communicate")
    assert [sig for _, sig in sent] == [signal.SIGKILL]
    assert json.loads(record.read_text())["phase"] == "communicate"
    hook(6, "communicate")  # fired once only
    hook(8, "compute")  # "at step 7 or later"
    assert [sig for _, sig in sent] == [signal.SIGKILL, signal.SIGSTOP]
    rec = json.loads(record.read_text())
    assert (rec["kind"], rec["step"]) == ("stop", 8) and rec["t"] > 0


def test_faults_due_at_one_phase_fire_together_in_their_order(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    import gossiprec.harness.faults as faults

    order: list[str] = []
    monkeypatch.setattr(faults.time, "sleep", lambda s: order.append(f"sleep {s}"))
    hook = FaultInjector([Fault("", "slow", 5, "optimizer"), Fault("", "kill", 5, "optimizer")], tmp_path / "f",
                         send=lambda pid, sig: order.append(f"signal {sig}"))
    hook(5, "optimizer")  # a stall, then the kill: at the same call, not at the next step's
    assert order == [f"sleep {faults.SLOW_S}", f"signal {signal.SIGKILL}"]


def test_reference_follows_world_changes_and_lr_scaling() -> None:
    plain = reference_state(6, 3, 8)
    assert reference_state(6, 3, 8, worlds=[(6, 2)]) == plain  # a change after the last step: no effect
    shrunk = reference_state(6, 3, 8, worlds=[(3, 2)])
    assert shrunk != plain
    assert reference_state(6, 3, 8, worlds=[(3, 2)], lr_scale=True) != shrunk  # the LR changed too


def test_checkpoint_round_trip(tmp_path: Path) -> None:
    import torch

    model, opt, cursor = build(8)
    cursor.index = 17
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    save_checkpoint(tmp_path / "ckpt", objects_of(model, opt, cursor), 17)
    model2, opt2, cursor2 = build(8)
    assert load_checkpoint(tmp_path / "ckpt", objects_of(model2, opt2, cursor2)) == 17
    assert cursor2.index == 17
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


class ScriptedWork:
    """A torch Work stand-in, polled (``blocking_wait=False``): completes at the ``polls``-th check of
    ``is_completed``, then succeeds or raises ``error``. (A native wait of a work without a future runs
    on a waiter thread: tests/test_groups.py.)"""

    def __init__(self, polls: int | None, error: str = "") -> None:
        self.polls, self.error, self.calls = polls, error, 0

    def is_completed(self) -> bool:
        self.calls += 1
        return self.polls is not None and self.calls >= self.polls

    def wait(self, timeout: timedelta | None = None) -> bool:
        assert timeout is None and self.polls is not None and self.calls >= self.polls, "waited while pending"
        if self.error:
            raise RuntimeError(self.error)
        return True


POLLED = {"blocking_wait": False}


def test_a_collective_still_pending_reports_waiting_once() -> None:
    calls: list[int] = []
    work = ScriptedWork(polls=50)
    wait_interruptible(work, threading.Event(), epoch=0, op="allreduce", poll_interval=0.001,
                       slow_after=0.0, on_slow=lambda: calls.append(work.calls), **POLLED)
    assert calls == [0] and work.calls == 50  # once, as soon as it was due, and the wait went on
    calls.clear()
    wait_interruptible(ScriptedWork(polls=2), threading.Event(), epoch=0, op="allreduce",
                       slow_after=60.0, on_slow=lambda: calls.append(1), **POLLED)
    assert calls == []  # done in time: nothing to report


def test_a_collective_done_before_the_abort_still_counts() -> None:
    abort = threading.Event()
    abort.set()
    wait_interruptible(ScriptedWork(polls=0), abort, epoch=2, op="allreduce", **POLLED)  # complete: no raise
    with pytest.raises(CollectiveAborted) as info:  # complete with an error: the error wins
        wait_interruptible(ScriptedWork(polls=0, error="Connection reset by peer"), abort, epoch=2,
                           op="allreduce", **POLLED)
    assert info.value.reason == "peer_failed"
    with pytest.raises(CollectiveAborted) as info:
        wait_interruptible(ScriptedWork(polls=None), abort, epoch=2, op="allreduce", **POLLED)
    assert info.value.reason == "aborted"


def test_a_group_build_stops_when_a_newer_view_supersedes_it() -> None:
    store, _ = start_store_server("127.0.0.1")
    groups = EpochGroups(store, timeout=30, poll_interval=0.01)
    asked: list[float] = []

    def cancelled() -> str:  # the second rank never comes; after a few polls a newer view is known
        asked.append(time.monotonic())
        return "view 6 supersedes the plan of epoch 5" if len(asked) >= 3 else ""

    with pytest.raises(CollectiveAborted, match="view 6 supersedes") as info:
        groups.build(5, 0, 2, cancelled=cancelled)
    assert info.value.reason == "aborted" and len(asked) >= 3  # cancelled by the newer view, not the 30 s timeout
    assert groups.current is None and groups.graveyard[-1].epoch == 5


# --------------------------------------------------------------------------------------------------
# end to end


def _check_common(res: dict, steps: int) -> None:
    assert res["bit_identical"], res
    assert res["final_step"] == [steps], res
    assert all(f["fired"] for f in res["faults"]), res["faults"]


@pytest.mark.slow
def test_kills_in_every_phase_bit_identical(tmp_path: Path) -> None:
    # 2 ranks and 4 spares; each kill takes the rank of the trainer that holds it at that moment (a
    # spare promoted by the previous fault), in another phase of the step each time
    faults = [Fault("n1", "kill", 8, "compute"), Fault("n0", "kill", 16, "communicate"),
              Fault("n2", "kill", 24, "optimizer"), Fault("n3", "kill", 32, "committed")]
    res = run_scenario(2, 4, 40, faults, hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=150.0)
    _check_common(res, 40)
    assert [(f["phase"], f["step"]) for f in res["faults"]] == [
        ("compute", 8), ("communicate", 16), ("optimizer", 24), ("committed", 32)]
    for f in res["faults"]:
        assert f["lost_steps"] == 0, f  # nothing committed was lost, in any phase
        assert "receiver" in f["roles"].values(), f  # a spare took the rank with a survivor's state
        assert f["transfer_bytes"] == res["state_bytes"], f
        assert f["rto_s"] is not None and f["rto_s"] > 0, f  # measured (figures: the recovery benchmark)
    # lost ranks take spares in node order; the survivor keeps its rank
    assert [f["assignment_after"] for f in res["faults"]] == [
        {0: "n0", 1: "n2"}, {0: "n3", 1: "n2"}, {0: "n3", 1: "n4"}, {0: "n5", 1: "n4"}], res["faults"]


@pytest.mark.slow
def test_donor_killed_mid_transfer_then_hang_shrinks(tmp_path: Path) -> None:
    # n2 dies; spare n3 streams its state striped from n0 and n1, slowed to 150 ms per 1 MiB chunk;
    # n0 dies 0.2 s into serving its stripe (6.8 MB, more than the socket buffers hold). Spare n4
    # replaces n0 under the next plan. Later n1 hangs (SIGSTOP) with no spare left: the job allows
    # shrinking, so 3 ranks become 2 and on_resize scales the learning rate (linear rule).
    faults = [Fault("n2", "kill", 6, "committed"), Fault("n0", "kill", 6, "serve"),
              Fault("n1", "stop", 24, "compute")]
    res = run_scenario(3, 2, 36, faults, hidden=1024, step_ms=40.0, workdir=str(tmp_path), timeout=150.0,
                       allow_shrink=True, lr_scale=True, slow_fetch=0.15)
    _check_common(res, 36)
    kill, donor, hang = res["faults"]
    log = (tmp_path / "n3.log").read_text()
    assert "failed while streaming" in log, log[-2000:]  # the donor died mid-stream, not before or after
    # the plan of the kill's epoch could not finish without n0; the next plan (n0 out, n4 in) did
    assert kill["rto_s"] is None and donor["epoch"] == 2 and donor["lost_steps"] == 0, res["faults"]
    assert "receiver" in donor["roles"].values(), donor
    assert donor["assignment_after"] == {0: "n4", 1: "n1", 2: "n3"}, donor
    # (the shrink's own plan may be superseded before its first step by the view that briefly
    # readmits n1's agent as a spare; either way the world is 2 and nothing committed is lost)
    assert hang["lost_steps"] == 0 and hang["assignment_after"] == {0: "n4", 1: "n3"}, hang
    # on_resize ran on both ranks of the new world, from the pre-shrink state (again, if a newer view
    # interrupted the recovery before its first step: each run starts from the restored state)
    assert set(res["resizes"]) == {"n3", "n4"}, res
    assert all(calls and all(c == [3, 2] for c in calls) for calls in res["resizes"].values()), res
    assert len(res["worlds"]) == 1 and res["worlds"][0][1] == 2, res  # the reference shrank at the same step
    assert res["hung_killed_by_launcher"] == {"n1": True}, res  # fenced: a SIGCONT cannot bring it back


@pytest.mark.slow
def test_hang_inside_the_allreduce_is_found(tmp_path: Path) -> None:
    # n1 freezes right after issuing its all-reduce: every rank last reported "communicate", so only
    # the survivor's "waiting" report (alive, waiting on peers) tells the agents which rank is hung
    faults = [Fault("n1", "stop", 12, "communicate")]
    res = run_scenario(2, 1, 24, faults, hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=120.0)
    _check_common(res, 24)
    (hang,) = res["faults"]
    assert hang["assignment_after"] == {0: "n0", 1: "n2"} and hang["lost_steps"] == 0, hang
    assert AgreementConfig().hang_floor - 0.1 <= hang["phases_s"]["detected"] <= hang["rto_s"], hang
    assert res["hung_killed_by_launcher"] == {"n1": True}, res


@pytest.mark.slow
def test_no_replica_left_loads_the_checkpoint(tmp_path: Path) -> None:
    # Two shards, one copy each (grid dp=1 x tp_pp=2): when n1 dies its shard has no holder, so the
    # plan is "checkpoint": the spare takes rank 1, both ranks load rank 0's last checkpoint (step 10)
    # through on_no_replica, check they agree, and train on to a state equal to the failure-free run.
    faults = [Fault("n1", "kill", 14, "committed")]
    res = run_scenario(2, 1, 30, faults, hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=120.0,
                       tp_pp=2, checkpoint_every=5)
    _check_common(res, 30)
    (f,) = res["faults"]
    assert f["action"] == "checkpoint", f
    assert sorted(f["roles"].values()) == ["checkpoint", "checkpoint"], f
    assert f["lost_steps"] == 4 and f["transfer_bytes"] == 0, f  # committed 14, checkpoint 10
    assert res["checkpoint_loads"] == {"n0": [10], "n2": [10]}, res


# --------------------------------------------------------------------------------------------------
# replicas identical after every recovery, and nothing committed lost


def _records(workdir: Path, node: str) -> list[dict]:
    path = workdir / f"{node}.records"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@pytest.mark.slow
def test_a_second_plan_during_a_recovery_leaves_the_survivor_at_the_new_target(tmp_path: Path) -> None:
    # n1 dies in its optimizer step of step 12; the survivors n0 and n2 are there too and wait in it
    # for the first plan, which (reports not held: report_hold = 0) targets step 11. n2 then commits 12
    # and reloads 11 for that plan; n0, the donor of spare n3, dies while serving it (a slowed receiver),
    # and the second plan targets 12, which n2 holds: n2 restores twice in one recovery, 11 then 12.
    # two host copies (TrainerConfig.snapshot_copies=2): with one, n2's reload of 11 overwrites its 12 and
    # the second plan resumes at 11 (tests/test_recovery_memory.py)
    res, n2 = second_plan_run(tmp_path, copies=2)
    assert [s[1] for s in n2["superseded"]] == [11] and n2["target_step"] == 12, n2  # targets 11, then 12
    assert n2["role"] in ("survivor", "donor"), n2  # it reloaded its own snapshots both times
    assert res["exits"] == {"n0": 137, "n1": 137, "n2": 0, "n3": 0, "n4": 0}, res["exits"]


@pytest.mark.slow
def test_a_kill_in_the_survivors_optimizer_step_loses_nothing(tmp_path: Path) -> None:
    # the survivors are still in their optimizer step when the view without n1 is installed: their
    # agents hold the state reports until they have committed it, so the plan resumes at step 12
    faults = [Fault("n1", "kill", 12, "optimizer"), Fault("n0", "slow", 12, "optimizer"),
              Fault("n2", "slow", 12, "optimizer")]
    res = run_scenario(3, 1, 20, faults, hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=120.0)
    _check_common(res, 20)
    (kill,) = res["faults"]
    assert kill["lost_steps"] == 0 and kill["epochs"] == [1], kill
    assert all(r["target_step"] == 12 for n in ("n0", "n2", "n3") for r in _records(tmp_path, n)), res
    assert list(kill["roles"].values()).count("receiver") == 1, kill  # the spare; no survivor re-received 12
    # the job ends by itself: every launcher that was not killed exits 0, the used spare included
    assert res["exits"] == {"n0": 0, "n1": 137, "n2": 0, "n3": 0}, res["exits"]


@pytest.mark.slow
def test_unused_spares_end_with_the_job(tmp_path: Path) -> None:
    res = run_scenario(2, 2, 15, [], hidden=32, step_ms=10.0, workdir=str(tmp_path), timeout=90.0)
    assert res["bit_identical"] and res["final_step"] == [15], res
    assert res["exits"] == {"n0": 0, "n1": 0, "n2": 0, "n3": 0}, res["exits"]
    assert "the job finished at step 15" in (tmp_path / "n2.log").read_text()


def _failed_run(tmp_path: Path, **kwargs: object) -> str:
    """Run a job that must fail; returns the trainers' logs."""
    with pytest.raises(GossiprecError, match="trainers failed"):
        run_scenario(2, 1, 12, kwargs.pop("faults", []), hidden=32, step_ms=10.0, workdir=str(tmp_path),  # type: ignore[arg-type]
                     timeout=90.0, **kwargs)  # type: ignore[arg-type]
    return "\n".join(p.read_text() for p in sorted(tmp_path.glob("n*.log")))


@pytest.mark.slow
def test_a_data_write_between_commit_and_allreduce_is_caught(tmp_path: Path) -> None:
    logs = _failed_run(tmp_path, mistakes={"n0": "data-write", "n1": "data-write"})
    assert "changed between commit() of step 1 and the next allreduce_gradients() without torch seeing" in logs
    assert "model/0.weight" in logs and ".data" in logs


@pytest.mark.slow
def test_generators_seeded_per_rank_are_caught_at_the_start(tmp_path: Path) -> None:
    logs = _failed_run(tmp_path, mistakes={"n0": "numpy-per-rank", "n1": "numpy-per-rank"})
    assert "ReplicaMismatch: replicas hold different state at step 0 (at the start): rng/numpy (ranks [" in logs
    assert "seed every random generator alike on every rank" in logs


@pytest.mark.slow
def test_an_unregistered_data_position_is_refused(tmp_path: Path) -> None:
    logs = _failed_run(tmp_path, mistakes={"n0": "no-data-position", "n1": "no-data-position"})
    assert "no data position among the objects ['model', 'optimizer', 'rng']" in logs


@pytest.mark.slow
def test_a_spare_that_cannot_take_the_state_leaves_and_the_next_one_does(tmp_path: Path) -> None:
    # spare n2 built a wider model: it cannot receive rank 1's state, says why and exits; the agents
    # then give the rank to n3, and the job ends as if nothing had happened
    res = run_scenario(2, 2, 24, [Fault("n1", "kill", 8, "committed")], hidden=32, step_ms=10.0,
                       workdir=str(tmp_path), timeout=120.0, mistakes={"n2": "wide-model"}, may_fail=("n2",))
    _check_common(res, 24)
    assert res["faults"][0]["assignment_after"] == {0: "n0", 1: "n3"}, res["faults"]
    log = (tmp_path / "n2.log").read_text()
    assert "cannot take part in the recovery of epoch 1" in log and "model/0.weight: donor float32[32, 32]" in log
    assert res["exits"]["n2"] == 1 and res["exits"]["n3"] == 0, res["exits"]
