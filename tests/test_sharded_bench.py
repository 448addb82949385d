"""``gossiprec bench sharded``: the per-layout summary from trial results (no processes), and its CLI."""

from __future__ import annotations

from typing import Any

from gossiprec.bench.sharded import summarize


def _trial(rto: float, donor: str, states: dict[int, str]) -> dict[str, Any]:
    fault = {"rto_s": rto, "phases_s": {"agreed": rto / 4, "first_step_done": rto}, "transfer_bytes": 6800,
             "donors": {3: [donor]}, "roles": {0: "survivor", 1: "donor", 2: "survivor", 3: "receiver"},
             "assignment": {0: "n0", 1: "n1", 2: "n2", 3: "n4"}, "lost_steps": 0}
    return {"faults": [fault], "replica_groups": [[0, 2], [1, 3]], "states": states,
            "state_bytes": {r: 6800 for r in range(4)}, "kept_bytes": {r: 13600 for r in range(4)}}


def test_summary_of_a_layout() -> None:
    ref = {0: "a", 1: "b", 2: "a", 3: "b"}
    out = summarize("tp", [_trial(0.8, "n1", ref), _trial(1.2, "n1", ref)], ref)
    assert out["rto_s"] == {"median": 1.0, "min": 0.8, "max": 1.2}
    assert out["phases_s"]["agreed"]["median"] == 0.25
    assert out["bytes_per_donor"] == 6800 and out["kept_ratio"] == 2.0
    assert out["donor_is_replica_peer"] and out["bit_identical"] and out["lost_steps"] == 0
    # a donor that is not the lost rank's replica peer (rank 1's node), or a state that differs, is reported
    bad = summarize("tp", [_trial(0.8, "n0", {**ref, 3: "c"})], ref)
    assert not bad["donor_is_replica_peer"] and not bad["bit_identical"]


def test_bench_sharded_is_a_bench_command() -> None:
    import argparse

    from gossiprec.bench import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["bench", "sharded", "--layout", "hsdp", "--trials", "1", "--phase", "optimizer"])
    assert (args.layout, args.trials, args.phase, args.kill_at) == ("hsdp", 1, "optimizer", 4)
