"""The progress page: a trainer's step, phase and donatable state, shared with its agent in memory.

Theory of operation
-------------------
A trainer changes phase three or four times per step (compute, communicate, optimizer, committed), and
counts every collective it enters (the position the hang check compares). A
control-socket message for each change would wake the agent, which on a machine whose cores all
compute preempts a trainer (the agent runs at a higher priority, so that a busy job cannot starve its
failure detector). So the trainer writes each change into a small file both processes map, and the
agent reads it when it handles a packet or a timer anyway, i.e. just before anything it sends could
carry the progress. A write is no system call; the agent never wakes for it.

The agent creates the page beside its control socket (``<socket>.progress``, mode 0600, in the same
private directory) and names it in its ``status`` reply (``progress_page``); a trainer that cannot
open it falls back to the control socket's ``report`` and ``state`` messages. There is one writing process (the
trainer; its threads take turns through a lock) and one reader (the agent).

Layout (little-endian)::

    0   4s  magic  b"GRPP"
    4   u32 version (5)
    8   u64 seq    seqlock: odd while a write is under way, +2 per record written, 0: never written
    16  record:  step i64, phase u32, step_ms u32, since f64 (CLOCK_MONOTONIC when (step, phase, coll)
                 last changed), committed_step i64 (-1: no state yet), inflight_step i64 (-1: none),
                 state_bytes u64, transfer_port i32 (-1: none), coll u32 (collectives entered in step),
                 wait_ms u32 (mean ms per step spent waiting inside collectives, last few steps),
                 seen_group i64 (the newest group epoch the trainer has taken in; -1: none yet),
                 crc32 of the record's other bytes u32

    1024  the exit bell: a process-shared robust pthread mutex (64 bytes; see :mod:`gossiprec.local.bell`)
    1088  u32 bell_ready (1: the agent set the bell up), u32 bell_pid (the trainer holding it; 0: none)

A reader takes ``seq``, the record, then ``seq`` again, and keeps the record only if both are the same
even number and the CRC matches: the CRC also catches a torn read where the CPU reorders stores
(weakly ordered machines); a read that keeps failing returns None and the agent keeps what it had.

``seen_group`` orders the agent's state report against the trainer's commits: the agent's report for a
view that changes the trainer's group promises that the trainer still holds the step it names, and a
trainer that has not taken the view in yet may commit the next step and drop that one. So the agent
holds its report until the trainer's follower has written the view's group epoch here (see
:mod:`gossiprec.core.aggregate`), and the trainer, once it has written a finishing phase before a commit,
reads its follower to decide whether to keep the previous step: one writing lock orders both writes, so
either the agent sees the finishing phase and waits for the commit, or the trainer sees the view and
keeps the step the agent reported.

The trainer arms the exit bell when it opens the page (:meth:`ProgressPage.arm_bell`) and releases it
in :meth:`ProgressPage.close`; the agent watches it, so a trainer that dies is seen before the kernel
has torn its memory down.
"""

from __future__ import annotations

import mmap
import os
import stat
import struct
import threading
import time
import zlib
from dataclasses import dataclass
from pathlib import Path

from gossiprec.errors import ConfigError
from gossiprec.local import bell

MAGIC = b"GRPP"
VERSION = 5
_HEAD = struct.Struct("<4sI")
_SEQ = struct.Struct("<Q")
_BODY = struct.Struct("<qIIdqqQiIIq")
_CRC = struct.Struct("<I")
SEQ_AT = _HEAD.size
RECORD_AT = SEQ_AT + _SEQ.size
CRC_AT = RECORD_AT + _BODY.size
PAGE_SIZE = 4096
_BELL_INFO = struct.Struct("<II")
BELL_INFO_AT = bell.BELL_AT + bell.BELL_SIZE
READ_TRIES = 64
"""Attempts of one read while a write is under way before it gives up (a write takes microseconds)."""


@dataclass(frozen=True, slots=True)
class ProgressRecord:
    """One record of the page (see the module docstring for the fields)."""

    seq: int
    step: int
    phase: int
    step_ms: int
    since: float
    committed_step: int
    inflight_step: int
    state_bytes: int
    transfer_port: int
    coll: int = 0
    wait_ms: int = 0
    seen_group: int = -1

    @property
    def has_state(self) -> bool:
        return self.committed_step >= 0


def page_path_for(control_path: str) -> str:
    """Where the agent serving ``control_path`` keeps its progress page."""
    return control_path + ".progress"


