"""The trainer side: state capture and streaming, epoch groups, and the recovering training loop.

Importing this package does not import torch; torch is loaded when a function that needs it runs.
"""

from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.state.digest import ReplicaMismatch
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.exits import EXIT_FINISHED, EXIT_NOT_NEEDED, EXIT_STOPPED, exit_code
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.collectives.groups import CollectiveAborted, EpochGroup, EpochGroups
from gossiprec.trainer.collectives.buckets import rank_ordered_mean
from gossiprec.trainer.loop import ResilientTrainer
from gossiprec.trainer.objects import Stateful, training_state
from gossiprec.trainer.state.receive import materialize_optimizer_state, restore_state
from gossiprec.trainer.recovery import JobFinished, JobStopped, MeshShrinkRefused, NoReplica, RecoveryRecord, Released
from gossiprec.trainer.state.rng import RNGState
from gossiprec.trainer.keys import TransferKeys
from gossiprec.trainer.settings import TrainerSettings, transfer_key
from gossiprec.trainer.collectives.sharded import MeshSpec
from gossiprec.trainer.steps import StepResult

__all__ = [
    "EXIT_FINISHED", "EXIT_NOT_NEEDED", "EXIT_STOPPED", "CollectiveAborted", "DonorServer", "EpochGroup", "EpochGroups",
    "JobFinished", "JobStopped", "MeshShrinkRefused", "MeshSpec", "NoReplica", "RNGState", "RecoveryRecord",
    "Released", "ReplicaMismatch", "StepResult",
    "ResilientTrainer", "Stateful", "TrainerConfig", "TrainerSettings", "TransferKeys", "capture_state", "exit_code",
    "fetch_state", "materialize_optimizer_state", "rank_ordered_mean", "restore_state", "training_state",
    "transfer_key",
]
