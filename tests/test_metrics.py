"""Prometheus metrics: the event accounting (detection and agreement times from event stamps), and the
endpoint scraped over loopback HTTP: refused packets by reason and live members of real agents, and a
view change of agents on an in-memory network in virtual time."""

from __future__ import annotations

import argparse
import asyncio
import shutil
import socket
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

from gossiprec.bench.agents import job_spec
from gossiprec.harness.ports import free_ports
from gossiprec.core.events import AlertRaised, Fenced, MemberAlive, MemberFailed, ProbeResult, ViewInstalled
from gossiprec.errors import ConfigError
from gossiprec.agent.pump import Agent
from gossiprec.agent.metrics import AgentMetrics, require_prometheus
from gossiprec.agent.settings import AgentSettings, add_agent_arguments, settings_from_args, split_host_port
from tests.support.memnet import MemNetwork
from tests.support.vtime import virtual_time

pytest.importorskip("prometheus_client")


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="grm", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _view(epoch: int, members: tuple[str, ...], removed: tuple[str, ...], at: float) -> ViewInstalled:
    return ViewInstalled(epoch, f"c{epoch}", members, removed, (), True, True, at)


# --- accounting -----------------------------------------------------------------------------------
def test_detection_and_agreement_are_timed_from_first_evidence() -> None:
    m = AgentMetrics()
    v = m.registry.get_sample_value
    m.observe(ProbeResult("b", False, 10.0))   # first failure: detection starts here
    m.observe(ProbeResult("b", False, 10.2))
    m.observe(AlertRaised("b", "unreachable", 10.9))
    m.observe(_view(1, ("a", "c"), ("b",), 11.4))
    assert v("gossiprec_detection_seconds_count", {"reason": "unreachable"}) == 1
    assert v("gossiprec_detection_seconds_sum", {"reason": "unreachable"}) == pytest.approx(0.9)
    assert v("gossiprec_agreement_seconds_sum") == pytest.approx(0.5)  # from the alert at 10.9
    assert v("gossiprec_alerts_raised_total", {"reason": "unreachable"}) == 1
    assert v("gossiprec_views_installed_total", {"fast": "true"}) == 1


def test_a_good_probe_restarts_detection_and_refutation_cancels_agreement() -> None:
    m = AgentMetrics()
    v = m.registry.get_sample_value
    m.observe(ProbeResult("b", False, 1.0))
    m.observe(ProbeResult("b", True, 1.1))     # recovered: 1.0 no longer counts
    m.observe(ProbeResult("b", False, 5.0))
    m.observe(AlertRaised("b", "unreachable", 5.5))
    assert v("gossiprec_detection_seconds_sum", {"reason": "unreachable"}) == pytest.approx(0.5)
    m.observe(MemberFailed("c", 1, "x", 6.0))
    m.observe(MemberAlive("c", 2, 6.5))        # refuted: c's evidence is dropped
    m.observe(_view(1, ("a", "c"), ("b",), 7.0))
    assert v("gossiprec_agreement_seconds_sum") == pytest.approx(1.5)  # from b's alert, not c
    m.observe(_view(2, ("a",), ("c",), 8.0))   # no evidence of our own about c: not observed
    assert v("gossiprec_agreement_seconds_count") == 1
    m.observe(AlertRaised("h", "hung", 9.0))   # no probe evidence: counted, not timed
    assert v("gossiprec_alerts_raised_total", {"reason": "hung"}) == 1
    assert v("gossiprec_detection_seconds_count", {"reason": "hung"}) is None
    m.observe(Fenced(2, "no quorum", 9.5))
    assert v("gossiprec_fences_total") == 1


def test_missing_prometheus_client_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import now raises ImportError
    with pytest.raises(ConfigError, match="prometheus-client is not installed"):
        require_prometheus()
    with pytest.raises(ConfigError, match="metrics port"):
        AgentMetrics()


