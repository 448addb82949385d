"""The exit codes a training process under gossiprec ends with, and the mapping from the trainer's outcomes.

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

from gossiprec.local.launch import EXIT_STOPPED as EXIT_STOPPED  # the job stopped in good order (EX_TEMPFAIL)

EXIT_FINISHED = 0
"""Training finished on this rank."""
EXIT_NOT_NEEDED = 0
"""A spare the job did not need, or a rank a shrink released."""
EXIT_ERROR = 1
"""Anything else."""


def exit_code(outcome: BaseException | None) -> int:
    """The exit code for ``outcome``: None (finished), or the exception the trainer raised."""
    from gossiprec.trainer.recovery import JobFinished, JobStopped, Released

    if outcome is None:
        return EXIT_FINISHED
    if isinstance(outcome, (JobFinished, Released)):
        return EXIT_NOT_NEEDED
    if isinstance(outcome, JobStopped):
        return EXIT_STOPPED
    return EXIT_ERROR
