"""How training ends: the clean ends the trainer raises, and the exit code of each outcome.

A clean end (:class:`TrainingEnded`) is not a failure of the recovery: the job finished without this
spare, a shrink released this rank, or the agreed plan stopped the job. It derives from
:class:`~gossiprec.errors.GossiprecError`, not from :class:`~gossiprec.errors.RecoveryError`, so that
``except RecoveryError`` never swallows one.

=====  ==================================================================================================
code   meaning
=====  ==================================================================================================
0      training finished on this rank (``finish()``); a spare the job did not need (:class:`JobFinished`);
       a rank a shrink released (:class:`Released`): the job goes on, or ended, without it
75     the job stopped in good order (:class:`JobStopped`): no spare left and no shrink allowed, or no
       replica of some state and no ``on_no_replica``. Restart it from a checkpoint. 75 is sysexits'
       EX_TEMPFAIL, "try again later": a scheduler can requeue on it (Slurm: ``RequeueExit=75``)
1      anything else: an error in the training code, a lost agent, a recovery that could not finish
128+N  killed by signal N (``gossiprec run`` reports a signalled child that way, as a shell does)
=====  ==================================================================================================

A fenced rank (its node lost the majority) does not exit: it drops its state and waits as a spare in the
same process until the partition heals (:mod:`gossiprec.trainer.recovery`). None of 0 and 75 is a crash;
:func:`exit_code` gives the code for an outcome, ``None`` meaning training finished.
"""

from __future__ import annotations

from gossiprec.errors import GossiprecError
from gossiprec.local.launch import EXIT_STOPPED as EXIT_STOPPED  # the job stopped in good order (EX_TEMPFAIL)


class TrainingEnded(GossiprecError):
    """Training ended in good order on this rank (one of the kinds below); :func:`exit_code` maps it."""


class Released(TrainingEnded):
    """A shrink dropped this rank from the world: leave the job (exit 0); the others go on without it."""


class JobStopped(TrainingEnded):
    """The agreed plan stops the job (no spare and no shrink allowed, or no replica of some state and no
    ``on_no_replica`` callback): restart it from a checkpoint, with more spares or ``allow_shrink``."""


class MeshShrinkRefused(JobStopped):
    """A plan would change a mesh job in a way no smaller mesh can hold (a rank moved along a sharded
    dimension, several replicate dimensions, local shards that change shape): give it spares, or restart
    it from a checkpoint."""


class JobFinished(TrainingEnded):
    """The job's trainers finished training while this process was a spare: nothing left to do (exit 0)."""


EXIT_FINISHED = 0
"""Training finished on this rank."""
EXIT_NOT_NEEDED = 0
"""A spare the job did not need, or a rank a shrink released."""
EXIT_ERROR = 1
"""Anything else."""


def exit_code(outcome: BaseException | None) -> int:
    """The exit code for ``outcome``: None (finished), or the exception the trainer raised."""
    if outcome is None:
        return EXIT_FINISHED
    if isinstance(outcome, (JobFinished, Released)):
        return EXIT_NOT_NEEDED
    if isinstance(outcome, JobStopped):
        return EXIT_STOPPED
    return EXIT_ERROR
