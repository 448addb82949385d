"""Where the other members' stores and donors listen: their agent's address plus fixed port offsets.

Every trainer process hosts a TCPStore server and a :class:`~gossiprec.trainer.transfer.donor.DonorServer` from
the start, on fixed offsets from its agent's port (``agent port + store_offset`` and ``+ donor_offset``,
default 1 and 2), so the host and port of any member's store and donor follow from the view's member
address: no address needs to be gossiped, and the store of a new epoch is already listening.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from gossiprec.trainer.collectives.groups import connect_store

if TYPE_CHECKING:
    from gossiprec.local.client import ControlClient


def host_port(addr: str) -> tuple[str, int]:
    """``("host", port)`` of an agent address ``host:port`` (``[v6]:port`` too)."""
    host, _, port = addr.rpartition(":")
    return host.strip("[]"), int(port)


class Peers:
    """The members' addresses (from the agent) and a client per member store, made on first use.

    :attr:`store_server` is this process's own store (set once it listens); :meth:`store_for` returns it
    for this node.
    """

    def __init__(self, control: ControlClient, node: str, *, store_offset: int, donor_offset: int,
                 timeout: float) -> None:
        self.control = control
        self.node = node
        self.store_offset = store_offset
        self.donor_offset = donor_offset
        self.timeout = timeout
        self.store_server: Any = None
        self.addrs: dict[str, str] = {}
        self._stores: dict[tuple[str, int], Any] = {}

    def refresh(self) -> None:
        """Ask the agent for the members' addresses again."""
        self.addrs.update({m["name"]: m["addr"] for m in self.control.members()})

    def agent_of(self, node: str) -> tuple[str, int]:
        """Host and agent port of ``node`` (as last refreshed)."""
        return host_port(self.addrs[node])

    def store_for(self, node: str, *, connect_timeout: float | None = None) -> Any:
        """The TCPStore hosted by ``node``'s trainer (a client, connected once and kept). Connecting
        waits up to ``connect_timeout`` (default the store timeout) for the server: a late store host's
        trainer may not listen yet; the client's operations then time out after the store timeout."""
        if node == self.node:
            return self.store_server
        if node not in self.addrs:
            self.refresh()
        host, port = self.agent_of(node)
        key = (host, port + self.store_offset)
        if key not in self._stores:
            wait = self.timeout if connect_timeout is None else max(self.timeout, connect_timeout)
            store = connect_store(host, port + self.store_offset, timeout=wait)
            if wait != self.timeout:
                from datetime import timedelta

                store.set_timeout(timedelta(seconds=self.timeout))
            self._stores[key] = store
        return self._stores[key]

    def forget(self, node: str) -> None:
        """Drop the client of ``node``'s store (its host died or came back: connect anew next time)."""
        if node in self.addrs:
            host, port = self.agent_of(node)
            self._stores.pop((host, port + self.store_offset), None)

    def donor_of(self, node: str) -> tuple[str, int]:
        """Host and port of ``node``'s donor server (as last refreshed)."""
        host, port = self.agent_of(node)
        return host, port + self.donor_offset
