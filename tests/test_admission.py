"""Admission at accept: the waste budget and the per-source backoff (the live attack is in
``test_hostile.py``)."""

from __future__ import annotations

from gossiprec.agent.admission import BACKOFF_MAX, PAUSE_QUANTUM, SourceBackoff
from gossiprec.security.refusals import TokenBucket


def test_waste_budget_pauses_once_spent_and_refills_at_its_rate() -> None:
    b = TokenBucket(rate=100.0, burst=5)
    for _ in range(5):
        assert b.pause(0.0, PAUSE_QUANTUM) == 0.0
        b.spend(0.0)
    pause = b.pause(0.0, PAUSE_QUANTUM)
    assert 0.0 < pause <= 0.02 + 1e-9  # waits for a quantum (2 tokens at 100/s), not a whole burst
    assert b.pause(pause, PAUSE_QUANTUM) == 0.0
    b.spend(10.0)
    assert b.tokens == 4.0  # refilled to the burst, never above it, then one spent


def test_backoff_doubles_per_strike_caps_and_is_forgiven() -> None:
    bo = SourceBackoff()
    assert not bo.refuses("a", 0.0)
    bo.strike("a", 0.0)
    assert bo.refuses("a", 0.009) and not bo.refuses("a", 0.011)
    bo.strike("a", 1.0)
    assert bo.refuses("a", 1.019) and not bo.refuses("a", 1.021)
    for _ in range(20):
        bo.strike("a", 2.0)
    assert bo.refuses("a", 2.0 + BACKOFF_MAX - 0.001) and not bo.refuses("a", 2.0 + BACKOFF_MAX + 0.001)
    assert not bo.refuses("b", 2.0)  # one source's strikes are its own
    bo.forgive("a")
    assert not bo.refuses("a", 2.0) and len(bo) == 0
