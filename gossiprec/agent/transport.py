"""Network transport of the agent: sealed UDP datagrams and sealed, length-prefixed TCP messages.

Theory of operation
-------------------
One :class:`NetTransport` binds a UDP socket and a TCP listening socket to the same port. The protocol core
hands the agent ``Send(addr, payload, reliable)``; the agent calls :meth:`NetTransport.send`:

- ``reliable=False``: the payload is sealed with the process's :class:`~gossiprec.security.crypto.Sealer`
  (one boot id per process) for the receiver at that address, and sent as one datagram. Nothing waits;
  a full socket buffer drops the packet (SWIM tolerates loss) and counts it.
- ``reliable=True``: a task in the transport's TaskGroup opens one short-lived TCP connection to the
  address, writes one frame sealed by a fresh :class:`~gossiprec.security.crypto.StreamSealer`, and closes.
  Connect and write are bounded by timeouts; at most ``max_outbound_streams`` run at once, further
  sends are dropped and counted (the core repeats what matters: push-pull, joins).

Inbound, every datagram is opened with the :class:`~gossiprec.security.crypto.Opener` (size, header,
receiver: this node's advertised address once :meth:`NetTransport.set_local_addr` named it, key, replay
window, tag; derivations for unknown senders rate limited) before its plaintext reaches
``on_message(payload, reliable=False)``. Every accepted TCP connection gets its own
:class:`~gossiprec.security.crypto.StreamOpener`; each complete frame goes to ``on_message(payload,
reliable=True)``. A connection is closed at its first bad frame, after ``max_frames_per_stream``
frames, or when ``io_timeout`` runs out. Refusals are counted by reason in :attr:`NetTransport.rejects`
(the opener's :class:`~gossiprec.security.crypto.RejectCounter`) and logged at most once per reason per
``log_interval`` seconds. No exception caused by a peer leaves this module.

Inbound connections are admitted so that nobody without the key can hold this node's TCP port or
memory. A connection is *pending* until its opening frame authenticated (the peer holds a key), and
must get there within ``first_frame_timeout``. When every one of ``max_inbound_streams`` slots is
taken, a new connection evicts the oldest pending one (only when none is pending is it refused); one
source address holds at most ``max_pending_per_source`` pending connections, a new one evicting its
own oldest. Each connection reads no more than its opener asks for (:meth:`StreamOpener.wanted`), and
the bytes every inbound connection buffers together stay within ``max_inbound_buffer``: a read that
would pass it closes its connection instead. Evictions, idle and over-budget closes are counted.
Connections that end without authenticating are also bounded at accept (:mod:`gossiprec.agent.admission`):
a source that overstays its share or idles is refused at accept for a doubling window, and past
``waste_rate`` such connections a second the accept loop pauses, leaving them in the kernel's backlog.

Accounting (:meth:`NetTransport.stats`, shown by the agent's ``status``): a *packet* is a datagram or a
stream frame. ``tx_packets``/``tx_bytes`` count what was handed to the kernel (sealed bytes, frame
length prefix included); ``rx_bytes`` counts every byte that arrived (datagrams, and stream bytes read),
``rx_packets`` every datagram and stream frame that reached the opener, so that
``rx_packets == rx_datagrams + rx_streams + rejects.total`` (accepted plus refused). ``dropped`` lists
every loss by reason: refusals (``rx_<reason>``, see :data:`~gossiprec.security.crypto.REASONS`) and local
drops (backpressure, sealing, resolution, capacity).

Addresses are the core's ``"host:port"`` strings. IP literals are used as they are; host names are
resolved asynchronously once and cached (a datagram to a name not yet resolved is dropped and counted).

Every task belongs to the transport's TaskGroup; :meth:`aclose` stops accepting, lets outbound
messages finish for a grace period, then cancels what is left and closes every socket.
:meth:`abort` closes everything at once (a crash, for tests).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import logging
import socket
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Protocol

from gossiprec.agent.admission import PAUSE_QUANTUM, SourceBackoff
from gossiprec.errors import ConfigError
from gossiprec.security.crypto import CryptoLimits, Opener, OpenError, RejectCounter, RejectLog, Sealer, SealError
from gossiprec.security.keyring import Keyring
from gossiprec.security.refusals import TokenBucket
from gossiprec.agent.settings import join_host_port, split_host_port

log = logging.getLogger(__name__)

_HOT_COUNTERS = ("tx_datagrams", "tx_packets", "tx_bytes", "rx_packets", "rx_bytes", "rx_datagrams")
DROP_COUNTERS = frozenset({
    "tx_after_close", "tx_dropped_backpressure", "tx_udp_errors", "tx_bad_address", "tx_unresolved",
    "tx_wrong_family", "tx_streams_dropped", "tx_stream_errors", "tx_seal_too_large", "tx_seal_no_key",
    "tx_seal_exhausted", "rx_streams_refused", "rx_stream_errors", "rx_handler_errors",
    "rx_streams_evicted", "rx_streams_idle", "rx_streams_over_budget", "rx_streams_backoff",
})
"""Counters of :attr:`NetTransport.counters` that count a lost message (reported under ``dropped``)."""

OnMessage = Callable[[bytes, bool], None]
"""``on_message(payload, reliable)``: called on the event loop for every authenticated message."""


class Transport(Protocol):
    """What the agent needs of its network: best-effort datagrams and reliable messages to
    ``"host:port"``, each delivered to the peer's ``on_message``. :class:`NetTransport` is the real one;
    tests run agents on an in-memory network through the same interface."""

    port: int
    """The port bound (meaningful once :meth:`start` returned)."""

    async def start(self) -> None:
        """Bind and start receiving; ConfigError if the address is taken or invalid."""
        ...

    async def aclose(self, grace: float = 0.0) -> None:
        """Stop, give reliable messages in flight ``grace`` seconds, release everything."""
        ...

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for reliable messages in flight."""
        ...

    def abort(self) -> None:
        """Stop all traffic at once (a crash); :meth:`aclose` still finishes the cleanup."""
        ...

    def set_local_addr(self, addr: str) -> None:
        """This node's advertised ``host:port``: from now on only datagrams sealed for it are accepted."""
        ...

    def send(self, addr: str, payload: bytes, reliable: bool = False) -> None:
        """Send one message; never raises (losses are counted)."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters for ``status`` and metrics (the shape of :meth:`NetTransport.stats`)."""
        ...


