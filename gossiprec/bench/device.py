"""``gossiprec bench device-transfer``: move an accelerator-resident training state between processes.

A donor process builds a model and its AdamW state on ``--device`` (``cuda`` on a GPU machine, ``cpu``
anywhere), captures it into pinned host buffers (:func:`capture_state` into a reused, pinned snapshot: one
device-to-host copy, as the trainer's commits do; ``gossiprec bench commit`` measures those), and serves
it with :class:`DonorServer`. The receiver
(this process) holds the same layout on its device with other values, fetches the state into pinned
staging buffers (:class:`ReceiveTarget` with ``pin_memory``), authenticated chunk by chunk, and loads it
(host-to-device copies in ``load_state_dict``). Then it captures its own state again and compares every
tensor's crc32 with the donor's: ``bit_identical``.

Figures (seconds, MB/s = 10**6 bytes per second): ``capture_s`` device -> pinned host at the donor (best
of ``--repeats``), ``transfer`` per donor count (``--donors 1,4``: several donor processes striping one
transfer), ``apply_s`` pinned host -> device at the receiver, ``tcp_mb_s`` plain loopback TCP in the same
run, the raw pinned copy rates ``d2h_gb_s`` / ``h2d_gb_s`` of one 1 GiB tensor, and
``device_to_device_s`` = capture + best transfer + apply (the three run one after the other).

It needs no accelerator to run (``--device cpu``); CI runs it that way, small, as a smoke test.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from typing import Any

from gossiprec.errors import ConfigError

LAYER_DIM = 4096
"""Square linear layers of this width: 64 MiB of float32 weights each (narrower for states under 200 MB)."""


def layer_shape(nbytes: int) -> tuple[int, int]:
    """(width, count) of the square, bias-free linear layers whose weights and AdamW moments (12 bytes
    per weight) come to about ``nbytes``: 4096 wide, or one narrower layer for a small state."""
    dim = LAYER_DIM
    if nbytes < dim * dim * 12:  # a small state (smoke tests): one narrower layer
        dim = max(64, int((nbytes / 12) ** 0.5) // 64 * 64)
    return dim, max(1, round(nbytes / (dim * dim * 12)))


def _build(device: str, nbytes: int, seed: int) -> dict[str, Any]:
    """Model + AdamW (one real step, so the optimizer state is not zeros) of about ``nbytes`` in all
    (weights are a third: AdamW keeps two moments per weight)."""
    import torch

    from gossiprec.trainer.state.rng import RNGState

    dim, layers = layer_shape(nbytes)
    # every generator the RNG entry captures, seeded: donors built with one seed hold identical states
    torch.manual_seed(seed)
    random.seed(seed)
    gen = torch.Generator(device=device).manual_seed(seed)
    model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim, bias=False, device=device)
                                  for _ in range(layers)])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, device=device))
            p.grad = torch.randn(p.shape, generator=gen, device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    opt.step()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return {"model": model, "optimizer": opt, "rng": RNGState(numpy=False)}


def sync(device: str) -> None:
    """Wait for the device's queued work (a no-op on the CPU)."""
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def _pinned_like(snapshot: Any) -> Any:
    import torch

    from gossiprec.trainer.state.capture import StateSnapshot

    pin = torch.cuda.is_available()
    return StateSnapshot(snapshot.header, tuple(t.pin_memory() if pin else t.clone() for t in snapshot.tensors))


def _donor_main(conn: Any, device: str, nbytes: int, seed: int, key: bytes, repeats: int) -> None:
    """A donor process: build, commit into pinned buffers (timed), serve until told to stop."""
    try:
        from gossiprec.trainer.state.capture import capture_state
        from gossiprec.trainer.transfer.donor import DonorServer

        objects = _build(device, nbytes, seed)
        first = capture_state(objects, step=1, copy=True, checksum=False)
        pinned = _pinned_like(first)
        del first
        times = []
        for _ in range(max(1, repeats)):
            sync(device)
            t0 = time.perf_counter()
            snap = capture_state(objects, step=1, copy=True, checksum=False, reuse=pinned)
            sync(device)
            times.append(time.perf_counter() - t0)
            pinned = snap
        # the served copy carries crc32s (computed on the host bytes, not timed) for the receiver's check
        served = capture_state(objects, step=1, copy=True, checksum=True, reuse=pinned)
        server = DonorServer(lambda epoch, step: served, key, host="127.0.0.1").start()
        conn.send({"port": server.port, "capture_s": times, "state_bytes": served.header.total_nbytes,
                   "crc": [s.crc32 for s in served.header.tensors],
                   "pinned": bool(served.tensors and served.tensors[0].is_pinned())})
        conn.recv()  # stop
        server.close()
    except BaseException as exc:  # reported to the parent, which fails with it
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        conn.close()


