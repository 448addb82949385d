"""A plain MLP trained data-parallel under gossiprec: the smallest complete use of ResilientTrainer.

Run one process per node under its agent (see examples/README.md)::

    gossiprec run --name n0 --port 7980 --job job.toml --insecure -- python examples/mlp.py --steps 300

Every replica holds identical state (same seeds); what differs per rank (its batch) is computed from
``rt.rank`` and the data position, never stored. A rank can be killed at any moment: a spare takes
its place with the state of a survivor and the job goes on from the last committed step.
"""

from __future__ import annotations

import argparse
import random

import numpy
import torch

from gossiprec.trainer import EXIT_FINISHED, JobFinished, JobStopped, Released, ResilientTrainer, training_state


SEED = 0


class DataPosition:
    """Which block of the synthetic data set the next step reads (a Stateful)."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = int(sd["index"])


def build(dim: int, hidden: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, DataPosition]:
    """Model, optimizer and data position, identical on every rank."""
    torch.manual_seed(SEED)  # every generator in the state seeded alike on every rank (checked)
    random.seed(SEED)
    numpy.random.seed(SEED)
    model = torch.nn.Sequential(torch.nn.Linear(dim, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, dim))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, DataPosition()


def batch(index: int, rank: int, dim: int, size: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at data position ``index``: y = tanh(x W) + noise, from seeds alone
    (nothing to download)."""
    g = torch.Generator().manual_seed(SEED * 1_000_003 + index * 1009 + rank)
    x = torch.randn(size, dim, generator=g)
    w = torch.randn(dim, dim, generator=torch.Generator().manual_seed(SEED))
    return x, torch.tanh(x @ w) + 0.01 * torch.randn(size, dim, generator=g)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=512)
    args = ap.parse_args()
    torch.set_num_threads(1)
    model, opt, pos = build(args.dim, args.hidden)
    rt = ResilientTrainer(training_state(model, opt, data=pos))
    try:
        rt.start()  # a trainer: wait for every rank (the start barrier); a spare: wait for a rank
        while rt.step < args.steps:
            step = rt.begin_step()
            x, y = batch(pos.index, rt.rank, args.dim)
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            if not rt.allreduce_gradients(model.parameters()):
                continue  # recovered: the step starts again from the committed state
            opt.step()
            pos.index += 1
            rt.commit()
            if rt.rank == 0 and step % 50 == 0:
                print(f"step {step} loss {loss.item():.4f} (world {rt.world_size}, epoch {rt.epoch})", flush=True)
        rt.finish(exit_code=EXIT_FINISHED)  # skips interpreter teardown (see ResilientTrainer.finish)
    except (JobFinished, Released, JobStopped) as exc:
        # a spare the job did not need, a rank a shrink released (both exit 0), or a job stopped in good
        # order (no spare left, no shrink allowed: exit 75, restart it from a checkpoint). A fenced rank
        # raises nothing: it drops its state and waits as a spare inside the trainer's calls.
        rt.leave(exc)


if __name__ == "__main__":
    main()
