"""The client of ``gossiprec members|status --agent HOST:PORT``: ask any agent of the cluster.

Theory of operation
-------------------
The command speaks the cluster's own authenticated protocol, as an agent does: it loads the cluster's
keyring (``--keyring PATH``, else ``GOSSIPREC_KEYRING``, else the user's default keyring if there is one:
:func:`keyring_path`) and the cluster name (``--cluster``, else ``GOSSIPREC_CLUSTER``, else the
default), binds a :class:`~gossiprec.agent.transport.NetTransport` of its own on an ephemeral port of the
local address that routes to the agent, and sends one sealed :class:`~gossiprec.core.wire.OpsQuery`
datagram there, naming that address and port as where to answer. The agent answers over the reliable
stream (TCP frames sealed with the same keyring) with :class:`~gossiprec.core.wire.OpsPage` pages; the
client joins them by index (they may arrive in any order) and decodes the msgpack map: the same
``status`` / ``members`` data the local control socket gives (see :mod:`gossiprec.agent.remote` for what
the agent checks and its rate limits).

``HOST:PORT`` is the agent's advertised address (the ``Address`` column of ``members``): a datagram is
sealed for its receiver's advertised address, and an agent refuses one sealed for another (a host name
is also tried as the addresses it resolves to, see :func:`_resolved`). The query is
sent again every :data:`RESEND_S` seconds until the answer is complete (a datagram may be lost); with no
complete answer within the timeout (3 s by default) the command fails with :class:`NoAnswer`: from the
outside a wrong key, a wrong port and a stopped agent look the same (the agent counts the refused packet
under ``rejected`` in its ``status``).
"""

from __future__ import annotations

import asyncio
import ipaddress
import os
import secrets
import socket
from typing import Any, Mapping

import msgpack

from gossiprec.agent.settings import ENV, default_keyring_path, join_host_port, split_host_port
from gossiprec.agent.transport import NetTransport, TransportLimits, routable_ip
from gossiprec.core.wire import OPS_PAGE_MAX, OPS_WHAT, OpsPage, OpsQuery, decode_packet, encode_packet
from gossiprec.errors import ConfigError, DecodeError, GossiprecError
from gossiprec.local.launch import DEFAULT_CLUSTER
from gossiprec.security.keyring import Keyring

DEFAULT_TIMEOUT = 3.0
RESEND_S = 1.0
NO_KEYRING = f"--agent needs the cluster keyring: --keyring PATH or {ENV['keyring']}"
_MAX_PAGES = 64


class RemoteError(GossiprecError):
    """A remote query could not be made or got no usable answer (the message says why)."""


class NoAnswer(RemoteError):
    """No complete answer within the timeout."""


def parse_agent(text: str) -> str:
    """``HOST:PORT`` of ``--agent`` checked (a port is required), as the ``host:port`` string to send to."""
    try:
        host, port = split_host_port(text.strip(), default_port=0)
    except ConfigError as exc:
        raise RemoteError(f"bad --agent {text!r}: expected HOST:PORT, the agent's advertised address ({exc})") \
            from None
    if not host or not 0 < port < 65536:
        raise RemoteError(f"bad --agent {text!r}: expected HOST:PORT, the agent's advertised address "
                          "(e.g. 10.0.0.5:7946)")
    return join_host_port(host, port)


