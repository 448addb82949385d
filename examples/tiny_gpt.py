"""A tiny GPT-style language model (causal self-attention, 2 layers) trained data-parallel under gossiprec.

The corpus is generated in the repo, deterministically: sentences from a small grammar (``corpus()``),
tokenised by characters. Run one process per node under its agent (see examples/README.md)::

    gossiprec run --name n0 --port 7980 --job job.toml --insecure -- python examples/tiny_gpt.py

Dropout is off and all randomness of the model comes from seeded generators, so replicas stay
bit-identical and a spare that receives a survivor's state continues exactly where the job was.
"""

from __future__ import annotations

import argparse
import math
import random

import numpy
import torch
from torch import nn

from gossiprec.trainer import EXIT_FINISHED, JobFinished, JobStopped, Released, ResilientTrainer, training_state

SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "every bird", "the engineer"]
VERBS = ["sees", "likes", "builds", "follows", "finds", "trains"]
OBJECTS = ["a ball", "the model", "some bread", "the river", "a red house", "the gradient"]


def corpus(n: int = 4000, seed: int = 11) -> str:
    rng = random.Random(seed)
    return " ".join(f"{rng.choice(SUBJECTS)} {rng.choice(VERBS)} {rng.choice(OBJECTS)}." for _ in range(n))


class Block(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, heads, dropout=0.0, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf")), diagonal=1)
        h = self.ln1(x)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    def __init__(self, vocab: int, d: int = 64, layers: int = 2, heads: int = 4, ctx: int = 64) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.zeros(1, ctx, d))
        self.blocks = nn.Sequential(*[Block(d, heads) for _ in range(layers)])
        self.ln = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos[:, :idx.shape[1]]
        return self.head(self.ln(self.blocks(x)))


class DataPosition:
    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = int(sd["index"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--ctx", type=int, default=64)
    args = ap.parse_args()
    torch.set_num_threads(1)
    text = corpus()
    chars = sorted(set(text))
    data = torch.tensor([chars.index(c) for c in text], dtype=torch.long)
    torch.manual_seed(0)  # every generator in the state seeded alike on every rank (checked)
    random.seed(0)
    numpy.random.seed(0)
    model = TinyGPT(len(chars), ctx=args.ctx)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    pos = DataPosition()
    rt = ResilientTrainer(training_state(model, opt, data=pos))
    try:
        rt.start()  # a trainer: wait for every rank (the start barrier); a spare: wait for a rank
        while rt.step < args.steps:
            step = rt.begin_step()
            g = torch.Generator().manual_seed(pos.index * 1009 + rt.rank)  # this rank's slice of the data
            starts = torch.randint(0, len(data) - args.ctx - 1, (args.batch,), generator=g)
            x = torch.stack([data[s:s + args.ctx] for s in starts])
            y = torch.stack([data[s + 1:s + args.ctx + 1] for s in starts])
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x).reshape(-1, len(chars)), y.reshape(-1))
            loss.backward()
            if not rt.allreduce_gradients(model.parameters()):
                continue
            opt.step()
            pos.index += 1
            rt.commit()
            if rt.rank == 0 and step % 25 == 0:
                print(f"step {step} loss {loss.item():.3f} ppl {math.exp(loss.item()):.1f} "
                      f"(world {rt.world_size}, epoch {rt.epoch})", flush=True)
        rt.finish(exit_code=EXIT_FINISHED)  # skips interpreter teardown (see ResilientTrainer.finish)
    except (JobFinished, Released, JobStopped) as exc:
        # a spare the job did not need, a rank a shrink released (both exit 0), or a job stopped in good
        # order (no spare left, no shrink allowed: exit 75, restart it from a checkpoint). A fenced rank
        # raises nothing: it drops its state and waits as a spare inside the trainer's calls.
        rt.leave(exc)


if __name__ == "__main__":
    main()
