"""The classic round waits while the fast round still moves (:meth:`gossiprec.core.decide.Decider.fallback`).

At N = 1,024 with real signature costs, the signed votes took longer than ``fallback_timeout`` to reach
every member and be checked, and some 40 members each started a classic round that the fast path made
moot (every member signing a promise to each). Here the same happens at N = 64 with the timeout cut to
0.1 s (views above ``direct_votes_max`` members gossip their votes): before the fix agents signed
promises; now none does, and the fast path still decides the one view. That a classic round still starts
when the fast round cannot decide is the consensus and agreement tests' business (split votes, partitions)."""

from __future__ import annotations

import functools

import pytest

import gossiprec.sim.agree as agree
from gossiprec.core.config import AgreementConfig
from gossiprec.sim.costs import CryptoCosts


def test_no_classic_round_while_the_fast_votes_still_arrive(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(agree, "AgreementConfig",
                        functools.partial(AgreementConfig, fallback_timeout=0.1, fallback_jitter=0.05))
    r = agree.run_agreement(agree.AgreeParams(nodes=64, duration=6.0, crypto_costs=CryptoCosts(50e-6, 180e-6)))
    assert r["invariant_violations"] == 0
    assert r["views_decided"] == 1 and r["fast_path_ratio"] == 1.0
    assert r["removed"] == r["expected_removed"]
    assert r["plan_ready_everywhere"]
    signs = r["per_agent"]["signs_by_kind"]
    assert "Vote" in signs  # the figures are there: a missing kind means none was made
    assert "Promise" not in signs and "Prepare" not in signs, signs
