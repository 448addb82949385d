"""The progress page (gossiprec.local.progress): the record round trip, the seqlock and CRC refusing torn
reads, refusing foreign files, and the agent taking a trainer's progress and state from it."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from typing import Iterator

import pytest

from gossiprec.core.wire import PHASES
from gossiprec.errors import ConfigError
from gossiprec.local import bell
from gossiprec.agent.pump import Agent
from gossiprec.local.client import AsyncControlClient
from gossiprec.local.progress import PAGE_SIZE, RECORD_AT, SEQ_AT, VERSION, ProgressPage, page_path_for
from gossiprec.agent.settings import AgentSettings
from tests.support.memnet import MemNetwork
from tests.support.vtime import virtual_time


@pytest.fixture
def tmpdir_() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grp", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_wait_in_collectives_rides_on_the_record_until_changed(tmpdir_: str) -> None:
    path = page_path_for(f"{tmpdir_}/w.sock")
    with ProgressPage.create(path) as agent_side, ProgressPage.open(path) as trainer:
        trainer.report(3, PHASES.index("compute"), 100)
        r = agent_side.read()
        assert r is not None and r.wait_ms == 0
        trainer.report(4, PHASES.index("compute"), 100, 0, 31)
        r = agent_side.read()
        assert r is not None and (r.step, r.wait_ms) == (4, 31)
        trainer.report(4, PHASES.index("communicate"), 100, 1)  # (None: unchanged)
        r = agent_side.read()
        assert r is not None and (r.coll, r.wait_ms) == (1, 31)


def test_round_trip_and_since(tmpdir_: str) -> None:
    path = page_path_for(f"{tmpdir_}/a.sock")
    with ProgressPage.create(path) as agent_side, ProgressPage.open(path) as trainer:
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600 and os.path.getsize(path) == PAGE_SIZE
        assert agent_side.seq() == 0 and agent_side.read() is None  # nothing written yet
        t0 = time.monotonic()
        trainer.report(7, PHASES.index("compute"), 120)
        r1 = agent_side.read()
        assert r1 is not None and (r1.step, PHASES[r1.phase], r1.step_ms) == (7, "compute", 120)
        assert t0 <= r1.since <= time.monotonic() and not r1.has_state
        trainer.report(7, PHASES.index("compute"), 130)  # same step and phase: `since` stays
        r2 = agent_side.read()
        assert r2 is not None and r2.since == r1.since and r2.step_ms == 130 and r2.seq == r1.seq + 2
        trainer.set_state(7, None, 1000, None)
        r3 = agent_side.read()
        assert r3 is not None and r3.has_state and (r3.committed_step, r3.inflight_step, r3.state_bytes,
                                                    r3.transfer_port) == (7, -1, 1000, -1)
        assert (r3.step, r3.phase) == (7, PHASES.index("compute"))  # the progress is kept beside it
        trainer.report(8, PHASES.index("optimizer"), 130)
        r4 = agent_side.read()
        assert r4 is not None and r4.since > r1.since and r4.committed_step == 7
        with pytest.raises(ConfigError, match="only reads"):
            agent_side.report(1, 0, 0)


def test_the_collective_count_is_part_of_the_position(tmpdir_: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each collective the trainer enters moves its position (and its `since`); a write without a count
    is collective 0."""
    import gossiprec.local.progress as progress_module

    clock = iter([10.0, 11.0, 12.0])
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: next(clock))
    path = page_path_for(f"{tmpdir_}/a.sock")
    with ProgressPage.create(path) as agent_side, ProgressPage.open(path) as trainer:
        compute = PHASES.index("compute")
        trainer.report(7, compute, 120)
        r0 = agent_side.read()
        assert r0 is not None and (r0.coll, r0.since) == (0, 10.0)
        trainer.report(7, compute, 120, 3)
        r1 = agent_side.read()
        assert r1 is not None and (r1.step, r1.phase, r1.coll, r1.since) == (7, compute, 3, 11.0)
        trainer.report(7, compute, 125, 3)  # the same position: `since` stays
        r2 = agent_side.read()
        assert r2 is not None and (r2.coll, r2.since, r2.step_ms) == (3, 11.0, 125)


def test_torn_or_busy_records_are_refused(tmpdir_: str) -> None:
    path = page_path_for(f"{tmpdir_}/a.sock")
    with ProgressPage.create(path) as agent_side, ProgressPage.open(path) as trainer:
        trainer.report(5, 1, 10)
        good = agent_side.read()
        assert good is not None
        with open(path, "r+b") as f:  # a write under way: the sequence number is odd
            f.seek(SEQ_AT)
            f.write(struct.pack("<Q", good.seq + 1))
        assert agent_side.read() is None
        with open(path, "r+b") as f:  # even again, but a byte of the record changed under the CRC
            f.seek(SEQ_AT)
            f.write(struct.pack("<Q", good.seq))
            f.seek(RECORD_AT)
            f.write(b"\x06")
        assert agent_side.read() is None
        trainer.report(6, 1, 10)  # the trainer's next write is whole again
        again = agent_side.read()
        assert again is not None and again.step == 6 and again.seq == good.seq + 2


