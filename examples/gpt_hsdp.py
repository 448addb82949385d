"""A small GPT trained with FSDP2 HSDP on a ("replicate", "shard") device mesh, recovered in place by gossiprec.

Written the way a training script is written: command-line options, logging, real text, a tokenizer, a
GPT-style model (token and position embeddings, pre-norm transformer blocks with causal self-attention,
a GELU MLP and dropout, a final LayerNorm and a head tied to the token embedding), AdamW with a warm-up
LR schedule and gradient clipping, and a data position registered with the trainer. One process per
rank (and per hot spare), each under its agent; on one machine, five terminals::

    gossiprec run --nnodes 1 --nproc-per-node 5 --spares 1 --mesh replicate=2,shard=2 --local-index 0 \
        --seed 127.0.0.1:7980 --insecure -- python examples/gpt_hsdp.py --out /tmp/gpt-ref

with ``--local-index`` 0 to 4 (docs/sharded.md; on a cluster, any launch line of a sharded job). Kill
any trainer (``kill -9``): the spare takes its mesh coordinate, receives its shard from the other
replica, and training goes on from the last step every shard committed. ``--ckpt DIR --ckpt-every N``
adds checkpoints (:class:`gossiprec.trainer.DcpCheckpoints`) for what no spare covers: a job restarted
after it stopped (exit 75, no spare left) resumes from the newest complete one, and a recovery that
finds no surviving replica of some shard loads it.

- **Data**: the source of a few modules of Python's standard library (:data:`CORPUS_FILES`, read from
  ``sysconfig.get_paths()["stdlib"]``): real text that ships with every Python, no download. The corpus,
  and so the model's vocabulary and the final state, depends on the Python version (the digest file
  names the corpus's SHA-256).
- **Tokenizer**: characters (:class:`CharTokenizer`), the vocabulary being the corpus's sorted characters.
- **Batches** are a function of (data position, mesh coordinate) alone (:class:`TokenCursor`): every
  rank of the mesh is a data-parallel worker (HSDP reduces gradients over both dimensions), a spare that
  takes a coordinate reads what the lost rank would have, and every run of the same command is the same.
- **The end**: each rank writes a digest of its final local state (its shards of the model and the
  optimizer, the schedule, the data position, the random generators) to ``--out/rank<R>.json``;
  ``--expect DIR`` (the ``--out`` of a failure-free run) compares each rank's digest with that run's
  and exits 1 when they differ.

On CUDA (``LOCAL_RANK`` picks the GPU) the mesh is a ``cuda`` one with NCCL; that path has not run here:
every test of this script runs on CPU with gloo.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import os
import platform
import random
import sys
import sysconfig
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from gossiprec.core.mesh import parse_mesh
from gossiprec.harness.workload import state_digest
from gossiprec.trainer import (
    EXIT_FINISHED, DcpCheckpoints, MeshSpec, RecoveryRecord, ResilientTrainer, TrainerConfig, TrainingEnded,
    training_state,
)

log = logging.getLogger("gpt_hsdp")

CORPUS_FILES = ("bisect.py", "colorsys.py", "fnmatch.py", "heapq.py", "string.py", "textwrap.py")
"""The standard library modules whose source is the corpus, in this order (about 68 KB on Python 3.11)."""
EXIT_MISMATCH = 1
"""Exit code of a rank whose final state is not the ``--expect`` run's."""


