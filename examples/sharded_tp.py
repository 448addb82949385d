"""Tensor parallel x data parallel on a 2 x 2 device mesh (CPU, gloo), recovered in place by gossiprec.

Four ranks and a hot spare, each under ``gossiprec run`` (see README.md in this folder). The job spec's
``[job]`` table comes from the mesh, never typed twice::

    python examples/sharded_tp.py --job-table      # [job] topology = "grid", dp = 2, tp_pp = 2

Kill any trainer (``kill -9``): the spare takes its mesh coordinate, receives its shard from the same
tensor-parallel coordinate of the other data-parallel replica, and training goes on from the last step
every shard committed.
"""

from __future__ import annotations

import random
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

from gossiprec.trainer import (
    EXIT_FINISHED, JobFinished, JobStopped, MeshSpec, Released, ResilientTrainer, TrainerConfig, training_state,
)

MESH = MeshSpec((2, 2), ("dp", "tp"))  # the dimension that replicates the state comes first
STEPS = 200


def build(mesh: object) -> dict[str, object]:
    """Model and optimizer on the mesh; the same in every process, a spare's too (seeded)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    torch.manual_seed(0)  # every generator in the state alike on every rank (the replicas are compared)
    random.seed(0)
    np.random.seed(0)
    model = nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 32))
    # src_data_rank=None: each rank shards its own seeded copy, so a spare needs no peer to build it
    parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()},  # type: ignore[index]
                       src_data_rank=None)
    return training_state(model, torch.optim.AdamW(model.parameters(), lr=1e-3))


def main() -> None:
    if "--job-table" in sys.argv:
        print(MESH.job_toml(), end="")
        return
    torch.set_num_threads(1)
    rt = ResilientTrainer(None, TrainerConfig(stateless_data=True), mesh=MESH, build=build)
    try:
        rt.start()  # a trainer: builds the mesh and the model for its rank; a spare: once it gets one
        while rt.step < STEPS:
            with rt.training_step() as step:  # commits at the end; after a failure anywhere in it, recovers
                model, opt = rt.objects["model"], rt.objects["optimizer"]
                dp = rt.mesh.get_coordinate()[0]
                x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step * 100 + dp))
                loss = model(x).pow(2).mean()
                loss.backward()
                dp_group = rt.mesh["dp"].get_group()
                for p in model.parameters():  # average the local shards' gradients over the replicas
                    dist.all_reduce(p.grad.to_local(), group=dp_group)
                    p.grad.to_local().div_(rt.mesh["dp"].size())
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad()
            if rt.rank == 0 and rt.step % 50 == 0:
                print(f"step {rt.step} loss {loss.item():.4f} (epoch {rt.epoch})", flush=True)
        rt.finish(exit_code=EXIT_FINISHED)  # os._exit: an aborted backend may hold collectives never completed
    except (JobFinished, Released, JobStopped) as exc:  # an unused spare, a job stopped in good order
        rt.leave(exc)

if __name__ == "__main__":
    main()
