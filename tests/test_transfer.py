"""State transfer over TCP: striping, bit-exactness, authentication and prompt failure on donor loss."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Iterator

import msgpack
import pytest
import torch

from gossiprec.errors import ConfigError, SecurityError, TransferError
from gossiprec.bench.transfer import benchmark
from gossiprec.trainer.transfer import wire as transfer_wire
from gossiprec.trainer.state.capture import StateSnapshot, capture_state
from gossiprec.trainer.state.header import TensorSpec, tensor_bytes
from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.receive import LayoutMismatch, ReceiveTarget, materialize_optimizer_state
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.transfer.wire import (
    TransferAuthError, TransferRequest, encode_request, even_stripes, plan_chunks, seal_state, select_chunks,
)

KEY = bytes(range(32))
LOCAL = "127.0.0.1"


def build(seed: int, hidden: int = 64) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(32, hidden), torch.nn.ReLU(), torch.nn.Linear(hidden, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def trained(steps: int = 3) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    model, opt, sched = build(0)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 32)).sum().backward()
        opt.step()
        sched.step()
    return model, opt, sched


def spare(hidden: int = 64) -> tuple[dict[str, Any], ReceiveTarget]:
    model, opt, sched = build(7, hidden)
    materialize_optimizer_state(opt)
    objects = training_state(model, opt, sched, rng=False)
    return objects, ReceiveTarget(objects)


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    for name in ("model", "optimizer", "scheduler"):
        sa, sb = a[name].state_dict(), b[name].state_dict()
        if name == "model":
            assert sa.keys() == sb.keys()
            for k in sa:
                assert torch.equal(sa[k], sb[k]), k
        elif name == "optimizer":
            assert sa["param_groups"] == sb["param_groups"]
            for pid in sa["state"]:
                for k, v in sa["state"][pid].items():
                    assert torch.equal(v, sb["state"][pid][k]), (pid, k)
        else:
            assert sa == sb


@pytest.fixture
def donor_objects() -> dict[str, Any]:
    return training_state(*trained(), rng=False)


def serve(snapshot: StateSnapshot | transfer_wire.SealedState, **kw: Any) -> DonorServer:
    return DonorServer(lambda epoch, step: snapshot, KEY, host=LOCAL, **kw).start()


# ------------------------------------------------------------------------------------------------
# pure plans


def test_chunks_never_cross_tensors_and_stripes_partition_them() -> None:
    sizes = [0, 5, 4096 * 3 + 7, 1, 8192, 0, 12345]
    specs, off = [], 0
    for i, n in enumerate(sizes):
        specs.append(TensorSpec(f"t{i}", "uint8", (n,), off, n, None))
        off += n
    chunks = plan_chunks(specs, 0, off, 4096)
    assert sum(hi - lo for _, lo, hi in chunks) == off
    assert all(0 <= lo < hi <= specs[ti].nbytes and hi - lo <= 4096 for ti, lo, hi in chunks)
    rnd = random.Random(1)
    for _ in range(50):
        cuts = sorted(rnd.randrange(off + 1) for _ in range(rnd.randrange(1, 4)))
        bounds = [0, *cuts, off]
        stripes = list(zip(bounds, bounds[1:]))
        picked = [g for s, e in stripes for g in select_chunks(chunks, specs, s, e)]
        assert picked == list(range(len(chunks)))
    assert even_stripes(10_000, 3, align=1000) == [(0, 3000), (3000, 6000), (6000, 10_000)]


# ------------------------------------------------------------------------------------------------
# in-process donors


def test_two_donors_stripe_one_receiver_bit_exact(donor_objects: dict[str, Any]) -> None:
    # two replicas captured and sealed separately (different seal salts), one receiver
    a = seal_state(capture_state(donor_objects, step=3), KEY, chunk_size=4096)
    b = seal_state(capture_state(donor_objects, step=3), KEY, chunk_size=4096)
    objects, target = spare()
    total = target.total_nbytes
    with serve(a) as da, serve(b) as db:
        stats = fetch_state([(LOCAL, da.port), (LOCAL, db.port)], KEY, target, step=3, epoch=1,
                            stripes=[(0, total // 3 + 5), (total // 3 + 5, total)], verify_crc=True)
    assert_same_state(donor_objects, objects)
    assert [d.port for d in stats.donors] == [da.port, db.port]
    assert all(d.nbytes > 0 for d in stats.donors)
    assert sum(d.nbytes for d in stats.donors) == total == stats.nbytes
    assert stats.step == 3 and stats.mb_per_s > 0
    assert da.counters["served"] == db.counters["served"] == 1


def test_default_stripes_and_lazy_sealing(donor_objects: dict[str, Any]) -> None:
    snap = capture_state(donor_objects, step=3)
    objects, target = spare()
    with serve(snap, chunk_size=4096) as d1, serve(snap, chunk_size=4096) as d2, \
            serve(snap, chunk_size=4096) as d3:
        stats = fetch_state([(LOCAL, d.port) for d in (d1, d2, d3)], KEY, target, step=3, epoch=0)
        # each donor tagged only the chunks of its own stripe, and only once
        seals = [d._last_seal for d in (d1, d2, d3)]
        assert all(s is not None for s in seals)
        tagged = [{g for g, t in enumerate(s._tags) if t is not None} for s in seals]  # type: ignore[union-attr]
        n_chunks = len(seals[0].chunks)  # type: ignore[union-attr]
        assert all(tagged) and set.union(*tagged) == set(range(n_chunks))
        assert sum(len(t) for t in tagged) == n_chunks  # disjoint: no chunk tagged twice
    assert_same_state(donor_objects, objects)
    assert len(stats.donors) == 3


def test_prepared_stripe_is_tagged_before_the_request(donor_objects: dict[str, Any]) -> None:
    snap = capture_state(donor_objects, step=3)
    objects, target = spare()
    total = target.total_nbytes
    with serve(snap, chunk_size=4096) as d:
        d.prepare(snap, [(0, total // 2)])
        seal = d._last_seal
        assert seal is not None and seal.snapshot is snap
        first = {g for g, t in enumerate(seal._tags) if t is not None}
        assert first == set(seal.stripe(0, total // 2)) and len(first) < len(seal.chunks)
        fetch_state([(LOCAL, d.port)], KEY, target, step=3, epoch=0)
        assert d._last_seal is seal  # the same lazy seal served the request: the prepared tags were used
    assert_same_state(donor_objects, objects)


def test_corrupted_byte_in_transit_is_refused(donor_objects: dict[str, Any]) -> None:
    sealed = seal_state(capture_state(donor_objects, step=3), KEY, chunk_size=4096)
    _, target = spare()
    with serve(sealed) as donor, FlipProxy(LOCAL, donor.port, flip_at=20_000) as proxy:
        with pytest.raises(TransferAuthError, match=r"chunk \d+ from donor .* failed authentication"):
            fetch_state([(LOCAL, proxy.port)], KEY, target, step=3, epoch=0)
    assert proxy.flipped


def test_snapshot_changed_after_sealing_is_refused(donor_objects: dict[str, Any]) -> None:
    snap = capture_state(donor_objects, step=3)
    sealed = seal_state(snap, KEY, chunk_size=4096)
    snap.tensors[1].view(-1)[0] += 1.0  # the donor's memory changes under the seal
    _, target = spare()
    with serve(sealed) as donor, pytest.raises(TransferAuthError, match="model/0.bias"):
        fetch_state([(LOCAL, donor.port)], KEY, target, step=3, epoch=0)


def test_corrupted_tag_in_transit_is_refused(donor_objects: dict[str, Any]) -> None:
    # each chunk's tag follows the chunk on the wire: flip a bit of the first chunk's tag, not its bytes
    snap = capture_state(donor_objects, step=3)
    sealed = seal_state(snap, KEY, chunk_size=4096)
    req = TransferRequest(0, 3, 0, transfer_wire.WHOLE)
    body = msgpack.packb({**req.to_wire(), "chunk": 4096, "salt": sealed.salt, "state": snap.header.to_wire()},
                         use_bin_type=True)
    first_tag = transfer_wire.RESP_PREFIX.size + len(body) + transfer_wire.TAG_SIZE + sealed.chunks[0][2]
    _, target = spare()
    with serve(sealed) as donor, FlipProxy(LOCAL, donor.port, flip_at=first_tag + 5) as proxy:
        with pytest.raises(TransferAuthError, match=r"chunk 0 from donor .* failed authentication"):
            fetch_state([(LOCAL, proxy.port)], KEY, target, step=3, epoch=0)
    assert proxy.flipped
    # the flipped byte was the tag's: chunk 0's bytes landed intact, and were refused all the same
    ti, lo, hi = sealed.chunks[0]
    landed = tensor_bytes(target.bind(snap.header).tensors[ti])[lo:hi]
    assert bytes(landed) == bytes(snap.views()[ti][lo:hi])
    # the same stream unflipped lands bit-exact (so the offset above is the tag's, not a header's)
    objects, target = spare()
    with serve(sealed) as donor, FlipProxy(LOCAL, donor.port, flip_at=1 << 40) as proxy:
        fetch_state([(LOCAL, proxy.port)], KEY, target, step=3, epoch=0)
    assert_same_state(donor_objects, objects)


def test_lazy_seal_threads_tag_every_chunk_once_and_in_parallel(donor_objects: dict[str, Any]) -> None:
    snap = capture_state(donor_objects, step=3)
    seal = transfer_wire.LazySeal(snap, KEY, 4096)
    n = len(seal.chunks)
    assert n >= 8
    calls: list[int] = []
    real = seal._aead

    class Counting:
        def encrypt(self, nonce: bytes, data: bytes, aad: Any) -> bytes:
            calls.append(int.from_bytes(nonce, "big"))
            time.sleep(0.002)  # long enough that the threads meet on the same chunks
            return real.encrypt(nonce, data, aad)

    seal._aead = Counting()  # type: ignore[assignment]
    stop = threading.Event()
    threads = [threading.Thread(target=seal.tag_ahead, args=(range(n), stop.is_set)) for _ in range(3)]
    for t in threads:
        t.start()
    tags = [seal.tag(g) for g in reversed(range(n))][::-1]  # a sender from the other end
    for t in threads:
        t.join(10)
    assert sorted(calls) == list(range(n))  # every chunk tagged, none twice
    assert b"".join(tags) == seal.tags_for(range(n))
    views = snap.views()
    for g, (ti, lo, hi) in enumerate(seal.chunks):
        real.decrypt(transfer_wire.nonce(g), tags[g], views[ti][lo:hi])  # raises InvalidTag if wrong
    # a stopped tagger stops: none of a fresh seal's chunks get tagged
    fresh = transfer_wire.LazySeal(snap, KEY, 4096)
    fresh.tag_ahead(range(n), lambda: True)
    assert all(t is None for t in fresh._tags)


def test_scatter_gather_helpers_land_every_byte_and_time_out() -> None:
    a, b = socket.socketpair()
    with a, b:
        for s in (a, b):
            s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 8192)  # force partial sends and receives
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)
            transfer_wire.set_stall_timeout(s, 2.0)
        data = [os.urandom(n) for n in (300_000, 16, 1, 70_000, 16)]
        dst = [memoryview(bytearray(len(d))) for d in data]
        sender = threading.Thread(target=transfer_wire.send_all, args=(a, [memoryview(d) for d in data]))
        sender.start()
        transfer_wire.recv_into_all(b, list(dst))
        sender.join(10)
        assert [bytes(d) for d in dst] == data
        assert transfer_wire._advance([memoryview(b"abc"), memoryview(b"de")], 4) == [memoryview(b"e")]
        # no byte for the stall timeout: TimeoutError, from the kernel's own timeout, promptly
        transfer_wire.set_stall_timeout(b, 0.2)
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            transfer_wire.recv_into_all(b, [memoryview(bytearray(10))])
        with pytest.raises(TimeoutError):
            transfer_wire.recv_into_exact(b, memoryview(bytearray(10)))
        assert time.monotonic() - t0 < 2.0
        # a peer gone: ConnectionError
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(ConnectionError):
            transfer_wire.recv_into_all(b, [memoryview(bytearray(10))])


def test_wrong_key_is_refused(donor_objects: dict[str, Any]) -> None:
    _, target = spare()
    with serve(capture_state(donor_objects, step=3)) as donor:
        with pytest.raises(SecurityError, match="cluster key"):
            fetch_state([(LOCAL, donor.port)], bytes(32), target, step=3, epoch=0)
        assert donor.counters["auth_failed"] == 1


def test_layout_mismatch_is_a_clear_error(donor_objects: dict[str, Any]) -> None:
    _, target = spare(hidden=48)
    with serve(capture_state(donor_objects, step=3)) as donor:
        with pytest.raises(LayoutMismatch,
                           match=r"model/0.weight: donor float32\[64, 32\], local float32\[48, 32\]"):
            fetch_state([(LOCAL, donor.port)], KEY, target, step=3, epoch=0)


def test_step_mismatch_and_provider_refusals(donor_objects: dict[str, Any]) -> None:
    _, target = spare()
    with serve(capture_state(donor_objects, step=3)) as donor:
        with pytest.raises(TransferError, match="committed step is 3, the receiver asked for step 4"):
            fetch_state([(LOCAL, donor.port)], KEY, target, step=4, epoch=0)

    def refuse(epoch: int, step: int) -> None:
        raise TransferError(f"epoch {epoch} is over")

    with DonorServer(refuse, KEY, host=LOCAL) as donor:
        with pytest.raises(TransferError, match="refused to serve epoch 5 step 3: epoch 5 is over"):
            fetch_state([(LOCAL, donor.port)], KEY, target, step=3, epoch=5)


def test_donors_with_different_states_cannot_stripe(donor_objects: dict[str, Any]) -> None:
    a = capture_state(donor_objects, step=3)
    other = training_state(*trained(steps=3), rng=False)
    other["model"][0].bias.data[0] += 1
    b = capture_state(other, step=3)
    _, target = spare()
    with serve(a) as da, serve(b) as db:
        with pytest.raises(TransferError, match="serve different states"):
            fetch_state([(LOCAL, da.port), (LOCAL, db.port)], KEY, target, step=3, epoch=0)


def test_replayed_request_is_refused(donor_objects: dict[str, Any]) -> None:
    frame = encode_request(KEY, os.urandom(16), TransferRequest(0, 3, 0, 0))
    with serve(capture_state(donor_objects, step=3)) as donor:
        replies = []
        for _ in range(2):
            with socket.create_connection((LOCAL, donor.port), timeout=5) as s:
                s.sendall(frame)
                replies.append(read_all(s))
    assert replies[0][5] == transfer_wire.KIND_OK
    assert replies[1][5] == transfer_wire.KIND_UNAUTHENTICATED_REFUSAL and b"replayed" in replies[1]


def test_stall_before_header_times_out_promptly() -> None:
    silent = socket.create_server((LOCAL, 0))  # accepts (backlog) and never answers
    _, target = spare()
    t0 = time.monotonic()
    with silent, pytest.raises(TransferError, match="sent nothing for 0.3s while waiting for the header"):
        fetch_state([(LOCAL, silent.getsockname()[1])], KEY, target, step=3, epoch=0, stall_timeout=0.3)
    assert time.monotonic() - t0 < 3.0


def test_bad_arguments() -> None:
    _, target = spare()
    with pytest.raises(ConfigError, match="32 bytes"):
        fetch_state([(LOCAL, 1)], b"short", target, step=0, epoch=0)
    with pytest.raises(ConfigError, match="partition"):
        fetch_state([(LOCAL, 1), (LOCAL, 2)], KEY, target, step=0, epoch=0, stripes=[(0, 10), (20, 30)])


def test_benchmark_reports_both_numbers() -> None:
    out = benchmark(4_000_000)
    assert out["tcp_mb_s"] > 0 and out["transfer_mb_s"] > 0 and out["ratio"] > 0
    lazy = benchmark(4_000_000, n_donors=2, trials=2, lazy=True)
    assert len(lazy["per_trial"]) == 2
    for row in lazy["per_trial"]:
        assert row["ratio"] == pytest.approx(row["transfer_mb_s"] / row["tcp_mb_s"], rel=0.01)
        assert row["tcp_cpu_ms_per_mb"] > 0 and row["transfer_cpu_ms_per_mb"] > 0


def test_no_pickle_anywhere_in_the_state_path() -> None:
    modules = sorted(Path(transfer_wire.__file__).parent.parent.rglob("*.py"))  # every module of the trainer package
    assert len(modules) > 5
    for path in modules:
        text = path.read_text()
        assert "pickle" not in text.replace("never pickle", "").replace("NEVER pickle", "")
        assert "torch.load" not in text


# ------------------------------------------------------------------------------------------------
# donors in other processes, killed or stopped mid-transfer

DONOR_PROGRAM = """
import sys, torch
from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.transfer.wire import seal_state

