"""What the sharded jobs' tests share: the failure-free references and the checks of a job with faults."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

STEPS = 9
"""Every sharded test job trains this many steps."""

REFERENCES: dict[str, dict[str, Any]] = {}


def reference_run(layout: str, tmp: Path, *args: str) -> dict[str, Any]:
    """The failure-free run (``args``: the trainers' options that change the training), once per session."""
    from gossiprec.harness.sharded import run_sharded

    key = " ".join((layout, *args))
    if key not in REFERENCES:
        REFERENCES[key] = run_sharded(layout, STEPS, spares=0, workdir=str(tmp / f"ref-{key.replace(' ', '')}"),
                                       timeout=240.0, trainer_args=args)
    return REFERENCES[key]


def reference(layout: str, tmp: Path, *args: str) -> dict[int, str]:
    """The failure-free run's final states: rank -> SHA-256 of its state."""
    states: dict[int, str] = reference_run(layout, tmp, *args)["states"]
    return states


@pytest.fixture(scope="session")
def ref_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("sharded-ref")


def check_job(res: dict[str, Any], reference: dict[int, str], copies: int = 1, buffers: int = 0) -> None:
    """``res`` (a faulted job's :func:`~gossiprec.harness.sharded.run_sharded`) ended as ``reference``,
    lost nothing committed, each lost shard came from its replica peer, and the memory kept for recovery
    is as ``copies`` says (``buffers``: bytes of the model's buffers, copied like the RNG)."""
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [STEPS], (res, where)
    assert res["states"] == reference, (res, where)  # every rank's shards, optimizer state, RNG: byte for byte
    # one snapshot copy: host memory kept for recovery is the rank's state once (its last commit is held
    # as the live tensors beside the copy of the one before), and a second copy only of what is not
    # parameters or optimizer state: here the RNG (torch's CPU generator state, 5 KB; two copies kept 2x).
    # No copy: the RNG alone (parameters and optimizer state are served live); buffers like the RNG
    import torch

    rng = torch.get_rng_state().numel()
    for r, kept in res["kept_bytes"].items():
        least = res["state_bytes"][r] if copies else 0
        assert least <= kept <= least + rng + buffers, (r, res["kept_bytes"], where)
    groups = res["replica_groups"]
    from gossiprec.harness.faults import STALLS

    for f in res["faults"]:
        if f["kind"] in STALLS:  # (a stall is no failure: the trainer records none)
            continue
        assert f["fired"], (f, where)
        # no step that every shard had committed is lost (a failure inside a step may leave one replica
        # group a commit ahead of another: that step was never committed by the job, and is redone)
        before = {r["rank"]: r["target_step"] + r["lost_steps"] for r in f["records"]
                  if r["previous_role"] == "trainer"}
        committed = min(max(before[r] for r in g if r in before) for g in groups)
        targets = {r["target_step"] for r in f["records"]}
        assert len(targets) == 1, (f, where)
        # (a kill in the optimizer step: the survivors' agents hold their reports until the survivors
        # committed that step, so nothing they commit is rolled back)
        assert targets == {committed}, (f, where)
        # a spare took the lost coordinate; every receiver (that spare, and on a loaded machine also a survivor
        # a commit behind the target) got its shard from the same coordinate of the other replica
        receivers = [r for r in f["assignment"] if f["roles"][r] == "receiver"]
        spares = [r["rank"] for r in f["records"] if r["previous_role"] == "spare" and r["role"] == "receiver"]
        assert len(spares) == 1 and spares[0] in receivers, (f, where)
        peers = {r: next(p for g in groups if r in g for p in g if p != r) for r in receivers}
        assert f["donors"] == {r: [f["assignment"][p]] for r, p in peers.items()}, (f, where)
        assert f["assignment"][spares[0]] != f["node"], (f, where)


def plain_torchrun(layout: str, nproc: int, work: Path, *args: str,
                   timeout: float = 240.0) -> dict[int, dict[str, Any]]:
    """The harness's trainer in plain mode (``--plain``) under torchrun: rank -> its report."""
    from gossiprec.bench.sharded_overhead import _env, training_digest

    work.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1", "--nproc-per-node",
           str(nproc), "-m", "gossiprec.harness.sharded_trainer", "--plain", "--layout", layout,
           "--out", str(work / "r{rank}.json"), *args]
    with open(work / "torchrun.log", "wb") as log:
        proc = subprocess.run(cmd, env={**_env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, stdout=log,
                              stderr=subprocess.STDOUT, timeout=timeout)
    assert proc.returncode == 0, f"torchrun failed: see {work}/torchrun.log"
    reports = {r: json.loads((work / f"r{r}.json").read_text()) for r in range(nproc)}
    for r, rep in reports.items():
        rep["digest"] = training_digest(work / f"r{r}.state")
    return reports


def shrunk_reference(layout: str, target: int, survivor: int, work: Path, *args: str) -> dict[int, dict[str, Any]]:
    """The state a 2 x 2 job that shrank at step ``target`` ends with, never running gossiprec's shrink:
    plain torchrun trains 2 x 2 to ``target`` and saves a torch distributed checkpoint; replica
    ``survivor``'s ranks load it on a 1 x 2 mesh and train to :data:`STEPS` (tests/test_mesh_shrink.py).
    (Both runs are failure-free and deterministic, so each is made once per session: the 2 x 2 run and its
    checkpoint per ``(layout, target, args)``, shared by the survivors of either replica, and the resumed
    1 x 2 run per ``(layout, target, survivor, args)``; ``work`` is where the first caller's runs go.)"""
    key = (layout, target, *args)
    if key not in _SHRUNK_CKPTS:
        ckpt = work / "ckpt"
        plain_torchrun(layout, 4, work / "before", "--steps", str(target), "--ckpt-out", str(ckpt), *args)
        _SHRUNK_CKPTS[key] = ckpt
    if (*key, survivor) not in _SHRUNK:
        _SHRUNK[(*key, survivor)] = plain_torchrun(
            layout, 2, work / f"after-{survivor}", "--steps", str(STEPS), "--ckpt-in", str(_SHRUNK_CKPTS[key]),
            "--resume-at", str(target), "--from-replica", str(survivor), *args)
    return _SHRUNK[(*key, survivor)]


_SHRUNK_CKPTS: dict[tuple[Any, ...], Path] = {}
_SHRUNK: dict[tuple[Any, ...], dict[int, dict[str, Any]]] = {}