def test_foreign_files_are_refused(tmpdir_: str) -> None:
    with pytest.raises(ConfigError, match="cannot open"):
        ProgressPage.open(f"{tmpdir_}/missing.progress")
    small = f"{tmpdir_}/small.progress"
    with open(small, "wb") as f:
        f.write(b"GRPP")
    with pytest.raises(ConfigError, match="not a progress page"):
        ProgressPage.open(small)
    other = f"{tmpdir_}/other.progress"
    with open(other, "wb") as f:
        f.write(b"XXXX" + bytes(PAGE_SIZE - 4))
    with pytest.raises(ConfigError, match=f"version-{VERSION} progress page"):
        ProgressPage.open(other)
    os.mkdir(f"{tmpdir_}/dir.progress")
    with pytest.raises(ConfigError, match="cannot create the progress page"):
        ProgressPage.create(f"{tmpdir_}/dir.progress")
    stale = page_path_for(f"{tmpdir_}/b.sock")
    with open(stale, "wb") as f:
        f.write(b"left by a dead agent")
    with ProgressPage.create(stale) as page:  # replaced
        assert page.read() is None and os.path.getsize(stale) == PAGE_SIZE


@virtual_time
async def test_agent_reads_the_trainers_page(tmpdir_: str) -> None:
    s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                      control_socket=f"{tmpdir_}/n0.sock")
    async with MemNetwork().agent(s) as agent:
        async with await AsyncControlClient.connect(agent.control_path) as c:
            status = await c.status()
            path = status["progress_page"]
            assert path == page_path_for(agent.control_path) and status["trainer_state"] is None
            assert not agent.trainer_trained
            with ProgressPage.open(path) as page:
                page.report(41, PHASES.index("optimizer"), 13)
                page.set_state(40, None, 4096, 7000)
                status = await c.status()  # no message: the agent looks at the page
                assert status["trainer_state"] == {"committed_step": 40, "inflight_step": None,
                                                   "state_bytes": 4096, "transfer_port": 7000}
                assert agent.trainer_trained  # (sticky: the launcher's rule for a removed trainer)
                me = [r for r in await c.members() if r["self"]][0]
                assert (me["step"], me["phase"], me["step_ms"]) == (41, "optimizer", 13)
                assert agent.machine is not None
                mine = agent.machine.swim.my_progress  # what the acks carry
                assert (mine.step, mine.phase) == (41, PHASES.index("optimizer"))
                page.report(42, PHASES.index("compute"), 14)
                await agent.wait_until(lambda: agent.machine.swim.my_progress.step == 42, 5)  # a timer's tick
                page.report(-5, 99, 1)  # out of range: counted and ignored, the last good progress stays
                await c.status()
                assert agent.counters.get("progress_page_invalid", 0) == 1
                assert agent.machine.swim.my_progress.step == 42
                page.report(43, PHASES.index("compute"), 14)
                page.set_state(41, None, 4096, 70000)  # not a port: the state message's rules apply
                status = await c.status()
                assert agent.counters["progress_page_invalid"] == 2 and status["trainer_state"]["committed_step"] == 40
    assert not os.path.exists(path)  # removed with the agent


# ---------------------------------------------------------------------- the exit bell
_TRAINER = """
import os, sys, time
from gossiprec.local.progress import ProgressPage
page = ProgressPage.open(sys.argv[1])
print(page.arm_bell(), flush=True)
page.report(1, 0, 10)
if sys.argv[2] == "clean":
    sys.stdin.readline()
    page.close()
elif sys.argv[2] == "exec":
    sys.stdin.readline()
    os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(30)"])
else:
    time.sleep(30)
"""


def _trainer(path: str, mode: str) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-c", _TRAINER, path, mode], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "True"  # armed
    return p


@pytest.mark.skipif(bell.pthreads() is None, reason="no robust mutexes on this system")
@pytest.mark.parametrize("mode", ["kill", "clean", "exec"])
def test_the_exit_bell_tells_a_death_from_a_clean_end(tmpdir_: str, mode: str) -> None:
    path = page_path_for(f"{tmpdir_}/a.sock")
    with ProgressPage.create(path) as agent_side:
        p = _trainer(path, mode)
        try:
            assert agent_side.bell_pid() == p.pid
            rang: list[tuple[int, float]] = []
            w = bell.BellWatcher(path, p.pid, lambda pid: rang.append((pid, time.monotonic())), wait_s=0.02)
            deadline = time.monotonic() + 5
            while w.waits < 2 and w.thread.is_alive() and time.monotonic() < deadline:
                time.sleep(0.005)
            # the trainer holds it: the watcher's waits time out, it neither rings nor ends
            assert w.waits >= 2 and w.thread.is_alive() and w.outcome is None and not rang
            t0 = time.monotonic()
            if mode == "kill":
                os.kill(p.pid, signal.SIGKILL)
            else:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            w.thread.join(5)
            assert not w.thread.is_alive()
            if mode == "kill":
                assert w.outcome == "rang" and rang[0][0] == p.pid and rang[0][1] - t0 < 2.0
            elif mode == "clean":
                assert p.wait(5) == 0  # first: the trainer clears bell_pid after it released the bell
                assert w.outcome == "released" and not rang and agent_side.bell_pid() == 0
            else:  # exec releases the lock too, but the process lives on: not a death
                assert w.outcome == "alive" and not rang and p.poll() is None
        finally:
            p.kill()
            p.wait()


