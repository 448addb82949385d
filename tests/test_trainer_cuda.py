"""Commits of a GPU-resident state, on a machine with CUDA (skipped elsewhere, so never in CI).

The deferred copies of CUDA parameters and optimizer state go to pinned host buffers on a side stream
that waits for the optimizer step: the snapshot holds exactly the committed bytes even when the host
runs ahead of the device (a long kernel queued before the commit), the buffers are reused by later
commits, and a source changed before the copy finished is reported.
"""

from __future__ import annotations

import threading
import zlib

import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (run on a GPU machine)", allow_module_level=True)

from gossiprec.trainer.state.capture import capture_deferred, capture_state  # noqa: E402
from gossiprec.trainer.state.header import tensor_bytes  # noqa: E402
from gossiprec.trainer.state.rng import RNGState  # noqa: E402


def _state() -> tuple[torch.nn.Module, torch.optim.Optimizer, dict[str, object]]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048), torch.nn.Linear(2048, 2048)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, {"model": model, "optimizer": opt, "rng": RNGState(numpy=False)}


def _train(model: torch.nn.Module, opt: torch.optim.Optimizer, rows: int = 4096) -> None:
    x = torch.randn(rows, 2048, device="cuda")
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()


def _late(model: torch.nn.Module, opt: torch.optim.Optimizer) -> frozenset[int]:
    ptrs = {p.data_ptr() for p in model.parameters()}
    for st in opt.state.values():
        ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor) and v.is_cuda)
    return frozenset(ptrs)


def _crcs(snap: object) -> list[int]:
    return [zlib.crc32(tensor_bytes(t)) for t in snap.tensors]  # type: ignore[attr-defined]


def test_deferred_cuda_copies_hold_the_committed_step() -> None:
    model, opt, objects = _state()
    _train(model, opt)
    late = _late(model, opt)
    reuse = None
    for _ in range(3):
        _train(model, opt, rows=65536)  # queued: the host reaches the capture long before the device
        snap, deferred = capture_deferred(objects, step=1, reuse=reuse, defer=late)
        assert deferred.ready and all(dst.is_pinned() for dst, _ in deferred.pairs)
        worker = threading.Thread(target=deferred.run)  # as the trainer's copier thread does
        worker.start()
        worker.join()
        assert deferred.modified() == []
        torch.cuda.synchronize()
        ref = capture_state(objects, step=1, copy=True, checksum=True)
        assert _crcs(snap) == [s.crc32 for s in ref.header.tensors]
        if reuse is not None:  # the second capture into the same buffers allocates nothing new
            assert [t.data_ptr() for t in snap.tensors] == [t.data_ptr() for t in reuse.tensors]
        reuse, older = snap, reuse
        del older


def test_a_source_changed_before_the_copy_is_reported() -> None:
    model, opt, objects = _state()
    _train(model, opt)
    snap, deferred = capture_deferred(objects, step=1, defer=_late(model, opt))
    _train(model, opt)  # the next optimizer step, before the copies ran: a torn snapshot
    deferred.run()
    assert deferred.modified()  # the trainer refuses this snapshot (RecoveryError)
