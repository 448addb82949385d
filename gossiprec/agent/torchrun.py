"""``torchrun --rdzv-backend=gossiprec``: torchrun's nodes take their ranks from gossiprec's agents, with
no etcd and no c10d store host.

Theory of operation
-------------------
torchrun finds an out-of-tree rendezvous through the ``torchrun.handlers`` entry point group:
the entry point ``gossiprec`` (:mod:`gossiprec.agent.torchrun_entry`, which imports nothing until a
run asks for the backend) returns ``create_handler``, which torchrun calls with its
:class:`RendezvousParameters` and which calls :func:`make_handler`; ``gossiprec torchrun``
(:mod:`gossiprec.agent.torchrun_cli`) registers the same creator in-process instead and runs
torchrun's ``main``. The
handler's plan (:mod:`gossiprec.agent.torchrun_conf`) says which slot of the job this torchrun node
is. :meth:`GossiprecRendezvous.next_rendezvous`, on torchrun's main thread, then

1. starts this slot's :class:`~gossiprec.agent.pump.Agent` inside torchrun's process, on its own event
   loop in a daemon thread (:class:`AgentThread`), from the job spec, so every node starts from the
   same view 0 without a coordinator;
2. waits until the agent has heard from every slot of the job (or its startup grace has run out:
   then gossiprec, not torchrun, deals with a slot that never came);
3. exports the agent's coordinates into ``os.environ``, which torchrun's workers inherit, exactly as
   ``gossiprec run`` hands them to its child (:func:`~gossiprec.agent.launcher.child_environment`:
   ``GOSSIPREC_CONTROL``, ``GOSSIPREC_NODE``, ``GOSSIPREC_ROLE``, ``GOSSIPREC_RANK``,
   ``GOSSIPREC_CLUSTER``), plus ``GOSSIPREC_KEYRING``;
4. returns the slot's index as torchrun's rank and the number of slots (trainers and spares) as its
   world. The training ranks are gossiprec's: ``ResilientTrainer`` takes them from the view and
   ignores torchrun's ``RANK`` and ``WORLD_SIZE``.

No store is shared between nodes. torchrun's agent uses the store of a rendezvous for two things
only: gathering its workers' ranks, and the exit barrier. The ranks are computed locally
(``TORCH_ELASTIC_WORKER_IDENTICAL=1``: global rank = node rank x workers per node + local rank, which
holds here, one worker per node). The exit barrier keeps a torchrun alive until every node's workers
have finished, because its peers may still need the store it hosts; no node hosts anything the
others need here, and a failed node never reaches that barrier, so waiting for it would hold every
survivor for ``exit_barrier_timeout`` (300 s): the node's own store (a :class:`HashStore`) has the
barrier passed already (:func:`node_store`). ``MASTER_ADDR`` names this node and ``MASTER_PORT`` is
0: there is no store behind them, so a script must not ``init_process_group("env://")``.

``num_nodes_waiting()`` is always 0 and a second ``next_rendezvous()`` is refused: torchrun never
restarts workers for gossiprec, which replaces a failed rank in place with a spare's process.
Failures: a worker that dies rings its exit bell and the agent leaves at once, as under ``gossiprec
run``; torchrun then stops (``--max-restarts 0``) and calls :meth:`shutdown`. A node removed from the
agreed view has its workers SIGKILLed (fencing, as ``gossiprec run`` does). :meth:`shutdown` (and,
should torchrun exit without calling it, an ``atexit`` hook) makes the agent leave gracefully, stops
its loop and thread and closes every socket.

The workers run ``trainer_nice`` nice levels below the agent (Linux): the nice value is per thread
there, so lowering torchrun's main thread, which spawns them, does it without touching the agent's.
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import os
import shutil
import signal
import sys
import tempfile
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable, Coroutine, Mapping, MutableMapping, TypeVar

from torch.distributed import HashStore, Store
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError, RendezvousHandler, RendezvousInfo, RendezvousParameters, RendezvousStoreInfo,
    RendezvousTimeoutError,
)

from gossiprec.agent.hub import Subscription
from gossiprec.agent.launcher import child_environment
from gossiprec.agent.logs import configure_logging
from gossiprec.agent.pump import Agent
from gossiprec.agent.removal import Leaving, Readmitted, membership_changes
from gossiprec.local.bell import stopped
from gossiprec.local.launch import KEYRING_ENV, RANK_ENV
from gossiprec.agent.settings import AgentSettings, split_host_port
from gossiprec.agent.torchrun_conf import BACKEND, NodePlan, check_torchrun_argv, plan_node

__all__ = ["AgentThread", "GossiprecRendezvous", "make_handler"]

log = logging.getLogger(__name__)

IDENTICAL_VAR = "TORCH_ELASTIC_WORKER_IDENTICAL"
EXIT_BARRIER_DONE = "torchelastic/agent/terminal_state/last_member"
"""The key torchrun's exit barrier waits for (``_TERMINAL_STATE_SYNC_ID`` + ``_LAST_MEMBER_CHECKIN``)."""
STOP_TIMEOUT_S = 30.0
"""How long :meth:`AgentThread.stop` waits for the agent to leave and its thread to end."""

