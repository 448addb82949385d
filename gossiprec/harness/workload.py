"""The demo workload: a small MLP trained with AdamW on data generated from (seed, data position, rank).

Every process that builds it (each trainer and spare of a local job, the benchmarks' workers, and the
reference computed in the orchestrator) gets the same model, optimizer and generators (:func:`build`
seeds them all), and a rank's batch is a function of the data position and the rank alone
(:func:`batch`): nothing per rank is stored, so a spare that receives a survivor's state continues
exactly where the rank was. :func:`reference_state` replays the failure-free training in one process;
because the trainers reduce gradients in rank order (``allreduce_gradients(exact=True)``, the same
:func:`~gossiprec.trainer.collectives.buckets.rank_ordered_mean`), its state equals theirs bit for bit, and a run with
failures must end with exactly that state. ``examples/mlp.py`` is the same workload written for a user
to copy (it cannot import this package's harness).
"""

from __future__ import annotations

import hashlib
import os
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    import torch

    from gossiprec.trainer.state.capture import StateSnapshot

SEED = 1234
DIM = 32
"""Input and output width of the MLP."""
LAYERS = 2
"""Hidden layers of the MLP."""


class DataPosition:
    """Data position as a Stateful: which sample block the next step reads."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = int(sd["index"])


def build(hidden: int, layers: int = LAYERS, dim: int = DIM) -> tuple[Any, Any, DataPosition]:
    """Model, AdamW optimizer and data position, identical in every process (a spare allocates the
    optimizer's state itself in ``start()``)."""
    import torch

    torch.manual_seed(SEED)
    random.seed(SEED)  # every generator in the state must be identical across replicas
    try:
        import numpy as np

        np.random.seed(SEED)
    except ImportError:
        pass
    mods: list[Any] = [torch.nn.Linear(dim, hidden), torch.nn.GELU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    mods.append(torch.nn.Linear(hidden, dim))
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, DataPosition()


def state_params(hidden: int, layers: int = LAYERS, dim: int = DIM) -> int:
    """Parameters of :func:`build`'s MLP: dim->h, (layers-1) x h->h, h->dim."""
    return dim * hidden + hidden + (layers - 1) * (hidden * hidden + hidden) + hidden * dim + dim


def batch(index: int, rank: int, dim: int = DIM, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at data position ``index``: y = tanh(x W) + noise, from seeds alone."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1_000_003 + index * 1009 + rank)
    x = torch.randn(size, dim, generator=g)
    w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(SEED))
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(size, dim, generator=g)


def local_gradients(model: Any, cursor: DataPosition, rank: int) -> None:
    """This rank's gradients of the MSE loss on its batch at the current data position."""
    import torch

    x, y = batch(cursor.index, rank)
    model.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(x), y).backward()


def objects_of(model: Any, opt: Any, cursor: DataPosition) -> dict[str, Any]:
    """The objects whose state the trainers carry: model, optimizer, data position, RNG."""
    from gossiprec.trainer.objects import training_state

    return training_state(model, opt, data=cursor)


def scale_lr(opt: Any, old_world: int, new_world: int) -> None:
    """The demo's ``on_resize``: the linear scaling rule (learning rate proportional to the global batch)."""
    for group in opt.param_groups:
        group["lr"] = group["lr"] * new_world / old_world


def reference_state(steps: int, world: int, hidden: int, *, worlds: Sequence[tuple[int, int]] = (),
                    lr_scale: bool = False) -> bytes:
    """The :func:`state_bytes` of the state after ``steps`` failure-free steps of a ``world``-rank job.

    ``worlds``: ``(after_step, world_size)`` changes (a shrink at ``after_step``: later steps run with
    ``world_size`` ranks, :func:`scale_lr` applied first when ``lr_scale``).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend with the job's processes
    try:
        return _reference(steps, world, hidden, sorted(worlds), lr_scale)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, world: int, hidden: int, worlds: list[tuple[int, int]], lr_scale: bool) -> bytes:
    import torch

    from gossiprec.trainer.collectives.buckets import rank_ordered_mean
    from gossiprec.trainer.state.capture import capture_state

    model, opt, cursor = build(hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(1, steps + 1):
        new = next((w for after, w in reversed(worlds) if after < step), world)
        if new != world and lr_scale:
            scale_lr(opt, world, new)
        world = new
        rows = []
        for rank in range(world):
            local_gradients(model, cursor, rank)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            rows.append(torch.zeros_like(flat) + flat)  # what the rank's row of the all-reduce holds
        set_flat_grads(params, rank_ordered_mean(rows))
        opt.step()
        cursor.index += 1
    return state_bytes(capture_state(objects_of(model, opt, cursor), step=steps, checksum=False))


def set_flat_grads(params: Sequence[Any], flat: torch.Tensor) -> None:
    """Copy ``flat`` (every gradient, flattened and concatenated in ``params``' order) into the
    parameters' gradients."""
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset:offset + n].view_as(p))
        offset += n


def state_bytes(snap: StateSnapshot) -> bytes:
    """A captured state as bytes: header (every non-tensor value: optimizer settings, data position,
    RNG) + payload."""
    from gossiprec.trainer.state.header import pack_header

    return pack_header(snap.header) + snap.payload()


def state_digest(objects: Any, step: int) -> tuple[str, int]:
    """SHA-256 of ``objects``' state at ``step`` (of its :func:`state_bytes`, hashed piece by piece) and
    the size of its payload in bytes."""
    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.state.header import pack_header

    snap = capture_state(objects, step=step, copy=False, checksum=False)
    digest = hashlib.sha256(pack_header(snap.header))
    for view in snap.views():
        digest.update(view)
    return digest.hexdigest(), snap.header.total_nbytes


def save_checkpoint(path: Path, objects: Any, step: int) -> None:
    """Write ``objects`` at ``step`` to ``path`` atomically: 8-byte header length, header, payload."""
    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.state.header import pack_header

    snap = capture_state(objects, step=step, copy=False, checksum=True)
    header = pack_header(snap.header)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "big"))
        f.write(header)
        for view in snap.views():
            f.write(view)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, objects: Any) -> int:
    """Load a :func:`save_checkpoint` file into ``objects`` (crc32-verified); returns its step."""
    from gossiprec.trainer.state.header import unpack_header
    from gossiprec.trainer.state.receive import restore_state

    data = path.read_bytes()
    n = int.from_bytes(data[:8], "big")
    header = data[8:8 + n]
    restore_state(objects, (header, data[8 + n:]))
    return unpack_header(header).step