# ------------------------------------------------------------------------------------------ data
def load_corpus(files: Sequence[str] = CORPUS_FILES) -> str:
    """The text of ``files`` from this Python's standard library, concatenated in the order given."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return "".join((root / name).read_text(encoding="utf-8") for name in files)


class CharTokenizer:
    """One token per character; the vocabulary is a fixed string of distinct characters."""

    def __init__(self, chars: str) -> None:
        if len(set(chars)) != len(chars):
            raise ValueError("the vocabulary has a character twice")
        self.chars = chars
        self.ids = {c: i for i, c in enumerate(chars)}

    @classmethod
    def from_text(cls, text: str) -> CharTokenizer:
        """The vocabulary of ``text``: its distinct characters, sorted (the same on every machine)."""
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.ids[c] for c in text]
        except KeyError as exc:
            raise ValueError(f"character {exc.args[0]!r} is not in the vocabulary") from None

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(self.chars[i] for i in ids)


class TokenCursor:
    """The data position (a Stateful the trainer saves and restores with the model): which batch the
    next step reads. A rank's batch is drawn from (position, data-parallel index) alone."""

    def __init__(self, tokens: torch.Tensor, batch: int, seq: int) -> None:
        if len(tokens) <= seq + 1:
            raise ValueError(f"the corpus has {len(tokens)} tokens: too few for --seq {seq}")
        self.tokens, self.batch_size, self.seq = tokens, batch, seq
        self.position = 0

    def batch(self, dp_index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets: ``batch`` windows of ``seq + 1`` tokens at random offsets."""
        g = torch.Generator().manual_seed(1_000_003 * self.position + dp_index)
        starts = torch.randint(0, len(self.tokens) - self.seq - 1, (self.batch_size,), generator=g)
        windows = self.tokens[starts[:, None] + torch.arange(self.seq + 1)]
        return windows[:, :-1], windows[:, 1:]

    def advance(self) -> None:
        self.position += 1

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position = int(sd["position"])


# ------------------------------------------------------------------------------------------ model
@dataclass(frozen=True)
class GPTConfig:
    vocab: int
    seq: int = 64
    dim: int = 96
    heads: int = 4
    layers: int = 3
    dropout: float = 0.1


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.heads, self.dropout = cfg.heads, cfg.dropout
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in self.qkv(x).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0)
        out: torch.Tensor = self.drop(self.proj(y.transpose(1, 2).reshape(b, t, d)))
        return out


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln1, self.attn, self.ln2 = nn.LayerNorm(cfg.dim), CausalSelfAttention(cfg), nn.LayerNorm(cfg.dim)
        self.mlp = nn.Sequential(nn.Linear(cfg.dim, 4 * cfg.dim), nn.GELU(), nn.Linear(4 * cfg.dim, cfg.dim),
                                 nn.Dropout(cfg.dropout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(cfg.vocab, cfg.dim)
        self.pos = nn.Embedding(cfg.seq, cfg.dim)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.tok.weight  # tied input and output embeddings
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device)))
        for block in self.blocks:
            x = block(x)
        logits: torch.Tensor = self.head(self.ln_f(x))
        return logits


def build_objects(mesh: Any, cfg: GPTConfig, tokens: torch.Tensor, args: argparse.Namespace) -> dict[str, Any]:
    """Model, optimizer, LR schedule and data position on ``mesh``. Every process builds the same (seeded):
    the replicas of a shard must be identical, a spare's too (gossiprec checks it)."""
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    try:
        import numpy as np

        np.random.seed(args.seed)
    except ImportError:
        pass
    from torch.distributed.fsdp import fully_shard

    model = GPT(cfg)
    for block in model.blocks:  # one FSDP2 group per block, then the root (embeddings, final norm, head)
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    decay = [p for p in model.parameters() if p.dim() >= 2]  # no weight decay on biases and norms
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95))
    warmup, total = int(args.warmup), max(int(args.steps), int(args.warmup) + 1)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine down to a tenth
        if step < warmup:
            return (step + 1) / warmup
        return 0.1 + 0.45 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / (total - warmup))))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    return training_state(model, opt, sched, data=TokenCursor(tokens, args.batch, cfg.seq))


def data_index(mesh: Any) -> int:
    """This rank's data-parallel index: its place in the mesh (under HSDP both dimensions split the data)."""
    index = 0
    for size, coord in zip(mesh.shape, mesh.get_coordinate()):
        index = index * size + coord
    return index


