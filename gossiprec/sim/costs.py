"""Real signature costs in the simulator (``gossiprec sim --real-crypto``).

What it decides: what each simulated agent's signatures cost it, and the figures of one recovery. The
agents sign and verify with the keyed-digest stand-in (:class:`~gossiprec.core.auth.DigestCrypto`: the
same code paths, deterministic, cheap), and every sign and every verify is charged, on the agent's own
virtual clock, the CPU that Ed25519 (:mod:`gossiprec.security.signing`) takes on this machine for it:
measured at startup (:meth:`CryptoCosts.measure`) or given (``--crypto-cost-us``). Charging rather than
signing for real keeps a 4,800-member run within minutes (each member verifies thousands of signatures
per recovery: tens of millions in all) and keeps it deterministic for given costs.

How a charge delays an agent: the simulator (:class:`~gossiprec.sim.cluster.SimCluster`, ``charge``)
asks after each input an agent handled (a packet, a timer) what its crypto cost; the agent is then busy
until that much later: what it sent and the events it emitted leave then, and whatever reaches it
meanwhile (packets, its own timers) waits and is handled in arrival order once it is free, each charged
again. So a member that verifies a burst of votes is late with everything after them, as a real agent's
one event loop would be. Only signatures are charged (the rest of an agent's CPU is not modelled).

Figures (:meth:`CostMeter.figures`): per agent, the CPU charged, the signatures made and verified (by
message kind) and the payload bytes sent and received, in four phases: idle (from ``IDLE_FROM`` to the
kill), the recovery (the kill to the plan ready on every survivor), its tail (``TAIL_S`` after that: the
confirmations and relays the recovery still causes) and after.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

from gossiprec.core.auth import Crypto
from gossiprec.core.codec import ROWS
from gossiprec.sim.metrics import quantiles

SIGN, VERIFY = 0, 1
IDLE_FROM = 1.0
"""Virtual second from which an agent is idle (start-up's first rounds are not idle traffic)."""
TAIL_S = 1.0
"""Seconds after the plan is ready everywhere still counted to the recovery (confirmations, relays)."""
WARMUP, IDLE, RECOVERY, TAIL, AFTER = range(5)
KIND_NAMES: dict[int, str] = {cls.TYPE: cls.__name__ for cls in ROWS}  # type: ignore[attr-defined]
KIND_NAMES[-1] = "Candidate"  # a bootstrap candidate's own row (tagged, not a wire message)
MEASURE_BYTES = 200
"""Size of the message the startup measurement signs (a vote, a claim, an alert are 100-300 bytes)."""
MEASURE_BIG = 16384
"""... and of the one that gives the cost per byte (a catch-up view of many members)."""


@dataclass(frozen=True, slots=True)
class CryptoCosts:
    """CPU seconds of one Ed25519 operation: ``sign_s`` / ``verify_s`` for a ``MEASURE_BYTES`` message,
    plus ``per_byte_s`` for each byte beyond (the message is hashed)."""

    sign_s: float
    verify_s: float
    per_byte_s: float = 0.0
    measured: bool = False

    @classmethod
    def measure(cls, rounds: int = 7, ops: int = 100) -> "CryptoCosts":
        """Ed25519 on this machine, as the agents sign (thread CPU time, so other processes' load does not
        count; the median of ``rounds`` rounds of ``ops`` operations each)."""
        from gossiprec.security.signing import Ed25519Crypto

        me, other = Ed25519Crypto.generate(), Ed25519Crypto.generate()

        def per_op(fn: Any, *args: Any) -> float:
            samples = []
            for _ in range(rounds):
                t0 = time.thread_time()
                for _ in range(ops):
                    fn(*args)
                samples.append((time.thread_time() - t0) / ops)
            return statistics.median(samples)

        small, big = b"\x01" * MEASURE_BYTES, b"\x01" * MEASURE_BIG
        sign_s = per_op(other.sign, small)
        verify_s = per_op(me.verify, other.public_key, small, other.sign(small))
        verify_big = per_op(me.verify, other.public_key, big, other.sign(big))
        per_byte = max(0.0, (verify_big - verify_s) / (MEASURE_BIG - MEASURE_BYTES))
        return cls(sign_s, verify_s, per_byte, measured=True)

    @classmethod
    def parse(cls, text: str) -> "CryptoCosts":
        """``SIGN_US,VERIFY_US[,PER_KB_US]`` (microseconds; ``--crypto-cost-us``)."""
        from gossiprec.errors import ConfigError

        try:
            parts = [float(x) for x in text.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or any(p < 0 for p in parts):
            raise ConfigError(f"--crypto-cost-us takes SIGN_US,VERIFY_US[,PER_KB_US] (non-negative "
                              f"microseconds), got {text!r}")
        per_kb = parts[2] if len(parts) == 3 else 0.0
        return cls(parts[0] / 1e6, parts[1] / 1e6, per_kb / 1e6 / 1024)

    def as_dict(self) -> dict[str, Any]:
        return {"sign_us": round(self.sign_s * 1e6, 1), "verify_us": round(self.verify_s * 1e6, 1),
                "per_kb_us": round(self.per_byte_s * 1024 * 1e6, 2), "measured": self.measured}


def kind_of(data: bytes) -> int:
    """The message type a signature covers (:func:`~gossiprec.core.auth.signed_bytes`: a msgpack array
    whose first item is the type id); -1 for anything else (a bootstrap candidate's tagged row)."""
    if not data:
        return -1
    b = data[0]
    off = 1 if 0x90 <= b <= 0x9F else 3 if b == 0xDC else 5 if b == 0xDD else 0
    if off and len(data) > off and data[off] < 0x80:
        return data[off]
    return -1


class AgentMeter:
    """One agent's charged CPU and operations (cumulative; ``pending_s`` until the simulator drains it)."""

    __slots__ = ("costs", "pending_s", "cpu_s", "ops", "cpu_by")

    def __init__(self, costs: CryptoCosts) -> None:
        self.costs = costs
        self.pending_s = 0.0
        self.cpu_s = 0.0
        self.ops: dict[tuple[int, int], int] = {}
        """(SIGN or VERIFY, message type id) -> operations."""
        self.cpu_by: dict[tuple[int, int], float] = {}
        """The same keys -> CPU seconds charged for them."""

    def op(self, what: int, data: bytes) -> None:
        c = self.costs
        extra = len(data) - MEASURE_BYTES
        cost = (c.sign_s if what == SIGN else c.verify_s) + (c.per_byte_s * extra if extra > 0 else 0.0)
        self.pending_s += cost
        key = (what, kind_of(data))
        ops = self.ops
        ops[key] = ops.get(key, 0) + 1
        self.cpu_by[key] = self.cpu_by.get(key, 0.0) + cost


@dataclass(slots=True)
class MeteredCrypto:
    """An agent's crypto whose every operation is charged to its :class:`AgentMeter`."""

    inner: Crypto
    meter: AgentMeter
    public_key: bytes = b""

    def __post_init__(self) -> None:
        self.public_key = self.inner.public_key

    def sign(self, data: bytes) -> bytes:
        self.meter.op(SIGN, data)
        return self.inner.sign(data)

    def verify(self, key: bytes, data: bytes, sig: bytes) -> bool:
        self.meter.op(VERIFY, data)
        return self.inner.verify(key, data, sig)


@dataclass(slots=True)
class Snapshot:
    """Every agent's cumulative figures at one moment."""

    at: float
    cpu_s: list[float]
    ops: list[dict[tuple[int, int], int]]
    cpu_by: list[dict[tuple[int, int], float]]
    sent: list[int]
    received: list[int]


@dataclass(slots=True)
class CostMeter:
    """Every agent's meter, and the phase boundaries of one recovery."""

    costs: CryptoCosts
    n: int
    agents: list[AgentMeter] = field(default_factory=list)
    snapshots: list[Snapshot] = field(default_factory=list)
    """One per phase entered: IDLE, RECOVERY, TAIL, AFTER."""
    end: Snapshot | None = None
    """At the end of the run."""

    def __post_init__(self) -> None:
        self.agents = [AgentMeter(self.costs) for _ in range(self.n)]

    def wrap(self, idx: int, crypto: Crypto) -> MeteredCrypto:
        return MeteredCrypto(crypto, self.agents[idx])

    def charge(self, idx: int, now: float) -> float:
        """CPU seconds agent ``idx`` spent on crypto since the last call (the simulator's ``charge``)."""
        a = self.agents[idx]
        c = a.pending_s
        if c:
            a.pending_s = 0.0
            a.cpu_s += c
        return c

    @property
    def phase(self) -> int:
        return len(self.snapshots)

    def snapshot(self, now: float, nodes: Sequence[Any], end: bool = False) -> None:
        """Enter the next phase at ``now`` (or note the run's ``end``); ``nodes``: the simulator's, for
        their byte counters."""
        agents = self.agents
        snap = Snapshot(now, [a.cpu_s + a.pending_s for a in agents], [dict(a.ops) for a in agents],
                        [dict(a.cpu_by) for a in agents], [n.sent_bytes for n in nodes],
                        [n.received_bytes for n in nodes])
        if end:
            self.end = snap
        else:
            self.snapshots.append(snap)

    # ------------------------------------------------------------------ figures
    def figures(self, survivors: Sequence[int], t_fault: float, plan_at: dict[int, float]) -> dict[str, Any]:
        """The ``--real-crypto`` keys (see ``docs/commands.md``). ``plan_at``: survivor -> when its plan
        of the view without the killed members was ready.

        Per recovery (CPU, signatures, verifications, by kind too) is what an agent did from the kill to
        ``TAIL_S`` after the plan was ready everywhere, less what it does idle in as long (its rate from
        ``IDLE_FROM`` to the kill), kind by kind and never below 0 (idle work a recovery displaces, fewer
        progress records checked, say, is not taken off the rest: the CPU is the operations counted at
        their cost); bytes per second are over the idle window and over the
        recovery proper (the kill to the plan ready everywhere)."""
        snaps = self.snapshots
        out: dict[str, Any] = {"crypto_cost": self.costs.as_dict()}
        ready = [plan_at[i] - t_fault for i in survivors if i in plan_at]
        out["plan_ready_s"] = {**quantiles(ready), "agents": len(ready), "of": len(survivors)}
        if len(snaps) < 2 or not survivors or self.end is None:
            return out  # the run ended before the kill
        # the run may end before the plan is ready everywhere: the recovery is then measured to the end
        # (what the agents did so far: a lower bound), and said so
        out["plan_ready_everywhere"] = len(snaps) > 2
        idle0, rec0 = snaps[0], snaps[1]
        rec1 = snaps[2] if len(snaps) > 2 else self.end
        tail1 = snaps[3] if len(snaps) > 3 else self.end
        idle_len, rec_len, win_len = rec0.at - idle0.at, rec1.at - rec0.at, tail1.at - rec0.at
        idle_frac = win_len / idle_len if idle_len > 0 else 0.0
        per: dict[str, list[float]] = {}
        kinds: dict[tuple[int, int], dict[str, list[float]]] = {}
        keys = sorted({key for i in survivors for key in tail1.ops[i]})

        def add(name: str, value: float) -> None:
            per.setdefault(name, []).append(value)

        for i in survivors:
            window_cpu = tail1.cpu_s[i] - rec0.cpu_s[i]
            idle_cpu = rec0.cpu_s[i] - idle0.cpu_s[i]
            add("cpu_window", window_cpu)
            add("cpu_idle_rate", idle_cpu / idle_len if idle_len > 0 else 0.0)
            totals = [0.0, 0.0, 0.0, 0.0]  # signs, verifies per recovery; per idle second
            w0, w1, i0 = rec0.ops[i], tail1.ops[i], idle0.ops[i]
            c0, c1, ci = rec0.cpu_by[i], tail1.cpu_by[i], idle0.cpu_by[i]
            add("cpu_recovery", sum(max(0.0, c1.get(key, 0.0) - c0.get(key, 0.0)
                                        - (c0.get(key, 0.0) - ci.get(key, 0.0)) * idle_frac) for key in keys))
            for key in keys:
                window = w1.get(key, 0) - w0.get(key, 0)
                idle = w0.get(key, 0) - i0.get(key, 0)
                excess = max(0.0, window - idle * idle_frac)
                rate = idle / idle_len if idle_len > 0 else 0.0
                totals[key[0]] += excess
                totals[2 + key[0]] += rate
                k = kinds.setdefault(key, {"recovery": [], "idle_per_s": []})
                k["recovery"].append(excess)
                k["idle_per_s"].append(rate)
            add("signs", totals[SIGN])
            add("verifies", totals[VERIFY])
            add("signs_idle", totals[2 + SIGN])
            add("verifies_idle", totals[2 + VERIFY])
            if idle_len > 0:
                add("sent_idle", (rec0.sent[i] - idle0.sent[i]) / idle_len)
                add("received_idle", (rec0.received[i] - idle0.received[i]) / idle_len)
            if rec_len > 0:
                add("sent_recovery", (rec1.sent[i] - rec0.sent[i]) / rec_len)
                add("received_recovery", (rec1.received[i] - rec0.received[i]) / rec_len)

        def q(name: str | list[float], digits: int = 4) -> dict[str, float | None]:
            values = per.get(name, []) if isinstance(name, str) else name
            s = quantiles(values)
            mean = sum(values) / len(values) if values else None
            return {k: round(v, digits) if v is not None else None
                    for k, v in (("p50", s["p50"]), ("max", s["max"]), ("mean", mean))}

        def by_kind(what: int) -> dict[str, Any]:
            rows = [(KIND_NAMES.get(key[1], str(key[1])), k) for key, k in kinds.items() if key[0] == what]
            rows.sort(key=lambda r: -sum(r[1]["recovery"]))
            return {name: {"recovery": q(k["recovery"], 1), "idle_per_s": q(k["idle_per_s"], 2)}
                    for name, k in rows if any(k["recovery"]) or any(k["idle_per_s"])}

        out["cpu_per_recovery_s"] = q("cpu_recovery")
        out["bytes_per_agent_s"] = q("sent_idle", 1)
        out["per_agent"] = {
            "verifies_per_recovery": q("verifies", 1),
            "signs_per_recovery": q("signs", 1),
            "cpu_per_recovery_s": q("cpu_recovery"),
            "cpu_recovery_window_s": q("cpu_window"),
            "cpu_idle_s_per_s": q("cpu_idle_rate", 6),
            "verifies_idle_per_s": q("verifies_idle", 2),
            "signs_idle_per_s": q("signs_idle", 2),
            "sent_bytes_s": {"idle": q("sent_idle", 1), "recovery": q("sent_recovery", 1)},
            "received_bytes_s": {"idle": q("received_idle", 1), "recovery": q("received_recovery", 1)},
            "verifies_by_kind": by_kind(VERIFY),  # most verified first
            "signs_by_kind": by_kind(SIGN),
        }
        out["cost_windows_s"] = {"idle": [round(idle0.at, 4), round(rec0.at, 4)],
                                 "recovery": [round(rec0.at, 4), round(rec1.at, 4)],
                                 "recovery_and_tail": [round(rec0.at, 4), round(tail1.at, 4)]}
        return out
