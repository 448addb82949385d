"""The exit bell: the kernel tells the agent that its trainer is dying, before the trainer's memory is gone.

Theory of operation
-------------------
A SIGKILLed (or crashed) trainer is seen by its launcher when the process has exited: ``waitpid`` and
pidfds report it after the kernel has freed the whole address space and closed every file. For a
trainer holding hundreds of MB that teardown is itself the largest part of detection.

The kernel does one thing for a dying thread before it frees any memory: it walks the thread's
*robust futex list* (``exit_mm`` -> ``mm_release`` -> ``futex_exit_release``) and marks every robust
mutex the thread holds as owner-dead, waking one waiter. So the progress page holds a process-shared
robust ``pthread_mutex_t`` (initialised by the agent, :func:`init_bell`); the trainer's main thread
locks it when it opens the page (:func:`arm`) and unlocks it when it closes the page (a clean end);
one watcher thread in the agent (:class:`BellWatcher`) waits on it. If the trainer dies holding it,
the watcher's lock returns ``EOWNERDEAD``, before the teardown.

A ring is believed only if the trainer (its pid is in the page) is really going: ``/proc/<pid>/stat``
is gone, is a zombie, or has ``PF_EXITING`` set (the kernel sets it before it walks the list). A
trainer that ``exec``-s itself also releases the lock; that is not a death, so it is ignored.

Only the trainer's main thread arms the bell (the death of another thread is not the death of the
process), once per process. While armed, the page's mapping is never unmapped (the robust list is
linked through the mutex itself, so glibc would follow a dangling pointer): :func:`disarm` unlocks
before the page closes, and an armed mapping is kept alive by this module until then.

Where the C library has no robust mutexes (not Linux/glibc), or the agent runs with ``exit_bell``
off, there is no bell and the launcher's exit watch (``waitpid``) is the only signal.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import logging
import mmap
import os
import sys
import threading
import time
from typing import Any, Callable

log = logging.getLogger(__name__)

BELL_AT = 1024
"""Offset of the mutex in the progress page (64 bytes reserved: pthread_mutex_t is 40 on x86-64, 48 on aarch64)."""
BELL_SIZE = 64
PTHREAD_PROCESS_SHARED = 1
PTHREAD_MUTEX_ROBUST = 1
PF_EXITING = 0x4
WAIT_S = 1.0
"""How long one wait of the watcher lasts before it looks at its stop flag."""


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class Pthreads:
    """The few pthread calls the bell needs, from the C library this process already uses."""

    def __init__(self, lib: Any) -> None:
        def call(name: str) -> Callable[..., int]:
            fn = getattr(lib, "pthread_" + name)  # AttributeError: not there
            fn.restype = ctypes.c_int
            return fn  # type: ignore[no-any-return]

        self.mutexattr_init = call("mutexattr_init")
        self.mutexattr_setpshared = call("mutexattr_setpshared")
        self.mutexattr_setrobust = call("mutexattr_setrobust")
        self.mutexattr_destroy = call("mutexattr_destroy")
        self.mutex_init = call("mutex_init")
        self.mutex_trylock = call("mutex_trylock")
        self.mutex_timedlock = call("mutex_timedlock")
        self.mutex_unlock = call("mutex_unlock")
        self.mutex_consistent = call("mutex_consistent")

    def init(self, addr: int) -> None:
        attr = ctypes.create_string_buffer(64)  # pthread_mutexattr_t is 4 bytes on glibc
        for rc in (self.mutexattr_init(attr), self.mutexattr_setpshared(attr, PTHREAD_PROCESS_SHARED),
                   self.mutexattr_setrobust(attr, PTHREAD_MUTEX_ROBUST),
                   self.mutex_init(ctypes.c_void_p(addr), attr)):
            if rc:
                raise OSError(rc, os.strerror(rc))
        self.mutexattr_destroy(attr)

    def timedlock(self, addr: int, seconds: float) -> int:
        deadline = time.time() + seconds  # pthread_mutex_timedlock's clock is CLOCK_REALTIME
        ts = _Timespec(int(deadline), int((deadline % 1) * 1e9))
        return int(self.mutex_timedlock(ctypes.c_void_p(addr), ctypes.byref(ts)))


_PTHREADS: Pthreads | None | bool = False


def pthreads() -> Pthreads | None:
    """The C library's robust-mutex calls, or None where there are none (then there is no bell)."""
    global _PTHREADS
    if _PTHREADS is False:
        _PTHREADS = None
        if sys.platform.startswith("linux"):
            try:
                _PTHREADS = Pthreads(ctypes.CDLL(None, use_errno=True))
            except (OSError, AttributeError) as exc:
                log.debug("no robust mutexes here (%s): the exit bell is off", exc)
    return _PTHREADS if isinstance(_PTHREADS, Pthreads) else None


def _address(mm: mmap.mmap) -> tuple[Any, int]:
    """A ctypes view of ``mm`` (it pins the mapping: mmap.close() refuses while it lives) and its address."""
    view = (ctypes.c_char * len(mm)).from_buffer(mm)
    return view, ctypes.addressof(view) + BELL_AT


