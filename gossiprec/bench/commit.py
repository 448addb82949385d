"""``gossiprec bench commit``: what a commit per step costs a training loop, on a GPU or on the CPU.

A model (square linear layers, ``--gb`` of weights + AdamW moments) trains on ``--device`` with a
fixed batch; every step is forward, backward, optimizer step. Three loops of ``--steps`` steps each,
after ``--warmup`` steps, in the order given by ``--modes``:

``none``
    no commit: the reference.
``inline``
    :class:`ResilientTrainer` with ``background_snapshot=False``: the commit copies the whole state
    inside ``commit()`` (device to host, synchronously, into reused host buffers).
``deferred``
    :class:`ResilientTrainer` with its default ``background_snapshot=True``: parameters and optimizer
    state are copied by a background thread while the next step computes (for CUDA tensors: into
    pinned host buffers, on a side stream that waits for the optimizer step, so the DMA runs beside
    the next step's kernels); the next optimizer step waits for the copy. Two host copies of the state
    (``TrainerConfig.snapshot_copies=2``).
``single``
    ``deferred`` with one host copy, overwritten in place (``snapshot_copies=1``).
``live``
    no host copy of parameters and optimizer state (``snapshot_copies=0``): a commit holds views of
    the live tensors; only buffers, RNG and data position are copied.

``--sizes-mb 1,100,1000`` runs the loops at each state size and adds, per size, the floor: one memory copy
of the whole state into buffers allocated beforehand (the least a commit that keeps a copy can cost),
and per mode the process's CPU per step (every thread: the background copies count) and what it adds to
``none``'s (``added_cpu_ms``: it holds the step's own spread between loops too), and the trainer's own
CPU per step (``own_cpu_ms``: the main thread's CPU inside the trainer's calls plus the CPU of its
``gossiprec-*`` threads, read per thread). ``--threads 1`` (the default) runs torch on one thread, so
that a copy's CPU lands on the thread that makes it and the floor's CPU time is comparable.
``--step-ms`` pads each step with a sleep to at least that long (it stands in for the
accelerator's compute, during which the host is idle). ``--rounds`` repeats the loops, in reverse order
every other round, so that a drifting load biases no mode; figures are medians over all rounds' steps.

The trainer runs without an agent and without a process group (a stub stands in for the control
socket): the loop calls ``commit()`` after the optimizer step and, before the next optimizer step,
what ``allreduce_gradients`` does once its collective is done (wait for the last commit's copies,
refuse a torn snapshot). So the figures are the commit's cost alone.

Report: per mode the median, p10 and p90 step time (host wall clock from one step's end to the next's,
the device synchronised at each step's end: nothing the commit leaves running escapes the timing, since
the next optimizer step waits for it) and the overhead against ``none`` (ratio of medians minus one),
the state size, the host memory each mode keeps for recovery (``host_bytes_kept``, and as a multiple
of the state: ``host_copies_of_state``), and ``snapshot_identical``: the last snapshot, once settled,
holds the bytes a synchronous capture of the same step gives (crc32 of every tensor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from typing import Any

from gossiprec.bench.device import layer_shape, sync
from gossiprec.errors import ConfigError

MODES = ("none", "inline", "deferred", "single", "live")
COPIES = {"inline": 2, "deferred": 2, "single": 1, "live": 0}


class _StubControl:
    """Stands in for the agent's control socket: the trainer's reports and state go nowhere."""

    path = ""
    node = "bench"

    def report(self, *args: Any, **kwargs: Any) -> None:
        pass

    def set_state(self, *args: Any, **kwargs: Any) -> None:
        pass


def _build(device: str, nbytes: int, batch: int, seed: int = 0) -> tuple[Any, Any, Any, Any]:
    """The device-transfer bench's layers (:func:`~gossiprec.bench.device.layer_shape`) with torch's
    default initialisation, so that training stays finite, a fresh AdamW and one fixed batch."""
    import torch

    dim, layers = layer_shape(nbytes)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, device=device) for _ in range(layers)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(batch, dim, device=device, generator=gen)
    y = torch.randn(batch, dim, device=device, generator=gen)
    return model, opt, x, y


def _loop(mode: str, device: str, nbytes: int, batch: int, steps: int, warmup: int,
          say: Any, step_s: float = 0.0) -> tuple[list[float], list[float], int, bool | None, int, float]:
    import torch

    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.state.header import tensor_bytes
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.state.rng import RNGState

    model, opt, x, y = _build(device, nbytes, batch)
    params = list(model.parameters())
    rt = None
    if mode != "none":
        config = TrainerConfig(background_snapshot=mode != "inline", stateless_data=True,
                               snapshot_copies=COPIES[mode])
        rt = ResilientTrainer({"model": model, "optimizer": opt, "rng": RNGState(numpy=False)}, config,
                              control=_StubControl(), key=bytes(32))  # type: ignore[arg-type]
    times: list[float] = []
    cpus: list[float] = []
    own = 0.0  # the main thread's CPU inside the trainer's calls, over the timed steps
    threads0: dict[int, float] = {}
    sync(device)
    t_prev = time.perf_counter()
    c_prev = time.process_time()
    for i in range(warmup + steps):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=False)
        loss.backward()
        if rt is not None:
            c0 = time.thread_time()
            rt.snapshots.settle()  # what allreduce_gradients does before it returns
            if rt.snapshots.background:
                rt.snapshots.update_late(params)
            own += (time.thread_time() - c0) if i >= warmup else 0.0
        opt.step()
        if rt is not None:
            c0 = time.thread_time()
            rt.commit()
            own += (time.thread_time() - c0) if i >= warmup else 0.0
        sync(device)  # the step's kernels; copies still queued on the side stream count in a later step
        if step_s:  # the rest of the step is the accelerator's: the host sleeps (background copies run)
            time.sleep(max(0.0, step_s - (time.perf_counter() - t_prev)))
        if i == warmup - 1:  # the copies of the last untimed commit are not the timed steps'
            if rt is not None:
                rt.snapshots.settle()
            threads0 = _own_threads_cpu()
        t, c = time.perf_counter(), time.process_time()
        if i >= warmup:
            times.append(t - t_prev)
            cpus.append(c - c_prev)
        t_prev, c_prev = t, c
    if rt is not None:
        c0 = time.thread_time()
        rt.snapshots.settle()  # the last step's background copies belong to the timed steps
        own += time.thread_time() - c0
    threads1 = _own_threads_cpu()
    own += sum(cpu - threads0.get(ident, 0.0) for ident, cpu in threads1.items())
    same: bool | None = None
    state_bytes = kept = 0
    if rt is not None:
        snap = rt.snapshots.at(rt.step)  # settled: the background copies are done
        assert snap is not None
        state_bytes = snap.header.total_nbytes
        kept = rt.snapshots.host_bytes()
        ref = capture_state(rt.objects, step=rt.step, copy=True, checksum=True)
        same = [zlib.crc32(tensor_bytes(t)) for t in snap.tensors] == [s.crc32 for s in ref.header.tensors]
        rt.close()
    say(f"{mode}: median step {statistics.median(times) * 1000:.2f} ms, CPU {statistics.median(cpus) * 1000:.2f} ms, "
        f"gossiprec's own CPU {own / steps * 1000:.2f} ms per step over {steps} steps")
    return times, cpus, state_bytes, same, kept, own / steps


def _own_threads_cpu() -> dict[int, float]:
    """CPU seconds so far of each of the trainer's own threads (named ``gossiprec-*``: the snapshot
    copier, the digest), by thread ident."""
    import threading

    out: dict[int, float] = {}
    for th in threading.enumerate():
        if th.name.startswith("gossiprec-") and th.ident is not None:
            try:
                out[th.ident] = time.clock_gettime(time.pthread_getcpuclockid(th.ident))
            except (OSError, ProcessLookupError):  # it ended between the two calls
                pass
    return out


def _stats(xs: list[float]) -> dict[str, float]:
    s = sorted(xs)
    return {"median_s": round(statistics.median(s), 5), "p10_s": round(s[len(s) // 10], 5),
            "p90_s": round(s[(len(s) * 9) // 10], 5)}


def run(device: str, nbytes: int, batch: int, steps: int, warmup: int, modes: list[str],
        say: Any = lambda m: None) -> dict[str, Any]:
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here (use --device cpu)")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "torch_threads": torch.get_num_threads(), "batch": batch,
                           "steps": steps, "modes": {}}
    out.update(_measure(device, nbytes, batch, steps, warmup, modes, say))
    return out


def _measure(device: str, nbytes: int, batch: int, steps: int, warmup: int, modes: list[str], say: Any,
             step_s: float = 0.0, rounds: int = 1) -> dict[str, Any]:
    """Every mode's loop, ``rounds`` times (reversed every other round); figures over all rounds' steps."""
    times: dict[str, list[float]] = {m: [] for m in modes}
    cpus: dict[str, list[float]] = {m: [] for m in modes}
    owns: dict[str, list[float]] = {m: [] for m in modes}
    rows: dict[str, dict[str, Any]] = {}
    out: dict[str, Any] = {}
    for r in range(rounds):
        for mode in modes if r % 2 == 0 else modes[::-1]:
            t, c, state_bytes, same, kept, own = _loop(mode, device, nbytes, batch, steps, warmup, say, step_s)
            times[mode] += t
            cpus[mode] += c
            owns[mode].append(own)
            row = rows.setdefault(mode, {"snapshot_identical": same, "host_bytes_kept": kept})
            if same is False:
                row["snapshot_identical"] = False
            if state_bytes:
                out["state_bytes"] = state_bytes
                row["host_copies_of_state"] = round(kept / state_bytes, 3)
    for mode in modes:
        rows[mode].update(_stats(times[mode]), cpu_s=round(statistics.median(cpus[mode]), 5),
                          own_cpu_ms=round(1000 * statistics.median(owns[mode]), 3) if mode != "none" else None)
    base = rows.get("none")  # (the figures as reported, so that each overhead follows from the report)
    for mode in modes:
        row = rows[mode]
        row["overhead_pct"] = (round(100 * (row["median_s"] / base["median_s"] - 1), 2)
                               if base and mode != "none" else None)
        row["added_cpu_ms"] = round(1000 * (row["cpu_s"] - base["cpu_s"]), 3) if base and mode != "none" else None
    out["modes"] = {m: rows[m] for m in modes}
    return out


def floor_copy_s(device: str, nbytes: int, batch: int, reps: int = 5) -> tuple[float, float]:
    """The median wall time and process CPU time (every thread) of one memory copy of the loops' whole
    state (weights and AdamW moments, after a step) into buffers allocated beforehand: the least a
    commit that keeps one copy can cost."""
    import torch

    model, opt, x, y = _build(device, nbytes, batch)
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    src = [p.detach() for p in model.parameters()] + [
        t for st in opt.state.values() for t in st.values() if isinstance(t, torch.Tensor) and t.dim() > 0]
    dst = [torch.empty_like(t, device="cpu", pin_memory=device.startswith("cuda")) for t in src]
    took, cpu = [], []
    for _ in range(reps + 1):  # (the first touches the buffers' pages: not counted)
        sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        for d, t in zip(dst, src):
            d.copy_(t, non_blocking=device.startswith("cuda"))
        sync(device)
        took.append(time.perf_counter() - t0)
        cpu.append(time.process_time() - c0)
    return statistics.median(took[1:]), statistics.median(cpu[1:])


TARGETS = {"live_overhead_pct_at_100mb": 0.5, "live_own_cpu_ms_at_100mb": 0.5, "single_own_cpu_ms_over_floor": 0.5}
"""Issue 38's targets for the per-step cost: no copy at most 0.5% of a 100 ms step at 100 MB, on the wall
clock and in the trainer's own CPU (which would be on the step's critical path were the host the
bottleneck); one copy at most the floor's CPU (one memory copy of the state) plus 0.5 ms per step."""


