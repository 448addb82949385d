"""The agent's side of ``gossiprec members|status --agent HOST:PORT``: answering a key holder's query.

Theory of operation
-------------------
An operator on another host asks an agent for what its local ``members`` / ``status`` print from
(:func:`~gossiprec.agent.status.member_rows`, :func:`~gossiprec.agent.status.agent_status`) with one
:class:`~gossiprec.core.wire.OpsQuery` datagram on the cluster's own port, sealed with the cluster's
keyring like any gossip (see :mod:`gossiprec.agent.remote_client`). There is no other port and no
other key: the transport's opener refuses, and counts, every datagram that does not authenticate
(wrong key, forged, replayed, sealed for another member), so only a key holder's query reaches
:meth:`RemoteOps.on_query`. The pump hands it a packet that starts with an OpsQuery's head
(:func:`is_query`, a prefix compare on the hot path) instead of the protocol machine.

Who gets an answer, and how (a key holder must not be able to turn an agent into an amplifier):

- only a query that came as a datagram on a keyed transport (an agent run ``--insecure`` answers
  nobody: nothing there is authenticated), and whose ``reply_to`` is that datagram's own source
  address, as the transport saw it (:attr:`~gossiprec.agent.transport.NetTransport.datagram_source`):
  the answer never goes to a third party named in the query;
- the answer goes over the reliable stream (TCP, sealed frames), never as datagrams: a TCP connection
  needs the handshake from the reply address, so a query with a forged source gets nothing larger
  than a SYN out of the agent, while a datagram answer would be many times the query's size;
- answers are rate limited per source host (:attr:`RemoteLimits.rate` a second, bursts of
  :attr:`RemoteLimits.burst`) and in all (:attr:`RemoteLimits.total_rate`, :attr:`RemoteLimits.total_burst`);
  a query past either is dropped and counted.

The answer is the msgpack map ``{"status": ...}`` (``status``) or ``{"status": ..., "members": [...]}``
(``members``: the view is needed to join the two, as locally), cut into :class:`~gossiprec.core.wire.OpsPage`
pages of at most ``page_size`` bytes, each its own reliable message; the client puts them back
together by index. Counters (in the agent's ``status`` under ``agent``): ``ops_queries``, ``ops_answered``,
``ops_pages``, ``ops_refused_insecure``, ``ops_refused_stream``, ``ops_refused_source``,
``ops_rate_limited``, ``ops_bad_query``, ``ops_too_large``.
"""

from __future__ import annotations

import ipaddress
import logging
from collections import OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import msgpack

from gossiprec.agent.settings import join_host_port, split_host_port
from gossiprec.core.wire import OPS_PAGE_MAX, OPS_WHAT, OpsPage, OpsQuery, decode_packet, encode_packet
from gossiprec.errors import ConfigError, DecodeError
from gossiprec.local.protocol import to_plain
from gossiprec.security.refusals import TokenBucket

log = logging.getLogger(__name__)

_QUERY_HEAD = encode_packet([OpsQuery(0, 0, "")])[:5]
"""How a packet holding one OpsQuery starts: [version, [[50, ...]]] (fixarray 2, the version, fixarray 1,
fixarray 4, 50)."""
MAX_QUERY = 512
"""Bytes an OpsQuery packet may take (it is about 40)."""
PAGE_OVERHEAD = 64
"""Bytes a page's packet adds around its data (about 25: packet head, request id, index, flag, length)."""
"""Bytes an OpsQuery packet may take (it is about 40)."""


def is_query(payload: bytes) -> bool:
    """Whether ``payload`` is a packet of one :class:`OpsQuery` (for the pump: anything else goes on to
    the machine, which drops an OpsQuery it gets some other way)."""
    return payload.startswith(_QUERY_HEAD)


@dataclass(frozen=True, slots=True)
class RemoteLimits:
    """Bounds on answers. Rates are answers a second."""

    rate: float = 1.0
    """Answers a second to one source host, after its burst."""
    burst: int = 4
    """Answers to one source host back to back (a client resends its query a few times)."""
    total_rate: float = 20.0
    """Answers a second to all sources together."""
    total_burst: int = 40
    page_size: int = 512 * 1024
    """Bytes of answer per page (each page is one reliable message)."""
    max_pages: int = 16
    """An answer longer than this many pages is not sent (counted ``ops_too_large``)."""
    max_sources: int = 1024
    """Source hosts whose bucket is remembered (the least recent is forgotten first)."""

    def __post_init__(self) -> None:
        if not 1 <= self.page_size <= OPS_PAGE_MAX:
            raise ConfigError(f"RemoteLimits.page_size must be 1..{OPS_PAGE_MAX}, got {self.page_size}")
        if self.rate <= 0 or self.total_rate <= 0 or self.burst < 1 or self.total_burst < 1:
            raise ConfigError("RemoteLimits: rates must be > 0 and bursts >= 1")


class RemoteSource(Protocol):
    """What answering needs of the agent (:class:`~gossiprec.agent.pump.Agent` is one)."""

    def control_members(self) -> list[dict[str, Any]]: ...
    def control_status(self) -> dict[str, Any]: ...


Send = Callable[[str, bytes, bool], None]
"""``send(addr, payload, reliable)``: the transport's :meth:`~gossiprec.agent.transport.Transport.send`."""


