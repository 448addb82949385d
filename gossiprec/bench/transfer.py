"""Loopback measurements of the state transfer: plain TCP, and :func:`fetch_state` against it.

:func:`loopback_tcp_baseline` is the reference the recovery and device-transfer benches report the
transfer's throughput against; :func:`benchmark` is one quick measurement of both.
"""

from __future__ import annotations

import os
import socket
import threading
import time

from gossiprec.errors import TransferError
from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.state.receive import ReceiveTarget
from gossiprec.trainer.transfer.wire import DEFAULT_CHUNK, KEY_SIZE, recv_into_exact, seal_state


def loopback_tcp_baseline(nbytes: int, chunk_size: int = 4 * 1024 * 1024) -> float:
    """Plain TCP throughput on loopback, MB/s (10**6 bytes): one connection, sendall / recv_into of
    preallocated buffers, no authentication; the reference :func:`fetch_state` is compared with.

    The receiver's buffer is written once before the clock starts, as the tensors a fetch lands in
    are: a fresh one would fault its pages in during the measurement and flatter the transfer."""
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
        t0 = time.monotonic()
        for pos in range(0, nbytes, chunk_size):
            out.sendall(src[pos:pos + chunk_size])
        th.join(60)
    server.close()
    if not result:
        raise TransferError("loopback baseline did not finish within 60 s")
    return nbytes / 1e6 / (result[0] - t0)


def benchmark(nbytes: int = 100 * 1000 * 1000, n_donors: int = 1, chunk_size: int = DEFAULT_CHUNK,
              verify_crc: bool = False) -> dict[str, float]:
    """One loopback measurement: plain TCP vs :func:`fetch_state` of an ``nbytes`` float32 state.

    Returns ``{"tcp_mb_s", "transfer_mb_s", "ratio", "verify_ms", "apply_ms"}``. Needs torch.
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
    sealed = seal_state(snap, key, chunk_size=chunk_size)
    servers = [DonorServer(lambda e, s: sealed, key, host="127.0.0.1").start() for _ in range(n_donors)]
    try:
        tcp = loopback_tcp_baseline(snap.header.total_nbytes)
        stats = fetch_state([("127.0.0.1", s.port) for s in servers], key, dst, step=1, epoch=0,
                            verify_crc=verify_crc)
    finally:
        for s in servers:
            s.close()
    return {"tcp_mb_s": tcp, "transfer_mb_s": stats.mb_per_s, "ratio": stats.mb_per_s / tcp,
            "verify_ms": stats.verify_seconds * 1e3, "apply_ms": stats.apply_seconds * 1e3}
