"""The clients of the control socket: :class:`ControlClient` for the training loop (blocking, no
asyncio) and :class:`AsyncControlClient` for asyncio code and tests.

Both number their requests and match replies by id; event frames that arrive while a request waits
(after ``subscribe``) are kept aside for ``next_event``. An error reply raises :class:`ControlError`;
an unsolicited one (an answer to a ``noreply`` request) is kept in ``last_error``, and raises only when
its code means the agent is closing the connection. The wire is :mod:`gossiprec.local.protocol`.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from typing import Any, Mapping

from gossiprec.local.launch import control_path_from_env
from gossiprec.local.protocol import (
    CONTROL_VERSION, DISCONNECTING, LENGTH_PREFIX, MAX_REPLY_FRAME, ControlError, check_reply, decode_body,
    encode_frame, frame_length,
)


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

    def recovered(self, record: Mapping[str, Any], *, wait: bool = True) -> None:
        """One finished recovery of this trainer (the fields of :data:`~gossiprec.local.protocol.RECOVERY_FIELDS`),
        for the agent's metrics and timeline file."""
        if wait:
            self.request("recovered", record=dict(record))
        else:
            self.notify("recovered", record=dict(record))

    def checked(self, ok: bool, *, wait: bool = True) -> None:
        """A comparison of the replicas' digests ended: ``ok`` false for a mismatch."""
        if wait:
            self.request("checked", ok=ok)
        else:
            self.notify("checked", ok=ok)

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
            if len(buf) >= LENGTH_PREFIX:
                n = frame_length(buf)
                if n > MAX_REPLY_FRAME:
                    raise ControlError("bad_frame", f"the agent sent a frame of {n} bytes")
                if len(buf) >= LENGTH_PREFIX + n:
                    body = bytes(buf[LENGTH_PREFIX:LENGTH_PREFIX + n])
                    del buf[:LENGTH_PREFIX + n]
                    return check_reply(decode_body(body))
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
            head = await self._reader.readexactly(LENGTH_PREFIX)
            n = frame_length(head)
            if n > MAX_REPLY_FRAME:
                raise ControlError("bad_frame", f"the agent sent a frame of {n} bytes")
            body = await self._reader.readexactly(n)
        except (asyncio.IncompleteReadError, OSError):
            raise ControlError("disconnected", "the agent closed the control connection") from None
        return check_reply(decode_body(body))
