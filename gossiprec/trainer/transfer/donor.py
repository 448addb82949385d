"""The donor: serves byte ranges of this process's committed state to receivers over TCP.

One thread per connection, on blocking sockets: ``sendmsg`` gathers each chunk straight from the
snapshot's tensors, with the previous chunk's tag, into one system call, with no copy in Python; the
chunks of a raw snapshot are tagged on a second thread, ahead of the sends. A request must
authenticate under one of the keys the donor accepts (every installed key of a keyring that rotates,
:mod:`gossiprec.trainer.keys`; the answer goes out under the key that opened it) and carry a transfer
id not served before (:mod:`gossiprec.trainer.transfer.wire`); anything else gets an unauthenticated
refusal, and errors on one connection never reach the others or the training loop.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Sequence

import msgpack
from cryptography.exceptions import InvalidTag

from gossiprec.errors import ConfigError, DecodeError, GossiprecError
from gossiprec.trainer.state.capture import StateSnapshot
from gossiprec.trainer.keys import TransferKeys
from gossiprec.trainer.transfer.wire import (
    DEFAULT_CHUNK, ID_SIZE, KIND_OK, KIND_REFUSED, MAX_REQUEST_BODY, REQ_MAGIC, REQ_PREFIX, TAG_SIZE, VERSION, WHOLE,
    LazySeal, SealedState, TransferRequest, check_key, derive_aead, open_request, recv_exact, select_chunks,
    send_all, send_frame, send_plain_refusal, set_stall_timeout, shutdown,
)

log = logging.getLogger(__name__)

StateProvider = Callable[[int, int], "SealedState | StateSnapshot | None"]
"""``(epoch, step) -> state`` on a donor; return None or raise a GossiprecError to refuse."""


class DonorServer:
    """Serves byte ranges of this process's committed state to receivers, one thread per connection.

    ``state_provider(epoch, step)`` returns the state to serve: a :class:`SealedState` (best: sealed
    at commit time) or a plain snapshot, whose requested chunks the server tags on demand (``chunk_size``) and
    reuses while the provider returns that same object. It is called once per request and may refuse
    by returning None or raising a GossiprecError (its message goes back to the receiver). The server
    itself refuses when the state's step differs from the requested one. The snapshot's tensors must
    not change once sealed (capture with ``copy=True``, or keep training paused). ``key``: one key, or
    the :class:`~gossiprec.trainer.keys.TransferKeys` of a keyring (every installed key accepted).
    """

    def __init__(self, state_provider: StateProvider, key: bytes | TransferKeys, host: str = "0.0.0.0", port: int = 0,
                 *, context: bytes = b"", stall_timeout: float = 30.0, max_connections: int = 16,
                 remember_ids: int = 4096, chunk_size: int = DEFAULT_CHUNK) -> None:
        if not isinstance(key, TransferKeys):
            check_key(key)
            key = TransferKeys.fixed(bytes(key))
        self._chunk_size = chunk_size
        self._seal_lock = threading.Lock()
        self._last_seal: LazySeal | None = None
        self._seals: dict[bytes, LazySeal] = {}
        """The lazy seal of the snapshot served last, per key (receivers may sign with different keys
        during a rotation)."""
        self._provider = state_provider
        self._keys = key
        self._context = context
        self._host, self._port = host, port
        self._stall = stall_timeout
        self._max_conns = max_connections
        self._remember = remember_ids
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()
        self._conns: set[socket.socket] = set()
        self._threads: set[threading.Thread] = set()
        self._sock: socket.socket | None = None
        self._accept_thread: threading.Thread | None = None
        self._closed = False
        self.counters: dict[str, int] = {"served": 0, "refused": 0, "auth_failed": 0, "aborted": 0,
                                         "bytes_sent": 0}

    def start(self) -> DonorServer:
        sock = socket.create_server((self._host, self._port), backlog=64, reuse_port=False)
        self._sock = sock
        self._port = int(sock.getsockname()[1])
        self._accept_thread = threading.Thread(target=self._accept_loop, name="gossiprec-donor-accept",
                                               daemon=True)
        self._accept_thread.start()
        return self

    @property
    def port(self) -> int:
        """The port it listens on (the one picked when constructed with port 0)."""
        if self._sock is None:
            raise ConfigError("DonorServer.start() first")
        return self._port

    def close(self, timeout: float = 2.0) -> None:
        """Stop accepting, cut every connection in progress and wait (bounded) for the threads."""
        with self._lock:
            self._closed = True
            conns = list(self._conns)
            threads = list(self._threads)
        if self._sock is not None:
            shutdown(self._sock)
            self._sock.close()
        for c in conns:
            shutdown(c)
        deadline = time.monotonic() + timeout
        for t in [*threads, *([self._accept_thread] if self._accept_thread else [])]:
            t.join(max(0.0, deadline - time.monotonic()))

    def __enter__(self) -> DonorServer:
        return self.start() if self._sock is None else self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counters[name] += n

    def _accept_loop(self) -> None:
        assert self._sock is not None
        while True:
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return  # closed
            handler = threading.Thread(target=self._serve, args=(conn, addr), daemon=True,
                                       name=f"gossiprec-donor-{addr[0]}:{addr[1]}")
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                busy = len(self._conns) >= self._max_conns
                if not busy:
                    self._conns.add(conn)
                    self._threads.add(handler)
            if busy:
                send_plain_refusal(conn, f"donor busy ({self._max_conns} transfers in progress)")
                conn.close()
                continue
            handler.start()

    def _serve(self, conn: socket.socket, addr: Any) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        try:
            set_stall_timeout(conn, self._stall)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            prefix = recv_exact(conn, REQ_PREFIX.size)
            magic, version, tid, n = REQ_PREFIX.unpack(prefix)
            if magic != REQ_MAGIC or version != VERSION or n > MAX_REQUEST_BODY:
                self._count("refused")
                send_plain_refusal(conn, "not a gossiprec state-transfer request of this version")
                return
            frame = prefix + recv_exact(conn, n + TAG_SIZE)
            opened = None
            for key in self._keys.accepted():
                try:
                    opened = key, *open_request(key, frame, self._context)
                    break
                except InvalidTag:
                    continue
            if opened is None:
                self._count("auth_failed")
                log.warning("state transfer request from %s failed authentication (another cluster key?)",
                            peer)
                send_plain_refusal(conn, "request failed authentication: the donor uses another "
                                          "cluster key")
                return
            key, tid, req = opened
            with self._lock:
                replay = tid in self._seen
                self._seen[tid] = None
                while len(self._seen) > self._remember:
                    self._seen.popitem(last=False)
            if replay:
                self._count("refused")
                send_plain_refusal(conn, "transfer id already served (replayed request)")
                return
            self._respond(conn, key, tid, req, peer)
        except (OSError, ConnectionError, DecodeError) as exc:
            self._count("aborted")
            log.info("state transfer to %s ended early: %s", peer, exc)
        finally:
            with self._lock:
                self._conns.discard(conn)
                self._threads.discard(threading.current_thread())
            conn.close()

    def prepare(self, snapshot: StateSnapshot, ranges: Sequence[tuple[int, int]]) -> None:
        """Tag the chunks of byte ranges ``ranges`` of ``snapshot`` now (blocking: call it from a spare
        thread as soon as a plan names this donor), so that the receivers' requests find them ready."""
        seal = self._sealed(snapshot, self._keys.primary())
        assert isinstance(seal, LazySeal)
        for start, end in ranges:
            seal.tags_for(seal.stripe(start, end))

    def _sealed(self, served: SealedState | StateSnapshot, key: bytes) -> SealedState | LazySeal:
        if isinstance(served, SealedState):
            return served
        with self._seal_lock:  # one lazy seal per raw snapshot and key: its chunks are tagged as requested
            seal = self._seals.get(key)
            if seal is None or seal.snapshot is not served:
                self._seals = {k: s for k, s in self._seals.items() if s.snapshot is served}
                seal = self._seals[key] = LazySeal(served, key, self._chunk_size, self._context)
            self._last_seal = seal
            return seal

    def _respond(self, conn: socket.socket, key: bytes, tid: bytes, req: TransferRequest, peer: str) -> None:
        salt = os.urandom(ID_SIZE)
        aead = derive_aead(key, tid + salt, b"response", self._context)
        refusal: str | None = None
        sealed: SealedState | LazySeal | None = None
        try:
            served = self._provider(req.epoch, req.step)
            if served is None:
                refusal = f"donor has no committed state to serve for epoch {req.epoch}, step {req.step}"
            elif served.step != req.step:
                refusal = (f"donor's committed step is {served.step}, the receiver asked for step "
                           f"{req.step}")
            else:
                sealed = self._sealed(served, key)
                if req.end > sealed.snapshot.header.total_nbytes and req.end != WHOLE:
                    refusal = (f"range [{req.start}, {req.end}) beyond the state's "
                               f"{sealed.snapshot.header.total_nbytes} bytes")
        except GossiprecError as exc:
            refusal = str(exc)
        except Exception as exc:  # the provider is user code: report, do not kill the server
            log.exception("state provider failed for epoch %d step %d", req.epoch, req.step)
            refusal = f"donor's state provider failed: {type(exc).__name__}: {exc}"
        if refusal is not None or sealed is None:
            self._count("refused")
            refused: dict[str, Any] = {"error": refusal, "epoch": req.epoch, "step": req.step}
            send_frame(conn, aead, KIND_REFUSED, salt, msgpack.packb(refused, use_bin_type=True))
            return
        header = sealed.snapshot.header
        sel = select_chunks(sealed.chunks, header.tensors, req.start, req.end)
        body: dict[str, Any] = {**req.to_wire(), "chunk": sealed.chunk_size, "salt": sealed.salt,
                                "state": header.to_wire()}
        send_frame(conn, aead, KIND_OK, salt, msgpack.packb(body, use_bin_type=True))
        views = sealed.snapshot.views()
        stop = threading.Event()
        tagger: threading.Thread | None = None
        if isinstance(sealed, LazySeal):  # tag ahead of the sends on a second core (the GMAC frees the GIL)
            tagger = threading.Thread(target=sealed.tag_ahead, args=(sel, stop.is_set), daemon=True,
                                      name=f"gossiprec-donor-tag-{peer}")
            tagger.start()
        sent = 0
        tag: list[memoryview] = []
        try:
            for g in sel:  # a chunk's tag goes out with the next chunk: asked for once its bytes are sent
                ti, lo, hi = sealed.chunks[g]
                send_all(conn, [*tag, views[ti][lo:hi]])
                tag = [memoryview(sealed.tag(g))]
                sent += hi - lo
            send_all(conn, tag)
        finally:
            stop.set()
            if tagger is not None:
                tagger.join()
        self._count("served")
        self._count("bytes_sent", sent)
        log.info("served %d bytes (stripe [%d, %d)) of step %d to %s", sent, req.start, req.end,
                 req.step, peer)
