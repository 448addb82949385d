"""Control socket between the agent and the training process on the same host.

Theory of operation
-------------------
The agent listens on a Unix stream socket (mode 0600: only this user). Frames in both directions are
a 4-byte big-endian length followed by one msgpack map. A connection starts with a handshake::

    -> {"op": "hello", "version": 1}
    <- {"ok": true, "version": 1, "node": NAME, "max_frame": BYTES}

then requests, each optionally carrying an ``"id"`` (int or string) echoed in its reply, and
``"noreply": true`` to skip the reply on success (errors are always answered)::

    {"op": "report", "step": 12, "phase": "compute", "step_ms": 840}   -> machine.set_progress
    {"op": "state", "committed_step": 12, "inflight_step": None,
     "state_bytes": N, "transfer_port": P}                              -> machine.set_state
    {"op": "members"}                                                   -> {"members": [...]}
    {"op": "status"}                                                    -> {"status": {...}}
    {"op": "subscribe"} / {"op": "unsubscribe"}                         -> event stream on/off
    {"op": "register_layout", "layout": {...}} / {"op": "get_layout"}   -> opaque dict kept by the agent
    {"op": "ping"}                                                      -> {"pong": true}

The training loop of :mod:`gossiprec.trainer` does not send ``report`` and ``state`` on every step: it
writes them into the agent's progress page (:mod:`gossiprec.local.progress`), whose path the ``status``
reply names (``progress_page``). The messages stay for other clients and as its fallback.

Replies are ``{"ok": true, "id": ID, ...}`` or ``{"ok": false, "id": ID, "error": CODE, "message": TEXT}``.
A subscribed connection also receives every event of the protocol machine as
``{"event": ClassName, field: value, ...}`` (dataclasses turned into maps generically, so new machine
events need no change here), interleaved with replies; replies never carry an ``"event"`` key.

Garbage is answered with one error frame and the connection is closed: a length of 0 or above
``max_frame`` (``bad_frame``), undecodable msgpack (``bad_msgpack``), a frame that is not a map with a
string ``op`` (``bad_request``), anything before the handshake or a wrong version (``bad_handshake``,
``unsupported_version``), an unknown op (``unknown_op``), no handshake within ``hello_timeout``
(``timeout``). Bad argument values of a known op (``bad_args``) are answered and the connection stays.
A subscriber that reads too slowly overflows its bounded queue and is disconnected (``overflow``). No
client can raise out of the server; each connection is a task of the server's TaskGroup. A client that
goes away mid-conversation (reset, broken pipe, not reading) is counted under ``disconnects`` and
logged as one debug line; only a bug in the server is logged with a traceback (``errors``).

:class:`ControlClient` is the blocking client for the training loop (no asyncio);
:class:`AsyncControlClient` is the same for asyncio code and tests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import logging
import math
import os
import socket
import stat
import time
from collections import deque
from pathlib import Path
from typing import Any, Mapping, Protocol

import msgpack

from gossiprec.core.wire import PHASES
from gossiprec.errors import ConfigError, ProtocolError

log = logging.getLogger(__name__)

CONTROL_VERSION = 1
MAX_REQUEST_FRAME = 1024 * 1024
"""Largest frame a client may send the agent (bytes)."""
MAX_REPLY_FRAME = 64 * 1024 * 1024
"""Largest frame a client accepts from the agent (a member list of 100,000 nodes fits)."""
DISCONNECTING = frozenset({"bad_frame", "bad_msgpack", "bad_request", "bad_handshake",
                           "unsupported_version", "unknown_op", "timeout", "overflow", "shutdown"})
"""Error codes after which the server closes the connection."""
_LEN = 4


class ControlError(ProtocolError):
    """A control request failed. ``code`` is machine-readable, the message says what to do."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


# --- encoding ---------------------------------------------------------------------------------------
def encode_frame(obj: Mapping[str, Any]) -> bytes:
    """Length prefix + msgpack map."""
    body: bytes = msgpack.packb(obj, use_bin_type=True)
    return len(body).to_bytes(_LEN, "big") + body


