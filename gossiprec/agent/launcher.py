"""``gossiprec run``: an agent in this process and the training process as its child.

Theory of operation
-------------------
:class:`Launcher` starts an :class:`~gossiprec.agent.pump.Agent` (bound, control socket open, joining
its seeds) and then the training command as a child process, in a new session like torchrun does, with
the agent's coordinates in its environment (the launch contract, :mod:`gossiprec.local.launch`):

    GOSSIPREC_CONTROL  the agent's control socket (``ControlClient.from_env()`` reads it)
    GOSSIPREC_NODE     this node's name in the cluster
    GOSSIPREC_RANK     the training rank in view 0, for a trainer (removed from the environment otherwise)
    LOCAL_RANK, LOCAL_WORLD_SIZE, RANK, WORLD_SIZE  torch's, as the launch contract defines them (a spare
                       has no RANK)
    GOSSIPREC_ROLE     ``trainer`` or ``spare``, as the job spec says (a node outside it joins as a spare)
    GOSSIPREC_CLUSTER  the cluster name
    GOSSIPREC_KEYRING  the keyring file's path on a keyed cluster (the trainer authenticates its state
                       transfers and stores with it and follows its rotation; the key itself never
                       enters the environment); removed on an ``--insecure`` one, and with
                       ``--keyring-fd``, which passes the keyring down a pipe instead:
    GOSSIPREC_KEYRING_FD  (``--keyring-fd``) the number of the descriptor the keyring arrives on: the
                       read end of a pipe only the child inherits; the launcher writes the agent's keyring
                       into it before the child starts and again each time the agent reloads a changed
                       one (see :mod:`gossiprec.local.launch`), for a trainer that cannot read the file
    GOSSIPREC_LOG_FORMAT, GOSSIPREC_LOG_LEVEL  the agent's log format and level: the trainer logs its
                       recoveries in them (one line each) unless its process configured logging itself
    THP_MEM_ALLOC_ENABLE=1  unless already set: huge pages for PyTorch's CPU tensors (see THP_VAR)
    TORCH_NCCL_ASYNC_ERROR_HANDLING=2  unless already set: NCCL's default (3) kills the process on a
                       collective's timeout instead of letting the agent's abort end it (see NCCL_VAR)

The child runs ``--trainer-nice`` (default 5) nice levels below the agent, so that a job saturating
the CPUs cannot starve its own failure detector (see :data:`DEFAULT_CHILD_NICE`).

It then awaits the child (``proc.wait()``, i.e. the event loop's child watcher), so the child's exit
is noticed at once, whatever the cause. A trainer that dies holding its exit bell (see
:mod:`gossiprec.local.bell`) is noticed earlier still, by the agent, before the kernel has torn its memory
down; the exit then only records the exit code. The exit is an alarm: the agent broadcasts its own departure
immediately (:meth:`Agent.leave_now`, which sends the Dead-about-itself directly to several members
and gossips it), so peers see this node gone within a gossip round instead of a probe-and-suspicion
timeout; it drains for a few gossip intervals and closes.

Signals pass through like torchrun's: SIGTERM, SIGINT and SIGQUIT received by the launcher are sent
to the child (a third one kills it with SIGKILL); the launcher exits with the child's exit code, or
128 + N when the child was killed by signal N; 127/126 when the command cannot be found/executed.
SIGHUP reloads the keyring. If the agent fails while the child runs, the child is terminated
(SIGTERM, then SIGKILL after ``kill_grace`` seconds) so that no trainer runs without its agent.

Fencing: when this node is removed from the agreed view (``Fenced`` "removed from the view", or a
``ViewInstalled`` without this node after it was a member), the others have already replaced its
rank. A training process that answers drops its state itself and waits as a spare
(:mod:`gossiprec.trainer.recovery`), and the agent rejoins the job as one; one that cannot must not
linger: it may be hung and hold the node's memory. So the launcher SIGKILLs the child's process group,
and the exit then makes the agent leave as above, when the child is stopped (SIGSTOP: at once) or when
it still holds committed state ``fence_grace`` seconds after a removal that was not preceded by a fence
of another kind. It keeps the child when the node was fenced first (a minority that lost the majority:
the partition, not the trainer, is at fault) and when the child holds no trained state (a spare, or a
re-provisioned host whose new trainer has not trained in this job yet, or a trainer that trained and
has since said, by its idle report, that it dropped its state); a trainer that trained and says nothing
more (hung in a collective that no abort reached) is killed after ``fence_grace``, also when the job
has stopped.

A child stopped for the hang threshold makes the agent leave (see ``Agent._check_stopped``); a leaving
agent sees no more views, so the launcher kills a child that is still stopped when its agent leaves.

Known limit: if the launcher itself is SIGKILLed the child keeps running (new session); the training
library notices because the control socket closes.

Exit codes: the child's (see :mod:`gossiprec.trainer.exits`: 0 finished or not needed, 75 stopped in
good order, 1 an error) or 128 + N for signal N; a child that stopped in good order (75) leaves the
cluster gracefully, like one that finished.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, replace
from typing import Any, Mapping, Sequence

from gossiprec.errors import ConfigError, GossiprecError
from gossiprec.agent.cli import run_async
from gossiprec.agent.logs import configure_logging
from gossiprec.agent.pump import Agent
from gossiprec.agent.removal import Leaving, Readmitted, membership_changes
from gossiprec.local.bell import stopped
from gossiprec.local.launch import EXIT_STOPPED, keyring_message, local_placement, trainer_environment
from gossiprec.agent.settings import AgentSettings, add_agent_arguments, settings_from_args
from gossiprec.core.bootstrap import Booting
from gossiprec.security.keyring import Keyring

log = logging.getLogger(__name__)

FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT)
DEFAULT_CHILD_NICE = 5
"""How much lower than the agent's the training process's CPU priority is (``nice`` increment).

