"""The background copier: finishes a commit's deferred tensor copies while the next step computes.

A commit leaves the copies of the tensors only the optimizer step changes (parameters, optimizer state)
as a :class:`~gossiprec.trainer.state.capture.DeferredCopies` job. The owner either submits it to the
copier's thread at once (large, or from a GPU: the DMA then runs beside the next step's kernels) or
holds it and releases it to the thread later. Whoever needs the copies before the thread has begun a
held job makes them itself, in its own thread.
"""

from __future__ import annotations

import threading

from gossiprec.errors import RecoveryError
from gossiprec.trainer.state.capture import DeferredCopies


class Copier:
    """Finishes a commit's deferred tensor copies while the next step runs: on one daemon thread, or,
    for a held job, in the first thread that asks for it.

    :meth:`submit` hands one :class:`DeferredCopies` to the thread; :meth:`hold` keeps it until
    :meth:`release` hands it to the thread (the previous job must have been waited for, either way).
    Until the thread has begun a held or released job, the first caller of :meth:`run_held` or
    :meth:`wait` makes it instead; :meth:`wait` blocks until the job is done and returns it (None when
    nothing was pending). Thread-safe: the main thread and donor threads may wait at the same time.
    """

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._job: DeferredCopies | None = None
        self._running = False
        """A job was submitted or held and is not done yet."""
        self._waits_for: str | None = None
        """A job nobody has begun: "thread" (submitted: for the thread), "caller" (held: for a caller, until
        :meth:`release`) or "released" (for the thread, unless a caller takes it first); else None."""
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, job: DeferredCopies) -> None:
        self._put(job, "thread")

    def hold(self, job: DeferredCopies) -> None:
        """Keep ``job`` until :meth:`release`, or for the first caller of :meth:`run_held` or :meth:`wait`."""
        self._put(job, "caller")

    def release(self) -> None:
        """Hand a held job to the thread (nothing if none is held); a caller may still take it first."""
        with self._cv:
            if self._waits_for == "caller":
                self._waits_for = "released"
                self._wake_thread()

    def _put(self, job: DeferredCopies, waits_for: str) -> None:
        with self._cv:
            assert self._job is None and not self._running, "wait() for the previous copies first"
            self._job, self._running, self._waits_for, self._error = job, True, waits_for, None
            if waits_for == "thread":
                self._wake_thread()

    def _wake_thread(self) -> None:
        """Start the thread or wake it (under ``_cv``)."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="gossiprec-snapshot", daemon=True)
            self._thread.start()
        self._cv.notify_all()

    def run_held(self) -> None:
        """Make a held or released job's copies in this thread now, unless the thread has begun them.

        Submitted jobs (large, or from a GPU, whose ``run`` ends in a stream synchronisation) are left
        to the thread: a caller that needs them waits in :meth:`wait`."""
        with self._cv:
            if self._waits_for not in ("caller", "released"):
                return
            self._waits_for = None
            job = self._job
        assert job is not None
        self._run(job)

    def wait(self, take: bool = True) -> DeferredCopies | None:
        """Block until the copies are done; ``take`` hands the job over (else it stays for the owner)."""
        self.run_held()
        with self._cv:
            while self._running:
                self._cv.wait()
            job, error = self._job, self._error
            if take:
                self._job = self._error = None  # reported once, to the owner
            if error is not None:
                raise RecoveryError(f"snapshot copy failed: {error}") from error
            return job

    def _loop(self) -> None:
        while True:
            with self._cv:
                while self._waits_for not in ("thread", "released"):
                    self._cv.wait()
                self._waits_for = None
                job = self._job
            assert job is not None
            self._run(job)

    def _run(self, job: DeferredCopies) -> None:
        error: BaseException | None = None
        try:
            job.run()
        except BaseException as exc:  # reported to whoever waits
            error = exc
        with self._cv:
            if error is not None:
                self._error = error
            self._running = False
            self._cv.notify_all()
        if error is not None and not isinstance(error, Exception) and threading.current_thread() is not self._thread:
            raise error  # a KeyboardInterrupt in a caller's run_held() stays one