def init_bell(mm: mmap.mmap) -> bool:
    """Agent side: make the page's bell a process-shared robust mutex. False: no bell on this system."""
    lib = pthreads()
    if lib is None:
        return False
    view, addr = _address(mm)
    try:
        lib.init(addr)
    except OSError as exc:
        log.warning("cannot set up the exit bell (%s): a dead trainer is seen when its process has exited", exc)
        return False
    finally:
        del view
    return True


_armed: tuple[int, Any] | None = None
"""(id of the armed mapping, the ctypes view pinning it): it is never unmapped while the lock is
held. The lock's owner is the main thread (only it arms)."""
_arm_lock = threading.Lock()


def arm(mm: mmap.mmap, tries: int = 20) -> bool:
    """Trainer side: the main thread takes the bell, once per process. False if it cannot."""
    global _armed
    lib = pthreads()
    if lib is None or threading.current_thread() is not threading.main_thread():
        return False
    with _arm_lock:
        if _armed is not None:
            return False  # one trainer per process holds a bell
        view, addr = _address(mm)
        for _ in range(tries):
            rc = lib.mutex_trylock(ctypes.c_void_p(addr))
            if rc == errno.EOWNERDEAD:  # an earlier trainer of this agent died holding it
                lib.mutex_consistent(ctypes.c_void_p(addr))
                rc = 0
            if rc == 0:
                _armed = (id(mm), view)
                return True
            if rc != errno.EBUSY:
                break
            time.sleep(0.001)  # the agent's watcher holds it for an instant after a clean end
        del view
        return False


def disarm(mm: mmap.mmap) -> bool:
    """Trainer side: release the bell (a clean end). True: released (or never armed), the mapping may
    be closed. False: this is not the main thread, which holds it (only the owner can unlock a robust
    mutex), so it stays held and mapped; it rings when the process ends."""
    global _armed
    lib = pthreads()
    with _arm_lock:
        if _armed is None or _armed[0] != id(mm) or lib is None:
            return True
        if threading.current_thread() is not threading.main_thread():
            return False
        view = _armed[1]
        _armed = None
        lib.mutex_unlock(ctypes.c_void_p(ctypes.addressof(view) + BELL_AT))
        del view
        return True


def exiting(pid: int) -> bool:
    """Whether process ``pid`` is gone, a zombie, or exiting (``PF_EXITING``), by ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()
    try:
        state, flags = fields[0], int(fields[6])
    except (IndexError, ValueError):
        return False
    return state in (b"Z", b"X", b"x") or bool(flags & PF_EXITING)


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is stopped (SIGSTOP, or a debugger holding it), by ``/proc/<pid>/stat``."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    return stat[stat.rfind(b")") + 2:stat.rfind(b")") + 3] in (b"T", b"t")


class BellWatcher:
    """Agent side: one thread waiting on the bell of the page at ``path`` held by trainer ``pid``.

    ``on_ring(pid)`` is called (from the watcher thread) when the trainer died holding the bell. The
    thread maps the page itself and unmaps it when it ends, so :meth:`stop` never waits on it: the
    thread ends within ``wait_s`` (:data:`WAIT_S`) after it, or at once when the trainer releases the bell.
    """

    def __init__(self, path: str, pid: int, on_ring: Callable[[int], None], wait_s: float = WAIT_S) -> None:
        lib = pthreads()
        if lib is None:
            raise OSError(errno.ENOSYS, "no robust mutexes on this system")
        self.lib, self.pid, self.on_ring = lib, pid, on_ring
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        self.wait_s = wait_s
        self.waits = 0
        """Waits that timed out with the trainer still holding the bell."""
        self.outcome: str | None = None
        """"rang", "released" (a clean end), "alive" (released by a process still running), "stopped", or an error."""
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"gossiprec-bell-{pid}", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        lib, view = self.lib, None
        try:
            view, addr = _address(self._mm)
            while not self._stop.is_set():
                rc = lib.timedlock(addr, self.wait_s)
                if rc == errno.ETIMEDOUT:
                    self.waits += 1
                    continue
                if rc == errno.EOWNERDEAD:
                    lib.mutex_consistent(ctypes.c_void_p(addr))
                    lib.mutex_unlock(ctypes.c_void_p(addr))
                    if exiting(self.pid):
                        self.outcome = "rang"
                        self.on_ring(self.pid)
                    else:
                        self.outcome = "alive"
                        log.warning("the trainer (pid %d) released its exit bell but is still running "
                                    "(exec?): watching for its exit only", self.pid)
                elif rc == 0:
                    lib.mutex_unlock(ctypes.c_void_p(addr))
                    self.outcome = "released"
                else:
                    self.outcome = f"error {errno.errorcode.get(rc, rc)}"
                    log.warning("the exit bell failed (%s): a dead trainer is seen when its process has exited",
                                os.strerror(rc))
                return
            self.outcome = "stopped"
        except Exception:  # never kill the agent over the bell
            self.outcome = "error"
            log.exception("the exit bell's watcher failed")
        finally:
            del view
            self._mm.close()
