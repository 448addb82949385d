"""The trainer side: a training loop that recovers in place when a rank fails, and what it is built of.

The user API is what this package exports: :class:`ResilientTrainer` with its :class:`TrainerConfig`,
:func:`training_state` (the objects a rank's state is made of), :class:`MeshSpec` for a sharded job,
:class:`DcpCheckpoints` (checkpoints for when no replica is left, and for a restarted job), the
clean ends a training script catches (:class:`TrainingEnded`: :class:`JobFinished`, :class:`Released`,
:class:`JobStopped`, :class:`MeshShrinkRefused`) with their exit codes, and the errors of a recovery
(:class:`~gossiprec.errors.RecoveryError`, :class:`CollectiveAborted`, :class:`ReplicaMismatch`).

Map of the package:

- :mod:`.loop`: :class:`ResilientTrainer`, the loop a training script drives (start, steps, commits, finish).
- :mod:`.recovery`: recovery in place: wait for the agreed plan, move the state it names, build the new group.
- :mod:`.gate`: the optimizer steps of one training step, all or none.
- :mod:`.redo`: the guard that a step redone after a recovery starts from clean gradients.
- :mod:`.identity`: who the rank is now (epoch, rank, world size, role, step), one frozen value.
- :mod:`.agent_link`: how the rank talks to its agent (progress page or control socket).
- :mod:`.follower`: what the agent says (its event stream: views, plans, fences, the end of the job).
- :mod:`.peers`: where the other members' stores and donors listen.
- :mod:`.steps`: what a step of :meth:`ResilientTrainer.run_step` returns.
- :mod:`.exits`: the clean ends and the exit code of each outcome.
- :mod:`.checkpoint`: DCP checkpoints, for a plan with no replica left and a job restarted after a stop.
- :mod:`.config`, :mod:`.settings`, :mod:`.keys`, :mod:`.objects`: configuration, the environment, the
  transfer keys, and the registered objects.
- :mod:`.state`: the rank's state: snapshots, their capture, serialized form and reception, replica checks.
- :mod:`.transfer`: moving a committed state between ranks (wire format, donor, striped fetch).
- :mod:`.collectives`: process groups an agent can interrupt, managed and sharded groups, gradient buckets.

Importing this package does not import torch; torch is loaded when a function that needs it runs.
"""

from gossiprec.errors import RecoveryError
from gossiprec.trainer.collectives.buckets import rank_ordered_mean
from gossiprec.trainer.collectives.groups import CollectiveAborted, EpochGroup, EpochGroups
from gossiprec.trainer.checkpoint import DcpCheckpoints
from gossiprec.trainer.collectives.sharded import MeshSpec
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.exits import (
    EXIT_FINISHED, EXIT_NOT_NEEDED, EXIT_STOPPED, JobFinished, JobStopped, MeshShrinkRefused, Released, TrainingEnded,
    exit_code,
)
from gossiprec.trainer.identity import RankIdentity
from gossiprec.trainer.keys import TransferKeys
from gossiprec.trainer.loop import ResilientTrainer
from gossiprec.trainer.objects import Stateful, training_state
from gossiprec.trainer.recovery import NoReplica, RecoveryRecord
from gossiprec.trainer.settings import TrainerSettings, transfer_key
from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.state.digest import ReplicaMismatch
from gossiprec.trainer.state.receive import materialize_optimizer_state, restore_state
from gossiprec.trainer.state.rng import RNGState
from gossiprec.trainer.steps import StepResult
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.transfer.fetch import fetch_state

__all__ = [
    # the loop and its configuration
    "ResilientTrainer", "TrainerConfig", "TrainerSettings", "TransferKeys", "MeshSpec", "StepResult",
    "RankIdentity", "RecoveryRecord", "NoReplica", "transfer_key",
    # checkpoints, for what recovery in place cannot cover (no replica left, a restarted job)
    "DcpCheckpoints",
    # the state a rank registers
    "Stateful", "training_state", "RNGState",
    # how training ends, and the errors a script may catch
    "TrainingEnded", "JobFinished", "JobStopped", "MeshShrinkRefused", "Released", "EXIT_FINISHED",
    "EXIT_NOT_NEEDED", "EXIT_STOPPED", "exit_code", "RecoveryError", "CollectiveAborted", "ReplicaMismatch",
    # building blocks (state capture and transfer, epoch groups, deterministic reduction)
    "capture_state", "fetch_state", "restore_state", "materialize_optimizer_state", "DonorServer", "EpochGroup",
    "EpochGroups", "rank_ordered_mean",
]