async def test_agent_with_metrics_port_but_no_client_refuses_to_start(sockdir: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    a = Agent(AgentSettings(name="m", bind_host="127.0.0.1", port=0, insecure=True, metrics_port=0,
                            control_socket=f"{sockdir}/m.sock"))
    with pytest.raises(ConfigError, match="prometheus-client"):
        await a.start()
    assert not Path(f"{sockdir}/m.sock").exists()  # everything it opened is closed again


# --- the endpoint ---------------------------------------------------------------------------------
def _get(url: str, method: str = "GET") -> tuple[int, str, str]:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers.get("Content-Type", ""), r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, "", exc.read().decode()


def _sample(text: str, name: str) -> float:
    for line in text.splitlines():
        if line.startswith(name + " ") or line == name:
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} not in the scrape:\n{text}")


async def _aget(port: int, path: str = "/metrics") -> tuple[int, str]:
    """GET over loopback from this event loop (no thread: the virtual clock must not run ahead of it)."""
    async with asyncio.timeout(5):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(f"GET {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
            data = await reader.read()  # the server closes after one response
        finally:
            writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body.decode()


async def _start_job(sockdir: str, n: int, ports: list[int], net: MemNetwork | None = None) -> list[Agent]:
    """``n`` agents of one job spec with metrics endpoints, once each has heard from every other: view-0
    members count as live from the job spec, but a crash is judged only by members that heard from the
    crashed one (the startup grace), so crashing one before anyone heard it would be seen only when the
    grace ends."""
    names = [f"m{i}" for i in range(n)]
    job = Path(sockdir) / "job.toml"
    job.write_text(job_spec(list(zip(names, ports)), 0))
    agents: list[Agent] = []
    try:
        for name, port in zip(names, ports):
            s = AgentSettings(name=name, bind_host="127.0.0.1", port=port, insecure=True, metrics_port=0,
                              control_socket=f"{sockdir}/{name}.sock", job=str(job),
                              seeds=(f"127.0.0.1:{ports[0]}",))
            a = Agent(s) if net is None else net.agent(s)
            await a.start()
            agents.append(a)
        for a in agents:
            await a.wait_until(lambda a=a: a.live_count() == n, 10)
            assert a.machine is not None
            await a.wait_until(lambda a=a: all(a.machine.has_heard(x) for x in names), 10)
            assert a.control_status()["unheard"] == 0
    except BaseException:
        await _stop(agents)
        raise
    return agents


async def _stop(agents: list[Agent]) -> None:
    for a in reversed(agents):
        a.abort()
    for a in reversed(agents):
        await a.aclose()


async def test_endpoint_serves_state_and_rejections(sockdir: str) -> None:
    agents = await _start_job(sockdir, 3, free_ports(3))
    try:
        a0 = agents[0]
        a0.metrics.cache_s = 0.0  # each scrape below must see the counters of that moment
        url = f"http://127.0.0.1:{a0.metrics.port}/metrics"

        status, ctype, text = await asyncio.to_thread(_get, url)
        assert status == 200 and ctype.startswith("text/plain")
        assert _sample(text, "gossiprec_live_members") == 3
        assert _sample(text, "gossiprec_epoch") == 0
        assert _sample(text, "gossiprec_health_score") == 0
        assert _sample(text, "gossiprec_fenced") == 0
        assert _sample(text, 'gossiprec_packets_rejected_total{reason="truncated"}') == 0
        assert "# TYPE gossiprec_detection_seconds histogram" in text
        assert "# TYPE gossiprec_agreement_seconds histogram" in text

        # a short datagram is refused and counted by reason
        assert a0.transport is not None
        before = a0.transport.rejects.total
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.sendto(b"\x01\x02", ("127.0.0.1", split_host_port(a0.addr, 0)[1]))
        await a0.wait_until(lambda: a0.transport.rejects.total > before, 5)
        _, _, text = await asyncio.to_thread(_get, url)
        refused = {line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
                   for line in text.splitlines() if line.startswith("gossiprec_packets_rejected_total{")}
        assert sum(refused.values()) == before + 1, refused

        assert (await asyncio.to_thread(_get, url.replace("/metrics", "/nope")))[0] == 404
        status, _, body = await asyncio.to_thread(_get, url, "HEAD")
        assert status == 200 and body == ""
        port = a0.metrics.port
    finally:
        await _stop(agents)
    with pytest.raises(OSError):  # the endpoint closed with the agent
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


@virtual_time
async def test_endpoint_follows_a_view_change(sockdir: str) -> None:
    agents = await _start_job(sockdir, 3, [7001, 7002, 7003], MemNetwork())
    try:
        a0 = agents[0]
        # a crash: the survivors install view 1 and the endpoint says so
        sub = a0.subscribe()
        agents[2].abort()
        await a0.wait_for_event(lambda ev: isinstance(ev, ViewInstalled) and ev.epoch == 1, 15, sub)
        status, text = await _aget(a0.metrics.port)
        assert status == 200
        assert _sample(text, "gossiprec_epoch") == 1
        assert _sample(text, "gossiprec_view_members") == 2
        views = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("gossiprec_views_installed_total{"))
        assert views == 1
        if _sample(text, 'gossiprec_alerts_raised_total{reason="unreachable"}') >= 1:  # a0 observed m2
            assert _sample(text, 'gossiprec_detection_seconds_count{reason="unreachable"}') >= 1
            assert _sample(text, "gossiprec_agreement_seconds_count") == 1
    finally:
        await _stop(agents)


