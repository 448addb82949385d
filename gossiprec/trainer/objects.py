"""What a training state is made of: named objects with ``state_dict()`` / ``load_state_dict()``.

A rank registers the complete replica state as ``name -> Stateful``: model, optimizer, LR scheduler,
data position and :class:`~gossiprec.trainer.state.rng.RNGState`. It must be identical on every replica at
a given step; rank-specific choices are computed from the rank, not stored.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping, Protocol, runtime_checkable

from gossiprec.errors import ConfigError
from gossiprec.trainer.state.rng import RNGState

if TYPE_CHECKING:
    from gossiprec.trainer.config import TrainerConfig


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


JOB_ENTRY = "gossiprec"
"""Name of the entry the trainer adds to the registered objects (the world size of the state)."""


class JobState:
    """The world size the registered state was last stepped in (a Stateful carried with the state, so
    that every rank of a new world, survivor or receiver, sees the same change of world size)."""

    def __init__(self) -> None:
        self.world_size = 0

    def state_dict(self) -> dict[str, int]:
        return {"world_size": self.world_size}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.world_size = int(sd["world_size"])


def has_data_position(objects: Mapping[str, Stateful]) -> bool:
    """Whether any object is something other than a model (an EMA copy too), optimizer, LR scheduler,
    gradient scaler or RNG state: what is left is taken for the data position."""
    import torch

    plain: tuple[type, ...] = (torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler,
                               torch.optim.lr_scheduler.ReduceLROnPlateau, RNGState)
    scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
    if isinstance(scaler, type):
        plain += (scaler,)
    return any(not isinstance(o, plain) for o in objects.values())


def check_objects(objects: Mapping[str, Stateful] | None, config: TrainerConfig) -> None:
    """Refuse objects a trainer cannot recover (none, the reserved name, no data position)."""
    if not objects:
        raise ConfigError("ResilientTrainer needs the objects that make up the training state")
    if JOB_ENTRY in objects:
        raise ConfigError(f"the object name {JOB_ENTRY!r} is reserved for the trainer's own state; "
                          "rename that object")
    if not config.stateless_data and not has_data_position(objects):
        raise ConfigError(
            f"no data position among the objects {sorted(objects)}: a spare that takes a rank would read "
            "its data from the start, training silently on other batches than the rank it replaces. "
            "Register the position (training_state(model, opt, data=position), any object with "
            "state_dict/load_state_dict), or pass TrainerConfig(stateless_data=True) if every batch is a "
            "function of rt.step and rt.rank")
