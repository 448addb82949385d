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


def test_the_overhead_is_the_ratio_of_the_median_steps_per_round_and_pooled() -> None:
    from gossiprec.bench.sharded_overhead import compare

    def job(step_s: float, jitter: float = 0.0) -> list[list[tuple[int, float]]]:
        # four ranks; the job's commit of a step is its last rank's
        return [[(s, s * step_s + r * jitter) for s in range(1, 13)] for r in range(4)]

    out = compare([job(0.100), job(0.100)], [job(0.101), job(0.103)])
    assert out["plain_step_s"]["median"] == 0.1 and out["plain_step_s"]["n"] == 20  # from step 3 on, 2 rounds
    assert out["per_round_pct"] == [1.0, 3.0]
    assert out["overhead_pct"] == 2.0  # pooled: the median of ten 0.101 s and ten 0.103 s steps is 0.102 s
    assert out["overhead_ms"] == 2.0 and out["within_0.5pct"] is False
    assert compare([job(0.1)], [job(0.1004)])["within_0.5pct"] is True
    assert compare([], [])["overhead_pct"] is None


def test_the_training_digest_leaves_out_only_gossiprecs_own_entry(tmp_path: Any) -> None:
    import msgpack

    from gossiprec.bench.sharded_overhead import training_digest

    def write(name: str, trees: dict[str, Any], payload: bytes) -> Any:
        path = tmp_path / name
        header = {"v": 1, "step": 5, "tensors": [["model/w", "float32", [2], 0, 8, None]], "trees": trees}
        path.write_bytes(msgpack.packb(header, use_bin_type=True) + payload)
        return path

    trees = {"model": {"w": 0}, "rng": {"seed": 7}}
    plain = training_digest(write("plain", trees, b"\x00" * 8))
    assert training_digest(write("managed", {**trees, "gossiprec": {"data": 3}}, b"\x00" * 8)) == plain
    assert training_digest(write("other_tensor", trees, b"\x00" * 7 + b"\x01")) != plain
    assert training_digest(write("other_rng", {**trees, "rng": {"seed": 8}}, b"\x00" * 8)) != plain


def test_bench_sharded_overhead_options() -> None:
    import argparse

    from gossiprec.bench import add_cli

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    args = parser.parse_args(["bench", "sharded", "--overhead", "--layout", "tp", "--rounds", "3", "--copies", "1,0"])
    assert (args.overhead, args.rounds, args.steps, args.pace_ms, args.copies) == (True, 3, 60, 100.0, "1,0")


def test_bench_sharded_refuses_bad_copies() -> None:
    import argparse

    import pytest

    from gossiprec.bench import add_cli
    from gossiprec.errors import ConfigError

    parser = argparse.ArgumentParser()
    add_cli(parser.add_subparsers())
    for bad in ("3", "1,1", "one", ""):
        args = parser.parse_args(["bench", "sharded", "--copies", bad])
        with pytest.raises(ConfigError, match="--copies"):
            args.func(args)