def run_sizes(device: str, sizes_mb: list[float], batch: int, steps: int, warmup: int, modes: list[str],
              say: Any = lambda m: None, step_ms: float = 0.0, rounds: int = 1) -> dict[str, Any]:
    """:func:`run` at every size of ``sizes_mb``, with the floor of one copy per size and each mode's
    added CPU per step; ``met`` says per size whether the targets (:data:`TARGETS`) hold."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here (use --device cpu)")
    if "none" not in modes:
        raise ConfigError("--sizes-mb compares every mode with the loop without gossiprec: --modes must hold none")
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
                           "torch": torch.__version__, "batch": batch, "steps": steps, "rounds": rounds,
                           "step_ms": step_ms, "torch_threads": torch.get_num_threads(), "targets": TARGETS,
                           "sizes": []}
    for mb in sizes_mb:
        nbytes = int(mb * 1e6)
        floor, floor_cpu = floor_copy_s(device, nbytes, batch)
        say(f"{mb:g} MB: one copy of the state {floor * 1000:.2f} ms, {floor_cpu * 1000:.2f} ms of CPU")
        row: dict[str, Any] = {"state_mb": mb, "floor_copy_ms": round(floor * 1000, 3),
                               "floor_copy_cpu_ms": round(floor_cpu * 1000, 3)}
        row.update(_measure(device, nbytes, batch, steps, warmup, modes, say, step_ms / 1000, rounds))
        met: dict[str, bool] = {}
        if "live" in row["modes"] and mb == 100:
            met["live_overhead"] = row["modes"]["live"]["overhead_pct"] <= TARGETS["live_overhead_pct_at_100mb"]
            met["live_own_cpu"] = row["modes"]["live"]["own_cpu_ms"] <= TARGETS["live_own_cpu_ms_at_100mb"]
        if "single" in row["modes"]:
            met["single_cpu"] = (row["modes"]["single"]["own_cpu_ms"]
                                 <= row["floor_copy_cpu_ms"] + TARGETS["single_own_cpu_ms_over_floor"])
        row["met"] = met
        out["sizes"].append(row)
    return out


def _cmd(args: argparse.Namespace) -> int:
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in MODES for m in modes):
        raise ConfigError(f"--modes takes some of {', '.join(MODES)}, got {args.modes!r}")
    if args.gb <= 0 or args.batch < 1 or args.steps < 2 or args.warmup < 0:
        raise ConfigError("--gb and --batch must be positive, --steps at least 2, --warmup not negative")

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    if args.step_ms < 0 or args.rounds < 1 or args.threads < 0:
        raise ConfigError("--step-ms and --threads must not be negative and --rounds at least 1")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if args.sizes_mb:
        try:
            sizes = [float(x) for x in args.sizes_mb.split(",") if x.strip()]
        except ValueError:
            sizes = []
        if not sizes or any(x <= 0 for x in sizes):
            raise ConfigError(f"--sizes-mb takes positive sizes in MB separated by commas, got {args.sizes_mb!r}")
        report = run_sizes(args.device, sizes, args.batch, args.steps, args.warmup, modes, say, args.step_ms,
                           args.rounds)
        rows = [r for size in report["sizes"] for r in size["modes"].values()]
    else:
        report = run(args.device, int(args.gb * 1e9), args.batch, args.steps, args.warmup, modes, say)
        rows = list(report["modes"].values())
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0 if all(r["snapshot_identical"] is not False for r in rows) else 1


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``commit`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "commit", help="step-time cost of a commit per step (GPU or CPU state), no agent",
        description="Train a model on --device with and without the trainer's commit per step (copies "
                    "inside commit(), or in the background into pinned buffers) and print the step times "
                    "and overheads as JSON.")
    p.add_argument("--device", default="cuda", help="torch device: cuda (default) or cpu")
    p.add_argument("--gb", type=float, default=1.0, help="state size in GB, weights + AdamW moments (1)")
    p.add_argument("--batch", type=int, default=4096, help="rows per step's batch (4096)")
    p.add_argument("--steps", type=int, default=30, help="timed steps per mode (30)")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (5)")
    p.add_argument("--modes", default=",".join(MODES), help=f"loops to run, in order ({','.join(MODES)})")
    p.add_argument("--sizes-mb", dest="sizes_mb", default="",
                   help="state sizes in MB, e.g. 1,100,1000: the loops at each, with the floor of one memory copy "
                        "of the state and each mode's added CPU per step (instead of --gb)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=0.0,
                   help="pad every step with a sleep to at least this long (the accelerator's compute; 0: none)")
    p.add_argument("--rounds", type=int, default=1, help="repeat the loops, in reverse order every other round (1)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (1: every copy runs on the thread that makes it, so that each "
                        "thread's CPU is its own; 0: torch's default)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
