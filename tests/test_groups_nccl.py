"""The NCCL path of :class:`EpochGroups`, on a machine with CUDA (skipped elsewhere, so never in CI).

NCCL refuses two ranks on one GPU, so on a one-GPU machine this runs a world of one: the group is built
with a non-blocking communicator, reduces a CUDA tensor, is aborted from another thread while a
collective waits on it (the abort returns and the waiter raises :class:`CollectiveAborted`), and the
next epoch's group comes up beside the aborted one and works. With two or more GPUs, a two-rank world
in two processes reduces across them.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run on a GPU machine)", allow_module_level=True)

import torch.distributed as dist  # noqa: E402

from gossiprec.errors import ConfigError  # noqa: E402
from gossiprec.trainer.collectives.groups import CollectiveAborted, EpochGroups, start_store_server  # noqa: E402


@pytest.fixture(autouse=True)
def _async_error_handling(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2")


def test_world_of_one_builds_reduces_aborts_and_rebuilds() -> None:
    store, _ = start_store_server("127.0.0.1", 0, timeout=30.0)
    groups = EpochGroups(store, backend="nccl", timeout=30.0, poll_interval=0.002, device=0)
    t0 = time.perf_counter()
    g0 = groups.build(0, 0, 1)
    build_s = time.perf_counter() - t0
    x = torch.arange(1 << 20, device="cuda", dtype=torch.float32)
    g0.allreduce(x, "sum")
    torch.cuda.synchronize()
    assert torch.equal(x, torch.arange(1 << 20, device="cuda", dtype=torch.float32))

    # an abort from another thread while the main thread waits on a collective: the waiter raises
    # promptly (a world of one completes at once, so the abort lands on the next one at the latest)
    aborted_at: list[float] = []

    def abort_soon() -> None:
        time.sleep(0.05)
        aborted_at.append(time.perf_counter())
        assert groups.abort(0, "test abort")

    th = threading.Thread(target=abort_soon)
    th.start()
    with pytest.raises(CollectiveAborted):
        while True:
            g0.allreduce(x, "sum")
    raised_at = time.perf_counter()
    th.join(5)
    assert aborted_at and raised_at - aborted_at[0] < 1.0

    g1 = groups.build(1, 0, 1)
    y = torch.full((1024,), 3.0, device="cuda")
    g1.allreduce(y, "avg")
    torch.cuda.synchronize()
    assert torch.equal(y, torch.full((1024,), 3.0, device="cuda"))
    assert g0 in groups.graveyard and groups.current is g1
    print(f"nccl world-of-one build {build_s:.3f} s, abort seen after {raised_at - aborted_at[0]:.4f} s")


def test_default_async_error_handling_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    store, _ = start_store_server("127.0.0.1", 0, timeout=10.0)
    groups = EpochGroups(store, backend="nccl", timeout=10.0, device=0)
    with pytest.raises(CollectiveAborted) as info:
        groups.build(0, 0, 1)
    assert isinstance(info.value.__cause__, ConfigError)


def _two_rank_worker(rank: int, port: int, out: object) -> None:
    os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] = "2"
    from gossiprec.trainer.collectives.groups import EpochGroups, connect_store, start_store_server

    store = start_store_server("127.0.0.1", port)[0] if rank == 0 else connect_store("127.0.0.1", port)
    groups = EpochGroups(store, backend="nccl", timeout=60.0, device=rank)
    g = groups.build(0, rank, 2)
    x = torch.full((1 << 20,), float(rank + 1), device=f"cuda:{rank}")
    g.allreduce(x, "sum")
    torch.cuda.synchronize(rank)
    out.put((rank, float(x[0].item())))  # type: ignore[attr-defined]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two ranks need two GPUs (NCCL refuses to share one)")
def test_two_ranks_on_two_gpus_reduce() -> None:
    import multiprocessing as mp
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_two_rank_worker, args=(r, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = sorted(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    assert got == [(0, 3.0), (1, 3.0)]
    assert dist.is_nccl_available()
