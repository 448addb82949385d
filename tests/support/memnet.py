"""An in-memory network for agents in one event loop, like memberlist's ``mock_transport.go``.

:class:`MemNetwork` knows every endpoint by its ``"host:port"``; :meth:`MemNetwork.transport` is a
:class:`~gossiprec.agent.transport.TransportFactory`, so ``Agent(settings, transport_factory=net.transport)``
runs an agent on it. A message is handed to its destination's ``on_message`` by a callback of the event
loop, ``latency`` seconds later (0: on the loop's next round), datagrams and reliable messages alike;
nothing is sealed (the keyring is not used). A message to an address nobody holds, or to an endpoint
closed before delivery, is lost and counted. :meth:`MemNetwork.agent` builds an agent for it on the
running loop's clock, which with :mod:`tests.support.vtime` is virtual.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings, join_host_port
from gossiprec.agent.transport import OnMessage, TransportLimits
from gossiprec.errors import ConfigError
from gossiprec.security.keyring import Keyring


class MemNetwork:
    def __init__(self, latency: float = 0.0) -> None:
        self.latency = latency
        self.endpoints: dict[str, MemTransport] = {}
        self._ports = itertools.count(20000)

    def transport(self, bind_host: str, port: int, *, cluster: str, on_message: OnMessage,
                  keyring: Keyring | None = None, insecure: bool = False,
                  limits: TransportLimits | None = None) -> MemTransport:
        return MemTransport(self, bind_host, port, on_message)

    def agent(self, settings: AgentSettings, **kwargs: Any) -> Agent:
        """An agent on this network, its clock the running loop's."""
        return Agent(settings, transport_factory=self.transport, clock=asyncio.get_running_loop().time, **kwargs)

    def _free_port(self, host: str) -> int:
        while True:
            port = next(self._ports)
            if join_host_port(host, port) not in self.endpoints:
                return port


class MemTransport:
    """One endpoint of a :class:`MemNetwork` (the :class:`~gossiprec.agent.transport.Transport` protocol)."""

    def __init__(self, net: MemNetwork, host: str, port: int, on_message: OnMessage) -> None:
        self.net = net
        self.host = host
        self.port = port
        self.addr = ""
        self.on_message = on_message
        self.counters: dict[str, int] = dict.fromkeys(("tx_packets", "tx_bytes", "rx_packets", "rx_bytes"), 0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False

    async def start(self) -> None:
        if self.port == 0:
            self.port = self.net._free_port(self.host)
        self.addr = join_host_port(self.host, self.port)
        if self.addr in self.net.endpoints:
            raise ConfigError(f"cannot bind {self.addr}: in use; choose another --port")
        self._loop = asyncio.get_running_loop()
        self.net.endpoints[self.addr] = self

    async def aclose(self, grace: float = 0.0) -> None:
        self.abort()

    async def drain(self, timeout: float) -> None:
        return None  # a sent message is a scheduled callback: nothing waits on this side

    def set_local_addr(self, addr: str) -> None:
        pass  # nothing is sealed here, so nothing names a receiver

    def abort(self) -> None:
        self._closing = True
        if self.net.endpoints.get(self.addr) is self:
            del self.net.endpoints[self.addr]

    def send(self, addr: str, payload: bytes, reliable: bool = False) -> None:
        if self._closing or self._loop is None:
            self._count("tx_after_close")
            return
        self.counters["tx_packets"] += 1
        self.counters["tx_bytes"] += len(payload)
        dst = self.net.endpoints.get(addr)
        if dst is None:
            self._count("tx_unreachable")
            return
        if self.net.latency > 0:
            self._loop.call_later(self.net.latency, dst._arrive, payload, reliable)
        else:
            self._loop.call_soon(dst._arrive, payload, reliable)

    def _arrive(self, payload: bytes, reliable: bool) -> None:
        if self._closing:
            self._count("rx_after_close")
            return
        self.counters["rx_packets"] += 1
        self.counters["rx_bytes"] += len(payload)
        try:
            self.on_message(payload, reliable)
        except Exception:  # like NetTransport: a bug above us must not kill the network
            self._count("rx_handler_errors")

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def stats(self) -> dict[str, Any]:
        dropped = {k: v for k, v in self.counters.items() if k in ("tx_after_close", "tx_unreachable",
                                                                   "rx_after_close", "rx_handler_errors")}
        return {"counters": dict(self.counters), "rejects": {}, "dropped": dropped,
                "dropped_total": sum(dropped.values()), "outbound_streams": 0, "inbound_streams": 0}
