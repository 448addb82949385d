"""``gossiprec bench digest``: what a cross-replica state check costs (``ResilientTrainer`` runs one at the
start, after the first step, after every recovery and every ``verify_every`` steps).

The state is the commit bench's (square linear layers and AdamW moments, ``--mb`` in all, on the CPU),
after one training step. Timed, ``--trials`` times each (median, min, max):

``digest_all_s``
    crc32 of every tensor and of the non-tensor values, in the calling thread.
``digest_critical_s``
    what the main thread spends on a digest of the live state that overlaps a step (after a recovery
    without background snapshots nothing overlaps; a sharded job's commits held live use this one): the
    buffers, RNG and other small values are hashed at once; the parameters and optimizer state (changed
    only by the optimizer step) on a thread.
``digest_thread_s``
    the rest, on that thread: the next all-reduce of gradients waits for it, so it is free when the
    step's compute takes longer.
``snapshot_digest_s``
    the comparison after a recovery with background snapshots: every tensor of the first commit's
    snapshot (a copy) hashed with ``gmac32`` on a thread while the next step computes (here timed alone).
``compare_s``
    the comparison: one all-reduce of a ``world x 3`` int64 matrix, here on a gloo group of ``--world``
    ranks in threads of this process (a mismatch adds one of ``world x entries``).
``verify_commit_s`` / ``plain_commit_s``
    a checked commit (the first step's, every ``verify_every``-th): every tensor copied and checksummed
    inside ``commit()``, against an ordinary one (copies left to the background thread, timed here with
    those copies made).
``live_check_s``
    the checked commit's second half, at the next all-reduce of gradients: the parameters and optimizer
    state hashed again (what catches writes through ``.data``).
``step_s``
    one training step of this model with a batch of ``--batch`` rows, for scale.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import zlib
from datetime import timedelta
from typing import Any, Callable

from gossiprec.errors import ConfigError


def _summary(times: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(times), 6), "min": round(min(times), 6),
            "max": round(max(times), 6)}


def _timed(fn: Callable[[], Any], trials: int) -> dict[str, float]:
    times = []
    for _ in range(trials):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return _summary(times)


def _compare_time(world: int, entries: int, trials: int) -> dict[str, float]:
    """One summary all-reduce per trial on a gloo group of ``world`` ranks (threads), timed on rank 0."""
    import torch.distributed as dist

    from gossiprec.trainer.state.digest import rows_tensor

    store = dist.TCPStore("127.0.0.1", 0, world, True, timedelta(seconds=30), wait_for_workers=False)
    groups: list[Any] = [None] * world

    def make(rank: int) -> None:
        client = store if rank == 0 else dist.TCPStore("127.0.0.1", store.port, world, False, timedelta(seconds=30))
        groups[rank] = dist.ProcessGroupGloo(dist.PrefixStore("bench", client), rank, world,
                                            timedelta(seconds=30))

    threads = [threading.Thread(target=make, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    times: list[float] = []

    def run(rank: int) -> None:
        for _ in range(trials + 1):
            rows = rows_tensor((entries, 1, 2), rank, world)
            t0 = time.perf_counter()
            groups[rank].allreduce([rows]).wait()
            if rank == 0:
                times.append(time.perf_counter() - t0)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return _summary(times[1:])  # the first one connects


def run(mb: float, batch: int, trials: int, world: int, say: Any = lambda m: None) -> dict[str, Any]:
    import torch

    from gossiprec.bench.commit import _build
    from gossiprec.trainer.state.digest import PendingDigest, SnapshotDigest
    from gossiprec.trainer.state.capture import capture_deferred
    from gossiprec.trainer.state.header import tensor_bytes
    from gossiprec.trainer.objects import training_state

    model, opt, x, y = _build("cpu", int(mb * 1e6), batch)

    def step() -> None:
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        opt.step()

    step()  # creates the optimizer state
    objects = training_state(model, opt, rng=True)
    late = frozenset({p.data_ptr() for p in model.parameters()}
                     | {v.data_ptr() for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)})
    say("timing the digests")
    out: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "trials": trials}
    out["digest_all_s"] = _timed(lambda: PendingDigest(objects, 1).result(), trials)
    critical, rest = [], []
    for _ in range(trials):  # the main thread's part, then the thread's part left when nothing overlaps it
        t0 = time.perf_counter()
        pending = PendingDigest(objects, 1, late=late)
        t1 = time.perf_counter()
        digest = pending.result()
        critical.append(t1 - t0)
        rest.append(time.perf_counter() - t1)
    out["digest_critical_s"], out["digest_thread_s"] = _summary(critical), _summary(rest)
    out["entries"] = len(digest.names)
    say("timing the commits")
    snap, _ = capture_deferred(objects, step=1, copy=True, checksum=True)
    out["state_bytes"] = snap.header.total_nbytes

    def plain() -> None:
        _, deferred = capture_deferred(objects, step=1, copy=True, checksum=False, reuse=snap, defer=late)
        deferred.run()

    out["plain_commit_s"] = _timed(plain, trials)
    out["snapshot_digest_s"] = _timed(lambda: SnapshotDigest(snap, lambda: None).result(), trials)
    out["verify_commit_s"] = _timed(lambda: capture_deferred(objects, step=1, copy=True, checksum=True, reuse=snap),
                                    trials)
    hashed = [t for t, s in zip(snap.tensors, snap.header.tensors, strict=True)
              if s.name.startswith(("model/", "optimizer/state/"))]  # what the live check hashes
    out["live_check_bytes"] = sum(t.nbytes for t in hashed)
    out["live_check_s"] = _timed(lambda: [zlib.crc32(tensor_bytes(t)) for t in hashed], trials)
    say(f"timing the comparison on {world} ranks")
    out["world"] = world
    out["compare_s"] = _compare_time(world, out["entries"], trials)
    out["step_s"] = _timed(step, max(3, trials // 2))
    return out


def _cmd(args: argparse.Namespace) -> int:
    if args.mb <= 0 or args.batch < 1 or args.trials < 1 or args.world < 2:
        raise ConfigError("--mb and --batch must be positive, --trials at least 1, --world at least 2")

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    report = run(args.mb, args.batch, args.trials, args.world, say)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``digest`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser("digest", help="cost of one cross-replica state check (digest, compare, checked commit)",
                              description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="state size in MB, weights + AdamW moments (100)")
    p.add_argument("--batch", type=int, default=256, help="rows per training step's batch, for step_s (256)")
    p.add_argument("--trials", type=int, default=10, help="timed runs of each part (10)")
    p.add_argument("--world", type=int, default=2, help="ranks of the comparison's gloo group (2)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
