"""What a training state is made of: named objects with ``state_dict()`` / ``load_state_dict()``.

A rank registers the complete replica state as ``name -> Stateful``: model, optimizer, LR scheduler,
data position and :class:`~gossiprec.trainer.rng.RNGState`. It must be identical on every replica at
a given step; rank-specific choices are computed from the rank, not stored.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from gossiprec.trainer.rng import RNGState


@runtime_checkable
class Stateful(Protocol):
    """Anything with ``state_dict()`` and ``load_state_dict()``: modules, optimizers, schedulers."""

    def state_dict(self) -> Any: ...

    def load_state_dict(self, state_dict: Any) -> Any: ...


def training_state(model: Any, optimizer: Any, scheduler: Any = None, data: Any = None, *,
                   rng: bool = True) -> dict[str, Stateful]:
    """The usual objects under their conventional names (``model``, ``optimizer``, ...)."""
    objects: dict[str, Stateful] = {"model": model, "optimizer": optimizer}
    if scheduler is not None:
        objects["scheduler"] = scheduler
    if data is not None:
        objects["data"] = data
    if rng:
        objects["rng"] = RNGState()
    return objects