A failure detector must not be starved by the job it watches: when the CPUs are saturated (many ranks
importing torch at once), agents at the same priority as their trainers miss their probe deadlines
for seconds, suspect healthy members and fence the whole cluster. The agent needs a small fraction of
a core; with a nice gap it gets it first, and the trainer loses next to nothing when a core is free.
``--trainer-nice 0`` turns this off."""


DEFAULT_FENCE_GRACE = 10.0
"""Seconds a child that still holds trained state after its node was removed from the view has to drop
it (its trainer does at its next collective) before the launcher kills it as hung."""


@dataclass(frozen=True, slots=True)
class ChildExit:
    """How the training process ended."""

    returncode: int
    """As :mod:`asyncio` reports it: the exit status, or ``-N`` when killed by signal N."""
    exit_code: int
    """What the launcher exits with: ``returncode``, or ``128 + N`` for signal N."""
    signal: str | None
    at: float
    """``time.monotonic()`` when the launcher saw the exit."""
    runtime_s: float


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)  # the child leads its own session and group
    except ProcessLookupError:
        pass


def exit_code_of(returncode: int) -> int:
    """Shell convention: a child killed by signal N gives 128 + N."""
    return returncode if returncode >= 0 else 128 - returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(returncode: int) -> str:
    if returncode >= 0:
        return f"exited with code {returncode}"
    return f"was killed by {_signal_name(-returncode)}"


THP_VAR = "THP_MEM_ALLOC_ENABLE"
"""PyTorch's switch for transparent huge pages in its CPU allocator (large tensors 2 MiB-aligned and
``madvise(MADV_HUGEPAGE)``). The launcher turns it on for the child unless the environment sets it: the
kernel tears a killed process's memory down before its parent can see it exit, and huge pages make
that teardown, i.e. the detection latency of a crashed trainer, much shorter. It also makes
page faults on large tensors (gradients, snapshots) cheaper."""


NCCL_VAR = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
"""NCCL's error handling: 2 (clean up the communicators only) lets the agent's abort end a collective;
torch's default, 3, tears the process down on a timeout. The trainer refuses an NCCL group under
another value than 0 or 2 (:func:`gossiprec.trainer.collectives.groups.check_nccl_environment`)."""


def child_environment(agent: Agent, base: Mapping[str, str], *, keyring_fd: int | None = None) -> dict[str, str]:
    """The training process's environment: ``base`` plus the agent's coordinates and keyring path, or
    ``keyring_fd``'s number instead of the path, written through the launch contract
    (:func:`~gossiprec.local.launch.trainer_environment`), and :data:`THP_VAR` = 1, :data:`NCCL_VAR` = 2
    unless ``base`` sets them."""
    env = dict(base)
    env.setdefault(THP_VAR, "1")
    env.setdefault(NCCL_VAR, "2")
    if env[NCCL_VAR] not in ("0", "2"):
        log.warning("%s=%s: an NCCL trainer will refuse to start (it needs 0 or 2; unset it and `gossiprec run` "
                    "sets 2)", NCCL_VAR, env[NCCL_VAR])
    s = agent.settings
    role, rank = s.role, s.rank
    local, world = (s.local_index or 0, max(s.nproc_per_node, (s.local_index or 0) + 1)), None
    if agent.machine is not None:  # its view says (a joiner enters as a spare)
        view = agent.machine.view
        me = view.member(agent.name) if view is not None else None
        role, rank = (me.role, me.rank) if me is not None else ("spare", None)
        if view is not None:
            local = local_placement(((m.node, m.addr, m.host) for m in view.members), agent.name, s.local_index)
            world = view.topology.world_size
    keyring = os.path.abspath(s.keyring) if s.keyring and not s.insecure and keyring_fd is None else None
    return trainer_environment(env, control=agent.control_path, node=agent.name, role=role, rank=rank,
                               cluster=s.cluster, keyring=keyring, keyring_fd=keyring_fd, local=local,
                               world_size=world, log=(s.log_format, s.log_level))


class _KeyPipe:
    """The keyring handed to the child down a pipe (``--keyring-fd``): written before the child starts,
    and again whenever the agent's keyring changed. Writes never block the agent: a child that does not
    read gets the newest keyring once it does."""

    def __init__(self, ring: Keyring) -> None:
        self.ring = ring
        self.read_fd, self.write_fd = os.pipe()  # both non-inheritable; pass_fds opens the read end to the child
        self.sent = ring.keyset
        first = keyring_message(ring)
        view = memoryview(first)
        while view:  # a keyring is far smaller than a pipe's buffer: this never waits
            view = view[os.write(self.write_fd, view):]
        os.set_blocking(self.write_fd, False)
        self.pending = b""

    def started(self) -> None:
        """The child holds the read end now: ours goes, so that the child sees end of file once we do."""
        if self.read_fd >= 0:
            os.close(self.read_fd)
            self.read_fd = -1

    def push(self) -> bool:
        """Send the agent's keyring if it changed since the last one sent; False once the child closed
        its end."""
        ks = self.ring.keyset  # one snapshot (the agent swaps the whole set)
        if not self.pending and ks is not self.sent:
            self.sent = ks
            self.pending = keyring_message(Keyring(list(ks.keys), ks.primary))
        if self.pending:
            try:
                self.pending = self.pending[os.write(self.write_fd, self.pending):]
            except BlockingIOError:
                pass  # the child is not reading now: the rest goes on a later push
            except BrokenPipeError:
                return False
        return True

    async def follow(self, agent: Agent) -> None:
        """Push every keyring change, checked as often as the agent checks its file."""
        while self.push():
            await asyncio.sleep(min(agent.keyring_check_s, 1.0))

    def close(self) -> None:
        for fd in (self.read_fd, self.write_fd):
            if fd >= 0:
                os.close(fd)
        self.read_fd = self.write_fd = -1


class Launcher:
    """Runs one agent and one training process; :meth:`run` returns the exit code to use."""

    def __init__(
        self,
        settings: AgentSettings,
        argv: Sequence[str],
        *,
        forward_signals: bool = True,
        environ: Mapping[str, str] | None = None,
        agent_kwargs: Mapping[str, Any] | None = None,
        child_kwargs: Mapping[str, Any] | None = None,
        kill_grace: float = 10.0,
        child_nice: int = DEFAULT_CHILD_NICE,
        fence_grace: float = DEFAULT_FENCE_GRACE,
        keyring_fd: bool = False,
    ) -> None:
        if not argv:
            raise ConfigError("no training command: write `gossiprec run [options] -- python train.py ...`")
        if isinstance(child_nice, bool) or not isinstance(child_nice, int) or not 0 <= child_nice <= 19:
            raise ConfigError(f"--trainer-nice must be an int in [0, 19], got {child_nice!r}")
        self.child_nice = child_nice
        self.settings = settings
        self.argv = list(argv)
        self.forward_signals = forward_signals
        self.environ = dict(os.environ if environ is None else environ)
        self.agent_kwargs = dict(agent_kwargs or {})
        self.child_kwargs = dict(child_kwargs or {})
        self.kill_grace = kill_grace
        self.fence_grace = fence_grace
        self.keyring_fd = keyring_fd
        """Hand the child the keyring down a pipe instead of the file's path (``--keyring-fd``)."""
        self.kept: str | None = None
        """Why the launcher kept the child after this node was removed from the view, if it did."""
        self.agent: Agent | None = None
        self.proc: asyncio.subprocess.Process | None = None
        self.child_exit: ChildExit | None = None
        self.fenced: str | None = None
        """Why the launcher killed the child because the node was removed from the view, if it did."""
        self.started = asyncio.Event()
        self._signals_seen = 0
        self._forwarded: int | None = None
        self._installed: list[int] = []

    async def run(self) -> int:
        async with Agent(self.settings, **self.agent_kwargs) as agent:
            self.agent = agent
            if isinstance(agent.machine, Booting):
                # the trainer's role and rank come from view 0, which the agents have yet to agree on
                boot = agent.machine.boot
                try:
                    await agent.wait_until(lambda: boot.decided is not None or agent.boot_failure is not None
                                           or agent.state != "running", self.settings.bootstrap_timeout + 5.0)
                except TimeoutError:
                    pass
                if boot.decided is None:
                    log.error("the training process was not started: %s",
                              agent.boot_failure or "the agent stopped before view 0 was agreed")
                    return 1
            pipe = _KeyPipe(agent.keyring) if self.keyring_fd and agent.keyring is not None else None
            kwargs = dict(self.child_kwargs)
            if pipe is not None:
                kwargs["pass_fds"] = (*kwargs.get("pass_fds", ()), pipe.read_fd)
            try:
                proc = await asyncio.create_subprocess_exec(
                    *self.argv, env=child_environment(agent, self.environ,
                                                      keyring_fd=None if pipe is None else pipe.read_fd),
                    start_new_session=True, **kwargs)
            except OSError as exc:
                if pipe is not None:
                    pipe.close()
                code = 127 if isinstance(exc, FileNotFoundError) else 126
                log.error("cannot start the training process %r: %s", self.argv[0], exc.strerror or exc)
                agent.leave_now(f"training process could not start: {exc.strerror or exc}", failed=True)
                return code
            self.proc = proc
            keys_task = None
            if pipe is not None:
                pipe.started()
                keys_task = asyncio.create_task(pipe.follow(agent), name="gossiprec-keyring-pipe")
            if self.child_nice:
                try:  # raising a child's niceness needs no privilege; its own children inherit it
                    os.setpriority(os.PRIO_PROCESS, proc.pid, os.getpriority(os.PRIO_PROCESS, 0) + self.child_nice)
                except OSError as exc:
                    log.warning("cannot lower the training process's CPU priority: %s", exc)
            t0 = time.monotonic()
            log.info("training process started", extra={"fields": {"pid": proc.pid, "argv": self.argv}})
            self.started.set()
            self._install_signals(agent)
            events = agent.subscribe()
            watch = asyncio.create_task(self._fence_watch(agent, proc, events), name="gossiprec-fence-watch")
            try:
                rc = await proc.wait()
            finally:
                if keys_task is not None:
                    keys_task.cancel()
                    try:
                        await keys_task
                    except asyncio.CancelledError:
                        pass
                if pipe is not None:
                    pipe.close()
                events.close()
                watch.cancel()
                try:
                    await watch
                except asyncio.CancelledError:
                    pass
                self._remove_signals(agent)
                if proc.returncode is None:  # we are being cancelled: never leave a trainer behind
                    await asyncio.shield(self._terminate(proc))
            at = time.monotonic()
            sig = _signal_name(-rc) if rc < 0 else None
            self.child_exit = ChildExit(rc, exit_code_of(rc), sig, at, at - t0)
            what = f"training process {describe_exit(rc)}"
            if self.fenced is not None:
                agent.leave_now(f"{what}: fenced ({self.fenced})", failed=True)
            elif self._forwarded is not None:
                agent.leave_now(f"{what} after {signal.Signals(self._forwarded).name}")
            elif rc in (0, EXIT_STOPPED):
                agent.leave_now(what)
            else:
                agent.leave_now(what, failed=True)
        assert self.child_exit is not None
        return self.child_exit.exit_code

    async def _fence_watch(self, agent: Agent, proc: asyncio.subprocess.Process, events: Any) -> None:
        """Once this node is out of the agreed view, SIGKILL the child's process group if it cannot be
        trusted to wait as a spare (see the module docstring); the child may be stopped or stuck, so
        nothing gentler is sure to work."""
        async for change in membership_changes(agent, events):
            if isinstance(change, Readmitted):
                self.kept = None
                continue
            if isinstance(change, Leaving):
                if proc.returncode is None and stopped(proc.pid):  # nothing will ever continue it
                    self.fenced = f"the agent left ({change.reason})"
                    log.warning("the agent left while the training process (pid %d) is stopped: killing it", proc.pid)
                    _kill_group(proc.pid)
                return
            reason = change.reason
            if proc.returncode is not None:
                return
            keep = await self._keep_after_removal(agent, proc, change.fenced_first)
            if keep:
                self.kept = f"{reason}: {keep}"
                log.warning("this node was %s; the training process (pid %d) is kept: %s", reason, proc.pid, keep)
                continue
            self.fenced = reason
            log.warning("this node was %s: killing the training process (pid %d)", reason, proc.pid)
            agent.leave_now(f"fenced ({reason}): the training process is killed", failed=True)
            _kill_group(proc.pid)
            return

    async def _keep_after_removal(self, agent: Agent, proc: asyncio.subprocess.Process, fenced_first: str) -> str:
        """Why the child may stay after a removal ("" if it must be killed): see the module docstring."""
        if stopped(proc.pid):
            return ""
        if fenced_first:
            return f"the node was fenced first ({fenced_first}): it waits as a spare for the partition to heal"
        deadline = time.monotonic() + self.fence_grace
        while True:
            state = agent.trainer_state
            if state is None or not state.get("state_bytes") or not state.get("committed_step"):
                if not agent.trainer_trained:
                    return "it holds no trained state: it waits as a spare"
                if agent.my_progress[1] == 0:  # idle: it dropped its state itself (it answers)
                    return "it dropped its trained state: it waits as a spare"
            if time.monotonic() >= deadline or proc.returncode is not None or stopped(proc.pid):
                return ""
            await asyncio.sleep(0.05)

    async def _terminate(self, proc: asyncio.subprocess.Process) -> None:
        try:
            proc.terminate()
            try:
                async with asyncio.timeout(self.kill_grace):
                    await proc.wait()
            except TimeoutError:
                proc.kill()
                await proc.wait()
        except ProcessLookupError:
            pass

    def forward(self, sig: int) -> None:
        """Send ``sig`` to the training process (the third signal becomes SIGKILL)."""
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        self._signals_seen += 1
        self._forwarded = sig
        send = signal.SIGKILL if self._signals_seen >= 3 else sig
        log.info("forwarding %s to the training process", signal.Signals(send).name)
        try:
            proc.send_signal(send)
        except ProcessLookupError:
            pass

    def _install_signals(self, agent: Agent) -> None:
        if not self.forward_signals:
            return
        loop = asyncio.get_running_loop()
        handlers: list[tuple[int, Any]] = [(s, lambda s=s: self.forward(s)) for s in FORWARDED_SIGNALS]
        handlers.append((signal.SIGHUP, lambda: agent.reload_keyring(force=True)))
        for sig, handler in handlers:
            try:
                loop.add_signal_handler(sig, handler)
                self._installed.append(sig)
            except (NotImplementedError, RuntimeError, ValueError):
                pass

    def _remove_signals(self, agent: Agent) -> None:
        if not self._installed:
            return
        loop = asyncio.get_running_loop()
        for sig in self._installed:
            loop.remove_signal_handler(sig)
        self._installed.clear()


