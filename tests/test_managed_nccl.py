"""Managed groups on NCCL (a ``cuda`` mesh), on a machine with CUDA: skipped elsewhere, so never in CI.

The GPU check for sharded jobs: run ``pytest -q tests/test_managed_nccl.py tests/test_groups_nccl.py`` when a
GPU machine is lent. Each case runs in processes of its own (the managed world is one per process);
this file is also the worker (``python tests/test_managed_nccl.py CASE``).

- ``one`` (any GPU): a world of one (NCCL refuses two ranks on one GPU) on a 1-D ``cuda`` mesh with FSDP2:
  two steps in epoch 0, an abort (every later collective of the epoch raises), two steps in epoch 1 on
  new communicators; the parameters equal a plain model's after the same four steps.
- ``two`` (two GPUs or more): two processes; rank 0 waits in an all-reduce that rank 1 has not issued,
  an abort from another thread ends the wait (``CollectiveAborted``) while the communicator hangs, and
  epoch 1 reduces across both.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _steps(model: object, opt: object, n: int, first: int) -> None:
    import torch

    for s in range(first, first + n):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(s)).cuda()
        model(x).pow(2).mean().backward()  # type: ignore[operator]
        opt.step()  # type: ignore[attr-defined]
        opt.zero_grad()  # type: ignore[attr-defined]


def _case_one() -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from gossiprec.trainer.collectives.groups import CollectiveAborted, start_store_server
    from gossiprec.trainer.collectives.managed import init_managed_world

    torch.cuda.set_device(0)
    world = init_managed_world(0, 1, backend="nccl", timeout=60.0)
    store, _ = start_store_server("127.0.0.1", 0, timeout=60.0)
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("shard",))
    torch.manual_seed(0)
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).cuda()
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 8)).cuda()
    model.load_state_dict(plain.state_dict())
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(plain.parameters(), lr=0.01)
    world.configure(0, store)
    _steps(model, opt, 2, 1)
    world.abort("a view change")
    try:
        dist.all_reduce(torch.ones(1, device="cuda"))
        raise SystemExit("a collective of an aborted epoch ran")
    except CollectiveAborted:
        pass
    world.configure(1, store)
    _steps(model, opt, 2, 3)
    _steps(plain, ref_opt, 4, 1)
    got = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
    want = torch.cat([p.detach().flatten() for p in plain.parameters()])
    assert torch.equal(got, want), (got - want).abs().max()
    print("ok one", flush=True)
    os._exit(0)


def _two_worker(rank: int, port: int) -> None:
    import torch
    import torch.distributed as dist

    from gossiprec.trainer.collectives.groups import CollectiveAborted, connect_store, start_store_server
    from gossiprec.trainer.collectives.managed import init_managed_world

    torch.cuda.set_device(rank)
    world = init_managed_world(rank, 2, backend="nccl", timeout=60.0)
    store = start_store_server("127.0.0.1", port, timeout=60.0)[0] if rank == 0 else None
    if store is None:
        time.sleep(1.0)
        store = connect_store("127.0.0.1", port, timeout=60.0)
    world.configure(0, store)
    x = torch.ones(4, device="cuda")
    dist.all_reduce(x)
    assert x.tolist() == [2.0] * 4
    if rank == 0:  # rank 1 never issues this one: the wait ends only by the abort
        threading.Timer(0.5, lambda: world.abort("rank 1 is gone")).start()
        t0 = time.monotonic()
        try:
            dist.all_reduce(torch.ones(4, device="cuda"))
            raise SystemExit("the all-reduce completed without its peer")
        except CollectiveAborted:
            waited = time.monotonic() - t0
        assert 0.4 < waited < 5.0, waited
        store.set("aborted", b"1")
    else:
        store.wait(["aborted"])
        world.abort("rank 0 moved on")
    world.configure(1, store)
    y = torch.full((4,), float(rank + 1), device="cuda")
    dist.all_reduce(y)
    assert y.tolist() == [3.0] * 4
    print(f"ok two rank {rank}", flush=True)
    os._exit(0)


def _run(case: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2", "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, __file__, case], capture_output=True, text=True, timeout=300, env=env,
                          cwd=ROOT)


def _needs(gpus: int) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available() or torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} CUDA device(s) (run on a GPU machine)")


def test_a_managed_world_on_nccl_refuses_a_machine_without_cuda_or_a_killing_error_mode(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs everywhere: a clear error at once, never a silent hang or a process NCCL's watchdog kills."""
    torch = pytest.importorskip("torch")
    from gossiprec.errors import ConfigError
    from gossiprec.trainer.collectives.managed import ManagedWorld, init_managed_world

    with pytest.raises(ConfigError, match="backend must be"):
        ManagedWorld(0, 1, backend="mpi")
    if torch.cuda.is_available():
        monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
        with pytest.raises(ConfigError, match="TORCH_NCCL_ASYNC_ERROR_HANDLING=3"):
            init_managed_world(0, 1, backend="nccl")
    else:
        with pytest.raises(ConfigError, match="needs CUDA"):
            init_managed_world(0, 1, backend="nccl")


def test_a_world_of_one_on_a_cuda_mesh_aborts_and_trains_on_in_the_next_epoch() -> None:
    _needs(1)
    out = _run("one")
    assert out.returncode == 0 and "ok one" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]


def test_two_ranks_an_abort_ends_a_wait_on_a_silent_peer() -> None:
    _needs(2)
    out = _run("two")
    assert out.returncode == 0 and out.stdout.count("ok two") == 2, out.stdout[-2000:] + out.stderr[-4000:]


if __name__ == "__main__":
    if sys.argv[1] == "one":
        _case_one()
    else:
        import socket

        import torch.multiprocessing as mp

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            free = s.getsockname()[1]
        mp.spawn(_two_worker, args=(free,), nprocs=2)
