"""Real signature costs in the simulator (``gossiprec sim --real-crypto``, :mod:`gossiprec.sim.costs`):
a charged agent is busy, handles what reached it meanwhile later and in arrival order, and sends later;
a larger cost per signature makes the plan ready later; the cost keys are there and consistent; and the
verifications counted per recovery are the ones the agents' key books really make."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Any

import msgpack
import pytest

from gossiprec.core.auth import DigestCrypto
from gossiprec.core.codec import ROWS
from gossiprec.core.records import Send
from gossiprec.errors import ConfigError
from gossiprec.sim.agree import AgreeParams, run_agreement
from gossiprec.sim.cluster import INF, SimCluster
from gossiprec.sim.costs import MEASURE_BYTES, CryptoCosts, kind_of
from gossiprec.sim.metrics import quantiles
from gossiprec.sim.network import NetworkModel

N = 16
FAULT = 3.0


@dataclass
class Toy:
    """A machine that answers every packet and has one timer; ``log`` is what it handled, when."""

    name: str
    peer: str
    timer: float = INF
    log: list[tuple[float, str]] = field(default_factory=list)
    out: list[Send] = field(default_factory=list)

    def receive(self, data: bytes, now: float, reliable: bool = False) -> None:
        self.log.append((now, data.decode()))
        if data.startswith(b"ping"):
            self.out.append(Send(self.peer, b"pong" + data[4:]))

    def tick(self, now: float) -> None:
        if now >= self.timer:
            self.log.append((now, "tick"))
            self.timer = INF

    def next_deadline(self) -> float:
        return self.timer

    def take_sends(self) -> list[Send]:
        out, self.out = self.out, []
        return out

    def take_events(self) -> list[Any]:
        return []


def test_a_busy_node_handles_what_reached_it_later_in_arrival_order_and_sends_when_done() -> None:
    def make(idx: int, now: float, inc: int, rng: Any) -> Toy:
        if idx == 0:  # three pings at once to b
            return Toy("a", "b", out=[Send("b", f"ping{k}".encode()) for k in range(3)])
        return Toy("b", "a", timer=0.0125)  # falls due while b is busy with the first ping

    cluster: SimCluster[Any] = SimCluster(2, make, seed=1, names=["a", "b"],
                                          model=NetworkModel(latency=0.01, jitter=0.0, bandwidth_delay_per_kb=0.0))
    cost = {1: 0.005}  # b's every input costs it 5 ms; a's nothing
    cluster.charge = lambda idx, now: cost.get(idx, 0.0)
    cluster.run_until(1.0)
    a, b = (n.machine for n in cluster.nodes)
    got = [(round(t, 6), what) for t, what in b.log]
    # the pings arrive together at 10 ms; b is busy 5 ms with each; its timer fell due (12.5 ms) while it
    # was busy, after the pings had arrived: it runs after them
    assert got == [(0.01, "ping0"), (0.015, "ping1"), (0.02, "ping2"), (0.025, "tick")]
    # each pong leaves once b is done with its ping (5 ms later), then 10 ms on the wire
    assert [(round(t, 6), what) for t, what in a.log] == [(0.025, "pong0"), (0.03, "pong1"), (0.035, "pong2")]
    assert cluster.nodes[1].received_bytes == 3 * 5 and cluster.nodes[0].received_bytes == 3 * 5

    free: SimCluster[Any] = SimCluster(2, make, seed=1, names=["a", "b"],
                                       model=NetworkModel(latency=0.01, jitter=0.0, bandwidth_delay_per_kb=0.0))
    free.run_until(1.0)  # no charges: everything as it arrives
    assert [round(t, 6) for t, _ in free.nodes[1].machine.log] == [0.01, 0.01, 0.01, 0.0125]


def _run(costs: CryptoCosts, **over: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(scenario="crash", nodes=N, seed=2, duration=FAULT + 4.0, fault_at=FAULT,
                                  crypto_costs=costs)
    fields.update(over)
    return run_agreement(AgreeParams(**fields))


def test_a_larger_cost_per_signature_makes_the_plan_ready_later() -> None:
    # seed 1: at seed 2 the uncharged and real runs happen to detect the kill 0.1 s later than the slow one
    # since view requests carry no progress records (any change to what is sent moves the detection of a
    # given seed by up to 0.15 s either way), which leaves less than the margin below
    free = _run(CryptoCosts(0.0, 0.0), seed=1)
    real = _run(CryptoCosts(50e-6, 180e-6), seed=1)
    slow = _run(CryptoCosts(2e-3, 8e-3), seed=1)
    assert free["cpu_per_recovery_s"]["max"] == 0.0
    for r in (free, real, slow):
        assert r["invariant_violations"] == 0 and r["removed_all_expected"]
        assert r["plan_ready_s"]["agents"] == r["plan_ready_s"]["of"] == N - 1
    # 8 ms per verification: each agent's dozens of verifications on the way to the plan make it late
    assert slow["plan_ready_s"]["p50"] > free["plan_ready_s"]["p50"] + 0.2
    assert slow["plan_ready_s"]["p99"] > real["plan_ready_s"]["p99"] + 0.2
    assert slow["cpu_per_recovery_s"]["p50"] > 20 * real["cpu_per_recovery_s"]["p50"] > 0


def test_the_cost_keys_are_there_and_consistent() -> None:
    costs = CryptoCosts(50e-6, 180e-6)
    r = _run(costs)
    ready = r["plan_ready_s"]
    assert 0 < ready["p50"] <= ready["p99"] <= ready["max"] == r["plan_s"]["max"]  # the same recovery
    cpu = r["cpu_per_recovery_s"]
    assert 0 < cpu["p50"] <= cpu["max"] < 1.0
    per = r["per_agent"]
    v, s = per["verifies_per_recovery"], per["signs_per_recovery"]
    assert v["p50"] >= 2 * (N - 2)  # every other survivor's plan confirm and state claim, at least
    assert s["p50"] >= 3  # its own vote, state claim and plan confirm
    # the CPU per recovery is those operations at their cost (no per-byte cost here)
    assert cpu["mean"] == pytest.approx(v["mean"] * costs.verify_s + s["mean"] * costs.sign_s, rel=0.05)
    assert per["cpu_recovery_window_s"]["mean"] >= cpu["mean"]
    for key in ("sent_bytes_s", "received_bytes_s"):
        assert 0 < per[key]["idle"]["p50"] < per[key]["recovery"]["p50"] < 1e6  # a recovery is busier
    assert r["bytes_per_agent_s"] == per["sent_bytes_s"]["idle"]
    windows = r["cost_windows_s"]
    assert windows["idle"][1] == windows["recovery"][0] == FAULT
    assert windows["recovery"][1] == pytest.approx(FAULT + ready["max"], abs=1e-3)
    assert r["crypto_cost"] == {"sign_us": 50.0, "verify_us": 180.0, "per_kb_us": 0.0, "measured": False}


def test_the_verifications_counted_are_those_the_agents_key_books_make(monkeypatch: pytest.MonkeyPatch) -> None:
    # an independent count: every verification the digest stand-in really makes, by verifier and by the
    # message type msgpack decodes from what it covers
    made: dict[tuple[bytes, str], int] = {}
    names = {cls.TYPE: cls.__name__ for cls in ROWS}  # type: ignore[attr-defined]
    verify = DigestCrypto.verify

    def counting(self: DigestCrypto, key: bytes, data: bytes, sig: bytes) -> bool:
        kind = names[msgpack.unpackb(data)[0]]
        made[(self.public_key, kind)] = made.get((self.public_key, kind), 0) + 1
        return verify(self, key, data, sig)

    monkeypatch.setattr(DigestCrypto, "verify", counting)
    # the run ends 2 s after the kill, before the recovery's tail: its window is the kill to the end, and
    # the kinds below are verified only during a recovery
    r = _run(CryptoCosts(50e-6, 180e-6), duration=FAULT + 2.0)
    assert r["plan_ready_s"]["agents"] == N - 1 and r["cost_windows_s"]["recovery_and_tail"][1] == FAULT + 2.0
    survivors = [f"n{i:05d}" for i in range(N) if f"n{i:05d}" not in r["removed"]]
    by_kind = r["per_agent"]["verifies_by_kind"]
    for kind in ("StateClaim", "PlanConfirm", "Vote"):
        counts = [made.get((DigestCrypto.for_name(s).public_key, kind), 0) for s in survivors]
        q = quantiles(counts)
        assert by_kind[kind]["recovery"] == {"p50": q["p50"], "max": q["max"],
                                             "mean": round(sum(counts) / len(counts), 1)}, kind
        assert by_kind[kind]["idle_per_s"]["max"] == 0
    # and what they are: every other survivor's plan confirm once; every other holder's state claim once
    assert by_kind["PlanConfirm"]["recovery"]["p50"] == by_kind["PlanConfirm"]["recovery"]["max"] == N - 2
    holders = N - 2 - 1  # trainers (the first N - 2) less the killed one: seed 2 kills a trainer
    assert len(r["removed"]) == 1 and int(r["removed"][0][1:]) < N - 2
    assert holders - 1 <= by_kind["StateClaim"]["recovery"]["p50"] <= by_kind["StateClaim"]["recovery"]["max"] \
        <= holders


def test_kind_of_reads_the_type_a_signature_covers() -> None:
    from gossiprec.core.auth import signed_bytes
    from gossiprec.core.wire import PlanConfirm, Vote

    assert kind_of(signed_bytes(Vote(3, "cfg", b"d" * 16, "n1"))) == Vote.TYPE
    confirm = PlanConfirm(3, "cfg", "n1", b"d" * 16)
    assert kind_of(signed_bytes(confirm)) == PlanConfirm.TYPE
    assert kind_of(msgpack.packb(["gossiprec.candidate/1", "n1"])) == -1
    assert kind_of(b"") == -1
    assert MEASURE_BYTES < 1024


def test_cost_options_are_checked() -> None:
    assert CryptoCosts.parse("50,180") == CryptoCosts(50e-6, 180e-6)
    assert CryptoCosts.parse("50,180,2").per_byte_s == pytest.approx(2e-6 / 1024)
    for bad in ("50", "a,b", "-1,2", "1,2,3,4"):
        with pytest.raises(ConfigError):
            CryptoCosts.parse(bad)
    with pytest.raises(ConfigError):
        AgreeParams(crypto_costs=CryptoCosts(0, 0), signing="ed25519").validate()


def test_cli_real_crypto_prints_the_keys() -> None:
    out = subprocess.run([sys.executable, "-m", "gossiprec", "sim", "--real-crypto", "--crypto-cost-us", "50,180",
                          "--nodes", "8", "--duration", "6", "--json", "--quiet"],
                         capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert r["scenario"] == "crash" and r["nodes"] == 8
    for key in ("plan_ready_s", "cpu_per_recovery_s", "bytes_per_agent_s", "per_agent", "crypto_cost"):
        assert key in r, key
    assert set(r["plan_ready_s"]) >= {"p50", "p99"} and set(r["cpu_per_recovery_s"]) >= {"p50", "max"}