def decode_body(body: bytes) -> Any:
    """msgpack -> Python; raises ControlError("bad_msgpack") on any defect."""
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as exc:  # msgpack raises assorted types on hostile input
        raise ControlError("bad_msgpack", f"frame is not valid msgpack ({type(exc).__name__})") from None


def to_plain(value: Any) -> Any:
    """Any event field -> msgpack-able data (dataclasses become maps, tuples lists, enums names)."""
    if value is None or isinstance(value, (bool, str, bytes)):
        return value
    if isinstance(value, int):
        return value if -2**63 <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, enum.Enum):
        return value.name
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Mapping):
        return {(k if isinstance(k, (str, int)) else str(k)): to_plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        items = sorted(value, key=repr) if isinstance(value, (set, frozenset)) else value
        return [to_plain(v) for v in items]
    return str(value)


def event_to_dict(event: Any) -> dict[str, Any]:
    """``{"event": ClassName, field: value, ...}`` for any machine event (dataclass or mapping)."""
    if isinstance(event, Mapping):
        out = {str(k): to_plain(v) for k, v in event.items()}
        out.setdefault("event", "Event")
        return out
    body = to_plain(event)
    if not isinstance(body, dict):
        body = {"value": body}
    return {"event": type(event).__name__, **body}


# --- the agent's side -------------------------------------------------------------------------------
class EventSource(Protocol):
    """A bounded subscription to the agent's events."""

    overflowed: bool

    async def get(self) -> Any | None:
        """The next event; None once closed or overflowed."""
        ...

    def close(self) -> None: ...


class ControlBackend(Protocol):
    """What the control server needs from the agent."""

    @property
    def node_name(self) -> str: ...
    def control_report(self, step: int, phase: int, step_ms: int) -> None: ...
    def control_set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int,
                          transfer_port: int | None) -> None: ...
    def control_finished(self, step: int) -> None: ...
    def control_members(self) -> list[dict[str, Any]]: ...
    def control_status(self) -> dict[str, Any]: ...
    def control_set_layout(self, layout: dict[Any, Any]) -> None: ...
    def control_layout(self) -> dict[Any, Any] | None: ...
    def control_subscribe(self) -> EventSource: ...


class FrameWriter(Protocol):
    """The writing half the server needs (``asyncio.StreamWriter`` has this shape)."""

    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...


_GONE = (OSError, TimeoutError, asyncio.IncompleteReadError)
"""What a client going away looks like to the server (reset, broken pipe, slow reader, EOF)."""


class _Conn:
    """One client connection: serialised writes with a timeout."""

    def __init__(self, writer: FrameWriter, write_timeout: float) -> None:
        self.writer = writer
        self.lock = asyncio.Lock()
        self.write_timeout = write_timeout
        self.source: EventSource | None = None
        self.forwarder: asyncio.Task[None] | None = None

    async def send(self, obj: Mapping[str, Any]) -> None:
        frame = encode_frame(obj)
        async with self.lock:
            try:
                self.writer.write(frame)
            except RuntimeError as exc:
                # uvloop's transports raise RuntimeError ("unable to perform operation on <UnixTransport
                # closed=True>") for a write after the close: the client is gone, like a reset
                raise ConnectionResetError(f"the client connection is closed ({exc})") from exc
            async with asyncio.timeout(self.write_timeout):
                await self.writer.drain()

    async def reply(self, rid: Any, body: Mapping[str, Any]) -> None:
        await self.send({"ok": True, "id": rid, **body})

    async def error(self, rid: Any, code: str, message: str) -> None:
        await self.send({"ok": False, "id": rid, "error": code, "message": message})


def _check_directory(d: Path) -> None:
    """Refuse a directory where another user could swap our socket for theirs."""
    st = os.stat(d)
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"control socket directory {d} belongs to another user (uid {st.st_uid}); "
                          "choose a directory of your own for --control-socket")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"control socket directory {d} is writable by others without the sticky bit, "
                          f"so anyone could replace the socket; `chmod go-w {d}` or choose another")


