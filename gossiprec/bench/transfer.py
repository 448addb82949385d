"""Loopback measurements of the state transfer: plain TCP, and :func:`fetch_state` against it.

:func:`loopback_tcp_baseline` is the reference the recovery and device-transfer benches report the
transfer's throughput against; :func:`benchmark` measures both in turns, with their CPU time per MB
(``gossiprec bench transfer``).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import threading
import time
from typing import Any

from gossiprec.errors import ConfigError, TransferError
from gossiprec.trainer.state.capture import StateSnapshot, capture_state
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.state.receive import ReceiveTarget
from gossiprec.trainer.transfer.wire import DEFAULT_CHUNK, KEY_SIZE, SealedState, recv_into_exact, seal_state


def loopback_tcp_baseline(nbytes: int, chunk_size: int = 4 * 1024 * 1024) -> float:
    """Plain TCP throughput on loopback, MB/s (10**6 bytes): one connection, sendall / recv_into of
    preallocated buffers, no authentication; the reference :func:`fetch_state` is compared with.

    The receiver's buffer is written once before the clock starts, as the tensors a fetch lands in
    are: a fresh one would fault its pages in during the measurement and flatter the transfer."""
    return loopback_tcp(nbytes, chunk_size)[0]


def loopback_tcp(nbytes: int, chunk_size: int = 4 * 1024 * 1024) -> tuple[float, float]:
    """:func:`loopback_tcp_baseline` and the process CPU seconds (both ends) of its timed part."""
    src = memoryview(bytearray(os.urandom(min(nbytes, 1 << 20)) * (nbytes // (1 << 20) + 1))[:nbytes])
    dst = memoryview(bytearray(src))
    server = socket.create_server(("127.0.0.1", 0))
    result: list[float] = []

    def receive() -> None:
        conn, _ = server.accept()
        with conn:
            recv_into_exact(conn, dst)
            result.append(time.monotonic())

    th = threading.Thread(target=receive, daemon=True)
    th.start()
    with socket.create_connection(server.getsockname()) as out:
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        c0 = time.process_time()
        t0 = time.monotonic()
        for pos in range(0, nbytes, chunk_size):
            out.sendall(src[pos:pos + chunk_size])
        th.join(60)
        cpu = time.process_time() - c0
    server.close()
    if not result:
        raise TransferError("loopback baseline did not finish within 60 s")
    return nbytes / 1e6 / (result[0] - t0), cpu


def benchmark(nbytes: int = 100 * 1000 * 1000, n_donors: int = 1, chunk_size: int = DEFAULT_CHUNK,
              verify_crc: bool = False, trials: int = 1, lazy: bool = False) -> dict[str, Any]:
    """Loopback measurements: plain TCP vs :func:`fetch_state` of an ``nbytes`` float32 state, taking
    turns ``trials`` times in one process (donors on threads of this process, as many as asked).

    ``lazy``: the donors serve the raw snapshot and tag its chunks as they serve them (what a recovery's
    donor does); otherwise it is sealed before the clock starts. Returns the medians
    ``{"tcp_mb_s", "transfer_mb_s", "ratio", "verify_ms", "apply_ms", "tcp_cpu_ms_per_mb",
    "transfer_cpu_ms_per_mb"}`` and ``per_trial`` (each trial's figures, its ratio over its own TCP).
    The CPU figures are this process's CPU time (every thread: sender, receiver, checkers, taggers)
    per MB moved, steadier than the wall figures on shared cores. Needs torch.
    """
    import torch

    class _Blob:
        def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
            self.tensors = tensors

        def state_dict(self) -> dict[str, torch.Tensor]:
            return self.tensors

        def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
            self.tensors = sd

    per = 8 * 1024 * 1024
    sizes = [per] * (nbytes // (4 * per)) + ([nbytes // 4 % per] if nbytes // 4 % per else [])
    src = {f"t{i}": torch.rand(n) for i, n in enumerate(sizes)}
    snap = capture_state({"blob": _Blob(src)}, step=1)
    dst = ReceiveTarget({"blob": _Blob({k: torch.zeros_like(v) for k, v in src.items()})})
    key = os.urandom(KEY_SIZE)
    mb = snap.header.total_nbytes / 1e6
    rows: list[dict[str, float]] = []
    for _ in range(trials):
        tcp, tcp_cpu = loopback_tcp(snap.header.total_nbytes)
        # a fresh snapshot object: the donors' lazy seals are per snapshot, so each trial tags anew
        served: SealedState | StateSnapshot = (StateSnapshot(snap.header, snap.tensors) if lazy
                                               else seal_state(snap, key, chunk_size=chunk_size))
        servers = [DonorServer(lambda e, s, served=served: served, key, host="127.0.0.1",  # type: ignore[misc]
                               chunk_size=chunk_size).start()
                   for _ in range(n_donors)]
        try:
            c0 = time.process_time()
            stats = fetch_state([("127.0.0.1", s.port) for s in servers], key, dst, step=1, epoch=0,
                                verify_crc=verify_crc)
            cpu = time.process_time() - c0
        finally:
            for s in servers:
                s.close()
        rows.append({"tcp_mb_s": round(tcp, 1), "transfer_mb_s": round(stats.mb_per_s, 1),
                     "ratio": round(stats.mb_per_s / tcp, 3), "verify_ms": stats.verify_seconds * 1e3,
                     "apply_ms": stats.apply_seconds * 1e3, "tcp_cpu_ms_per_mb": round(tcp_cpu * 1e3 / mb, 4),
                     "transfer_cpu_ms_per_mb": round(cpu * 1e3 / mb, 4)})
    out: dict[str, Any] = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    out["per_trial"] = rows
    return out


def _cmd(args: argparse.Namespace) -> int:
    if args.mb <= 0 or args.donors < 1 or args.trials < 1:
        raise ConfigError("--mb must be positive, --donors and --trials at least 1")
    report = {"bench": "transfer", "state_bytes": int(args.mb * 1e6), "donors": args.donors,
              "seal": "lazy" if args.lazy else "commit", "trials": args.trials, "cpu_count": os.cpu_count(),
              "loadavg_1m_start": round(os.getloadavg()[0], 2),
              **benchmark(int(args.mb * 1e6), args.donors, trials=args.trials, lazy=args.lazy),
              "loadavg_1m_end": round(os.getloadavg()[0], 2)}
    print(json.dumps(report) if args.json else json.dumps(report, indent=2), flush=True)
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``transfer`` to the ``bench`` sub-commands (sets ``func``)."""
    p = subparsers.add_parser("transfer", help="state transfer vs plain loopback TCP, in one process",
                              description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--mb", type=float, default=100.0, help="state size in MB (100)")
    p.add_argument("--donors", type=int, default=1, help="donors striping the transfer (1)")
    p.add_argument("--trials", type=int, default=5, help="turns of plain TCP and transfer (5)")
    p.add_argument("--lazy", action="store_true",
                   help="donors tag the chunks as they serve them, as a recovery's donor does (default: sealed before)")
    p.add_argument("--json", action="store_true", help="one JSON line")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