def train_step(objects: dict[str, Any], mesh: Any, device: str, clip: float) -> float:
    """One step on this rank's batch; returns its loss."""
    model, opt, sched, data = objects["model"], objects["optimizer"], objects["scheduler"], objects["data"]
    x, y = (t.to(device) for t in data.batch(data_index(mesh)))
    logits = model(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)  # a norm all-reduce over the shards
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    data.advance()
    return float(loss.detach())


# ------------------------------------------------------------------------------------------ the end
def digest_record(rt: ResilientTrainer, corpus: str, args: argparse.Namespace) -> dict[str, Any]:
    """What ``--out`` keeps of this rank: the SHA-256 of its final local state (every registered object,
    as gossiprec serialises it for a transfer: :func:`gossiprec.harness.workload.state_digest`) and what
    the run depended on."""
    sha, nbytes = state_digest(rt.objects, rt.step)
    return {"rank": rt.rank, "coordinate": list(rt.mesh.get_coordinate()), "step": rt.step, "state_sha256": sha,
            "state_bytes": nbytes, "corpus_sha256": hashlib.sha256(corpus.encode()).hexdigest(),
            "python": platform.python_version(), "torch": torch.__version__, "mesh": args.mesh, "node": rt.node}


def compare(mine: dict[str, Any], expected_dir: Path) -> str:
    """'' when ``mine`` equals the same rank's digest in ``expected_dir``; otherwise why not."""
    path = expected_dir / f"rank{mine['rank']}.json"
    try:
        theirs = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return f"no digest to compare with in {path}: {exc}"
    for key in ("corpus_sha256", "step", "state_sha256"):
        if mine.get(key) != theirs.get(key):
            return f"{key} differs from {path}: {mine.get(key)} here, {theirs.get(key)} there"
    return ""