def source_addr(sockaddr: Any) -> str | None:
    """``host:port`` of a socket address (an IPv4-mapped IPv6 address as its IPv4 form), else None."""
    if not isinstance(sockaddr, tuple) or len(sockaddr) < 2:
        return None
    try:
        ip = ipaddress.ip_address(str(sockaddr[0]).split("%", 1)[0])
        port = int(sockaddr[1])
    except (ValueError, TypeError):
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return join_host_port(str(ip), port)


def same_addr(a: str, b: str) -> bool:
    """Whether two ``host:port`` strings name one socket address (IP literals compared as addresses)."""
    try:
        ha, pa = split_host_port(a, default_port=0)
        hb, pb = split_host_port(b, default_port=0)
        ia, ib = ipaddress.ip_address(ha), ipaddress.ip_address(hb)
    except (ConfigError, ValueError):
        return False
    if isinstance(ia, ipaddress.IPv6Address) and ia.ipv4_mapped is not None:
        ia = ia.ipv4_mapped
    if isinstance(ib, ipaddress.IPv6Address) and ib.ipv4_mapped is not None:
        ib = ib.ipv4_mapped
    return ia == ib and pa == pb and pa > 0


def answer_of(agent: RemoteSource, what: str) -> dict[str, Any]:
    """The map a query for ``what`` is answered with (what the local commands print from)."""
    out: dict[str, Any] = {"status": agent.control_status()}
    if what == "members":
        out["members"] = agent.control_members()
    return out


def pages_of(req: int, data: bytes, page_size: int) -> list[OpsPage]:
    """``data`` cut into pages of at most ``page_size`` bytes (one empty page for empty data)."""
    chunks = [data[i:i + page_size] for i in range(0, len(data), page_size)] or [b""]
    return [OpsPage(req, i, i == len(chunks) - 1, c) for i, c in enumerate(chunks)]


class RemoteOps:
    """Answers :class:`OpsQuery` datagrams for one agent. See the module docstring."""

    def __init__(self, agent: RemoteSource, send: Send, counters: dict[str, int], *, keyed: bool,
                 clock: Callable[[], float], limits: RemoteLimits | None = None,
                 max_message: int | None = None) -> None:
        """``max_message``: the largest reliable message the transport sends (a page stays below it)."""
        self.agent = agent
        self.send = send
        self.counters = counters
        self.keyed = keyed
        self.clock = clock
        self.limits = limits if limits is not None else RemoteLimits()
        if max_message is not None and self.limits.page_size > max_message - PAGE_OVERHEAD:
            self.limits = replace(self.limits, page_size=max(1, max_message - PAGE_OVERHEAD))
        self._total = TokenBucket(self.limits.total_rate, self.limits.total_burst)
        self._sources: OrderedDict[str, TokenBucket] = OrderedDict()

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def on_query(self, payload: bytes, reliable: bool, sockaddr: Any) -> None:
        """Handle one authenticated packet that :func:`is_query` said holds an OpsQuery; ``sockaddr``:
        where the datagram came from (None: unknown, or a stream frame). Never raises."""
        self._count("ops_queries")
        if not self.keyed:
            self._count("ops_refused_insecure")  # nothing authenticated the querier
            return
        if reliable:
            self._count("ops_refused_stream")  # its source is a connection's port, never a reply address
            return
        try:
            msgs = decode_packet(payload, MAX_QUERY)
        except DecodeError:
            self._count("ops_bad_query")
            return
        if len(msgs) != 1 or type(msgs[0]) is not OpsQuery:
            self._count("ops_bad_query")
            return
        q = msgs[0]
        source = source_addr(sockaddr)
        if source is None or not same_addr(q.reply_to, source):
            self._count("ops_refused_source")
            log.debug("operator query %d asks for its answer at %s but came from %s; not answered",
                      q.req, q.reply_to, source)
            return
        if not self._allowed(source.rsplit(":", 1)[0]):
            self._count("ops_rate_limited")
            return
        what = OPS_WHAT[q.what]
        try:
            data: bytes = msgpack.packb(to_plain(answer_of(self.agent, what)), use_bin_type=True)
        except Exception:  # a bug in the reports must not reach the transport
            self._count("ops_bad_answer")
            log.warning("cannot build the answer to an operator query", exc_info=True)
            return
        pages = pages_of(q.req, data, self.limits.page_size)
        if len(pages) > self.limits.max_pages:
            self._count("ops_too_large")
            log.warning("the answer to a %s query from %s takes %d pages (> %d); not sent", what, source,
                        len(pages), self.limits.max_pages)
            return
        for page in pages:
            self.send(source, encode_packet([page]), True)
        self._count("ops_answered")
        self._count("ops_pages", len(pages))
        log.info("answered a %s query from %s (%d bytes, %d page(s))", what, source, len(data), len(pages))

    def _allowed(self, host: str) -> bool:
        now = self.clock()
        bucket = self._sources.get(host)
        if bucket is None:
            bucket = self._sources[host] = TokenBucket(self.limits.rate, self.limits.burst)
            if len(self._sources) > self.limits.max_sources:
                self._sources.popitem(last=False)
        else:
            self._sources.move_to_end(host)
        # the source's own bucket first: one noisy source must not spend what the others share
        return bucket.take(now) and self._total.take(now)