async def test_endpoint_listens_on_the_agent_address_unless_told_and_caches_the_exposition(sockdir: str) -> None:
    assert AgentSettings(bind_host="0.0.0.0", insecure=True).metrics_host() == "127.0.0.1"
    assert AgentSettings(bind_host="0.0.0.0", insecure=True).metrics_host("10.1.2.3:7980") == "10.1.2.3"
    assert AgentSettings(bind_host="10.9.9.9", insecure=True).metrics_host("10.1.2.3:7980") == "10.9.9.9"
    assert AgentSettings(insecure=True, metrics_bind="0.0.0.0").metrics_host("10.1.2.3:7980") == "0.0.0.0"
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    flagged = settings_from_args(parser.parse_args(["--insecure", "--metrics-bind", "127.0.0.2"]), {})
    assert flagged.metrics_bind == "127.0.0.2"
    assert settings_from_args(parser.parse_args(["--insecure"]),
                              {"GOSSIPREC_METRICS_BIND": "::1"}).metrics_bind == "::1"
    # the agent binds every interface, advertises loopback: the endpoint is on loopback only
    s = AgentSettings(name="m", bind_host="0.0.0.0", advertise="127.0.0.1", port=0, insecure=True,
                      metrics_port=0, control_socket=f"{sockdir}/m.sock")
    async with Agent(s) as a:
        assert a.metrics._server.sockets[0].getsockname()[0] == "127.0.0.1"
        first = await _aget(a.metrics.port)
        second = await _aget(a.metrics.port)
        assert first[0] == second[0] == 200 and first[1] == second[1]
        assert a.metrics.counters.get("cached", 0) >= 1  # a storm of scrapes renders once a second


async def test_slow_requests_do_not_blind_the_scraper(sockdir: str) -> None:
    s = AgentSettings(name="m", bind_host="127.0.0.1", port=0, insecure=True, metrics_port=0,
                      control_socket=f"{sockdir}/m.sock")
    async with Agent(s) as a:
        slow = []
        for _ in range(16):  # every slot: a request that never finishes its headers
            reader, writer = await asyncio.open_connection("127.0.0.1", a.metrics.port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            slow.append((reader, writer))
        async with asyncio.timeout(5):
            while len(a.metrics._conns) < 16:
                await asyncio.sleep(0.01)
        status, text = await _aget(a.metrics.port)
        assert status == 200 and "gossiprec_live_members" in text
        assert a.metrics.counters["evicted"] >= 1 and a.metrics.counters.get("refused", 0) == 0
        for _, w in slow:
            w.close()
