"""The receiver: fetch a state from its donors, striped, straight into the local tensors, and load it.

:func:`fetch_state` runs one thread per donor on blocking sockets: ``recv_into`` lands the bytes in
the receiver's pre-allocated tensors (:class:`~gossiprec.trainer.state.receive.ReceiveTarget`) with no copy
in Python (``recvmsg_into`` with ``MSG_WAITALL``: a chunk and the tag that follows it in one system call),
and a second thread per donor checks each chunk's tag while the next one arrives. The
crc32s of the state header are checked after assembly only when asked (``verify_crc``): the seal
already covers every byte from seal time on (:mod:`gossiprec.trainer.transfer.wire`).

Failure handling: every receive uses ``stall_timeout`` (no byte for that long -> the donor is declared
stalled), a closed connection is reported at once, and the whole fetch has a deadline. The first error
wins, names the donor, and closes every other connection so no thread keeps writing; the caller gets a
:class:`~gossiprec.errors.TransferError` and may retry with other donors (the destination tensors then
hold garbage until a fetch succeeds).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from dataclasses import dataclass
from queue import SimpleQueue
from typing import Callable, Sequence

import msgpack
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from gossiprec.errors import ConfigError, DecodeError, TransferError
from gossiprec.trainer.state.header import StateHeader
from gossiprec.trainer.state.receive import BoundTarget, ReceiveTarget
from gossiprec.trainer.transfer.wire import (
    ID_SIZE, KIND_OK, KIND_REFUSED, KIND_UNAUTHENTICATED_REFUSAL, MAX_CHUNK, MAX_RESPONSE_BODY, MIN_CHUNK,
    RESP_MAGIC, RESP_PREFIX, TAG_SIZE, VERSION, WHOLE, TransferAuthError, TransferRequest, check_key, derive_aead,
    encode_request, even_stripes, nonce, plan_chunks, recv_exact, recv_into_all, select_chunks, set_stall_timeout,
    shutdown,
)

Address = tuple[str, int]


@dataclass(frozen=True, slots=True)
class DonorStats:
    host: str
    port: int
    start: int
    end: int
    nbytes: int
    """Bytes this donor actually sent (its stripe snapped to chunk boundaries)."""
    seconds: float

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0


@dataclass(frozen=True, slots=True)
class TransferStats:
    """Outcome of :func:`fetch_state`; MB are 10**6 bytes."""

    header: StateHeader
    epoch: int
    seconds: float
    """Connect to last byte verified over the wire (all stripes), excluding crc32 and load."""
    verify_seconds: float
    apply_seconds: float
    donors: tuple[DonorStats, ...]

    @property
    def step(self) -> int:
        return self.header.step

    @property
    def nbytes(self) -> int:
        return self.header.total_nbytes

    @property
    def mb_per_s(self) -> float:
        return self.nbytes / 1e6 / self.seconds if self.seconds > 0 else 0.0



def _check_stripes(stripes: Sequence[tuple[int, int]], total: int, n: int) -> None:
    if len(stripes) != n:
        raise ConfigError(f"{len(stripes)} stripes for {n} donors; give one (start, end) per donor")
    pos = 0
    for start, end in sorted(stripes):
        if start != pos or end < start:
            raise ConfigError(f"stripes {list(stripes)} must partition [0, {total}) without gaps or overlap")
        pos = end
    if pos != total:
        raise ConfigError(f"stripes {list(stripes)} must cover [0, {total})")



class _Fetch:
    """Shared state of one fetch: first error wins, then every connection is cut."""

    def __init__(self, target: ReceiveTarget, total: int | None) -> None:
        self.target = target
        self.total = total
        """The payload size the stripes cover (None: whatever the donor's header says)."""
        self.cond = threading.Condition()
        self.error: BaseException | None = None
        self.finished: dict[int, DonorStats] = {}
        self.socks: list[socket.socket] = []
        self.bound: BoundTarget | None = None
        self.chunk_size = 0
        self.bound_by = ""

    def add_socket(self, sock: socket.socket) -> bool:
        with self.cond:
            if self.error is not None:
                return False
            self.socks.append(sock)
            return True

    def bind(self, header: StateHeader, chunk_size: int, donor: str) -> BoundTarget:
        with self.cond:
            if self.bound is None:
                if self.total is not None and header.total_nbytes != self.total:
                    raise TransferError(f"donor {donor} serves {header.total_nbytes} bytes of state for step "
                                        f"{header.step}, but the stripes asked for cover {self.total}: the "
                                        "donors' states differ in size; fetch from one donor instead")
                self.bound = self.target.bind(header)
                self.chunk_size = chunk_size
                self.bound_by = donor
            elif header != self.bound.header or chunk_size != self.chunk_size:
                what = (_first_difference(self.bound.header, header) if header != self.bound.header
                        else f"chunk sizes {self.chunk_size} and {chunk_size}")
                raise TransferError(f"donors {self.bound_by} and {donor} serve different states for step "
                                    f"{header.step} ({what}); striping needs identical replicas sealed "
                                    "with the same chunk size: fetch from one donor instead")
            return self.bound

    def fail(self, exc: BaseException) -> None:
        with self.cond:
            if self.error is None:
                self.error = exc
            socks = list(self.socks)
            self.cond.notify_all()
        for s in socks:
            shutdown(s)

    def finish(self, index: int, stats: DonorStats) -> None:
        with self.cond:
            self.finished[index] = stats
            self.cond.notify_all()


def _first_difference(a: StateHeader, b: StateHeader) -> str:
    for sa, sb in zip(a.tensors, b.tensors):  # noqa: B905 (lengths compared below)
        if sa != sb:
            return f"tensor {sa.name} differs"
    if len(a.tensors) != len(b.tensors):
        return "tensor counts differ"
    return "non-tensor state differs"


def fetch_state(donors: Sequence[Address], key: bytes, target: ReceiveTarget, *, step: int, epoch: int,
                stripes: Sequence[tuple[int, int]] | None = None, timeout: float = 120.0,
                stall_timeout: float = 5.0, context: bytes = b"", verify_crc: bool = False,
                apply: bool = True, on_progress: Callable[[int, int], None] | None = None
                ) -> TransferStats:
    """Fetch the state at (``epoch``, ``step``) from ``donors`` into ``target`` and load it.

    Donor ``i`` serves the chunks starting in ``stripes[i]`` (default: :func:`even_stripes` of the local
    payload size; donors with an empty stripe are not contacted). All donors must hold the identical
    state. Bytes land directly in the target's tensors and every chunk is authenticated on arrival;
    then, if ``verify_crc``, the header's crc32s are checked too, and the state is loaded into the
    objects (``apply``; with ``apply=False`` call ``target.bind(stats.header).apply()`` later).
    ``on_progress(donor index, bytes received so far)`` is called from the receiving threads after
    each chunk. Raises :class:`TransferError` (naming the donor) when a donor refuses, dies, stalls
    for ``stall_timeout`` seconds, sends bytes that do not authenticate (:class:`TransferAuthError`)
    or when ``timeout`` passes; :class:`~gossiprec.trainer.state.receive.LayoutMismatch` when the state does
    not fit the local objects.
    """
    check_key(key)
    if not donors:
        raise ConfigError("fetch_state needs at least one donor")
    total: int | None
    if stripes is not None:  # the donors' byte space: the plan knows their size, this process may not
        stripes = list(stripes)
        total = max((end for _, end in stripes), default=0)
        _check_stripes(stripes, total, len(donors))
    elif len(donors) == 1:
        stripes, total = [(0, WHOLE)], None  # all of it, whatever its size
    else:
        total = target.total_nbytes
        stripes = even_stripes(total, len(donors))
    jobs = [(i, d, s) for i, (d, s) in enumerate(zip(donors, stripes, strict=True)) if s[1] > s[0]]
    if not jobs:  # nothing to stream; still need a header (the non-tensor state) from one donor
        jobs = [(0, donors[0], stripes[0])]
    tid = os.urandom(ID_SIZE)
    fetch = _Fetch(target, total)
    t0 = time.monotonic()
    deadline = t0 + timeout
    threads = [threading.Thread(target=_receive_stripe, name=f"gossiprec-fetch-{d[0]}:{d[1]}", daemon=True,
                                args=(fetch, i, d, s, key, tid, epoch, step, context, stall_timeout,
                                      deadline, on_progress))
               for i, d, s in jobs]
    for t in threads:
        t.start()
    with fetch.cond:
        while fetch.error is None and len(fetch.finished) < len(jobs):
            left = deadline - time.monotonic()
            if left <= 0:
                done = sorted(fetch.finished)
                fetch.error = TransferError(f"state transfer of step {step} timed out after {timeout:.1f}s "
                                            f"(donors done: {done} of {[i for i, _, _ in jobs]})")
                break
            fetch.cond.wait(left)
    if fetch.error is not None:
        fetch.fail(fetch.error)  # cut every connection
        for t in threads:
            t.join(max(0.0, min(1.0, deadline + 1.0 - time.monotonic())))
        raise fetch.error
    seconds = time.monotonic() - t0
    assert fetch.bound is not None
    t1 = time.monotonic()
    if verify_crc:
        fetch.bound.verify()
    t2 = time.monotonic()
    if apply:
        fetch.bound.apply()
    t3 = time.monotonic()
    return TransferStats(header=fetch.bound.header, epoch=epoch, seconds=seconds, verify_seconds=t2 - t1,
                         apply_seconds=t3 - t2,
                         donors=tuple(fetch.finished[i] for i in sorted(fetch.finished)))


def _receive_stripe(fetch: _Fetch, index: int, donor: Address, stripe: tuple[int, int], key: bytes,
                    tid: bytes, epoch: int, step: int, context: bytes, stall_timeout: float,
                    deadline: float, on_progress: Callable[[int, int], None] | None) -> None:
    name = f"{donor[0]}:{donor[1]}"
    start, end = stripe
    got = 0
    want: int | str = "?"
    t0 = time.monotonic()
    phase = "connecting"
    try:
        sock = socket.create_connection(donor, timeout=max(0.01, min(stall_timeout,
                                                                     deadline - time.monotonic())))
        if not fetch.add_socket(sock):
            sock.close()
            return
        with sock:
            set_stall_timeout(sock, stall_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            req = TransferRequest(epoch, step, start, end)
            phase = "requesting"
            sock.sendall(encode_request(key, tid, req, context))
            phase = "waiting for the header"
            header, chunk_size, salt = _read_header(sock, key, tid, req, context, name)
            chunks = plan_chunks(header.tensors, 0, header.total_nbytes, chunk_size)
            sel = select_chunks(chunks, header.tensors, start, end)
            tags = memoryview(bytearray(TAG_SIZE * len(sel)))
            bound = fetch.bind(header, chunk_size, name)
            want = sum(chunks[g][2] - chunks[g][1] for g in sel)
            views = bound.views()
            aead = derive_aead(key, salt, b"state", context)
            queue: SimpleQueue[tuple[int, int, memoryview] | None] = SimpleQueue()
            checker = threading.Thread(target=_check_chunks, args=(fetch, queue, aead, tags, header,
                                                                   chunks, name),
                                       name=f"gossiprec-verify-{name}", daemon=True)
            checker.start()
            phase = "streaming"
            try:
                for k, g in enumerate(sel):
                    ti, lo, hi = chunks[g]
                    view = views[ti][lo:hi]
                    recv_into_all(sock, [view, tags[k * TAG_SIZE:(k + 1) * TAG_SIZE]])
                    queue.put((k, g, view))
                    got += hi - lo
                    if on_progress is not None:
                        on_progress(index, got)
            finally:
                queue.put(None)
            phase = "verifying"
            checker.join()
            if fetch.error is not None:
                return
    except TransferError as exc:
        fetch.fail(exc)
        return
    except (TimeoutError, BlockingIOError) as exc:
        err = TransferError(f"donor {name} sent nothing for {stall_timeout:.1f}s while {phase} "
                            f"({got} of {want} bytes of its stripe): stalled or hung; retry with other "
                            "donors")
        err.__cause__ = exc
        fetch.fail(err)
        return
    except (OSError, ConnectionError, DecodeError) as exc:
        err = TransferError(f"donor {name} failed while {phase} after {got} of {want} bytes of its "
                            f"stripe: {exc} (donor died or closed the connection); retry with other donors")
        err.__cause__ = exc
        fetch.fail(err)
        return
    except BaseException as exc:  # never leave the main thread waiting
        fetch.fail(exc)
        return
    fetch.finish(index, DonorStats(donor[0], donor[1], start, end, got, time.monotonic() - t0))


def _check_chunks(fetch: _Fetch, queue: SimpleQueue[tuple[int, int, memoryview] | None], aead: AESGCM,
                  tags: memoryview, header: StateHeader, chunks: Sequence[tuple[int, int, int]],
                  name: str) -> None:
    """Verify chunks as they arrive, overlapping GMAC with the next ``recv_into``."""
    failed = False
    while (item := queue.get()) is not None:
        if failed:
            continue
        k, g, view = item
        try:
            aead.decrypt(nonce(g), tags[k * TAG_SIZE:(k + 1) * TAG_SIZE], view)
        except InvalidTag:
            ti, lo, hi = chunks[g]
            fetch.fail(TransferAuthError(
                f"chunk {g} from donor {name} (tensor {header.tensors[ti].name}, bytes {lo}..{hi}) failed "
                "authentication: corrupted, tampered with, or changed after the donor sealed it; state "
                "refused"))
            failed = True


def _read_header(sock: socket.socket, key: bytes, tid: bytes, req: TransferRequest, context: bytes,
                 name: str) -> tuple[StateHeader, int, bytes]:
    prefix = recv_exact(sock, RESP_PREFIX.size)
    magic, version, kind, salt, n = RESP_PREFIX.unpack(prefix)
    if magic != RESP_MAGIC or version != VERSION:
        raise TransferError(f"donor {name} does not speak state-transfer version {VERSION}")
    if kind == KIND_UNAUTHENTICATED_REFUSAL:
        reason = recv_exact(sock, min(n, 512)).decode(errors="replace")
        raise TransferAuthError(f"donor {name} refused (unauthenticated reply): {reason}; check that "
                                "donor and receiver use the same cluster key")
    if kind not in (KIND_OK, KIND_REFUSED) or n > MAX_RESPONSE_BODY:
        raise TransferError(f"donor {name} sent a bad response header (kind {kind}, {n} bytes)")
    rest = recv_exact(sock, n + TAG_SIZE)
    aead = derive_aead(key, tid + salt, b"response", context)
    try:
        aead.decrypt(nonce(0), rest[-TAG_SIZE:], prefix + rest[:-TAG_SIZE])
    except InvalidTag:
        raise TransferAuthError(f"response header from donor {name} failed authentication: another "
                                "cluster key, or tampered in transit") from None
    try:
        body = msgpack.unpackb(rest[:-TAG_SIZE], raw=False, strict_map_key=False)
    except (ValueError, msgpack.UnpackException) as exc:
        raise TransferError(f"donor {name} sent an undecodable header: {exc}") from exc
    if not isinstance(body, dict):
        raise TransferError(f"donor {name} sent a malformed header")
    if kind == KIND_REFUSED:
        raise TransferError(f"donor {name} refused to serve epoch {req.epoch} step {req.step}: "
                            f"{body.get('error')}")
    echo = {k: body.get(k) for k in ("epoch", "step", "start", "end")}
    if echo != req.to_wire():
        raise TransferError(f"donor {name} answered another request ({echo}, asked {req.to_wire()})")
    chunk_size, seal_salt = body.get("chunk"), body.get("salt")
    if (not isinstance(chunk_size, int) or not MIN_CHUNK <= chunk_size <= MAX_CHUNK
            or not isinstance(seal_salt, bytes) or len(seal_salt) != ID_SIZE):
        raise TransferError(f"donor {name} sent a malformed header (chunk size or salt)")
    try:
        header = StateHeader.from_wire(body.get("state"))
    except DecodeError as exc:
        raise TransferError(f"donor {name} sent a malformed state header: {exc}") from exc
    if header.step != req.step:
        raise TransferError(f"donor {name} sent state for step {header.step}, asked for {req.step}")
    return header, chunk_size, seal_salt