T = TypeVar("T")


def make_handler(params: RendezvousParameters) -> RendezvousHandler:
    """This node's handler, for :func:`~gossiprec.agent.torchrun_entry.create_handler`: checks torchrun's
    command line and plans this node (see the module docstring)."""
    check_torchrun_argv(sys.argv)
    plan = plan_node(params.config, params.endpoint or "", params.min_nodes, params.max_nodes, os.environ)
    return GossiprecRendezvous(plan, params.run_id)


def node_store() -> Store:
    """This node's own store: what torchrun's agent asks of a rendezvous store, answered locally."""
    store = HashStore()
    store.set(EXIT_BARRIER_DONE, BACKEND)  # nothing to wait for: no node hosts anything the others need
    return store


def worker_processes(parent: int) -> list[int]:
    """The pids of ``parent``'s child processes (torchrun's workers), from ``/proc``."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent:
            out.append(int(d.name))
    return out


def kill_workers() -> list[int]:
    """SIGKILL every child of this process with its process group (torchrun starts each worker in its
    own session); returns their pids."""
    pids = worker_processes(os.getpid())
    for pid in pids:
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    return pids


def lower_spawn_priority(nice: int) -> None:
    """Run this thread, and so the processes it starts from now on, ``nice`` levels lower (Linux: nice
    values are per thread, so the agent's thread keeps its own)."""
    if not nice or not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id()
    try:
        os.setpriority(os.PRIO_PROCESS, tid, os.getpriority(os.PRIO_PROCESS, tid) + nice)
    except OSError as exc:
        log.warning("cannot lower the workers' CPU priority: %s", exc)


class AgentThread:
    """One :class:`Agent` on its own event loop in a daemon thread, started, asked and stopped from others."""

    def __init__(self, settings: AgentSettings, *, kill: Callable[[], list[int]] = kill_workers,
                 agent_kwargs: Mapping[str, Any] | None = None) -> None:
        self.settings = settings
        self.kill = kill
        """What ends the workers when this node is fenced (:func:`kill_workers`)."""
        self.agent_kwargs = dict(agent_kwargs or {})
        self.agent: Agent | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.fenced: str | None = None
        """Why the workers were killed because this node was removed from the view, if they were."""
        self._thread = threading.Thread(target=self._run, name=f"gossiprec-agent-{settings.name}", daemon=True)
        self._started = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def start(self, timeout: float) -> Agent:
        """Start the thread and its agent (bound, control socket open, joining); raise what start raised."""
        self._thread.start()
        if not self._started.wait(timeout):
            raise RendezvousTimeoutError(f"the gossiprec agent did not start within {timeout:.0f} s")
        if self._error is not None:
            raise self._error
        assert self.agent is not None
        return self.agent

    def call(self, fn: Callable[[], Coroutine[Any, Any, T]], timeout: float) -> T:
        """Run the coroutine ``fn()`` on the agent's loop and return its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(fn(), self.loop).result(timeout)

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> bool:
        """Make the agent leave gracefully and close; True once its thread has ended."""
        loop, stop = self.loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop has closed already
        if self._thread.is_alive():
            self._thread.join(timeout)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            import uvloop

            runner = asyncio.Runner(loop_factory=uvloop.new_event_loop)
        except ImportError:
            runner = asyncio.Runner()
        try:
            with runner:
                runner.run(self._main())
        except BaseException as exc:  # reported to start(), or logged once it has returned
            if self._started.is_set():
                log.error("the gossiprec agent failed: %s", exc, exc_info=exc)
            self._error = exc
        finally:
            self._started.set()

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stop = stop = asyncio.Event()
        async with Agent(self.settings, **self.agent_kwargs) as agent:
            self.agent = agent
            events = agent.subscribe()
            watch = asyncio.create_task(self._fence_watch(agent, events), name="gossiprec-fence-watch")
            self._started.set()
            try:
                await stop.wait()
            finally:
                events.close()
                watch.cancel()
                try:
                    await watch
                except asyncio.CancelledError:
                    pass

    async def _fence_watch(self, agent: Agent, events: Subscription) -> None:
        """SIGKILL the workers once this node is out of the agreed view: the others have replaced it, and
        a stopped or stuck worker must not wake up later with stale state (as ``gossiprec run`` does)."""
        async for change in membership_changes(agent, events):
            if isinstance(change, Readmitted):
                continue
            if isinstance(change, Leaving):
                stuck = [pid for pid in worker_processes(os.getpid()) if stopped(pid)]
                if stuck:  # a leaving agent sees no more views: nothing would end them later
                    self.fenced = f"the agent left ({change.reason})"
                    log.warning("the agent left while workers %s are stopped: killed %s", stuck, self.kill())
                return
            reason = change.reason
            self.fenced = reason
            agent.leave_now(f"fenced ({reason}): torchrun's workers are killed", failed=True)
            pids = self.kill()
            log.warning("this node was %s: killed torchrun's workers %s", reason, pids)
            return


def export_coordinates(agent: Agent, environ: MutableMapping[str, str]) -> dict[str, str]:
    """Put the agent's coordinates for the workers into ``environ`` (see the module docstring); returns
    what was set. Runs on the agent's loop: it reads the agent's view."""
    env = child_environment(agent, environ)
    if agent.settings.keyring is not None:
        env[KEYRING_ENV] = agent.settings.keyring
    env[IDENTICAL_VAR] = "1"
    if RANK_ENV not in env:
        environ.pop(RANK_ENV, None)
    changed = {k: v for k, v in env.items() if environ.get(k) != v}
    environ.update(changed)
    return changed


class GossiprecRendezvous(RendezvousHandler):
    """torchrun's rendezvous handler for one gossiprec slot (see the module docstring)."""

    def __init__(self, plan: NodePlan, run_id: str, *, environ: MutableMapping[str, str] | None = None,
                 agent_kwargs: Mapping[str, Any] | None = None) -> None:
        self.plan = plan
        self.run_id = run_id
        self.environ = os.environ if environ is None else environ
        self.agent_kwargs = dict(agent_kwargs or {})
        self.runner: AgentThread | None = None
        self.exported: dict[str, str] = {}
        self._closed = False
        self._rendezvoused = False
        self._lock = threading.Lock()
        self._tmp: str | None = None

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return False  # no store for the workers: ResilientTrainer builds its groups from gossiprec's view

    def next_rendezvous(self) -> RendezvousInfo:
        with self._lock:
            if self._closed:
                raise RendezvousClosedError("the gossiprec rendezvous is closed")
            if self._rendezvoused:
                raise RendezvousClosedError(
                    "torchrun asked the gossiprec backend for a second rendezvous (a restart); gossiprec "
                    "replaces failed ranks in place and never restarts workers: run torchrun with "
                    "--max-restarts 0 and one worker per node (--nproc-per-node 1)")
            self._rendezvoused = True
        plan = self.plan
        settings = plan.settings
        if plan.spec_path is None:  # computed from hosts=: the agent reads it from a file of its own
            self._tmp = tempfile.mkdtemp(prefix="gossiprec-torchrun-")
            path = Path(self._tmp) / "job.toml"
            path.write_text(plan.spec_text)
            settings = replace(settings, job=str(path))
        if not logging.getLogger("gossiprec").handlers:
            configure_logging(settings.log_format, settings.log_level)
        runner = AgentThread(settings, agent_kwargs=self.agent_kwargs)
        self.runner = runner
        atexit.register(self.shutdown)
        try:
            agent = runner.start(plan.timeout)
            names = [m.name for m in plan.members]

            def everyone_heard() -> bool:
                m = agent.machine
                return m is not None and all(m.has_heard(n) for n in names)

            try:
                runner.call(lambda: agent.wait_until(everyone_heard, plan.timeout), plan.timeout + 5)
            except TimeoutError:
                raise RendezvousTimeoutError(f"the gossiprec agent of {agent.name} did not hear from every "
                                             f"slot within {plan.timeout:.0f} s") from None

            async def export() -> dict[str, str]:
                return export_coordinates(agent, self.environ)

            self.exported = runner.call(export, 30.0)
        except BaseException:
            self.shutdown()
            raise
        lower_spawn_priority(plan.trainer_nice)
        me = plan.me
        log.info("gossiprec rendezvous: node %s is torchrun rank %d of %d (%s%s)", me.name, plan.index,
                 plan.world_size, me.role, "" if me.rank is None else f", training rank {me.rank}")
        host, _ = split_host_port(me.addr, default_port=0)
        return RendezvousInfo(node_store(), plan.index, plan.world_size, RendezvousStoreInfo(host, 0))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # a joiner becomes a spare inside gossiprec: never a reason for torchrun to restart

    def get_run_id(self) -> str:
        return self.run_id

    def shutdown(self) -> bool:
        """The agent leaves gracefully, its loop and thread end, every socket closes; idempotent."""
        with self._lock:
            runner, self.runner = self.runner, None
            tmp, self._tmp = self._tmp, None
            self._closed = True
        atexit.unregister(self.shutdown)
        ok = True
        if runner is not None:
            ok = runner.stop()
            if not ok:
                log.warning("the gossiprec agent did not stop within %.0f s", STOP_TIMEOUT_S)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        return ok