def bind_unix_socket(path: str) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path`` with mode 0600 (nobody can connect before the chmod: listen comes
    after it). A stale socket file is replaced; a live one (another agent) is a ConfigError."""
    p = Path(path)
    if len(os.fsencode(path)) > 107:
        raise ConfigError(f"control socket path {path} is longer than 107 bytes; choose a shorter one")
    if not p.parent.exists():
        p.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    _check_directory(p.parent)
    try:
        st = os.lstat(p)
    except FileNotFoundError:
        st = None
    if st is not None:
        if not stat.S_ISSOCK(st.st_mode):
            raise ConfigError(f"{path} exists and is not a socket; remove it or choose another "
                              "--control-socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        probe.settimeout(0.5)
        try:
            probe.connect(str(p))
        except OSError:
            p.unlink(missing_ok=True)  # stale: its agent is gone
        else:
            raise ConfigError(f"another agent is serving the control socket {path}; stop it or choose "
                              "another --control-socket")
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(str(p))
        os.chmod(p, 0o600)
        sock.listen(64)
        sock.setblocking(False)
        st = os.stat(p)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"cannot listen on control socket {path}: {exc.strerror}") from None
    return sock, (st.st_dev, st.st_ino)


class ControlServer:
    """Serves :class:`ControlBackend` on a Unix socket. ``async with`` from one task."""

    def __init__(self, path: str, backend: ControlBackend, *, max_frame: int = MAX_REQUEST_FRAME,
                 max_clients: int = 32, hello_timeout: float = 5.0, write_timeout: float = 5.0) -> None:
        self.path = path
        self.backend = backend
        self.max_frame = max_frame
        self.max_clients = max_clients
        self.hello_timeout = hello_timeout
        self.write_timeout = write_timeout
        self.counters: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._accept: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._closed = False

    async def __aenter__(self) -> ControlServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    @property
    def clients(self) -> int:
        return len(self._clients)

    async def start(self) -> None:
        self._sock, self._ident = bind_unix_socket(self.path)
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._accept = self._tg.create_task(self._accept_loop(self._sock), name="gossiprec-control")

    async def aclose(self) -> None:
        """Stop accepting, close every client, remove the socket file (if it is still ours)."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            self._sock.close()
            try:
                st = os.stat(self.path)
                if (st.st_dev, st.st_ino) == self._ident:
                    os.unlink(self.path)
            except OSError:
                pass
        for task in (self._accept, *self._clients):
            if task is not None:
                task.cancel()
        tg, self._tg = self._tg, None
        if tg is not None:
            await tg.__aexit__(None, None, None)

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closed:
            try:
                conn, _ = await loop.sock_accept(sock)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if self._closed:
                    return
                self._count("accept_errors")
                log.warning("control socket accept failed: %s", exc)
                await asyncio.sleep(0.05)
                continue
            if len(self._clients) >= self.max_clients or self._tg is None:
                self._count("clients_refused")
                conn.close()
                continue
            conn.setblocking(False)
            task = self._tg.create_task(self._serve(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn)
        except OSError as exc:
            conn.close()
            self._disconnected(exc)
            return
        await self.serve_stream(reader, writer)

    async def serve_stream(self, reader: asyncio.StreamReader, writer: FrameWriter) -> None:
        """Serve one client until it ends; never raises (but on cancellation). The accept loop calls
        this per client; tests may pass an in-memory reader and any writer of this shape. A client
        going away is one debug line (``disconnects``); anything else is a bug: ``errors``, traceback."""
        self._count("connections")
        c = _Conn(writer, self.write_timeout)
        try:
            async with asyncio.TaskGroup() as tg:
                try:
                    await self._session(reader, c, tg)
                finally:
                    if c.source is not None:
                        c.source.close()
                    if c.forwarder is not None:
                        c.forwarder.cancel()
        except _GONE as exc:
            self._disconnected(exc)
        except Exception as exc:  # a bug must not take the agent down with one client
            gone, bug = exc.split(_GONE) if isinstance(exc, ExceptionGroup) else (None, exc)
            if bug is None:
                self._disconnected(gone)
            else:
                self._count("errors")
                log.error("control connection failed", exc_info=bug)
        finally:
            writer.close()

    def _disconnected(self, exc: BaseException | None) -> None:
        self._count("disconnects")
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        log.debug("control client went away: %s", type(exc).__name__ if exc is not None else "?")

    async def _session(self, reader: asyncio.StreamReader, c: _Conn, tg: asyncio.TaskGroup) -> None:
        hello = False
        while True:
            try:
                if hello:
                    head = await reader.readexactly(_LEN)
                else:
                    async with asyncio.timeout(self.hello_timeout):
                        head = await reader.readexactly(_LEN)
                n = int.from_bytes(head, "big")
                if n == 0 or n > self.max_frame:
                    raise ControlError("bad_frame", f"frame length {n} is outside 1..{self.max_frame}")
                async with asyncio.timeout(self.write_timeout):
                    body = await reader.readexactly(n)
                req = decode_body(body)
                if not isinstance(req, dict) or not isinstance(req.get("op"), str):
                    raise ControlError("bad_request", "a request is a map with a string \"op\"")
                rid = req.get("id")
                if rid is not None and not isinstance(rid, (int, str)):
                    raise ControlError("bad_request", "\"id\" must be an integer or a string")
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # client closed (or exited with unread data: reset)
            except TimeoutError:
                await self._refuse(c, None, "timeout", f"no request within {self.hello_timeout} s")
                return
            except ControlError as exc:
                await self._refuse(c, None, exc.code, exc.message)
                return
            op = req["op"]
            if not hello:
                if op != "hello":
                    await self._refuse(c, rid, "bad_handshake", "send {\"op\": \"hello\", \"version\": 1} "
                                                                 "first")
                    return
                if req.get("version") != CONTROL_VERSION:
                    await self._refuse(c, rid, "unsupported_version",
                                       f"client speaks version {req.get('version')!r}, this agent speaks "
                                       f"{CONTROL_VERSION}; use the gossiprec version of the agent")
                    return
                hello = True
                await c.reply(rid, {"version": CONTROL_VERSION, "node": self.backend.node_name,
                                    "max_frame": self.max_frame})
                continue
            handler = _OPS.get(op)
            if handler is None:
                await self._refuse(c, rid, "unknown_op", f"unknown op {op!r}; known: {', '.join(sorted(_OPS))}")
                return
            self._count("op_" + op)
            try:
                result = handler(self, req, c, tg)
            except ControlError as exc:
                self._count("bad_args")
                await c.error(rid, exc.code, exc.message)
                continue
            if not req.get("noreply"):
                await c.reply(rid, result)

    async def _refuse(self, c: _Conn, rid: Any, code: str, message: str) -> None:
        self._count("refused_" + code)
        try:
            await c.error(rid, code, message)
        except (OSError, TimeoutError):
            pass

    # --- ops ----------------------------------------------------------------------------------
    def _op_ping(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        return {"pong": True}

    def _op_report(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        step = _int_arg(req, "step", -1, 2**62)
        phase = req.get("phase", "compute")
        if isinstance(phase, str) and phase in PHASES:
            phase_i = PHASES.index(phase)
        elif type(phase) is int and 0 <= phase < len(PHASES):
            phase_i = phase
        else:
            raise ControlError("bad_args", f"phase must be one of {', '.join(PHASES)} (or its index), "
                                           f"got {phase!r}")
        step_ms = req.get("step_ms", 0)
        if type(step_ms) is float and math.isfinite(step_ms):
            step_ms = int(round(step_ms))
        if type(step_ms) is not int or not 0 <= step_ms <= 2**31 - 1:
            raise ControlError("bad_args", f"step_ms must be a number of milliseconds 0..2**31-1, got "
                                           f"{step_ms!r}")
        self.backend.control_report(step, phase_i, step_ms)
        return {}

    def _op_state(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        args = (req.get("committed_step"), req.get("inflight_step"), req.get("state_bytes"), req.get("transfer_port"))
        problem = state_problem(*args)
        if problem is not None:
            raise ControlError("bad_args", problem)
        self.backend.control_set_state(*args)
        return {}

    def _op_finished(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_finished(_int_arg(req, "step", 0, 2**62))
        return {}

    def _op_members(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        return {"members": self.backend.control_members()}

    def _op_status(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        return {"status": to_plain(self.backend.control_status())}

    def _op_subscribe(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        if c.source is None:
            c.source = self.backend.control_subscribe()
            c.forwarder = tg.create_task(self._forward(c, c.source))
        return {}

    def _op_unsubscribe(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        if c.source is not None:
            c.source.close()
            c.source = None
        return {}

    def _op_register_layout(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        layout = req.get("layout")
        if not isinstance(layout, dict):
            raise ControlError("bad_args", "layout must be a map")
        self.backend.control_set_layout(layout)
        return {}

    def _op_get_layout(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        return {"layout": self.backend.control_layout()}

    async def _forward(self, c: _Conn, source: EventSource) -> None:
        try:
            while True:
                ev = await source.get()
                if ev is None:
                    if source.overflowed:
                        self._count("overflows")
                        await self._refuse(c, None, "overflow", "event stream overflowed: read events "
                                                                "faster; reconnect and subscribe again")
                        c.writer.close()
                    return
                await c.send(event_to_dict(ev))
        except (OSError, TimeoutError):
            c.writer.close()  # the reader side sees the close and ends the session

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


_OPS = {
    "ping": ControlServer._op_ping,
    "report": ControlServer._op_report,
    "state": ControlServer._op_state,
    "finished": ControlServer._op_finished,
    "members": ControlServer._op_members,
    "status": ControlServer._op_status,
    "subscribe": ControlServer._op_subscribe,
    "unsubscribe": ControlServer._op_unsubscribe,
    "register_layout": ControlServer._op_register_layout,
    "get_layout": ControlServer._op_get_layout,
}


def state_problem(committed_step: Any, inflight_step: Any, state_bytes: Any, transfer_port: Any) -> str | None:
    """What is wrong with a trainer's state (the ``state`` message, or the progress page), or None."""
    if type(committed_step) is not int or not 0 <= committed_step <= 2**62:
        return f"committed_step must be an integer 0..2**62, got {committed_step!r}"
    if inflight_step is not None and (type(inflight_step) is not int or not committed_step < inflight_step <= 2**62):
        return f"inflight_step must be null or an integer above committed_step {committed_step}, got {inflight_step!r}"
    if type(state_bytes) is not int or not 0 <= state_bytes <= 2**62:
        return f"state_bytes must be an integer 0..2**62, got {state_bytes!r}"
    if transfer_port is not None and (type(transfer_port) is not int or not 0 < transfer_port < 65536):
        return f"transfer_port must be null or a TCP port 1..65535, got {transfer_port!r}"
    return None


def _int_arg(req: Mapping[str, Any], name: str, lo: int, hi: int) -> int:
    v = req.get(name)
    if type(v) is not int or not lo <= v <= hi:
        raise ControlError("bad_args", f"{name} must be an integer {lo}..{hi}, got {v!r}")
    return v


# --- clients ----------------------------------------------------------------------------------------
def _check_reply(frame: Any) -> dict[str, Any]:
    if not isinstance(frame, dict):
        raise ControlError("bad_reply", "the agent sent something that is not a map")
    return frame


class ControlClient:
    """Blocking client for the training loop (no asyncio). Not thread-safe: one thread per client.

    ``ControlClient(path)`` connects and performs the handshake; errors raise :class:`ControlError`.
    Events (after :meth:`subscribe`) are buffered while a request waits for its reply; read them with
    :meth:`next_event`.
    """

    def __init__(self, path: str, *, timeout: float = 5.0, max_events: int = 100_000) -> None:
        self.path = path
        self.timeout = timeout
        self.node: str | None = None
        self.events_dropped = 0
        self.last_error: ControlError | None = None
        self._events: deque[dict[str, Any]] = deque()
        self._max_events = max_events
        self._buf = bytearray()
        self._next_id = 1
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(timeout)
            self._sock.connect(path)
        except OSError as exc:
            self._sock.close()
            raise ControlError("unavailable", f"cannot connect to the agent at {path}: {exc.strerror or exc}; "
                                              "is `gossiprec agent` or `gossiprec run` running?") from None
        try:
            reply = self.request("hello", version=CONTROL_VERSION)
        except BaseException:
            self._sock.close()
            raise
        self.node = reply.get("node")

    @classmethod
    def from_env(cls, **kwargs: Any) -> ControlClient:
        """Connect to the socket named by ``GOSSIPREC_CONTROL`` (set by ``gossiprec run``)."""
        from gossiprec.agent.settings import control_path_from_env
        return cls(control_path_from_env(), **kwargs)

    def __enter__(self) -> ControlClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._sock.close()

    # --- requests ------------------------------------------------------------------------------
    def request(self, op: str, *, timeout: float | None = None, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raises ControlError for an error reply."""
        rid = self._next_id
        self._next_id += 1
        self._send({**args, "op": op, "id": rid})
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            frame = self._read_frame(deadline)
            if frame is None:
                raise ControlError("timeout", f"no reply to {op!r} within {self.timeout} s; is the agent "
                                              "overloaded or stopped?")
            if self._dispatch(frame, rid):
                if not frame.get("ok"):
                    raise ControlError(str(frame.get("error")), str(frame.get("message")))
                return frame

    def notify(self, op: str, **args: Any) -> None:
        """Send a request without waiting (``noreply``); an error shows up in :attr:`last_error`."""
        self._send({**args, "op": op, "noreply": True})

    def report(self, step: int, phase: str | int = "compute", step_ms: int | float = 0,
               *, wait: bool = True) -> None:
        """Tell the agent this rank's training progress (gossiped to every member)."""
        if wait:
            self.request("report", step=step, phase=phase, step_ms=step_ms)
        else:
            self.notify("report", step=step, phase=phase, step_ms=step_ms)

    def set_state(self, committed_step: int, inflight_step: int | None = None, state_bytes: int = 0,
                  transfer_port: int | None = None, *, wait: bool = True) -> None:
        """Tell the agent what this rank could donate: reported to the plan of each new view."""
        args = {"committed_step": committed_step, "inflight_step": inflight_step,
                "state_bytes": state_bytes, "transfer_port": transfer_port}
        if wait:
            self.request("state", **args)
        else:
            self.notify("state", **args)

    def finished(self, step: int) -> None:
        """Training is over at ``step`` (the job's last): the agents end the job, spares leave."""
        self.request("finished", step=step)

    def members(self) -> list[dict[str, Any]]:
        return list(self.request("members")["members"])

    def status(self) -> dict[str, Any]:
        return dict(self.request("status")["status"])

    def ping(self) -> float:
        """Round trip to the agent, seconds."""
        t0 = time.perf_counter()
        self.request("ping")
        return time.perf_counter() - t0

    def register_layout(self, layout: Mapping[Any, Any]) -> None:
        self.request("register_layout", layout=dict(layout))

    def layout(self) -> dict[Any, Any] | None:
        layout: dict[Any, Any] | None = self.request("get_layout")["layout"]
        return layout

    def subscribe(self) -> None:
        self.request("subscribe")

    def next_event(self, timeout: float | None = None) -> dict[str, Any] | None:
        """The next event (blocking up to ``timeout`` seconds; 0 polls); None if none arrived."""
        if self._events:
            return self._events.popleft()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            frame = self._read_frame(deadline)
            if frame is None:
                return None
            self._dispatch(frame, None)
            if self._events:
                return self._events.popleft()

    # --- framing -------------------------------------------------------------------------------
    def _dispatch(self, frame: dict[str, Any], rid: Any) -> bool:
        """Route a frame; True if it answers request ``rid``."""
        if "event" in frame:
            if len(self._events) >= self._max_events:
                self._events.popleft()
                self.events_dropped += 1
            self._events.append(frame)
            return False
        if rid is not None and frame.get("id") == rid:
            return True
        if not frame.get("ok", True):
            err = ControlError(str(frame.get("error")), str(frame.get("message")))
            self.last_error = err
            if err.code in DISCONNECTING:
                raise err
        return False

    def _send(self, obj: Mapping[str, Any]) -> None:
        try:
            self._sock.settimeout(self.timeout)
            self._sock.sendall(encode_frame(obj))
        except OSError as exc:
            raise ControlError("disconnected", f"cannot write to the agent: {exc}") from None

    def _read_frame(self, deadline: float | None) -> dict[str, Any] | None:
        buf = self._buf
        while True:
            if len(buf) >= _LEN:
                n = int.from_bytes(buf[:_LEN], "big")
                if n > MAX_REPLY_FRAME:
                    raise ControlError("bad_frame", f"the agent sent a frame of {n} bytes")
                if len(buf) >= _LEN + n:
                    body = bytes(buf[_LEN:_LEN + n])
                    del buf[:_LEN + n]
                    return _check_reply(decode_body(body))
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return None
            try:
                self._sock.settimeout(remaining)
                chunk = self._sock.recv(256 * 1024)
            except (socket.timeout, BlockingIOError):
                return None
            except OSError as exc:
                raise ControlError("disconnected", f"control connection failed: {exc}") from None
            if not chunk:
                raise ControlError("disconnected", "the agent closed the control connection")
            buf += chunk


class AsyncControlClient:
    """asyncio twin of :class:`ControlClient`. Use from one task at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, timeout: float) -> None:
        self._reader = reader
        self._writer = writer
        self.timeout = timeout
        self.node: str | None = None
        self._events: deque[dict[str, Any]] = deque()
        self._next_id = 1
        self.last_error: ControlError | None = None

    @classmethod
    async def connect(cls, path: str, *, timeout: float = 5.0) -> AsyncControlClient:
        try:
            reader, writer = await asyncio.open_unix_connection(path, limit=MAX_REPLY_FRAME)
        except OSError as exc:
            raise ControlError("unavailable", f"cannot connect to the agent at {path}: {exc}") from None
        client = cls(reader, writer, timeout)
        try:
            client.node = (await client.request("hello", version=CONTROL_VERSION)).get("node")
        except BaseException:
            await client.aclose()
            raise
        return client

    async def __aenter__(self) -> AsyncControlClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass

    async def request(self, op: str, **args: Any) -> dict[str, Any]:
        rid = self._next_id
        self._next_id += 1
        self._writer.write(encode_frame({**args, "op": op, "id": rid}))
        async with asyncio.timeout(self.timeout):
            await self._writer.drain()
            while True:
                frame = await self._read_frame()
                if "event" in frame:
                    self._events.append(frame)
                elif frame.get("id") == rid:
                    if not frame.get("ok"):
                        raise ControlError(str(frame.get("error")), str(frame.get("message")))
                    return frame
                elif not frame.get("ok", True):
                    self.last_error = ControlError(str(frame.get("error")), str(frame.get("message")))
                    if self.last_error.code in DISCONNECTING:
                        raise self.last_error

    async def report(self, step: int, phase: str | int = "compute", step_ms: int | float = 0) -> None:
        await self.request("report", step=step, phase=phase, step_ms=step_ms)

    async def members(self) -> list[dict[str, Any]]:
        return list((await self.request("members"))["members"])

    async def status(self) -> dict[str, Any]:
        return dict((await self.request("status"))["status"])

    async def subscribe(self) -> None:
        await self.request("subscribe")

    async def next_event(self) -> dict[str, Any]:
        """The next event frame (wrap in ``asyncio.timeout`` to bound the wait)."""
        while not self._events:
            frame = await self._read_frame()
            if "event" in frame:
                self._events.append(frame)
            elif not frame.get("ok", True):
                raise ControlError(str(frame.get("error")), str(frame.get("message")))
        return self._events.popleft()

    async def _read_frame(self) -> dict[str, Any]:
        try:
            head = await self._reader.readexactly(_LEN)
            n = int.from_bytes(head, "big")
            if n > MAX_REPLY_FRAME:
                raise ControlError("bad_frame", f"the agent sent a frame of {n} bytes")
            body = await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, OSError):
            raise ControlError("disconnected", "the agent closed the control connection") from None
        return _check_reply(decode_body(body))