class Blob:
    def __init__(self):
        g = torch.Generator().manual_seed(3)
        self.t = {f"t{i}": torch.rand(1024 * 1024, generator=g) for i in range(16)}
    def state_dict(self):
        return self.t
    def load_state_dict(self, sd):
        self.t = sd

key = bytes(range(32))
sealed = seal_state(capture_state({"blob": Blob()}, step=9, checksum=False), key)
server = DonorServer(lambda e, s: sealed, key, host="127.0.0.1").start()
print(server.port, flush=True)
sys.stdin.read()
"""


class Blob:
    def __init__(self) -> None:
        self.t = {f"t{i}": torch.zeros(1024 * 1024) for i in range(16)}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.t

    def load_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.t = sd


@pytest.fixture
def donor_process() -> Iterator[tuple[subprocess.Popen[str], int]]:
    proc = subprocess.Popen([sys.executable, "-c", DONOR_PROGRAM], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        yield proc, int(proc.stdout.readline())  # type: ignore[union-attr]
    finally:
        proc.kill()
        proc.wait(10)


def test_donor_stopped_or_killed_mid_transfer_fails_promptly(
        donor_process: tuple[subprocess.Popen[str], int]) -> None:
    proc, port = donor_process
    events: list[float] = []

    def signal_once(sig: int) -> Any:
        def on_progress(index: int, got: int) -> None:
            if not events:
                proc.send_signal(sig)
                events.append(time.monotonic())
        return on_progress

    # SIGSTOP: the donor hangs mid-stream; no byte for stall_timeout -> TransferError naming it
    with pytest.raises(TransferError, match=rf"donor 127.0.0.1:{port} sent nothing for 0.5s while streaming"):
        fetch_state([(LOCAL, port)], KEY, ReceiveTarget({"blob": Blob()}), step=9, epoch=0,
                    stall_timeout=0.5, on_progress=signal_once(signal.SIGSTOP))
    assert 0.5 <= time.monotonic() - events[0] < 3.0
    proc.send_signal(signal.SIGCONT)

    # SIGKILL: the connection closes; reported at once, long before the 5 s stall timeout
    events.clear()
    with pytest.raises(TransferError, match=rf"donor 127.0.0.1:{port} failed while streaming after \d+ of"):
        fetch_state([(LOCAL, port)], KEY, ReceiveTarget({"blob": Blob()}), step=9, epoch=0,
                    stall_timeout=5.0, on_progress=signal_once(signal.SIGKILL))
    assert time.monotonic() - events[0] < 2.0


# ------------------------------------------------------------------------------------------------
# helpers


def read_all(s: socket.socket) -> bytes:
    out = bytearray()
    while chunk := s.recv(65536):
        out += chunk
    return bytes(out)


class FlipProxy:
    """A TCP relay that flips one bit of the donor->receiver stream at byte ``flip_at``."""

    def __init__(self, host: str, port: int, flip_at: int) -> None:
        self.upstream = (host, port)
        self.flip_at = flip_at
        self.flipped = False
        self.server = socket.create_server((LOCAL, 0))
        self.port = self.server.getsockname()[1]
        self.threads: list[threading.Thread] = []

    def __enter__(self) -> FlipProxy:
        t = threading.Thread(target=self._run, daemon=True)
        t.start()
        self.threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.close()
        for t in self.threads:
            t.join(5)

    def _run(self) -> None:
        down, _ = self.server.accept()
        up = socket.create_connection(self.upstream)
        relay = threading.Thread(target=self._pipe, args=(down, up, False), daemon=True)
        relay.start()
        self._pipe(up, down, True)
        relay.join(5)
        up.close()
        down.close()

    def _pipe(self, src: socket.socket, dst: socket.socket, flip: bool) -> None:
        seen = 0
        try:
            while data := src.recv(65536):
                if flip and seen <= self.flip_at < seen + len(data):
                    buf = bytearray(data)
                    buf[self.flip_at - seen] ^= 0x01
                    data = bytes(buf)
                    self.flipped = True
                seen += len(data)
                dst.sendall(data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