def _copy_rates(device: str) -> dict[str, float | None]:
    """Raw pinned host <-> device copy rates of one 1 GiB tensor (GB/s), best of 3; None on cpu."""
    if not device.startswith("cuda"):
        return {"d2h_gb_s": None, "h2d_gb_s": None}
    import torch

    n = 1 << 28  # float32: 1 GiB
    dev = torch.empty(n, device=device)
    host = torch.empty(n, pin_memory=True)
    out: dict[str, float | None] = {}
    for name, dst, src in (("d2h_gb_s", host, dev), ("h2d_gb_s", dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out[name] = round(n * 4 / 1e9 / best, 2)
    return out


def run(device: str, nbytes: int, donors: list[int], repeats: int,
        say: Any = lambda m: None) -> dict[str, Any]:
    import multiprocessing as mp

    import torch

    from gossiprec.trainer.state.capture import capture_state
    from gossiprec.trainer.state.receive import ReceiveTarget
    from gossiprec.bench.transfer import loopback_tcp_baseline
    from gossiprec.trainer.transfer.fetch import fetch_state
    from gossiprec.trainer.transfer.wire import KEY_SIZE

    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("--device cuda: torch sees no CUDA device here (use --device cpu)")
    key = os.urandom(KEY_SIZE)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    say(f"starting {max(donors)} donor process(es) on {device} with ~{nbytes / 1e9:.2f} GB of state each")
    for i in range(max(donors)):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_donor_main, args=(child, device, nbytes, 1, key, repeats), daemon=True,
                        name=f"gossiprec-bench-donor-{i}")
        p.start()
        procs.append(p)
        conns.append(parent)
    try:
        receiver = _build(device, nbytes, 2)  # same layout, other values
        target = ReceiveTarget(receiver, pin_memory=True)
        infos = []
        for c in conns:
            if not c.poll(600):
                raise ConfigError("a donor process did not get ready within 600 s")
            info = c.recv()
            if "error" in info:
                raise ConfigError(f"donor process failed: {info['error']}")
            infos.append(info)
        total = infos[0]["state_bytes"]
        say(f"donors ready: {total / 1e9:.3f} GB each; capture {min(infos[0]['capture_s']):.3f} s")
        addrs = [("127.0.0.1", info["port"]) for info in infos]
        transfer = []
        apply_s = []
        for k in donors:
            secs = []
            for r in range(max(1, repeats)):
                stats = fetch_state(addrs[:k], key, target, step=1, epoch=0, apply=False, timeout=600.0,
                                    verify_crc=False)
                secs.append(stats.seconds)
                bound = target.bind(stats.header)
                sync(device)
                t0 = time.perf_counter()
                bound.apply()
                sync(device)
                apply_s.append(time.perf_counter() - t0)
                say(f"  {k} donor(s), try {r + 1}: {total / 1e6 / stats.seconds:,.0f} MB/s, "
                    f"apply {apply_s[-1]:.3f} s")
            transfer.append({"donors": k, "seconds": [round(s, 4) for s in secs],
                             "mb_s": round(total / 1e6 / min(secs), 1)})
        mine = capture_state(receiver, step=1, copy=True, checksum=True)
        same = [s.crc32 for s in mine.header.tensors] == infos[0]["crc"]
        tcp = [loopback_tcp_baseline(total) for _ in range(2)]
    finally:
        for c in conns:
            try:
                c.send("stop")
            except (OSError, ValueError):
                pass
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    best = max(transfer, key=lambda t: t["mb_s"])
    capture = min(min(i["capture_s"]) for i in infos)
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "state_bytes": total,
        "pinned": infos[0]["pinned"],
        "capture_s": round(capture, 4),
        "capture_gb_s": round(total / 1e9 / capture, 2),
        "transfer": transfer,
        "apply_s": round(min(apply_s), 4),
        "apply_gb_s": round(total / 1e9 / min(apply_s), 2),
        "tcp_mb_s": round(statistics.median(tcp), 1),
        "transfer_vs_tcp": round(best["mb_s"] / statistics.median(tcp), 3),
        "device_to_device_s": round(capture + total / 1e6 / best["mb_s"] + min(apply_s), 3),
        "bit_identical": same,
        "cpu_count": os.cpu_count(),
        "loadavg": [round(x, 2) for x in os.getloadavg()],
    }
    report.update(_copy_rates(device))
    return report


def _cmd(args: argparse.Namespace) -> int:
    try:
        donors = sorted({int(x) for x in args.donors.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--donors takes counts like 1,4, got {args.donors!r}") from None
    if not donors or donors[0] < 1 or donors[-1] > 16:
        raise ConfigError("--donors: counts between 1 and 16")
    if args.gb <= 0 or args.repeats < 1:
        raise ConfigError("--gb must be positive and --repeats at least 1")

    def say(msg: str) -> None:
        if not args.quiet:
            print(msg, file=sys.stderr, flush=True)

    report = run(args.device, int(args.gb * 1e9), donors, args.repeats, say)
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0 if report["bit_identical"] else 1


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``device-transfer`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser(
        "device-transfer", help="move a GPU-resident (or CPU) training state between processes via pinned buffers",
        description="Donor processes build a model + AdamW state on --device and copy it into pinned host "
                    "buffers; this process fetches it from them (striped over --donors), authenticated, into "
                    "pinned staging buffers, loads it onto its device and compares every tensor's crc32 with "
                    "the donor's. Prints one JSON report: capture_s (device to host), transfer MB/s per donor "
                    "count, apply_s (host to device), plain loopback TCP MB/s, bit_identical.")
    p.add_argument("--device", default="cuda", help="torch device of the state: cuda (default) or cpu")
    p.add_argument("--gb", type=float, default=4.0, help="state size in GB, weights + AdamW moments (4)")
    p.add_argument("--donors", default="1,4", help="donor counts to stripe over, e.g. 1,4 (default)")
    p.add_argument("--repeats", type=int, default=2, help="tries per donor count (best is reported)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
