"""The trainer's recoveries at its agent: a record's phases and its wire form, the ``recovered`` and ``checked``
control requests (and the version that brought them), the agent's metrics and timeline file (a disk that
fails included), the step samples, and the trainer's one log line per recovery in the agent's format."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import signal
import subprocess
import sys
import time
import logging
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any, Iterator

import pytest

from gossiprec.agent.pump import Agent
from gossiprec.agent.recoveries import RecoveryLog, TimelineWriter, timeline_path
from gossiprec.agent.settings import AgentSettings, load_settings
from gossiprec.core.events import AlertRaised
from gossiprec.local.client import AsyncControlClient
from gossiprec.local.launch import read_launch_env, trainer_environment
from gossiprec.local.protocol import (
    CONTROL_VERSION, RECOVERY_FIELDS, RECOVERY_PHASES, ControlError, encode_frame, recovered_args,
)
from gossiprec.trainer.recovery import RecoveryRecord, tell_recovery
from gossiprec.trainer.settings import TrainerSettings

prom = pytest.importorskip("prometheus_client")

TIMELINE_KEYS = ["v", "kind", "time", "node", *RECOVERY_FIELDS]


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grr", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def record(**kw: Any) -> RecoveryRecord:
    base: dict[str, Any] = dict(
        epoch=3, cause="interrupted in step 41: peer gone", role="receiver", rank=1, world_size=4, target_step=40,
        lost_steps=1, noticed_at=100.0, detected_at=100.25, agreed_at=100.75, planned_at=101.0, group_at=103.5,
        state_at=102.0, first_step_at=104.0, bytes_received=8_000_000, transfer_s=0.5, action="resume",
        previous_world_size=4, donors=("n0", "n2"))
    base.update(kw)
    return RecoveryRecord(**base)


def wire(**kw: Any) -> dict[str, Any]:
    digest = kw.pop("digest", "ok")
    return record(**kw).to_wire(digest)


# --- the record -----------------------------------------------------------------------------------
def test_phases_follow_the_recovery_and_sum_to_its_rto() -> None:
    w = wire()
    assert list(w["phases"]) == list(RECOVERY_PHASES)
    # the state is loaded (102.0) before the group is built (103.5)
    assert w["phases"] == {"detect": 0.25, "agree": 0.5, "plan": 0.25, "group": 1.5, "state": 1.0, "first_step": 0.5}
    assert w["rto_s"] == 4.0 == pytest.approx(sum(w["phases"].values()), abs=1e-3)
    assert recovered_args({"record": w}) == w  # what the trainer sends, the agent takes
    # the agent saw the failure 1 s before this rank noticed it (a hang alert): the recovery counts from
    # there, detect lasts until the rank knows; and no agreement event was seen
    w = wire(detected_at=99.0, agreed_at=None)
    assert w["phases"]["detect"] == 1.0 and w["phases"]["agree"] == 0.0 and w["phases"]["plan"] == 1.0
    assert w["rto_s"] == pytest.approx(sum(w["phases"].values()), abs=1e-3) == 5.0
    # a spare's first rank counts from the detection, not from the start of its wait
    w = wire(previous_role="spare", noticed_at=10.0)
    assert w["rto_s"] == pytest.approx(104.0 - 100.25)


@pytest.mark.parametrize("change,match", [
    ({"action": "retry"}, "record.action"), ({"rto_s": -1.0}, "record.rto_s"), ({"rank": "1"}, "record.rank"),
    ({"phases": {"detect": 1.0}}, "record.phases"), ({"donors": [1]}, "record.donors"),
    ({"digest": "maybe"}, "record.digest"), ({"rto_s": float("nan")}, "record.rto_s"),
])
def test_a_bad_record_is_refused_with_the_field(change: dict[str, Any], match: str) -> None:
    with pytest.raises(ControlError, match=match) as exc:
        recovered_args({"record": {**wire(), **change}})
    assert exc.value.code == "bad_args"


# --- the agent's log: metrics and timeline --------------------------------------------------------
def value(reg: Any, name: str, **labels: str) -> float:
    v = reg.get_sample_value(name, labels)
    return 0.0 if v is None else float(v)


def test_a_record_becomes_metrics_and_one_timeline_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = RecoveryLog(str(path), lambda: "n1", wall=lambda: 1700000000.5)
    reg = prom.CollectorRegistry()
    rec.attach(prom, reg)
    rec.recovered(recovered_args({"record": wire()}))
    rec.recovered(recovered_args({"record": wire(action="shrink", lost_steps=2, donors=(), bytes_received=0,
                                                role="survivor", digest="off")}))
    rec.checked(True)
    rec.checked(False)
    rec.observe(AlertRaised("n3", "hung", 5.0))
    rec.observe(AlertRaised("n3", "unreachable", 5.0))
    rec.close()
    assert value(reg, "gossiprec_recoveries_total", action="resume") == 1
    assert value(reg, "gossiprec_recoveries_total", action="shrink") == 1
    assert value(reg, "gossiprec_recoveries_total", action="stop") == 0
    assert value(reg, "gossiprec_recovery_seconds_count") == 2
    assert value(reg, "gossiprec_recovery_seconds_sum") == pytest.approx(8.0)
    assert value(reg, "gossiprec_recovery_phase_seconds_sum", phase="group") == pytest.approx(3.0)
    assert value(reg, "gossiprec_recovery_lost_steps_total") == 3
    assert value(reg, "gossiprec_recovery_bytes_total", donor="n0") == 4_000_000
    assert value(reg, "gossiprec_recovery_throughput_bytes_per_second", donor="n2") == 8_000_000
    assert value(reg, "gossiprec_replica_checks_total") == 2
    assert value(reg, "gossiprec_replica_mismatches_total") == 1
    assert value(reg, "gossiprec_hang_reports_total") == 1
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert list(first) == TIMELINE_KEYS
    assert first["v"] == 1 and first["kind"] == "recovery" and first["time"] == 1700000000.5 and first["node"] == "n1"
    assert {k: first[k] for k in ("action", "role", "lost_steps", "rto_s", "bytes", "digest", "donors")} == {
        "action": "resume", "role": "receiver", "lost_steps": 1, "rto_s": 4.0, "bytes": 8_000_000, "digest": "ok",
        "donors": ["n0", "n2"]}
    assert list(first["phases"]) == list(RECOVERY_PHASES)
    assert lines[1]["action"] == "shrink" and lines[1]["digest"] == "off"


def test_steps_are_sampled_as_mean_seconds_per_step(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rec = RecoveryLog(str(path), lambda: "n1", wall=lambda: 5.0)
    reg = prom.CollectorRegistry()
    rec.attach(prom, reg)
    assert rec.sample(2, 10, 100.0) is None  # the first look is a base
    assert rec.sample(2, 20, 105.0) == {"v": 1, "kind": "steps", "time": 5.0, "node": "n1", "rank": 2, "step": 20,
                                        "step_s": 0.5, "behind_ms": 0.0}
    assert rec.sample(2, 20, 110.0) is None  # no step: no mean
    assert rec.sample(2, 21, 115.0)["step_s"] == pytest.approx(10.0)  # type: ignore[index]  # since step 20
    assert value(reg, "gossiprec_step", rank="2") == 21 and value(reg, "gossiprec_step_seconds", rank="2") == 10.0
    assert rec.sample(0, 30, 120.0) is None  # a new rank after a recovery: a new base, the old rank's gauges gone
    assert reg.get_sample_value("gossiprec_step", {"rank": "2"}) is None
    assert value(reg, "gossiprec_step", rank="0") == 30
    rec.close()
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [20, 21]


def test_a_disk_error_is_counted_and_logged_once(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    counted: list[str] = []
    writer = TimelineWriter(str(tmp_path), counted.append)  # a directory: every append fails
    with caplog.at_level(logging.WARNING, logger="gossiprec.agent.recoveries"):
        for i in range(3):
            writer.write({"i": i})
            writer._thread.join(0.01) if writer._thread else None  # (let each write fail on its own)
        writer.close()
    assert counted and set(counted) == {"timeline_errors"}
    assert len([r for r in caplog.records if "cannot append to the timeline file" in r.message]) == 1
    assert writer.written == 0


def test_the_timeline_setting() -> None:
    assert [timeline_path(x) for x in (None, "", "-", " - ", "t.jsonl")] == [None, None, None, None, "t.jsonl"]
    env = {"GOSSIPREC_INSECURE": "1", "HOME": "/nonexistent"}
    assert load_settings({}, env).timeline == "gossiprec-timeline.jsonl"  # the commands' default
    assert load_settings({}, {**env, "GOSSIPREC_TIMELINE": "-"}).timeline == "-"
    assert load_settings({"timeline": "/x/t.jsonl"}, env).timeline == "/x/t.jsonl"
    assert AgentSettings(insecure=True).timeline is None  # an agent built in code writes none


# --- over the control socket ----------------------------------------------------------------------
async def _scrape(port: int) -> str:
    def get() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())
    return await asyncio.to_thread(get)


async def test_recovered_and_checked_reach_the_metrics_and_the_file(sockdir: str) -> None:
    path = Path(sockdir) / "timeline.jsonl"
    s = AgentSettings(name="n1", bind_host="127.0.0.1", port=0, insecure=True, metrics_port=0,
                      control_socket=f"{sockdir}/n1.sock", timeline=str(path))
    async with Agent(s) as agent:
        agent.metrics.cache_s = 0.0
        async with await AsyncControlClient.connect(agent.control_path) as c:
            await c.request("recovered", record=wire())
            await c.request("checked", ok=True)
            with pytest.raises(ControlError) as exc:
                await c.request("recovered", record={**wire(), "lost_steps": -1})
            assert exc.value.code == "bad_args"
            assert (await c.request("ping"))["pong"]  # a bad record does not disconnect
        text = await _scrape(agent.metrics.port)
    assert 'gossiprec_recoveries_total{action="resume"} 1.0' in text
    assert "gossiprec_recovery_seconds_sum 4.0" in text and "gossiprec_replica_checks_total 1.0" in text
    lines = [json.loads(x) for x in path.read_text().splitlines()]  # written by the time the agent closed
    assert len(lines) == 1 and lines[0]["node"] == "n1" and lines[0]["kind"] == "recovery"
    assert {k: v for k, v in lines[0].items() if k not in ("v", "kind", "time", "node")} == wire()


async def test_a_client_of_the_old_version_is_refused(sockdir: str) -> None:
    assert CONTROL_VERSION == 3
    s = AgentSettings(name="n1", bind_host="127.0.0.1", port=0, insecure=True, control_socket=f"{sockdir}/n1.sock")
    async with Agent(s) as agent:
        reader, writer = await asyncio.open_unix_connection(agent.control_path)
        writer.write(encode_frame({"op": "hello", "version": 2}))
        head = await reader.readexactly(4)
        import msgpack
        frame = msgpack.unpackb(await reader.readexactly(int.from_bytes(head, "big")), raw=False)
        writer.close()
    assert frame["ok"] is False and frame["error"] == "unsupported_version"


# --- the trainer's log line -----------------------------------------------------------------------
class Link:
    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []

    def recovered(self, rec: dict[str, Any]) -> None:
        self.sent.append(rec)


@pytest.fixture
def clean_logger() -> Iterator[logging.Logger]:
    """The ``gossiprec`` logger with no handler, as in a process that configured no logging; call
    :func:`bare_root` in the test itself (pytest adds its capture handlers to the root for each phase)."""
    logger = logging.getLogger("gossiprec")
    saved = logger.handlers[:], logger.level, logger.propagate
    # a fresh process's logger, whatever an earlier test left (the CLI run in-process configures it)
    logger.handlers[:], logger.level, logger.propagate = [], logging.NOTSET, True
    try:
        yield logger
    finally:
        logger.handlers[:], logger.level, logger.propagate = saved[0], saved[1], saved[2]


@contextlib.contextmanager
def bare_root() -> Iterator[logging.Logger]:
    """No handler on the root nor on the ``gossiprec`` logger (pytest's capture handlers, added for the
    test's call phase, are put back after)."""
    root, mine = logging.getLogger(), logging.getLogger("gossiprec")
    saved = root.handlers[:], mine.handlers[:]
    root.handlers[:], mine.handlers[:] = [], []
    try:
        yield root
    finally:
        root.handlers[:] = saved[0]
        mine.handlers[:] = [h for h in saved[1] if h not in mine.handlers] + mine.handlers


def test_one_json_line_per_recovery_in_the_agents_format(clean_logger: logging.Logger) -> None:
    env = trainer_environment({}, control="/c.sock", node="n1", role="trainer", rank=1, cluster="c",
                              log=("json", "info"))
    settings = TrainerSettings.from_env(env)
    assert (settings.log_format, settings.log_level) == ("json", "info")
    out = io.StringIO()
    with bare_root():
        assert settings.configure_logging(out)
    link = Link()
    tell_recovery(link, record(), "ok")  # type: ignore[arg-type]  # (the link's one method used)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1 and link.sent == [wire()]
    doc = json.loads(lines[0])
    assert doc["level"] == "info" and doc["logger"] == "gossiprec.trainer.recovery"
    assert "rto 4.000 s" in doc["msg"] and "1 step(s) lost" in doc["msg"]
    assert doc["recovery"]["rto_s"] == 4.0 and doc["recovery"]["lost_steps"] == 1


def test_the_trainer_leaves_configured_logging_alone(clean_logger: logging.Logger) -> None:
    with bare_root() as root:
        assert not TrainerSettings().configure_logging()  # not under `gossiprec run`
        root.addHandler(logging.NullHandler())
        assert not TrainerSettings(log_format="text").configure_logging()  # the user configured the root
        root.handlers[:] = []
        clean_logger.addHandler(logging.NullHandler())
        assert not TrainerSettings(log_format="text").configure_logging()  # or the gossiprec logger
        assert len(clean_logger.handlers) == 1
        clean_logger.handlers[:] = []
        assert TrainerSettings(log_format="text").configure_logging()  # nobody did: it does
    with pytest.raises(Exception, match="GOSSIPREC_LOG_FORMAT"):
        read_launch_env({"GOSSIPREC_LOG_FORMAT": "xml"})


# --- a demo-shaped job: its agents' metrics against its timeline file ------------------------------
def _samples(text: str, name: str) -> dict[str, float]:
    """``{labels: value}`` of metric ``name`` in an exposition (labels as written, "" for none)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            head, val = line.rsplit(" ", 1)
            out[head[len(name):]] = float(val)
    return out


@pytest.mark.long  # (80 s on two loaded cores; the request, metrics and file are covered above in CI)
def test_a_demo_jobs_metrics_match_its_timeline(tmp_path: Path) -> None:
    from gossiprec.harness.faults import Fault
    from gossiprec.harness.scenario import Action, run_scenario

    def lines(path: Path) -> list[dict[str, Any]]:
        text = path.read_text() if path.exists() else ""
        return [json.loads(x) for x in text.splitlines() if x.strip()]

    scraped: dict[str, str] = {}

    def scrape(job: Any) -> None:
        for node, port in job.metrics_ports.items():
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
                    scraped[node] = r.read().decode()
            except OSError:
                pass  # the killed and the hung node's agents have left

    followers: list[subprocess.Popen[bytes]] = []

    def follow(job: Any) -> None:  # `gossiprec events --json` on n0 and on n2 (hung later), as an operator would
        for node in ("n0", "n2"):
            with open(tmp_path / f"events-{node}.jsonl", "wb") as out:
                followers.append(subprocess.Popen([sys.executable, "-m", "gossiprec", "events", "--json",
                                                   "--control-socket", str(job.path(node, ".sock"))], stdout=out))
        time.sleep(0.5)  # subscribed before the first fault (at step 60, about 2 s in)

    start = Action("events", lambda job: all(job.path(n, ".sock").exists() for n in ("n0", "n2")), follow)
    both = Action("scrape", lambda job: sum(x["kind"] == "recovery" for x in lines(job.timeline)) >= 8, scrape)
    try:
        res = run_scenario(4, 2, 260, [Fault("n3", "kill", 60), Fault("n2", "stop", 120)], hidden=64,
                           step_ms=20.0, workdir=str(tmp_path), timeout=150.0, metrics=True, actions=[start, both])
    finally:
        for f in followers:
            f.send_signal(signal.SIGINT)
            assert f.wait(10) in (0, 1)  # Ctrl-C: 0; the agent gone first (job over): 1
    assert res["bit_identical"] and "scrape" in res["actions"]
    # n0's stream saw the kill, then the hang, in order: each member left (the killed trainer's agent rang
    # its exit bell; the hung one's saw its trainer stopped), and the views removed them in that order
    records = lines(tmp_path / "events-n0.jsonl")
    removed = [(who, cause) for r in records if r["kind"] == "view" for who, cause in (r.get("causes") or {}).items()]
    assert removed[:2] == [("n3", "departed"), ("n2", "departed")], removed
    assert [r["time"] for r in records] == sorted(r["time"] for r in records)
    # the hung member's own agent said why it left (the cause the others see as "departed")
    leaving = [r for r in lines(tmp_path / "events-n2.jsonl") if r["kind"] == "leaving"]
    assert leaving and "stopped" in leaving[0]["reason"], leaving
    recs = [x for x in lines(Path(res["timeline"])) if x["kind"] == "recovery"]
    assert len(recs) == 8 and {x["epoch"] for x in recs} == {1, 2}  # four ranks, two recoveries
    assert {x["action"] for x in recs} == {"resume"}
    roles = [x["role"] for x in recs if x["node"] in ("n4", "n5")]  # the spares: each received its rank's state
    assert len(roles) == 3 and roles.count("receiver") == 2 and set(roles) <= {"receiver", "survivor", "donor"}
    for x in recs:
        assert x["rto_s"] == pytest.approx(sum(x["phases"].values()), abs=1e-3)
        assert 0 < x["rto_s"] < 30 and x["digest"] == "ok"
    assert set(scraped) >= {"n0", "n1", "n4", "n5"}
    for node, text in scraped.items():
        mine = [x for x in recs if x["node"] == node]
        assert _samples(text, "gossiprec_recoveries_total")['{action="resume"}'] == len(mine), node
        assert _samples(text, "gossiprec_recovery_lost_steps_total")[""] == sum(x["lost_steps"] for x in mine)
        assert _samples(text, "gossiprec_recovery_seconds_count")[""] == len(mine)
        assert _samples(text, "gossiprec_recovery_seconds_sum")[""] == pytest.approx(
            sum(x["rto_s"] for x in mine), abs=1e-3 * max(1, len(mine)))
        phases = _samples(text, "gossiprec_recovery_phase_seconds_sum")
        assert sum(phases.values()) == pytest.approx(sum(x["rto_s"] for x in mine), abs=2e-3 * max(1, len(mine)))
    steps = [x for x in lines(Path(res["timeline"])) if x["kind"] == "steps"]
    assert steps and all(x["step_s"] > 0 for x in steps)
