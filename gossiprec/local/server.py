"""The agent's end of the control socket: a Unix stream socket for the training processes of this host.

The socket is mode 0600 in a directory only this user (or root) can change, so only this user can
connect (the default directory, ``$XDG_RUNTIME_DIR/gossiprec`` or ``/tmp/gossiprec-<uid>``, must be this
user's own 0700 directory, checked without following a symlink); a stale socket file is replaced, a
live one (another agent) refused (:func:`bind_unix_socket`). Each connection is a task of the server's
TaskGroup that speaks :mod:`gossiprec.local.protocol` to the agent behind the :class:`ControlBackend`
interface.

Garbage is answered with one error frame and the connection is closed: a length of 0 or above
``max_frame`` (``bad_frame``), undecodable msgpack (``bad_msgpack``), a frame that is not a map with a
string ``op`` (``bad_request``), anything before the handshake or a wrong version (``bad_handshake``,
``unsupported_version``), an unknown op (``unknown_op``), no handshake within ``hello_timeout``
(``timeout``). Bad argument values of a known op (``bad_args``) are answered and the connection stays.
A subscriber that reads too slowly overflows its bounded queue and is disconnected (``overflow``). A
follower (``follow``: ``gossiprec events``) is not: its queue is lossy (what does not fit is dropped and
announced by one ``Gap`` event), and its writes may wait ``idle_timeout``, not ``write_timeout``.

No client can hold the agent's resources: a client that stops reading is aborted (its socket and
unsent bytes dropped at once, not left to a close that would wait for it) when a write has waited
``write_timeout``; a client that sent its handshake and then nothing for ``idle_timeout`` is closed
(``timeout``), unless it subscribed (a subscriber only reads); and when all ``max_clients`` slots are
taken, a new client evicts the one that has been quiet longest among those not subscribed, so idle
clients cannot lock out ``gossiprec status`` (only when every slot is a subscriber is the new one
refused). No client can raise out of the server. A client that goes away mid-conversation (reset, broken pipe, not
reading) is counted under ``disconnects`` and logged as one debug line; only a bug in the server is
logged with a traceback (``errors``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from pathlib import Path
from typing import Any, Mapping, Protocol

from gossiprec.errors import ConfigError, ProtocolError
from gossiprec.local.protocol import (
    CONTROL_VERSION, LENGTH_PREFIX, MAX_REQUEST_FRAME, ControlError, check_request, decode_body, encode_frame,
    checked_args, event_to_dict, finished_args, follow_args, frame_length, layout_args, recovered_args, report_args,
    state_args, to_plain,
)

log = logging.getLogger(__name__)

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
    def control_recovered(self, record: dict[str, Any]) -> None: ...
    def control_checked(self, ok: bool) -> None: ...
    def control_members(self) -> list[dict[str, Any]]: ...
    def control_status(self) -> dict[str, Any]: ...
    def control_set_layout(self, layout: dict[Any, Any]) -> None: ...
    def control_layout(self) -> dict[Any, Any] | None: ...
    def control_subscribe(self) -> EventSource: ...
    def control_follow(self, queue: int, probes: bool) -> EventSource:
        """A lossy subscription of ``queue`` events, probe outcomes only if ``probes`` (items:
        ``Stamped`` events and ``Gap`` markers, :mod:`gossiprec.agent.hub`)."""
        ...


class FrameWriter(Protocol):
    """The writing half the server needs (``asyncio.StreamWriter`` has this shape)."""

    def write(self, data: bytes) -> None: ...
    async def drain(self) -> None: ...
    def close(self) -> None: ...


_GONE = (OSError, TimeoutError, asyncio.IncompleteReadError)
"""What a client going away looks like to the server (reset, broken pipe, slow reader, EOF)."""


def _abort(writer: FrameWriter) -> None:
    """Drop the connection now, unsent bytes and all (a close would wait for a reader that never reads)."""
    transport = getattr(writer, "transport", None)
    if transport is not None:
        transport.abort()
    else:
        writer.close()


class _Conn:
    """One client connection: serialised writes with a timeout, and when it last did anything."""

    def __init__(self, writer: FrameWriter, write_timeout: float, now: float) -> None:
        self.writer = writer
        self.lock = asyncio.Lock()
        self.write_timeout = write_timeout
        self.source: EventSource | None = None
        self.forwarder: asyncio.Task[None] | None = None
        self.active_at = now
        self.stuck = False
        """A write timed out: the client does not read."""

    async def send(self, obj: Mapping[str, Any]) -> None:
        frame = encode_frame(obj)
        async with self.lock:
            try:
                self.writer.write(frame)
            except RuntimeError as exc:
                # uvloop's transports raise RuntimeError ("unable to perform operation on <UnixTransport
                # closed=True>") for a write after the close: the client is gone, like a reset
                raise ConnectionResetError(f"the client connection is closed ({exc})") from exc
            try:
                async with asyncio.timeout(self.write_timeout):
                    await self.writer.drain()
            except TimeoutError:
                self.stuck = True
                _abort(self.writer)
                raise

    async def reply(self, rid: Any, body: Mapping[str, Any]) -> None:
        await self.send({"ok": True, "id": rid, **body})

    async def error(self, rid: Any, code: str, message: str) -> None:
        await self.send({"ok": False, "id": rid, "error": code, "message": message})


def _check_directory(d: Path) -> None:
    """Refuse a directory where another user could swap our socket for theirs (a symlink to it too:
    whoever owns the link can point it elsewhere later)."""
    link = os.lstat(d)
    if stat.S_ISLNK(link.st_mode) and link.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"control socket directory {d} is a symlink owned by another user (uid "
                          f"{link.st_uid}), who could redirect it; choose a directory of your own for "
                          "--control-socket")
    st = os.stat(d)
    if st.st_uid not in (os.getuid(), 0):
        raise ConfigError(f"control socket directory {d} belongs to another user (uid {st.st_uid}); "
                          "choose a directory of your own for --control-socket")
    if st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX:
        raise ConfigError(f"control socket directory {d} is writable by others without the sticky bit, "
                          f"so anyone could replace the socket; `chmod go-w {d}` or choose another")


def ensure_private_dir(d: Path) -> None:
    """Create ``d`` mode 0700, or accept it only as this user's own 0700 directory (not a symlink):
    the default socket directory has a predictable name, which another local user may have taken
    first to block or hijack the agent."""
    try:
        os.mkdir(d, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise ConfigError(f"cannot create the control socket directory {d}: {exc.strerror}; set "
                          "XDG_RUNTIME_DIR or pass --control-socket") from None
    st = os.lstat(d)
    fix = ("another local user may have created it to block or hijack this agent: remove it if it is "
           "not yours, set XDG_RUNTIME_DIR (a directory only you can use), or pass --control-socket")
    if stat.S_ISLNK(st.st_mode):
        raise ConfigError(f"control socket directory {d} is a symlink; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"control socket directory {d} is not a directory; {fix}")
    if st.st_uid != os.getuid():
        raise ConfigError(f"control socket directory {d} belongs to uid {st.st_uid}, not to you "
                          f"(uid {os.getuid()}); {fix}")
    if st.st_mode & 0o077:
        raise ConfigError(f"control socket directory {d} has mode {stat.S_IMODE(st.st_mode):o}; it must be "
                          f"0700 (`chmod 700 {d}`), or {fix}")


def bind_unix_socket(path: str, *, private_dir: bool = False) -> tuple[socket.socket, tuple[int, int]]:
    """Bind and listen on ``path`` with mode 0600 (nobody can connect before the chmod: listen comes
    after it). A stale socket file is replaced; a live one (another agent) is a ConfigError.
    ``private_dir``: the directory is the default one, and must be this user's own 0700 directory
    (:func:`ensure_private_dir`); otherwise it must be one only this user or root can change."""
    p = Path(path)
    if len(os.fsencode(path)) > 107:
        raise ConfigError(f"control socket path {path} is longer than 107 bytes; choose a shorter one")
    if private_dir:
        ensure_private_dir(p.parent)
    elif not p.parent.exists():
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
                 max_clients: int = 32, hello_timeout: float = 5.0, write_timeout: float = 5.0,
                 idle_timeout: float = 600.0, private_dir: bool = False) -> None:
        self.path = path
        self.private_dir = private_dir
        """The path is the default one: its directory must be this user's own (see bind_unix_socket)."""
        self.backend = backend
        self.max_frame = max_frame
        self.max_clients = max_clients
        self.hello_timeout = hello_timeout
        self.write_timeout = write_timeout
        self.idle_timeout = idle_timeout
        """Seconds a client that is not subscribed may stay silent after its handshake. A training
        loop reports every step; this outlasts any step, a checkpoint and a recovery."""
        self.counters: dict[str, int] = {}
        self._sock: socket.socket | None = None
        self._ident: tuple[int, int] | None = None
        self._tg: asyncio.TaskGroup | None = None
        self._accept: asyncio.Task[None] | None = None
        self._clients: set[asyncio.Task[None]] = set()
        self._conns: dict[asyncio.Task[Any], _Conn] = {}
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
        self._sock, self._ident = bind_unix_socket(self.path, private_dir=self.private_dir)
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
            if self._tg is None or (len(self._clients) >= self.max_clients and not self._evict_one()):
                self._count("clients_refused")
                conn.close()
                continue
            conn.setblocking(False)
            task = self._tg.create_task(self._serve(conn))
            self._clients.add(task)
            task.add_done_callback(self._clients.discard)

    def _evict_one(self) -> bool:
        """Make room: cancel the client quiet longest that is not subscribed. False if there is none."""
        quiet = [(c.active_at, t) for t, c in self._conns.items() if c.source is None and not t.done()]
        if not quiet:
            return False
        _, task = min(quiet, key=lambda x: x[0])
        self._clients.discard(task)  # its slot is free now; the task ends at its next await
        task.cancel()
        self._count("clients_evicted")
        return True

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
        loop = asyncio.get_running_loop()
        c = _Conn(writer, self.write_timeout, loop.time())
        me = asyncio.current_task()
        if me is not None:
            self._conns[me] = c
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
            if me is not None:
                self._conns.pop(me, None)
            if c.stuck:
                _abort(writer)
            else:
                writer.close()

    def _disconnected(self, exc: BaseException | None) -> None:
        self._count("disconnects")
        while isinstance(exc, BaseExceptionGroup):
            exc = exc.exceptions[0]
        log.debug("control client went away: %s", type(exc).__name__ if exc is not None else "?")

    async def _session(self, reader: asyncio.StreamReader, c: _Conn, tg: asyncio.TaskGroup) -> None:
        hello = False
        loop = asyncio.get_running_loop()
        while True:
            try:
                if hello:
                    async with asyncio.timeout(None if c.source is not None else self.idle_timeout):
                        head = await reader.readexactly(LENGTH_PREFIX)
                else:
                    async with asyncio.timeout(self.hello_timeout):
                        head = await reader.readexactly(LENGTH_PREFIX)
                c.active_at = loop.time()
                n = frame_length(head)
                if n == 0 or n > self.max_frame:
                    raise ControlError("bad_frame", f"frame length {n} is outside 1..{self.max_frame}")
                async with asyncio.timeout(self.write_timeout):
                    body = await reader.readexactly(n)
                req = decode_body(body)
                op, rid = check_request(req)
            except (asyncio.IncompleteReadError, ConnectionError):
                return  # client closed (or exited with unread data: reset)
            except TimeoutError:
                if c.stuck:
                    return  # a write to it timed out (from the event forwarder): aborted already
                wait = self.idle_timeout if hello else self.hello_timeout
                await self._refuse(c, None, "timeout", f"no request within {wait:g} s; reconnect")
                return
            except ControlError as exc:
                await self._refuse(c, None, exc.code, exc.message)
                return
            if not hello:
                if op != "hello":
                    await self._refuse(c, rid, "bad_handshake",
                                       f'send {{"op": "hello", "version": {CONTROL_VERSION}}} first')
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
        try:
            self.backend.control_report(*report_args(req))
        except ControlError:
            raise
        except ProtocolError as exc:  # the core refused the values (a step further ahead than training goes)
            raise ControlError("bad_args", str(exc)) from exc
        return {}

    def _op_state(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_set_state(*state_args(req))
        return {}

    def _op_finished(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_finished(finished_args(req))
        return {}

    def _op_recovered(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_recovered(recovered_args(req))
        return {}

    def _op_checked(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_checked(checked_args(req))
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

    def _op_follow(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        queue, probes = follow_args(req)
        if c.source is None:
            c.source = self.backend.control_follow(queue, probes)
            # a person reads this stream and may pause it: its queue drops instead of growing, so the
            # writes may wait as long as an idle client may stay
            c.write_timeout = max(self.write_timeout, self.idle_timeout)
            c.forwarder = tg.create_task(self._forward(c, c.source, follow=True))
        return {}

    def _op_unsubscribe(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        if c.source is not None:
            c.source.close()
            c.source = None
        return {}

    def _op_register_layout(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        self.backend.control_set_layout(layout_args(req))
        return {}

    def _op_get_layout(self, req: dict[str, Any], c: _Conn, tg: asyncio.TaskGroup) -> dict[str, Any]:
        return {"layout": self.backend.control_layout()}

    async def _forward(self, c: _Conn, source: EventSource, *, follow: bool = False) -> None:
        try:
            while True:
                ev = await source.get()
                if follow and ev is not None:
                    await self._send_followed(c, ev)
                    continue
                if ev is None:
                    if source.overflowed:
                        self._count("overflows")
                        await self._refuse(c, None, "overflow", "event stream overflowed: read events "
                                                                "faster; reconnect and subscribe again")
                        c.writer.close()
                    return
                await c.send(event_to_dict(ev))
        except (OSError, TimeoutError):
            _abort(c.writer)  # the reader side sees the close and ends the session

    async def _send_followed(self, c: _Conn, item: Any) -> None:
        """One item of a lossy subscription: a stamped event, or a gap (``{"event": "Gap", ...}``)."""
        stamp = getattr(item, "time", None)
        ev = getattr(item, "event", item)
        frame = event_to_dict(ev)
        if type(ev).__name__ == "Gap":
            self._count("follow_gaps")
            frame["time"] = frame.get("at")
        else:
            frame["time"] = stamp
        await c.send(frame)

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1


_OPS = {
    "ping": ControlServer._op_ping,
    "report": ControlServer._op_report,
    "state": ControlServer._op_state,
    "finished": ControlServer._op_finished,
    "recovered": ControlServer._op_recovered,
    "checked": ControlServer._op_checked,
    "members": ControlServer._op_members,
    "status": ControlServer._op_status,
    "subscribe": ControlServer._op_subscribe,
    "unsubscribe": ControlServer._op_unsubscribe,
    "follow": ControlServer._op_follow,
    "register_layout": ControlServer._op_register_layout,
    "get_layout": ControlServer._op_get_layout,
}