def _cmd_run(args: argparse.Namespace) -> int:
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    try:
        settings = settings_from_args(args)
        if args.spare:
            settings = replace(settings, role="spare")
        launcher = Launcher(settings, command, child_nice=args.trainer_nice, keyring_fd=args.keyring_fd)
    except ConfigError as exc:
        print(f"gossiprec run: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:
        return run_async(launcher.run())
    except GossiprecError as exc:
        print(f"gossiprec run: error: {exc}", file=sys.stderr)
        return 1


def _add_run_arguments(p: argparse.ArgumentParser) -> None:
    add_agent_arguments(p)
    p.add_argument("--spare", action="store_true",
                   help="run as a hot spare (role spare): same command, waits to take over a rank")
    p.add_argument("--trainer-nice", type=int, default=DEFAULT_CHILD_NICE, metavar="N",
                   help=f"run the training process N nice levels below the agent (default {DEFAULT_CHILD_NICE}; "
                        "0: same priority), so that a saturated CPU cannot starve failure detection")
    p.add_argument("--keyring-fd", action="store_true",
                   help="hand the training process the keyring down an inherited descriptor "
                        "(GOSSIPREC_KEYRING_FD) instead of the file's path: for a trainer that cannot read the "
                        "file (another user, a container); rotations reach it through this launcher")
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- COMMAND ...",
                   help="the training command, after `--`")


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``run`` sub-command (sets ``func``: ``args.func(args) -> exit code``)."""
    p = subparsers.add_parser(
        "run", help="run a training process under a gossiprec agent",
        description="Start a gossiprec agent and the training command as its child. The child finds "
                    "the agent through GOSSIPREC_CONTROL; its exit is announced to the cluster at once. "
                    "Exit codes and signals pass through like torchrun.",
        usage="%(prog)s [agent options] [--spare] -- COMMAND [ARGS ...]")
    _add_run_arguments(p)
    p.set_defaults(func=_cmd_run)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec run",
                                     usage="%(prog)s [agent options] [--spare] -- COMMAND [ARGS ...]")
    _add_run_arguments(parser)
    return _cmd_run(parser.parse_args(argv))


if __name__ == "__main__":
    # Run the package's copy of this module, not __main__'s, so loggers and classes are the real ones.
    from gossiprec.agent.launcher import main as _main

    sys.exit(_main())
