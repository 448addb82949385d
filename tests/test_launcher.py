"""``gossiprec run``: the child's environment, exit codes and signals passing through, the child's exit
announced to peers at once; and real ``agent`` / ``run`` processes talking over loopback."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
import time
from typing import Any, Iterator

import pytest

from gossiprec.core.events import MemberFailed, MemberLeft
from gossiprec.agent import cli as agent_mod
from gossiprec.agent import launcher as launcher_mod
from gossiprec.agent.pump import Agent
from gossiprec.local.client import ControlClient
from gossiprec.errors import ConfigError
from gossiprec.agent.launcher import Launcher, child_environment, describe_exit, exit_code_of
from gossiprec.agent.settings import AgentSettings

FAST = (("suspicion_floor", 0.5),)
PY = sys.executable


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="gr", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def settings(sockdir: str, i: int, seeds: tuple[str, ...] = (), **kw: Any) -> AgentSettings:
    base: dict[str, Any] = dict(name=f"n{i}", bind_host="127.0.0.1", port=0, seeds=seeds, insecure=True,
                                control_socket=f"{sockdir}/n{i}.sock", protocol=FAST)
    base.update(kw)
    return AgentSettings(**base)


# --- in-process launcher -----------------------------------------------------------------------------
def test_exit_code_convention() -> None:
    assert exit_code_of(0) == 0 and exit_code_of(7) == 7
    assert exit_code_of(-signal.SIGKILL) == 137 and exit_code_of(-signal.SIGTERM) == 143
    assert describe_exit(-9) == "was killed by SIGKILL"


async def test_child_gets_coordinates_and_its_exit_code_passes_through(sockdir: str) -> None:
    code = ("import json, os, sys\n"
            "print(json.dumps({k: v for k, v in os.environ.items() if k.startswith(('GOSSIPREC_', 'THP_'))}))\n"
            "sys.exit(7)\n")
    env = {"PATH": os.environ.get("PATH", ""), "GOSSIPREC_RANK": "99"}
    launcher = Launcher(settings(sockdir, 0, role="spare"), [PY, "-c", code], forward_signals=False,
                        environ=env, child_kwargs={"stdout": asyncio.subprocess.PIPE})
    assert await launcher.run() == 7
    assert launcher.proc is not None and launcher.proc.stdout is not None
    seen = json.loads(await launcher.proc.stdout.read())
    assert seen == {"GOSSIPREC_CONTROL": f"{sockdir}/n0.sock", "GOSSIPREC_NODE": "n0",
                    "GOSSIPREC_ROLE": "spare", "GOSSIPREC_CLUSTER": "gossiprec",  # stale RANK removed
                    "GOSSIPREC_LOG_FORMAT": "text", "GOSSIPREC_LOG_LEVEL": "info",  # the agent's, for its logs
                    "THP_MEM_ALLOC_ENABLE": "1"}  # huge pages for torch's CPU allocator by default
    assert launcher.agent is not None and launcher.agent.leave_reason == "training process exited with code 7"
    assert child_environment(launcher.agent, {"THP_MEM_ALLOC_ENABLE": "0"})["THP_MEM_ALLOC_ENABLE"] == "0"


@pytest.mark.parametrize("trained,progress,kept", [
    (False, (0, 0, 0), "it holds no trained state"),       # a spare: never trained, kept at once
    (True, (0, 0, 0), "it dropped its trained state"),     # trained, then said idle: it answers
    (True, (5, 1, 100), ""),                               # trained, reports nothing since: killed (hung)
])
async def test_a_removed_child_is_kept_only_if_it_never_trained_or_said_it_dropped_its_state(
        trained: bool, progress: tuple[int, int, int], kept: str) -> None:
    """A trainer hung in a collective no abort reached, whose agent's last word of its state is "none"
    (its reports were reset by the views that removed it), once waited as a spare for a job that had
    stopped: a child that trained is kept only once it says, by its idle report, that it dropped its
    state; otherwise it is killed after the grace."""
    from types import SimpleNamespace

    proc = await asyncio.create_subprocess_exec(PY, "-c", "import time; time.sleep(30)")
    try:
        agent = SimpleNamespace(trainer_state={"committed_step": 0, "state_bytes": 0}, trainer_trained=trained,
                                my_progress=progress)
        launcher = Launcher(AgentSettings(name="n0", insecure=True), [PY], fence_grace=0.3)
        t0 = time.monotonic()
        why = await launcher._keep_after_removal(agent, proc, "")  # type: ignore[arg-type]
        assert why.startswith(kept) if kept else why == "", why
        assert (time.monotonic() - t0 >= 0.3) == (not kept)  # a hung one had the whole grace
    finally:
        proc.kill()
        await proc.wait()


async def test_child_runs_below_the_agent_cpu_priority(sockdir: str) -> None:
    code = "import os; print(os.getpriority(os.PRIO_PROCESS, 0))"
    base = os.getpriority(os.PRIO_PROCESS, 0)
    seen = []
    for nice in (5, 0):
        launcher = Launcher(settings(sockdir, 0), [PY, "-c", code], forward_signals=False, child_nice=nice,
                            child_kwargs={"stdout": asyncio.subprocess.PIPE})
        assert await launcher.run() == 0
        assert launcher.proc is not None and launcher.proc.stdout is not None
        seen.append(int(await launcher.proc.stdout.read()))
    assert seen == [min(19, base + 5), base]
    with pytest.raises(ConfigError, match="trainer-nice"):
        Launcher(settings(sockdir, 0), [PY], child_nice=20)


async def test_missing_command_gives_127(sockdir: str) -> None:
    launcher = Launcher(settings(sockdir, 0), ["/nonexistent/trainer"], forward_signals=False)
    assert await launcher.run() == 127


async def test_child_death_is_announced_to_peers_as_a_departure(sockdir: str) -> None:
    a = Agent(settings(sockdir, 0))
    async with a:
        b = Agent(settings(sockdir, 1, (a.addr,)))
        async with b:
            launcher = Launcher(settings(sockdir, 5, (a.addr,), rank=2),
                                [PY, "-c", "import time; time.sleep(60)"], forward_signals=False)
            subs = [a.subscribe(), b.subscribe()]
            async with asyncio.TaskGroup() as tg:
                task = tg.create_task(launcher.run())
                await asyncio.wait_for(launcher.started.wait(), 10)
                node = launcher.agent
                assert node is not None
                await node.wait_until(lambda: node.live_count() == 3, 10)
                for peer in (a, b):
                    await peer.wait_until(lambda p=peer: p.member_status("n5") == "alive", 10)
                assert launcher.proc is not None
                t_kill = time.monotonic()
                launcher.proc.kill()  # the trainer crashes
                seen = []
                for peer, sub in zip((a, b), subs):
                    ev = await peer.wait_for_event(
                        lambda e: isinstance(e, (MemberLeft, MemberFailed)) and e.name == "n5", 30, sub)
                    seen.append(ev)
            assert task.result() == 128 + signal.SIGKILL
            assert launcher.child_exit is not None and launcher.child_exit.signal == "SIGKILL"
            # the launcher's departure notice, not a probe timeout (the figure is the agents' benchmark's)
            assert all(isinstance(ev, MemberLeft) and ev.at >= t_kill for ev in seen), seen
            assert node.leave_reason == "training process was killed by SIGKILL"


async def test_agent_failure_terminates_the_child(sockdir: str) -> None:
    launcher = Launcher(settings(sockdir, 0), [PY, "-c", "import time; time.sleep(60)"],
                        forward_signals=False, kill_grace=5)
    task = asyncio.ensure_future(launcher.run())
    try:
        await asyncio.wait_for(launcher.started.wait(), 10)
        task.cancel()  # e.g. the agent's TaskGroup failed
        with pytest.raises(asyncio.CancelledError):
            await task
    finally:
        if not task.done():
            task.cancel()
    assert launcher.proc is not None and launcher.proc.returncode == -signal.SIGTERM


async def test_removed_from_the_view_kills_a_stopped_child(sockdir: str) -> None:
    from gossiprec.core.events import Fenced

    # the child stops itself like a hung trainer: only SIGKILL can end it
    code = "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); time.sleep(60)"
    launcher = Launcher(settings(sockdir, 0), [PY, "-c", code], forward_signals=False)
    task = asyncio.ensure_future(launcher.run())
    try:
        await asyncio.wait_for(launcher.started.wait(), 10)
        assert launcher.agent is not None and launcher.proc is not None and launcher.proc.returncode is None
        while not launcher_mod.stopped(launcher.proc.pid):  # the child has stopped itself: "hung"
            await asyncio.sleep(0.01)
        # The watcher takes events in order and kills at a removal: a minority fence first, then a
        # removal. Had the minority fence killed the child, the kill would name epoch 3; a stopped child
        # is killed at once even though its node was fenced first (a running one would be kept).
        launcher.agent.hub.publish(Fenced(3, "no quorum: cannot reach a majority of the view", time.monotonic()))
        launcher.agent.hub.publish(Fenced(4, "removed from the view", time.monotonic()))
        assert await asyncio.wait_for(task, 10) == 128 + signal.SIGKILL
    finally:
        if not task.done():
            task.cancel()
    assert launcher.fenced == "removed from the view (epoch 4)"  # not for the minority fence before it
    reason = launcher.agent.leave_reason
    assert reason is not None and "fenced (removed from the view (epoch 4))" in reason and "no quorum" not in reason


async def test_a_keyed_childs_environment_names_the_keyring_file_never_the_key(sockdir: str) -> None:
    from gossiprec.security.keyring import Keyring, decode_key, encode_key, generate_key

    key = decode_key(generate_key())
    Keyring([key]).save(f"{sockdir}/keyring.json")
    code = "import json, os; print(json.dumps(dict(os.environ)))\n"
    env = {"PATH": os.environ.get("PATH", ""), "GOSSIPREC_KEYRING": "/elsewhere/stale.json"}
    launcher = Launcher(settings(sockdir, 0, role="spare", insecure=False, keyring=f"{sockdir}/keyring.json"),
                        [PY, "-c", code], forward_signals=False, environ=env,
                        child_kwargs={"stdout": asyncio.subprocess.PIPE})
    assert await launcher.run() == 0
    assert launcher.proc is not None and launcher.proc.stdout is not None
    seen = json.loads(await launcher.proc.stdout.read())
    assert seen["GOSSIPREC_KEYRING"] == f"{sockdir}/keyring.json"
    assert seen["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # NCCL's abort, not its process teardown
    text = json.dumps(seen)
    assert encode_key(key) not in text and key.hex() not in text
    assert launcher.agent is not None
    insecure = child_environment(launcher.agent, env)
    assert insecure["GOSSIPREC_KEYRING"] == f"{sockdir}/keyring.json"
    launcher.agent.settings = dataclasses.replace(launcher.agent.settings, insecure=True, keyring=None)
    assert "GOSSIPREC_KEYRING" not in child_environment(launcher.agent, env)


async def test_a_child_fenced_first_is_kept_to_wait_as_a_spare(sockdir: str) -> None:
    from gossiprec.core.events import Fenced, Unfenced

    launcher = Launcher(settings(sockdir, 0), [PY, "-c", "import time; time.sleep(60)"], forward_signals=False,
                        kill_grace=2)
    task = asyncio.ensure_future(launcher.run())
    try:
        await asyncio.wait_for(launcher.started.wait(), 10)
        assert launcher.agent is not None and launcher.proc is not None
        # a minority's fence, then the removal the majority decided meanwhile: the partition is at fault,
        # not the trainer, which drops its state and waits as a spare in its own process
        launcher.agent.hub.publish(Fenced(3, "no quorum: cannot reach a majority of the view", time.monotonic()))
        launcher.agent.hub.publish(Fenced(4, "removed from the view", time.monotonic()))
        launcher.agent.hub.publish(Unfenced(5, time.monotonic()))
        while launcher.kept is None:
            await asyncio.sleep(0.01)
        assert "fenced first" in launcher.kept and launcher.fenced is None
        assert launcher.proc.returncode is None
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_child_stopped_in_good_order_leaves_gracefully(sockdir: str) -> None:
    from gossiprec.agent.hub import AgentLeaving

    go = f"{sockdir}/go"
    code = f"import os, sys, time\nwhile not os.path.exists({go!r}): time.sleep(0.01)\nsys.exit(75)\n"
    launcher = Launcher(settings(sockdir, 0), [PY, "-c", code], forward_signals=False)
    task = asyncio.ensure_future(launcher.run())
    await asyncio.wait_for(launcher.started.wait(), 10)
    assert launcher.agent is not None
    events = launcher.agent.hub.subscribe()
    Path(go).write_text("1")
    assert await asyncio.wait_for(task, 10) == 75  # EXIT_STOPPED passes through to the scheduler
    leaving = [ev for ev in iter(events.get_nowait, None) if isinstance(ev, AgentLeaving)]
    assert [(ev.reason, ev.failed) for ev in leaving] == [("training process exited with code 75", False)]


# --- command line ------------------------------------------------------------------------------------
def test_cli_hooks_parse() -> None:
    parser = argparse.ArgumentParser(prog="gossiprec")
    sub = parser.add_subparsers(dest="cmd")
    agent_mod.add_cli(sub)
    launcher_mod.add_cli(sub)
    args = parser.parse_args(["run", "--insecure", "--spare", "--port", "0", "--", "python", "train.py",
                              "--lr", "1"])
    assert args.spare and args.port == 0 and args.command == ["--", "python", "train.py", "--lr", "1"]
    assert args.func is launcher_mod._cmd_run
    args = parser.parse_args(["agent", "--insecure", "--seed", "a:1,b:2", "--seed", "c:3"])
    assert args.func is agent_mod._cmd_agent and args.seeds == ["a:1,b:2", "c:3"]
    assert launcher_mod.main(["--insecure"]) == 2  # no command: a usage error, not a crash
    assert agent_mod.main(["--port", "-1", "--insecure"]) == 2


# --- real processes ----------------------------------------------------------------------------------
class Lines:
    """Line reader over a pipe with a timeout (select on the raw fd; no hidden read-ahead buffer)."""

    def __init__(self, stream: Any) -> None:
        self.fd = stream.fileno()
        self.buf = b""

    def next(self, timeout: float) -> str:
        deadline = time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("no output from the subprocess")
            ready, _, _ = select.select([self.fd], [], [], left)
            if ready:
                chunk = os.read(self.fd, 65536)
                if not chunk:
                    raise EOFError("subprocess closed its output")
                self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode()


def wait_started(proc: subprocess.Popen[bytes], timeout: float = 15) -> dict[str, Any]:
    lines = Lines(proc.stderr)
    deadline = time.monotonic() + timeout
    while True:
        line = lines.next(deadline - time.monotonic())
        try:
            doc = json.loads(line)
        except json.JSONDecodeError:
            continue
        if doc.get("msg") == "agent started":
            return dict(doc)


def agent_cmd(sockdir: str, name: str, *extra: str) -> list[str]:
    return [PY, "-m", "gossiprec.agent.cli", "--insecure", "--bind", "127.0.0.1", "--port", "0",
            "--name", name, "--control-socket", f"{sockdir}/{name}.sock", "--log-format", "json",
            "--protocol", "suspicion_floor=0.5", *extra]


def stop(*procs: subprocess.Popen[bytes]) -> None:
    for p in procs:
        if p.poll() is None:
            p.kill()
        p.wait(10)


def test_two_agent_processes_join_and_leave(sockdir: str) -> None:
    a = subprocess.Popen(agent_cmd(sockdir, "a"), stderr=subprocess.PIPE)
    b: subprocess.Popen[bytes] | None = None
    try:
        addr = wait_started(a)["addr"]
        b = subprocess.Popen(agent_cmd(sockdir, "b", "--seed", addr), stderr=subprocess.PIPE)
        wait_started(b)
        with ControlClient(f"{sockdir}/b.sock") as c:
            c.subscribe()
            deadline = time.monotonic() + 10
            while not any(m["name"] == "a" and m["status"] == "alive" for m in c.members()):
                assert c.next_event(timeout=deadline - time.monotonic()) is not None, "a never joined"
            a.send_signal(signal.SIGTERM)
            assert a.wait(10) == 0  # graceful leave, then exit 0
            while True:
                ev = c.next_event(timeout=deadline + 10 - time.monotonic())
                assert ev is not None, "the leave never arrived"
                if ev.get("name") == "a" and ev["event"] in ("MemberLeft", "MemberFailed"):
                    break
            assert ev["event"] == "MemberLeft"
        b.send_signal(signal.SIGINT)
        assert b.wait(10) == 0
    finally:
        stop(a, *([b] if b else []))


CHILD_TRAP = ("import signal, sys, time\n"
              "signal.signal(signal.SIGTERM, lambda *a: sys.exit(5))\n"
              "print('ready', flush=True)\n"
              "time.sleep(30)\n")


@pytest.mark.parametrize(("child", "expected"), [(CHILD_TRAP, 5),
                                                 (CHILD_TRAP.replace("signal.signal", "0 and signal.signal"),
                                                  128 + signal.SIGTERM)])
def test_run_process_forwards_sigterm_and_exits_like_the_child(sockdir: str, child: str,
                                                                expected: int) -> None:
    cmd = [PY, "-m", "gossiprec.agent.launcher", "--insecure", "--bind", "127.0.0.1", "--port", "0",
           "--control-socket", f"{sockdir}/l.sock", "--log-level", "warning", "--", PY, "-c", child]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert Lines(proc.stdout).next(15).strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) == expected
    finally:
        stop(proc)


def test_cli_command_owners_are_complete_and_an_agent_imports_no_tooling() -> None:
    from gossiprec.cli import _OWNER, build_parser

    subparsers = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    assert set(subparsers.choices) == set(_OWNER)
    code = ("import sys; from gossiprec.cli import build_parser; build_parser('agent'); build_parser('run');"
            "print(sorted({m.split('.')[0] + '.' + m.split('.')[1] if m.startswith('gossiprec.') else m"
            " for m in sys.modules if m.startswith(('gossiprec.sim', 'gossiprec.bench', 'gossiprec.demo', 'torch'))}))")
    out = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "[]"


async def test_the_childs_role_rank_and_torch_variables_come_from_the_job_spec(sockdir: str) -> None:
    from gossiprec.harness.ports import free_ports

    ports = sorted(free_ports(3))  # a host's slots are numbered in port order
    rows = [("n0", "trainer", 0, "a"), ("n1", "trainer", 1, "a"), ("n2", "spare", None, "b")]
    spec = Path(sockdir) / "job.toml"
    spec.write_text("".join(f'[[members]]\nname = "{n}"\naddr = "127.0.0.1:{p}"\nrole = "{r}"\nhost = "{h}"\n'
                            + (f"rank = {k}\n" if k is not None else "") for (n, r, k, h), p in zip(rows, ports)))
    names = ("GOSSIPREC_ROLE", "GOSSIPREC_RANK", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    seen = {}
    for (name, _, _, _), port in zip(rows[1:], ports[1:]):  # no --spare flag, no --rank: the spec says
        launcher = Launcher(settings(sockdir, int(name[1]), port=port, job=str(spec)), [PY, "-c", code],
                            forward_signals=False, child_kwargs={"stdout": asyncio.subprocess.PIPE},
                            environ={"RANK": "7", "PATH": os.environ.get("PATH", "")})
        assert await launcher.run() == 0
        assert launcher.proc is not None and launcher.proc.stdout is not None
        seen[name] = json.loads(await launcher.proc.stdout.read())
    # a spare has no RANK (a stale one is removed): its rank comes with the plan that promotes it
    assert seen == {"n1": {"GOSSIPREC_ROLE": "trainer", "GOSSIPREC_RANK": "1", "RANK": "1", "WORLD_SIZE": "2",
                           "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"},
                    "n2": {"GOSSIPREC_ROLE": "spare", "GOSSIPREC_RANK": None, "RANK": None, "WORLD_SIZE": "2",
                           "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}}