def keyring_path(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``--keyring``, else ``GOSSIPREC_KEYRING``, else the default keyring if it exists; else RemoteError."""
    env = os.environ if environ is None else environ
    if flag:
        return flag
    if env.get(ENV["keyring"]):
        return env[ENV["keyring"]]
    fallback = default_keyring_path(env)
    if os.path.exists(fallback):
        return fallback
    raise RemoteError(NO_KEYRING)


def cluster_name(flag: str | None, environ: Mapping[str, str] | None = None) -> str:
    """``--cluster``, else ``GOSSIPREC_CLUSTER``, else the default cluster name."""
    env = os.environ if environ is None else environ
    return flag or env.get(ENV["cluster"]) or DEFAULT_CLUSTER


class _Pages:
    """The pages of one answer, collected in any order."""

    def __init__(self, req: int) -> None:
        self.req = req
        self.pages: dict[int, bytes] = {}
        self.last: int | None = None
        self.done = asyncio.Event()

    def on_message(self, payload: bytes, reliable: bool) -> None:
        if not reliable:
            return
        try:
            msgs = decode_packet(payload, OPS_PAGE_MAX + 1024)
        except DecodeError:
            return
        for m in msgs:
            if type(m) is not OpsPage or m.req != self.req or m.index >= _MAX_PAGES:
                continue
            self.pages[m.index] = m.data
            if m.last:
                self.last = m.index
        if self.last is not None and all(i in self.pages for i in range(self.last + 1)):
            self.done.set()

    def data(self) -> bytes:
        assert self.last is not None
        return b"".join(self.pages[i] for i in range(self.last + 1))


async def _resolved(agent: str) -> list[str]:
    """``agent`` with its host name resolved (``[]`` for an IP literal, or a name that does not resolve).

    A datagram is sealed for the address it is sent to, and an agent opens only those sealed for its
    advertised address: a name given for an agent that advertises its IP (the usual case) reaches it only
    as that IP. Both are sent; the agent opens the one that names it and refuses the other."""
    host, port = split_host_port(agent, default_port=0)
    try:
        ipaddress.ip_address(host)
        return []
    except ValueError:
        pass
    try:
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return []
    out = [join_host_port(str(info[4][0]), port) for info in infos]
    return list(dict.fromkeys(a for a in out if a != agent))[:4]


async def query(agent: str, what: str, *, keyring: Keyring, cluster: str,
                timeout: float = DEFAULT_TIMEOUT) -> dict[str, Any]:
    """Ask the agent at ``agent`` (its advertised ``host:port``) for ``what`` (members|status).

    Returns the answer's map (``{"status": ...}``, plus ``"members"`` for members). Raises
    :class:`NoAnswer` with no complete answer within ``timeout`` seconds, :class:`RemoteError` for a bad
    address or answer."""
    if what not in OPS_WHAT:
        raise RemoteError(f"unknown query {what!r}: one of {', '.join(OPS_WHAT)}")
    agent = parse_agent(agent)
    local_ip = await routable_ip([agent])  # bound to it: the source address the agent will see
    targets = [agent, *await _resolved(agent)]
    req = secrets.randbits(63)
    pages = _Pages(req)
    limits = TransportLimits(max_stream_payload=OPS_PAGE_MAX + 1024,
                             max_inbound_buffer=4 * (OPS_PAGE_MAX + 1024))
    loop = asyncio.get_running_loop()
    async with NetTransport(local_ip, 0, cluster=cluster, on_message=pages.on_message, keyring=keyring,
                            limits=limits) as transport:
        packet = encode_packet([OpsQuery(OPS_WHAT.index(what), req, join_host_port(local_ip, transport.port))])
        deadline = loop.time() + timeout
        while not pages.done.is_set():
            left = deadline - loop.time()
            if left <= 0:
                break
            for target in targets:
                transport.send(target, packet, False)
            try:
                async with asyncio.timeout(min(RESEND_S, left)):
                    await pages.done.wait()
            except TimeoutError:
                pass
        if not pages.done.is_set():
            raise NoAnswer(f"no answer from {agent} within {timeout:g} s: wrong key, wrong port, or agent down")
    try:
        obj = msgpack.unpackb(pages.data(), raw=False, strict_map_key=False, max_ext_len=0)
    except Exception as exc:  # msgpack raises assorted types on bad input
        raise RemoteError(f"the answer from {agent} is not valid msgpack ({type(exc).__name__})") from None
    if (not isinstance(obj, dict) or not isinstance(obj.get("status"), dict)
            or (what == "members" and not isinstance(obj.get("members"), list))):
        raise RemoteError(f"the answer from {agent} is not a {what} answer")
    return obj


def fetch_remote(agent: str, what: str, *, keyring_file: str | None, cluster: str | None,
                 timeout: float = DEFAULT_TIMEOUT, environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """:func:`query` from a command: checks the address, finds and loads the keyring, runs the loop."""
    agent = parse_agent(agent)
    ring = Keyring.load(keyring_path(keyring_file, environ))
    return asyncio.run(query(agent, what, keyring=ring, cluster=cluster_name(cluster, environ), timeout=timeout))
