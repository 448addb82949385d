"""What :meth:`~gossiprec.trainer.loop.ResilientTrainer.run_step` returns for one step of the loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class StepResult(Generic[T]):
    """``step``: the step that ran; ``committed``: whether it committed (False: a failure interrupted it
    and the trainer recovered: the loop goes on from ``rt.step``); ``value``: what the step's closure
    returned (None when it did not commit, and when the closure was interrupted but the recovery's plan
    resumed at this very step, this rank taking its state from a replica: committed, with no value of its
    own)."""

    step: int
    committed: bool
    value: T | None