@pytest.mark.skipif(bell.pthreads() is None, reason="no robust mutexes on this system")
def test_only_the_main_thread_arms_and_only_once(tmpdir_: str) -> None:
    path = page_path_for(f"{tmpdir_}/a.sock")
    with ProgressPage.create(path) as agent_side:
        first, second = ProgressPage.open(path), ProgressPage.open(path)
        try:
            got: list[bool] = []
            t = threading.Thread(target=lambda: got.append(first.arm_bell()))
            t.start()
            t.join()
            assert got == [False]  # a thread's end is not the process's
            assert first.arm_bell() and agent_side.bell_pid() == os.getpid()
            assert not second.arm_bell()  # one bell per process
            assert not agent_side.arm_bell()  # the agent's mapping only reads
            closer = threading.Thread(target=first.close)  # not the owner: it cannot release the bell
            closer.start()
            closer.join()
            assert agent_side.bell_pid() == os.getpid()  # still held, and still mapped
            first.report(3, 0, 1)
            assert agent_side.read() is not None and agent_side.read().step == 3  # type: ignore[union-attr]
        finally:
            first.close()  # the owner: releases it before unmapping
            second.close()
        assert agent_side.bell_pid() == 0
        assert bell.exiting(2**22 + 12345)  # no such process: gone
        assert not bell.exiting(os.getpid())


@pytest.mark.skipif(bell.pthreads() is None, reason="no robust mutexes on this system")
async def test_the_agent_leaves_when_its_trainer_dies_holding_the_bell(tmpdir_: str) -> None:
    s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                      control_socket=f"{tmpdir_}/n0.sock")
    async with Agent(s) as agent:
        p = _trainer(page_path_for(agent.control_path), "kill")
        try:
            await agent.wait_until(lambda: agent._bell is not None, 5)  # a tick reads the page
            os.kill(p.pid, signal.SIGKILL)
            await agent.wait_until(lambda: agent.leaving, 5)
            assert agent.counters["trainer_exit_bell"] == 1
            assert agent.leave_reason is not None and f"pid {p.pid}" in agent.leave_reason
            assert agent._stop_requested.is_set()  # a standalone agent (run()) ends with its trainer
        finally:
            p.kill()
            p.wait()


@pytest.mark.skipif(bell.pthreads() is None, reason="no robust mutexes on this system")
async def test_with_the_exit_bell_off_there_is_none_to_arm(tmpdir_: str) -> None:
    s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                      control_socket=f"{tmpdir_}/n0.sock", exit_bell=False)
    async with Agent(s) as agent:
        with ProgressPage.open(page_path_for(agent.control_path)) as page:
            assert not page.arm_bell() and page.bell_pid() == 0
            page.report(5, PHASES.index("compute"), 10)
            me = [r for r in agent.control_members() if r["self"]][0]
            assert me["step"] == 5  # the page still carries the progress
            assert agent._bell is None  # and nothing watches a bell


@pytest.mark.skipif(bell.pthreads() is None, reason="no robust mutexes on this system")
async def test_the_agent_leaves_when_its_trainer_stays_stopped_for_the_hang_threshold(tmpdir_: str) -> None:
    # a trainer stopped inside a collective freezes the others' progress too: only its own agent can
    # tell it from a stall that all ranks share, by its process state
    s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True,
                      control_socket=f"{tmpdir_}/n0.sock")
    async with Agent(s) as agent:
        p = _trainer(page_path_for(agent.control_path), "kill")
        try:
            await agent.wait_until(lambda: agent._bell is not None, 5)
            # stopped and continued before the threshold: a pause, not a hang
            os.kill(p.pid, signal.SIGSTOP)
            await agent.wait_until(lambda: agent._stopped_since is not None, 5)
            os.kill(p.pid, signal.SIGCONT)
            await agent.wait_until(lambda: agent._stopped_since is None, 5)
            assert not agent.leaving and "trainer_stopped" not in agent.counters
            os.kill(p.pid, signal.SIGSTOP)
            stopped_at = time.monotonic()
            await agent.wait_until(lambda: agent.leaving, 10)
            assert time.monotonic() - stopped_at >= agent.agreement.hang_floor
            assert agent.counters["trainer_stopped"] == 1
            assert agent.leave_reason is not None and f"pid {p.pid}" in agent.leave_reason
            assert "stopped" in agent.leave_reason
        finally:
            p.kill()
            p.wait()
