"""A small language model shaped as users write them, for the sharded jobs' tests (``--model lm``).

A token embedding and a learned position embedding, transformer blocks (pre-norm attention with dropout,
a GELU MLP), then a final LayerNorm and an output head whose weight is tied to the token embedding: the
embeddings, the final norm and the head sit directly under the root module, outside every block. A
persistent buffer (``tokens_seen``) is written by every training forward, as BatchNorm's running
statistics are. The optimizer is AdamW with a warm-up LR schedule, the gradients are clipped, and the
data position is an object of its own (:class:`TokenCursor`).

How each layout shards it (:func:`parallelize`):

- ``hsdp``: ``fully_shard`` on each block and then on the root (the embeddings, the final norm and the
  head are the root's FSDP2 group, which stays unsharded between forward and backward);
- ``tp``: each block's attention projections and MLP column-/row-wise parallel along ``tp`` (the
  attention heads split between the two ranks); the embeddings, the final norm and the head stay plain
  tensors, replicated along ``tp``. The loop averages every gradient along ``dp`` itself and clips the
  DTensor and plain gradients against one total norm (:func:`train_step`).

Importing this module does not import torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

VOCAB, DIM, HEADS, SEQ, BATCH, BLOCKS = 32, 16, 2, 8, 4, 2
DROPOUT = 0.1
BUFFER_BYTES = 8
"""The model's buffers (``tokens_seen``, one int64): kept like the RNG, a copy per snapshot."""


class TokenCursor:
    """The data position: which window of the token stream each step reads (a Stateful)."""

    def __init__(self) -> None:
        self.position = 0

    def batch(self, dp: int) -> tuple[Any, Any]:
        """The inputs and targets of the current position for data-parallel coordinate ``dp``."""
        import torch

        g = torch.Generator().manual_seed(7919 * self.position + dp)
        tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
        return tokens[:, :-1], tokens[:, 1:]

    def advance(self) -> None:
        self.position += 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


def build_model() -> Any:
    """The model (see the module docstring), the same in every process once torch is seeded."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
            self.proj = nn.Linear(DIM, DIM)
            self.drop = nn.Dropout(DROPOUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            b, t, _ = x.shape
            hd = DIM // HEADS  # (-1 below: the heads of this rank, all of them or its tensor-parallel share)
            q, k, v = (f(x).view(b, t, -1, hd).transpose(1, 2) for f in (self.q, self.k, self.v))
            att = (q @ k.transpose(-2, -1)) / hd ** 0.5
            att = att.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = self.drop(att.softmax(-1)) @ v
            return cast("torch.Tensor", self.proj(y.transpose(1, 2).reshape(b, t, -1)))

    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ln1, self.attn, self.ln2 = nn.LayerNorm(DIM), Attention(), nn.LayerNorm(DIM)
            self.fc, self.out = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
            self.drop = nn.Dropout(DROPOUT)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            x = x + self.drop(self.attn(self.ln1(x)))
            return cast("torch.Tensor", x + self.drop(self.out(F.gelu(self.fc(self.ln2(x))))))

    class TinyLM(nn.Module):
        tokens_seen: torch.Tensor  # a buffer (register_buffer below)

        def __init__(self) -> None:
            super().__init__()
            self.tok = nn.Embedding(VOCAB, DIM)
            self.pos = nn.Parameter(torch.randn(SEQ, DIM) * 0.02)
            self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
            self.ln_f = nn.LayerNorm(DIM)
            self.head = nn.Linear(DIM, VOCAB, bias=False)
            self.head.weight = self.tok.weight  # tied input and output embeddings
            self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.long))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            if self.training:
                self.tokens_seen += idx.numel()
            x = self.tok(idx) + self.pos[: idx.shape[1]]
            for block in self.blocks:
                x = block(x)
            return cast("torch.Tensor", self.head(self.ln_f(x)))

    return TinyLM()


def parallelize(model: Any, layout: str, mesh: Any) -> None:
    """Shard ``model`` on ``mesh`` for ``layout`` (``hsdp`` or ``tp``; see the module docstring)."""
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
                "attn.proj": RowwiseParallel(), "fc": ColwiseParallel(), "out": RowwiseParallel()}
        for block in model.blocks:
            # src_data_rank=None: every rank shards its own (identically seeded) copy, no scatter
            parallelize_module(block, mesh["tp"], plan, src_data_rank=None)
        return
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def build_objects(layout: str, mesh: Any) -> dict[str, Any]:
    """Model, optimizer, LR schedule and data position of ``layout`` on ``mesh`` (seeded: the same in
    every process)."""
    import random

    import torch

    from gossiprec.trainer.objects import training_state

    torch.manual_seed(0)
    random.seed(0)  # every generator in the state (numpy's too) alike on every replica
    try:
        import numpy as np

        np.random.seed(0)
    except ImportError:
        pass
    model = build_model()
    parallelize(model, layout, mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 4))
    return training_state(model, opt, sched, data=TokenCursor())


def train_step(layout: str, objects: dict[str, Any], mesh: Any, clip: bool = True) -> float:
    """One step on the cursor's batch: forward, backward, data-parallel averaging (tp), clipping,
    optimizer, schedule; returns the loss."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    model, opt, sched, data = objects["model"], objects["optimizer"], objects["scheduler"], objects["data"]
    x, y = data.batch(mesh.get_coordinate()[0])
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    params = list(model.parameters())
    if layout == "tp":
        group, n = mesh["dp"].get_group(), mesh["dp"].size()
        for p in params:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(g, group=group)
            g.div_(n)
    if clip:
        if layout == "tp":  # DTensor shards and plain replicated tensors: one total norm for both
            sharded = [p for p in params if hasattr(p, "to_local")]
            plain = [p for p in params if not hasattr(p, "to_local")]
            norms = torch.stack([
                cast("DTensor", torch.nn.utils.get_total_norm([p.grad for p in sharded])).full_tensor(),
                torch.nn.utils.get_total_norm([p.grad for p in plain])])
            total = norms.norm()
            torch.nn.utils.clip_grads_with_norm_(sharded, 1.0, total)
            torch.nn.utils.clip_grads_with_norm_(plain, 1.0, total)
        else:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    data.advance()
    return float(loss.detach())


def arm(objects: dict[str, Any], at: Any) -> None:
    """Call ``at(phase)`` at the in-step fault phases: ``forward`` (before the last block), ``backprop``
    (between the last block's gradients and the earlier ones') and ``optimizer`` (in ``opt.step()``)."""
    model, opt = objects["model"], objects["optimizer"]
    last = model.blocks[-1]
    last.register_forward_pre_hook(lambda _m, _a: at("forward"))

    def into_last(_m: Any, args: Any) -> None:
        x = args[0]
        if x.requires_grad:
            x.register_hook(lambda _g: at("backprop"))

    last.register_forward_pre_hook(into_last)
    opt.register_step_pre_hook(lambda _o, _a, _k: at("optimizer"))