# ------------------------------------------------------------------------------------------ main
def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="A small GPT trained with FSDP2 HSDP under gossiprec (see the docstring).")
    p.add_argument("--mesh", default=os.environ.get("GOSSIPREC_MESH") or "replicate=2,shard=2",
                   help="NAME=SIZE,..., replicate dimension first, as launched (default: $GOSSIPREC_MESH or "
                        "replicate=2,shard=2)")
    p.add_argument("--steps", type=int, default=40, help="train until this step is committed")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence (the context length)")
    p.add_argument("--dim", type=int, default=96, help="model width")
    p.add_argument("--layers", type=int, default=3, help="transformer blocks")
    p.add_argument("--heads", type=int, default=4, help="attention heads")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate")
    p.add_argument("--warmup", type=int, default=10, help="steps of linear LR warm-up")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", dest="log_every", type=int, default=10, help="log the loss every N steps")
    p.add_argument("--out", type=Path, default=None, help="write each rank's final digest to OUT/rank<R>.json")
    p.add_argument("--expect", type=Path, default=None,
                   help="the --out of a failure-free run: compare each rank's final digest with it; exit 1 "
                        "if they differ")
    p.add_argument("--ckpt", type=Path, default=None,
                   help="checkpoint directory (shared by every rank): a restarted run resumes from its newest "
                        "complete checkpoint, and a recovery that finds no replica of some shard loads it")
    p.add_argument("--ckpt-every", dest="ckpt_every", type=int, default=0,
                   help="save a checkpoint every N committed steps (0: never)")
    p.add_argument("--wait-for-spares", dest="wait_for_spares", type=float, default=0.0,
                   help="seconds start() waits for the hot spares to be up (TrainerConfig.wait_for_spares)")
    p.add_argument("--timeout", type=float, default=30.0, help="collective and group timeout, seconds")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto: cuda when torch sees a GPU, else cpu")
    args = p.parse_args(argv)
    try:
        shape = parse_mesh(args.mesh)
    except ValueError as exc:  # (gossiprec's ConfigError is a ValueError too)
        p.error(str(exc))
    if len(shape.sizes) != 2:
        p.error(f"--mesh {args.mesh}: HSDP takes two dimensions, the replicate one first, then the shard one")
    if args.ckpt_every < 0 or (args.ckpt_every and args.ckpt is None):
        p.error("--ckpt-every N takes N >= 0 and a --ckpt DIR")
    if args.dim % args.heads:
        p.error(f"--dim {args.dim} is not a multiple of --heads {args.heads}")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s", stream=sys.stderr)
    torch.set_num_threads(1)
    shape = parse_mesh(args.mesh)
    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda":  # untested here: no GPU in this repository's tests
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    mesh_spec = MeshSpec(shape.sizes, shape.names, device=device)
    config = TrainerConfig(backend="nccl" if device == "cuda" else "gloo", timeout=args.timeout,
                           wait_for_spares=args.wait_for_spares)

    corpus = load_corpus()
    tok = CharTokenizer.from_text(corpus)
    tokens = torch.tensor(tok.encode(corpus), dtype=torch.long)
    cfg = GPTConfig(vocab=tok.vocab_size, seq=args.seq, dim=args.dim, heads=args.heads, layers=args.layers,
                    dropout=args.dropout)

    def on_recovered(rec: RecoveryRecord) -> None:
        log.info("rank %d recovered in epoch %d (%s): %s from step %d", rec.rank, rec.epoch, rec.cause, rec.action,
                 rec.target_step)

    # checkpoints (torch.distributed.checkpoint) cover what a spare cannot: a restart after the job stopped
    # (exit 75: no spare left), and a recovery that finds no surviving replica of some shard
    ckpt = DcpCheckpoints(args.ckpt, every=args.ckpt_every) if args.ckpt is not None else None
    rt = ResilientTrainer(None, config, mesh=mesh_spec, build=lambda mesh: build_objects(mesh, cfg, tokens, args),
                          on_recovered=on_recovered, on_no_replica=ckpt.on_no_replica if ckpt else None)
    try:
        rt.start()  # a trainer: builds the mesh and the model for its rank; a spare: waits for a rank to take
        if ckpt is not None and (resumed := ckpt.resume(rt)) is not None:
            log.info("rank %d resumed from the checkpoint of step %d in %s", rt.rank, resumed, args.ckpt)
        if rt.rank == 0:
            model: Any = rt.objects["model"]
            n = sum(p.numel() for p in model.parameters())
            log.info("corpus %d characters, vocabulary %d, model %d parameters (%s), mesh %s on %s",
                     len(corpus), tok.vocab_size, n, json.dumps(asdict(cfg)), args.mesh, device)
        while rt.step < args.steps:
            # (rt.objects and rt.mesh are read inside the step: a spare gets them when it takes a rank)
            done = rt.run_step(lambda _step: train_step(rt.objects, rt.mesh, device, args.clip))
            if done.committed and rt.rank == 0 and (done.step % args.log_every == 0 or done.step == args.steps):
                sched: Any = rt.objects["scheduler"]
                lr = sched.get_last_lr()[0]
                log.info("step %d loss %.4f lr %.2e (epoch %d)", done.step, done.value, lr, rt.epoch)
            if ckpt is not None and ckpt.maybe_save(rt) is not None and rt.rank == 0:
                log.info("checkpoint of step %d saved in %s", rt.step, args.ckpt)
        record = digest_record(rt, corpus, args)
        log.info("rank %d final step %d state sha256 %s", rt.rank, rt.step, record["state_sha256"])
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            tmp = args.out / f".rank{rt.rank}.json.tmp"
            tmp.write_text(json.dumps(record, indent=1) + "\n")
            tmp.replace(args.out / f"rank{rt.rank}.json")
        code = EXIT_FINISHED
        if args.expect is not None:
            why = compare(record, args.expect)
            log.info("rank %d: %s", rt.rank, f"NOT the failure-free run's state: {why}" if why
                     else "final state equals the failure-free run's, bit for bit")
            code = EXIT_MISMATCH if why else code
        rt.finish(exit_code=code)  # os._exit: an aborted backend may hold collectives never completed
    except TrainingEnded as exc:  # an unused spare (exit 0), a job stopped in good order (exit 75: restart it)
        rt.leave(exc)


if __name__ == "__main__":
    main()
