"""The ``torchrun.handlers`` entry point of the gossiprec rendezvous backend, kept light.

torchrun loads every entry point of that group whenever its rendezvous package is imported, by every
torchrun run in the environment, whatever its backend: this module imports nothing, and the backend
(:mod:`gossiprec.agent.torchrun`: the agent, its crypto, torch's handler classes) is imported only
when a run asks for ``--rdzv-backend gossiprec``. :func:`create_handler` is the one creator both the
entry point and ``gossiprec torchrun``'s in-process registration hand to torchrun: its registry
refuses a second, different creator under the same name.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from torch.distributed.elastic.rendezvous import RendezvousHandler, RendezvousParameters


def create_handler(params: RendezvousParameters) -> RendezvousHandler:
    """torchrun's handler creator for ``--rdzv-backend gossiprec`` (:func:`gossiprec.agent.torchrun.make_handler`)."""
    from gossiprec.agent.torchrun import make_handler

    return make_handler(params)


def torchrun_backend() -> Callable[[RendezvousParameters], RendezvousHandler]:
    """The entry point: torchrun calls it with no argument and registers what it returns under the
    entry point's name (``gossiprec``)."""
    return create_handler