class ProgressPage:
    """One mapping of a progress page; :meth:`create` (agent) or :meth:`open` (trainer)."""

    def __init__(self, path: str, fd: int, writer: bool) -> None:
        self.path = path
        self._mm = mmap.mmap(fd, PAGE_SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        os.close(fd)
        self._writer = writer
        self._armed = False
        self._seq = 0
        # the writer's current values: every write stores the whole record
        self._fields = [-1, 0, 0, 0.0, -1, -1, 0, -1, 0, 0, -1]
        self._lock = threading.Lock()  # a report from a thread waiting in a collective meets the main one's

    @classmethod
    def create(cls, path: str, with_bell: bool = True) -> ProgressPage:
        """Create (or replace) the page at ``path``, mode 0600; the caller's directory is already checked.
        ``with_bell=False``: no exit bell (a trainer finds none to arm)."""
        p = Path(path)
        try:
            # one left by an agent that died (the control socket, bound first, refused a live agent)
            p.unlink(missing_ok=True)
            fd = os.open(p, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            raise ConfigError(f"cannot create the progress page {path}: {exc.strerror}; remove it or choose "
                              "another --control-socket") from None
        try:
            os.ftruncate(fd, PAGE_SIZE)
            page = cls(path, fd, writer=False)
        except BaseException:
            os.close(fd)
            p.unlink(missing_ok=True)
            raise
        _BELL_INFO.pack_into(page._mm, BELL_INFO_AT, int(with_bell and bell.init_bell(page._mm)), 0)
        _HEAD.pack_into(page._mm, 0, MAGIC, VERSION)
        return page

    @classmethod
    def open(cls, path: str) -> ProgressPage:
        """Map an agent's page for writing; ConfigError if it is missing, foreign or of another version."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(f"cannot open the progress page {path}: {exc.strerror}") from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size != PAGE_SIZE:
                raise ConfigError(f"{path} is not a progress page ({st.st_size} bytes)")
            if st.st_uid != os.getuid():
                raise ConfigError(f"the progress page {path} belongs to another user (uid {st.st_uid})")
            page = cls(path, fd, writer=True)
        except BaseException:
            try:
                os.close(fd)
            except OSError:
                pass
            raise
        magic, version = _HEAD.unpack_from(page._mm, 0)
        if magic != MAGIC or version != VERSION:
            page.close()
            raise ConfigError(f"{path} is not a version-{VERSION} progress page (magic {magic!r}, version "
                              f"{version})")
        page._seq = _SEQ.unpack_from(page._mm, SEQ_AT)[0] & ~1
        return page

    # ------------------------------------------------------------------ the trainer's side
    def arm_bell(self) -> bool:
        """Take the exit bell (the main thread, once per process); False where there is none to take."""
        ready, _pid = _BELL_INFO.unpack_from(self._mm, BELL_INFO_AT)
        if not self._writer or self._armed or not ready or not bell.arm(self._mm):
            return False
        self._armed = True
        _BELL_INFO.pack_into(self._mm, BELL_INFO_AT, ready, os.getpid())
        return True

    def report(self, step: int, phase: int, step_ms: int, coll: int = 0, wait_ms: int | None = None) -> None:
        """Progress: step ``step`` in phase ``phase`` (index into ``PHASES``), ``coll`` collectives
        entered in it so far, last step time ``step_ms``; ``wait_ms``: mean wait per step inside
        collectives (None: unchanged)."""
        with self._lock:
            f = self._fields
            if (step, phase, coll) != (f[0], f[1], f[8]):
                f[3] = time.monotonic()
            f[0], f[1], f[2], f[8] = step, phase, step_ms, coll
            if wait_ms is not None:
                f[9] = max(0, min(wait_ms, 2**31 - 1))
            self._write()

    def set_state(self, committed_step: int, inflight_step: int | None, state_bytes: int,
                  transfer_port: int | None) -> None:
        """What this rank could donate (as the control socket's ``state`` message)."""
        with self._lock:
            f = self._fields
            f[4] = committed_step
            f[5] = -1 if inflight_step is None else inflight_step
            f[6] = state_bytes
            f[7] = -1 if transfer_port is None else transfer_port
            self._write()

    def see_group(self, group_epoch: int) -> None:
        """The trainer has taken in the view of group epoch ``group_epoch`` (it only ever rises)."""
        with self._lock:
            f = self._fields
            if group_epoch > f[10]:
                f[10] = group_epoch
                self._write()

    def _write(self) -> None:
        if not self._writer:
            raise ConfigError("this mapping of the progress page is the agent's: it only reads")
        mm, seq = self._mm, self._seq
        body = _BODY.pack(*self._fields)
        _SEQ.pack_into(mm, SEQ_AT, seq + 1)
        mm[RECORD_AT:CRC_AT] = body
        _CRC.pack_into(mm, CRC_AT, zlib.crc32(body))
        self._seq = seq + 2
        _SEQ.pack_into(mm, SEQ_AT, seq + 2)

    # ------------------------------------------------------------------ the agent's side
    def seq(self) -> int:
        """The sequence number as it is now (cheap: compare with the last record's before :meth:`read`)."""
        return int(_SEQ.unpack_from(self._mm, SEQ_AT)[0])

    def read(self) -> ProgressRecord | None:
        """The newest complete record; None if none was written yet or every try met a write."""
        mm = self._mm
        for _ in range(READ_TRIES):
            s1 = _SEQ.unpack_from(mm, SEQ_AT)[0]
            if s1 == 0:
                return None
            if s1 & 1:
                continue
            body = mm[RECORD_AT:CRC_AT]
            crc = _CRC.unpack_from(mm, CRC_AT)[0]
            if _SEQ.unpack_from(mm, SEQ_AT)[0] != s1 or zlib.crc32(body) != crc:
                continue
            return ProgressRecord(s1, *_BODY.unpack(body))
        return None

    def bell_pid(self) -> int:
        """The pid of the trainer holding the exit bell; 0 if none does (or there is no bell)."""
        ready, pid = _BELL_INFO.unpack_from(self._mm, BELL_INFO_AT)
        return int(pid) if ready else 0

    def close(self) -> None:
        """Unmap; a trainer releases its exit bell first (a clean end: the agent's watcher stands down).

        Only the thread that armed the bell can release it: from another thread the page stays armed
        and mapped (the bell then rings when the process ends), and a later close() on the arming
        thread finishes the job.
        """
        if self._mm.closed:
            return
        if self._armed:
            if not bell.disarm(self._mm):
                return
            self._armed = False
            _BELL_INFO.pack_into(self._mm, BELL_INFO_AT, 1, 0)
        self._mm.close()

    def __enter__(self) -> ProgressPage:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