class TransportFactory(Protocol):
    """How the agent builds its transport (:class:`NetTransport` itself is one)."""

    def __call__(self, bind_host: str, port: int, *, cluster: str, on_message: OnMessage,
                 keyring: Keyring | None = None, insecure: bool = False,
                 limits: TransportLimits | None = None) -> Transport: ...


@dataclass(frozen=True, slots=True)
class TransportLimits:
    """Bounds on sizes, concurrency and time. Seconds for times, bytes for sizes."""

    max_datagram_payload: int = 1400
    """Largest datagram plaintext (the core's ``Config.mtu``)."""
    max_stream_payload: int = 8 * 1024 * 1024
    """Largest reliable message plaintext; a push-pull of 10,000 members is about 0.5 MB."""
    connect_timeout: float = 2.0
    """Seconds to establish an outbound TCP connection."""
    io_timeout: float = 10.0
    """Seconds an outbound write, or a whole inbound connection, may take."""
    first_frame_timeout: float = 2.0
    """Seconds an inbound connection may take to authenticate (its opening frame); a peer sends that
    frame right after connecting, so this is a round trip and a scheduling delay, with room."""
    max_inbound_streams: int = 64
    """Inbound TCP connections served at once; when all are taken, a new one evicts the oldest that
    has not authenticated yet, and is refused (counted) only when every one has."""
    max_pending_per_source: int = 32
    """Inbound connections from one source address that have not authenticated yet; a new one past
    this evicts that source's oldest."""
    max_inbound_buffer: int = 32 * 1024 * 1024
    """Bytes all inbound connections may buffer together (at least one largest message)."""
    max_outbound_streams: int = 64
    """Outbound reliable messages in flight; more are dropped and counted."""
    max_frames_per_stream: int = 16
    """Frames accepted on one inbound connection before it is closed."""
    udp_buffer_limit: int = 4 * 1024 * 1024
    """Bytes queued in the UDP transport above which datagrams are dropped (backpressure)."""
    socket_buffer: int = 4 * 1024 * 1024
    """SO_RCVBUF / SO_SNDBUF asked of the kernel for the UDP socket (best effort)."""
    log_interval: float = 10.0
    """At most one log line per refusal reason per this many seconds."""
    new_sender_rate: float = 512.0
    """Subkey derivations a second for datagrams from unknown senders (see ``CryptoLimits``)."""
    new_sender_burst: int = 1024
    """Such derivations allowed back to back."""
    waste_rate: float = 500.0
    """Inbound connections a second that may end without authenticating (idle, evicted, refused,
    garbage) before the accept loop pauses until the budget refills (see ``admission``)."""
    waste_burst: int = 500
    """Such connections allowed back to back."""

    def __post_init__(self) -> None:
        for name in ("max_datagram_payload", "max_stream_payload", "max_inbound_streams",
                     "max_outbound_streams", "max_frames_per_stream", "max_pending_per_source"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TransportLimits.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("connect_timeout", "io_timeout", "log_interval", "first_frame_timeout"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"TransportLimits.{name} must be > 0 seconds")
        if not self.waste_rate > 0 or self.waste_burst < 1:
            raise ConfigError("TransportLimits.waste_rate must be > 0 and waste_burst >= 1")
        if self.max_inbound_buffer < self.max_stream_payload + 1024:
            raise ConfigError(f"TransportLimits.max_inbound_buffer ({self.max_inbound_buffer}) must hold "
                              f"one largest message (max_stream_payload {self.max_stream_payload} + framing)")


class Throttle:
    """At most one log line per key per ``interval`` seconds; later lines report what was skipped."""

    def __init__(self, logger: logging.Logger, interval: float = 10.0) -> None:
        self.logger = logger
        self.interval = interval
        self._last: dict[str, float] = {}
        self._skipped: dict[str, int] = {}

    def warn(self, key: str, msg: str, *args: Any, exc_info: bool = False) -> None:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.interval:
            self._skipped[key] = self._skipped.get(key, 0) + 1
            return
        self._last[key] = now
        n = self._skipped.pop(key, 0)
        suffix = f" (+{n} similar since the last report)" if n else ""
        self.logger.warning(msg + suffix, *args, exc_info=exc_info)


@dataclass(eq=False, slots=True)
class _Inbound:
    """One inbound connection: its source, task, whether it authenticated, the buffer bytes it holds."""

    source: str
    task: asyncio.Task[None] | None = None
    reserved: int = 0


_READ_CHUNK = 256 * 1024


class _UdpProtocol(asyncio.DatagramProtocol):
    def __init__(self, owner: NetTransport) -> None:
        self.owner = owner

    def datagram_received(self, data: bytes, addr: Any) -> None:
        self.owner._on_datagram(data, addr)

    def error_received(self, exc: Exception) -> None:
        # ICMP port unreachable and friends: the peer is gone or not there yet; SWIM will notice.
        self.owner._count("udp_errors")

    def connection_lost(self, exc: Exception | None) -> None:
        pass


class NetTransport:
    """UDP + TCP endpoint with sealing. Use as ``async with NetTransport(...) as t`` from one task."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        *,
        cluster: str,
        on_message: OnMessage,
        keyring: Keyring | None = None,
        insecure: bool = False,
        limits: TransportLimits | None = None,
    ) -> None:
        self.limits = limits if limits is not None else TransportLimits()
        crypto_limits = CryptoLimits(max_payload=self.limits.max_datagram_payload,
                                     max_frame_payload=self.limits.max_stream_payload,
                                     new_sender_rate=self.limits.new_sender_rate,
                                     new_sender_burst=self.limits.new_sender_burst)
        self.sealer = Sealer(keyring, cluster, insecure=insecure, limits=crypto_limits)
        self.opener = Opener(keyring, cluster, insecure=insecure, limits=crypto_limits, clock=time.monotonic)
        self.bind_host = bind_host
        self.requested_port = port
        self.port = 0
        self.on_message = on_message
        self.counters: dict[str, int] = dict.fromkeys(_HOT_COUNTERS, 0)
        """Counters by name; the per-datagram ones exist from the start (incremented in place, the
        hot path of an idle agent)."""
        self._reject_log = RejectLog(log, self.limits.log_interval)
        self._throttle = Throttle(log, self.limits.log_interval)
        self._udp: asyncio.DatagramTransport | None = None
        self._listen: socket.socket | None = None
        self._family = socket.AF_INET
        self._tg: asyncio.TaskGroup | None = None
        self._accept_task: asyncio.Task[None] | None = None
        self._outbound: set[asyncio.Task[None]] = set()
        self._inbound: set[asyncio.Task[None]] = set()
        self._pending: OrderedDict[_Inbound, None] = OrderedDict()
        """Inbound connections not authenticated yet, oldest first."""
        self._waste = TokenBucket(self.limits.waste_rate, self.limits.waste_burst)
        self._backoff = SourceBackoff()
        self._buffered = 0
        """Bytes reserved by inbound connections (what they buffer, and their next read)."""
        self._resolved: OrderedDict[str, tuple[Any, ...] | None] = OrderedDict()
        self._resolving: set[str] = set()
        self._closing = False
        self._closed = False
        self.datagram_source: Any = None
        """The socket address a datagram being delivered came from (None outside that call and for
        stream frames): the handler of an operator query checks its reply address against it."""

    # ------------------------------------------------------------------ lifecycle
    @property
    def rejects(self) -> RejectCounter:
        """Refused inbound packets and frames, by reason."""
        return self.opener.rejects

    @property
    def closed(self) -> bool:
        return self._closing

    async def __aenter__(self) -> NetTransport:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def start(self) -> None:
        """Bind UDP and TCP to one port and start accepting. Raises ConfigError if it cannot bind."""
        loop = asyncio.get_running_loop()
        udp_sock, tcp_sock = self._bind_pair()
        self._family = udp_sock.family
        self.port = udp_sock.getsockname()[1]
        self._listen = tcp_sock
        try:
            transport, _ = await loop.create_datagram_endpoint(lambda: _UdpProtocol(self), sock=udp_sock)
        except BaseException:
            udp_sock.close()
            tcp_sock.close()
            raise
        self._udp = transport
        self._tg = asyncio.TaskGroup()
        await self._tg.__aenter__()
        self._accept_task = self._tg.create_task(self._accept_loop(tcp_sock), name="gossiprec-accept")

    def _bind_pair(self) -> tuple[socket.socket, socket.socket]:
        host, want = self.bind_host, self.requested_port
        try:
            infos = socket.getaddrinfo(host, want, type=socket.SOCK_DGRAM, flags=socket.AI_PASSIVE)
        except socket.gaierror as exc:
            raise ConfigError(f"cannot resolve bind address {host!r}: {exc.strerror}") from None
        family, _, _, _, sockaddr = infos[0]
        last: OSError | None = None
        for _ in range(1 if want else 32):
            udp = socket.socket(family, socket.SOCK_DGRAM)
            try:
                udp.setblocking(False)
                for opt in (socket.SO_RCVBUF, socket.SO_SNDBUF):
                    try:
                        udp.setsockopt(socket.SOL_SOCKET, opt, self.limits.socket_buffer)
                    except OSError:
                        pass
                udp.bind(sockaddr)
                port = udp.getsockname()[1]
            except OSError as exc:
                udp.close()
                raise ConfigError(f"cannot bind UDP {join_host_port(host, want)}: {exc.strerror}; "
                                  + _bind_hint(exc.errno, host)) from None
            tcp = socket.socket(family, socket.SOCK_STREAM)
            try:
                tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                tcp.bind((sockaddr[0], port, *sockaddr[2:]))
                tcp.listen(128)
                tcp.setblocking(False)
                return udp, tcp
            except OSError as exc:
                tcp.close()
                udp.close()
                last = exc
                if exc.errno != errno.EADDRINUSE:
                    break
        msg = last.strerror if last is not None else "unknown error"
        raise ConfigError(f"cannot bind TCP {join_host_port(host, want)}: {msg}; "
                          + _bind_hint(last.errno if last is not None else None, host))

    async def aclose(self, grace: float = 0.0) -> None:
        """Stop accepting, give outbound messages ``grace`` seconds, cancel the rest, close sockets."""
        if self._closed:
            return
        self._closing = True
        if self._listen is not None:
            self._listen.close()
        if self._accept_task is not None:
            self._accept_task.cancel()
        if grace > 0 and self._outbound:
            await asyncio.wait(set(self._outbound), timeout=grace)
        for task in (*self._outbound, *self._inbound):
            task.cancel()
        if self._udp is not None:
            self._udp.close()
        tg, self._tg = self._tg, None
        self._closed = True
        if tg is not None:
            await tg.__aexit__(None, None, None)

    async def drain(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for outbound reliable messages in flight."""
        if self._outbound:
            await asyncio.wait(set(self._outbound), timeout=timeout)

    def abort(self) -> None:
        """Close every socket now (no more traffic in or out); :meth:`aclose` still finishes cleanup."""
        self._closing = True
        if self._listen is not None:
            self._listen.close()
        if self._udp is not None:
            self._udp.abort()
        for task in (self._accept_task, *self._outbound, *self._inbound):
            if task is not None:
                task.cancel()

    def set_local_addr(self, addr: str) -> None:
        """This node's advertised ``host:port``: from now on only datagrams sealed for it are accepted."""
        self.opener.set_receiver(addr)

    # ------------------------------------------------------------------ sending
    def send(self, addr: str, payload: bytes, reliable: bool = False) -> None:
        """Seal and send one message to ``"host:port"``. Never raises; failures are counted."""
        if self._closing:
            self._count("tx_after_close")
            return
        if reliable:
            self._send_stream(addr, payload)
            return
        target = self._target(addr)
        if target is None:
            return
        udp = self._udp
        if udp is None or udp.is_closing():
            return
        if udp.get_write_buffer_size() > self.limits.udp_buffer_limit:  # type: ignore[attr-defined]
            self._count("tx_dropped_backpressure")
            return
        try:
            data = self.sealer.seal(payload, addr)
        except SealError as exc:
            self._count("tx_seal_" + exc.reason)
            self._throttle.warn("seal_" + exc.reason, "cannot seal datagram to %s: %s", addr, exc)
            return
        try:
            udp.sendto(data, target)
        except (OSError, ValueError, TypeError) as exc:
            self._count("tx_udp_errors")
            self._throttle.warn("sendto", "sendto %s failed: %s", addr, exc)
            return
        c = self.counters
        c["tx_datagrams"] += 1
        c["tx_packets"] += 1
        c["tx_bytes"] += len(data)

    def _target(self, addr: str) -> tuple[Any, ...] | None:
        cached = self._resolved.get(addr)
        if cached is not None:
            return cached
        try:
            host, port = split_host_port(addr, default_port=0)
        except ConfigError:
            self._count("tx_bad_address")
            return None
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            ip = None
        if ip is not None:
            target = self._sockaddr(str(ip), port, ip.version)
            if target is None:
                self._count("tx_wrong_family")
                return None
            self._remember(addr, target)
            return target
        self._count("tx_unresolved")
        if addr not in self._resolving and len(self._resolving) < 16 and self._tg is not None:
            self._resolving.add(addr)
            self._spawn(self._resolve(addr, host, port), self._outbound)
        return None

    def _sockaddr(self, ip: str, port: int, version: int) -> tuple[Any, ...] | None:
        if self._family == socket.AF_INET6:
            return (ip, port, 0, 0) if version == 6 else (f"::ffff:{ip}", port, 0, 0)
        return (ip, port) if version == 4 else None

    def _remember(self, addr: str, target: tuple[Any, ...]) -> None:
        self._resolved[addr] = target
        if len(self._resolved) > 8192:
            self._resolved.popitem(last=False)

    async def _resolve(self, addr: str, host: str, port: int) -> None:
        try:
            loop = asyncio.get_running_loop()
            async with asyncio.timeout(self.limits.connect_timeout):
                infos = await loop.getaddrinfo(host, port, family=self._family, type=socket.SOCK_DGRAM)
            if infos:
                self._remember(addr, tuple(infos[0][4]))
        except (OSError, TimeoutError, UnicodeError) as exc:
            self._count("tx_resolve_failed")
            self._throttle.warn("resolve", "cannot resolve %s: %s", host, exc)
        finally:
            self._resolving.discard(addr)

    def _send_stream(self, addr: str, payload: bytes) -> None:
        if len(self._outbound) >= self.limits.max_outbound_streams:
            self._count("tx_streams_dropped")
            self._throttle.warn("tx_streams", "too many reliable sends in flight (%d); dropping one to %s",
                                len(self._outbound), addr)
            return
        if len(payload) > self.limits.max_stream_payload:
            self._count("tx_seal_too_large")
            self._throttle.warn("seal_too_large", "reliable message of %d bytes to %s exceeds %d; dropped",
                                len(payload), addr, self.limits.max_stream_payload)
            return
        self._spawn(self._stream_out(addr, payload), self._outbound)

    async def _stream_out(self, addr: str, payload: bytes) -> None:
        writer: asyncio.StreamWriter | None = None
        try:
            host, port = split_host_port(addr, default_port=0)
            frame = self.sealer.new_stream().seal_frame(payload)
            async with asyncio.timeout(self.limits.connect_timeout):
                _, writer = await asyncio.open_connection(host, port)
            async with asyncio.timeout(self.limits.io_timeout):
                writer.write(frame)
                await writer.drain()
                if writer.can_write_eof():
                    writer.write_eof()
            self._count("tx_streams")
            self._count("tx_packets")
            self._count("tx_bytes", len(frame))
        except SealError as exc:
            self._count("tx_seal_" + exc.reason)
            self._throttle.warn("seal_" + exc.reason, "cannot seal message to %s: %s", addr, exc)
        except (OSError, TimeoutError, ConfigError) as exc:
            self._count("tx_stream_errors")
            self._throttle.warn("tx_stream", "reliable send to %s failed: %s", addr,
                                exc.strerror if isinstance(exc, OSError) and exc.strerror else
                                type(exc).__name__)
        except Exception:  # never let one message take the transport down
            self._count("tx_stream_errors")
            self._throttle.warn("tx_stream_bug", "reliable send to %s failed", addr, exc_info=True)
        finally:
            if writer is not None:
                writer.close()
                try:
                    async with asyncio.timeout(self.limits.connect_timeout):
                        await writer.wait_closed()
                except (OSError, TimeoutError):
                    pass

    # ------------------------------------------------------------------ receiving
    def _on_datagram(self, data: bytes, addr: Any) -> None:
        if self._closing:
            return
        c = self.counters
        c["rx_packets"] += 1
        c["rx_bytes"] += len(data)
        try:
            _, payload = self.opener.open(data, addr)
        except OpenError as exc:
            self._reject_log.note(exc, time.monotonic(), _peer(addr))
            return
        c["rx_datagrams"] += 1
        self.datagram_source = addr
        self._deliver(payload, False)
        self.datagram_source = None

    def _deliver(self, payload: bytes, reliable: bool) -> None:
        try:
            self.on_message(payload, reliable)
        except Exception:  # a bug above us must not kill the receive path
            self._count("rx_handler_errors")
            self._throttle.warn("handler", "message handler failed", exc_info=True)

    async def _accept_loop(self, listen: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        while not self._closing:
            pause = self._waste.pause(time.monotonic(), PAUSE_QUANTUM)
            if pause > 0:
                # the budget for connections that never authenticate is spent: leave the rest in the
                # kernel's backlog, where they cost nothing, until it refills
                self._count("rx_accept_paused")
                await asyncio.sleep(pause)
                continue
            try:
                conn, peer = await loop.sock_accept(listen)
            except asyncio.CancelledError:
                raise
            except OSError as exc:
                if self._closing:
                    return
                self._count("rx_accept_errors")
                self._throttle.warn("accept", "accept failed: %s", exc)
                await asyncio.sleep(0.05)  # e.g. EMFILE: do not spin
                continue
            source = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)
            if self._backoff.refuses(source, time.monotonic()):
                self._count("rx_streams_backoff")
                self._waste.spend(time.monotonic())
                conn.close()
                continue
            if not self._admit(source):
                self._count("rx_streams_refused")
                self._throttle.warn("rx_full", "%d inbound connections, all authenticated: refusing one "
                                    "from %s", len(self._inbound), _peer(peer))
                conn.close()
                continue
            conn.setblocking(False)
            state = _Inbound(source)
            state.task = self._spawn(self._stream_in(conn, peer, state), self._inbound)
            if state.task is not None:
                self._pending[state] = None

    def _admit(self, source: str) -> bool:
        """Make room for a connection from ``source``, evicting pending ones; False: refuse it."""
        lim = self.limits
        mine = [c for c in self._pending if c.source == source]
        if len(mine) >= lim.max_pending_per_source:
            self._evict(mine[0])
            self._backoff.strike(source, time.monotonic())  # more than its share: refused for a while
        if len(self._inbound) >= lim.max_inbound_streams:
            if not self._pending:
                return False
            self._evict(next(iter(self._pending)))
        return True

    def _evict(self, c: _Inbound) -> None:
        self._pending.pop(c, None)
        if c.task is not None:
            self._inbound.discard(c.task)  # its slot is free now; the task ends at its next await
            c.task.cancel()
        self._count("rx_streams_evicted")
        self._waste.spend(time.monotonic())

    async def _stream_in(self, conn: socket.socket, peer: Any, state: _Inbound) -> None:
        loop = asyncio.get_running_loop()
        lim = self.limits
        opener = self.opener.new_stream()
        frames = 0
        started = loop.time()
        try:
            async with asyncio.timeout(lim.first_frame_timeout) as deadline:
                while frames < lim.max_frames_per_stream:
                    if opener.authenticated and state in self._pending:
                        self._backoff.forgive(state.source)
                        del self._pending[state]  # a key holder: no longer evictable, the whole io_timeout
                        deadline.reschedule(started + lim.io_timeout)
                    want = min(opener.wanted(), _READ_CHUNK)
                    if not self._reserve(state, opener.buffered + want):
                        self._count("rx_streams_over_budget")
                        self._throttle.warn("rx_budget", "inbound connections buffer %d bytes; closing "
                                            "the one from %s", self._buffered, _peer(peer))
                        break
                    data = await loop.sock_recv(conn, want)
                    if not data:
                        break
                    self._count("rx_bytes", len(data))
                    opener.receive_data(data)
                    # frame by frame: the frames before a bad one are delivered, the rest is not parsed
                    while frames < lim.max_frames_per_stream:
                        payload = opener.next_frame()
                        if payload is None:
                            break
                        frames += 1
                        self._count("rx_packets")
                        self._count("rx_streams")
                        self._deliver(payload, True)
                    self._reserve(state, opener.buffered)
        except OpenError as exc:
            self._count("rx_packets")
            self._waste.spend(time.monotonic())
            self._reject_log.note(exc, time.monotonic(), _peer(peer))
        except TimeoutError:
            if opener.authenticated:
                self._count("rx_stream_errors")
                self._throttle.warn("rx_stream", "inbound stream from %s failed: %s", _peer(peer),
                                    "TimeoutError")
            else:
                self._count("rx_streams_idle")
                self._waste.spend(time.monotonic())
                self._backoff.strike(state.source, time.monotonic())
                self._throttle.warn("rx_idle", "inbound connection from %s sent no opening frame within "
                                    "%.1f s; closed", _peer(peer), lim.first_frame_timeout)
        except OSError as exc:
            self._count("rx_stream_errors")
            self._throttle.warn("rx_stream", "inbound stream from %s failed: %s", _peer(peer),
                                type(exc).__name__)
        except Exception:
            self._count("rx_stream_errors")
            self._throttle.warn("rx_stream_bug", "inbound stream from %s failed", _peer(peer),
                                exc_info=True)
        finally:
            self._pending.pop(state, None)
            self._reserve(state, 0)
            conn.close()

    def _reserve(self, state: _Inbound, nbytes: int) -> bool:
        """Hold ``nbytes`` of the inbound buffer budget for ``state`` (less: release); False if over."""
        extra = nbytes - state.reserved
        if extra > 0 and self._buffered + extra > self.limits.max_inbound_buffer:
            return False
        self._buffered += extra
        state.reserved = nbytes
        return True

    # ------------------------------------------------------------------ helpers
    def _spawn(self, coro: Any, bucket: set[asyncio.Task[None]]) -> asyncio.Task[None] | None:
        tg = self._tg
        if tg is None or self._closing:
            coro.close()
            return None
        try:
            task = tg.create_task(coro)
        except RuntimeError:  # the group is shutting down
            coro.close()
            return None
        bucket.add(task)
        task.add_done_callback(bucket.discard)
        return task

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def stats(self) -> dict[str, Any]:
        """Counters, refusals and drops by reason, and what is in flight (for ``status`` and metrics).

        ``counters`` always holds ``tx_packets``, ``tx_bytes``, ``rx_packets`` and ``rx_bytes`` (0 until
        traffic); ``dropped`` maps every reason a message was lost to its count (see the module notes).
        """
        counters = {"tx_packets": 0, "tx_bytes": 0, "rx_packets": 0, "rx_bytes": 0, **self.counters,
                    "rx_subkey_derivations": self.opener.derivations}
        rejects = dict(self.rejects)
        dropped = {f"rx_{reason}": n for reason, n in rejects.items()}
        dropped.update((k, v) for k, v in counters.items() if k in DROP_COUNTERS)
        return {
            "counters": counters,
            "rejects": rejects,
            "dropped": dropped,
            "dropped_total": sum(dropped.values()),
            "outbound_streams": len(self._outbound),
            "inbound_streams": len(self._inbound),
            "pending_streams": len(self._pending),
            "inbound_buffered": self._buffered,
        }


async def routable_ip(seeds: Iterable[str]) -> str:
    """The local address of the interface that routes to the first resolvable seed (no packet is sent)."""
    loop = asyncio.get_running_loop()
    for seed in seeds:
        try:
            host, port = split_host_port(seed, default_port=1)
            infos = await loop.getaddrinfo(host, port, type=socket.SOCK_DGRAM)
            family, _, _, _, sockaddr = infos[0]
            with socket.socket(family, socket.SOCK_DGRAM) as probe:
                probe.connect(sockaddr)
                ip = probe.getsockname()[0]
            if ip not in ("0.0.0.0", "::"):
                return str(ip)
        except (OSError, ConfigError):
            continue
    try:
        ip = socket.gethostbyname(socket.gethostname())
        return ip
    except OSError:
        return "127.0.0.1"


def _peer(addr: Any) -> str:
    if isinstance(addr, tuple) and len(addr) >= 2:
        return join_host_port(str(addr[0]), int(addr[1]))
    return str(addr)


def _bind_hint(err: int | None, host: str) -> str:
    if err == errno.EADDRNOTAVAIL:
        return (f"this machine has no address {host} (an agent with a job spec binds its member's address there): "
                "pass --bind with one it has, or --bind 0.0.0.0 for every interface (behind NAT)")
    return "is another agent using this port? choose another --port"
