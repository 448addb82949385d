"""Table-driven tests of :mod:`gossiprec.core.config` (formulas, profiles of both configs, validation) and
of the Lifeguard health score in :mod:`gossiprec.core.awareness`.

Every expected number below was computed by hand from the formula documented on the field, not by
calling the code under test.
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest

from gossiprec.core.awareness import Awareness
from gossiprec.core.config import PROFILES, WAN_FACTOR, AgreementConfig, Config, remaining_suspicion
from gossiprec.errors import ConfigError, GossiprecError

NS = (1, 10, 100, 1000, 10000)

# --- suspicion_min / suspicion_max ----------------------------------------------------------------
# suspicion_min = max(floor, mult * log10(max(N, 10)) * probe_interval); suspicion_max = max_mult * min.
#
# lan: 2 * 0.1 * log10(max(N,10)) = 0.2, 0.2, 0.4, 0.6, 0.8: always under the 1.2 s floor.
LAN_MIN = (1.2, 1.2, 1.2, 1.2, 1.2)
LAN_MAX = (3.6, 3.6, 3.6, 3.6, 3.6)
# probe_interval 1 s, floor 0.5 s: 2 * log10(max(N,10)) = 2, 2, 4, 6, 8; max = 3x.
WIDE_MIN = (2.0, 2.0, 4.0, 6.0, 8.0)
WIDE_MAX = (6.0, 6.0, 12.0, 18.0, 24.0)
# wan: probe_interval 1 s, floor 6 s: max(6, 2, 2, 4, 6, 8).
WAN_MIN = (6.0, 6.0, 6.0, 6.0, 8.0)
WAN_MAX = (18.0, 18.0, 18.0, 18.0, 24.0)


def _wide() -> Config:
    return Config(probe_interval=1.0, suspicion_floor=0.5)


@pytest.mark.parametrize("make, mins, maxs", [
    (Config, LAN_MIN, LAN_MAX),
    (_wide, WIDE_MIN, WIDE_MAX),
    (lambda: Config.profile("wan"), WAN_MIN, WAN_MAX),
    (lambda: Config(suspicion_max_mult=1.0, probe_interval=1.0, suspicion_floor=0.5), WIDE_MIN, WIDE_MIN),
], ids=["lan", "pi=1s,floor=0.5s", "wan", "max_mult=1"])
def test_suspicion_bounds_table(make, mins, maxs) -> None:  # type: ignore[no-untyped-def]
    cfg = make()
    for n, lo, hi in zip(NS, mins, maxs):
        assert cfg.suspicion_min(n) == pytest.approx(lo, abs=1e-9), n
        assert cfg.suspicion_max(n) == pytest.approx(hi, abs=1e-9), n
        assert cfg.suspicion_min(n) <= cfg.suspicion_max(n)


def test_suspicion_min_treats_tiny_and_zero_clusters_as_ten() -> None:
    cfg = _wide()
    assert cfg.suspicion_min(0) == cfg.suspicion_min(1) == cfg.suspicion_min(10) == pytest.approx(2.0)


def test_suspicion_min_grows_monotonically_with_n() -> None:
    cfg = _wide()
    values = [cfg.suspicion_min(n) for n in range(1, 5000, 37)]
    assert values == sorted(values)


# --- retransmit_limit -----------------------------------------------------------------------------
# retransmit_mult * ceil(log10(N + 1)); log10(N+1) for N = 1, 9, 10, 99, 100, 999, 1000, 10000:
# 0.30 -> 1, 1.0 -> 1, 1.04 -> 2, 2.0 -> 2, 2.004 -> 3, 3.0 -> 3, 3.0004 -> 4, 4.00004 -> 5.
@pytest.mark.parametrize("n, lan, wan", [
    (1, 3, 4), (9, 3, 4), (10, 6, 8), (99, 6, 8), (100, 9, 12), (999, 9, 12), (1000, 12, 16),
    (10000, 15, 20),
])
def test_retransmit_limit_table(n: int, lan: int, wan: int) -> None:
    assert Config().retransmit_limit(n) == lan
    assert Config.profile("wan").retransmit_limit(n) == wan
    assert Config(retransmit_mult=1).retransmit_limit(n) == lan // 3


# --- pushpull_period ------------------------------------------------------------------------------
# pushpull_interval * max(1, N / pushpull_ref_nodes): flat up to the reference size, linear above.
@pytest.mark.parametrize("n, expected", [
    (1, 30.0), (10, 30.0), (100, 30.0), (150, 45.0), (1000, 300.0), (10000, 3000.0),
])
def test_pushpull_period_scales_linearly_above_reference(n: int, expected: float) -> None:
    assert Config().pushpull_period(n) == pytest.approx(expected)


def test_pushpull_period_follows_its_fields() -> None:
    cfg = Config(pushpull_interval=10.0, pushpull_ref_nodes=50)
    assert [cfg.pushpull_period(n) for n in (1, 50, 100, 500)] == pytest.approx([10.0, 10.0, 20.0, 100.0])


# --- remaining_suspicion --------------------------------------------------------------------------
# total(C) = max(min, max - (max - min) * ln(C + 1) / ln(K + 1)); remaining = total - elapsed.
# K = 3, min = 1.2, max = 3.6 (lan, any N):
#   C=0: 3.6; C=1: 3.6 - 2.4 * ln2/ln4 = 2.4; C=2: 3.6 - 2.4 * 0.7924813 = 1.6980449;
#   C=3: 1.2; C=4: 3.6 - 2.4 * 1.1609640 = 0.8137 -> clamped to 1.2.
@pytest.mark.parametrize("c, elapsed, expected", [
    (0, 0.0, 3.6), (1, 0.0, 2.4), (2, 0.0, 1.6980449), (3, 0.0, 1.2), (4, 0.0, 1.2), (10, 0.0, 1.2),
    (0, 1.0, 2.6), (1, 0.4, 2.0), (2, 1.6980449, 0.0), (3, 0.2, 1.0),
    (0, 5.0, -1.4),  # overdue: negative, the caller fires at once
])
def test_remaining_suspicion_table(c: int, elapsed: float, expected: float) -> None:
    assert remaining_suspicion(c, 3, elapsed, 1.2, 3.6) == pytest.approx(expected, abs=1e-6)


# K = 2, min 1, max 10: C=0: 10; C=1: 10 - 9 * ln2/ln3 = 10 - 9 * 0.6309298 = 4.3216318; C=2: 1.
@pytest.mark.parametrize("c, expected", [(0, 10.0), (1, 4.3216318), (2, 1.0), (3, 1.0)])
def test_remaining_suspicion_k2(c: int, expected: float) -> None:
    assert remaining_suspicion(c, 2, 0.0, 1.0, 10.0) == pytest.approx(expected, abs=1e-6)


def test_remaining_suspicion_edges() -> None:
    # K = 0: no confirmations expected, the timeout is min from the start.
    assert remaining_suspicion(0, 0, 0.0, 1.0, 5.0) == pytest.approx(1.0)
    # min == max: constant whatever C.
    assert {round(remaining_suspicion(c, 3, 0.0, 2.0, 2.0), 9) for c in range(6)} == {2.0}
    # monotone: more confirmations never lengthen the timeout.
    totals = [remaining_suspicion(c, 5, 0.0, 1.0, 9.0) for c in range(10)]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] == pytest.approx(9.0) and totals[5] == pytest.approx(1.0)


# --- profiles -------------------------------------------------------------------------------------
def test_profiles_lan_and_sim_are_the_documented_defaults() -> None:
    assert PROFILES == ("lan", "wan", "sim")
    assert Config.profile("lan") == Config()
    assert Config.profile("sim") == Config.profile("lan")
    lan = Config.profile("lan")
    assert (lan.probe_interval, lan.probe_timeout, lan.suspicion_floor) == (0.1, 0.1, 1.2)


def test_wan_profile_overrides() -> None:
    wan, lan = Config.profile("wan"), Config.profile("lan")
    expected = dict(probe_interval=1.0, probe_timeout=0.5, indirect_timeout=0.5, verify_timeout=0.5,
                    suspicion_floor=6.0, gossip_interval=0.2, starve_slack=1.0, retransmit_mult=4)
    for name, value in expected.items():
        assert getattr(wan, name) == value, name
    # Everything else is the lan value.
    for f in dataclasses.fields(Config):
        if f.name not in expected:
            assert getattr(wan, f.name) == getattr(lan, f.name), f.name


@pytest.mark.parametrize("name", ["LAN", "local", "", "wan ", "prod"])
def test_unknown_profile_lists_the_choices(name: str) -> None:
    with pytest.raises(ConfigError) as info:
        Config.profile(name)
    msg = str(info.value)
    assert repr(name) in msg
    for p in PROFILES:
        assert p in msg


def test_profile_field_overrides_apply_on_top_of_profile() -> None:
    cfg = Config.profile("wan", mtu=9000, cluster="train-7", indirect_checks=5)
    assert (cfg.mtu, cfg.cluster, cfg.indirect_checks) == (9000, "train-7", 5)
    assert cfg.probe_interval == 1.0  # still wan
    assert Config.profile("lan", probe_interval=0.05).probe_interval == 0.05


def test_profile_unknown_field_is_named() -> None:
    with pytest.raises(ConfigError, match="probe_intervall"):
        Config.profile("lan", probe_intervall=0.2)
    with pytest.raises(ConfigError, match="bogus.*zzz"):
        Config.profile("wan", zzz=1, bogus=2)


def test_profile_override_with_bad_value_is_validated() -> None:
    with pytest.raises(ConfigError, match="probe_timeout"):
        Config.profile("wan", probe_timeout=-1.0)


def test_config_is_frozen_and_round_trips_to_dict() -> None:
    cfg = Config.profile("wan")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.mtu = 1000  # type: ignore[misc]
    assert Config(**cfg.to_dict()) == cfg
    assert set(cfg.to_dict()) == {f.name for f in dataclasses.fields(Config)}


def test_wan_timeouts_are_the_lan_ones_times_the_factor() -> None:
    wan, lan = Config.profile("wan"), Config.profile("lan")
    assert WAN_FACTOR == 5.0
    assert Config.WAN_TIMEOUTS == ("probe_timeout", "indirect_timeout", "verify_timeout", "suspicion_floor")
    for name in Config.WAN_TIMEOUTS:
        assert getattr(wan, name) == getattr(lan, name) * WAN_FACTOR, name


# --- agreement profiles ---------------------------------------------------------------------------
# How ``wan`` treats each AgreementConfig field: "x5" (a time: lan * WAN_FACTOR) or "=" (a count, a
# boolean or a ratio: the lan value). Every field must be listed, so a new one is classified on purpose.
AGREEMENT_WAN_RULE = {
    "k": "=", "alert_after": "x5", "confirm_after": "x5", "settle": "x5", "settle_departed": "x5",
    "unstable_timeout": "x5", "fallback_timeout": "x5", "fallback_jitter": "x5", "retry_interval": "x5",
    "fence_after": "x5", "hang_floor": "x5", "hang_mult": "=", "step_floor_ms": "=", "checkpoint_timeout": "x5",
    "answered_within": "x5", "progress_stale": "x5", "evict_stragglers": "=", "retract_after": "=",
    "straggler_floor_ms": "=", "straggler_ratio": "=", "straggler_samples": "=", "straggler_evict_ratio": "=",
    "straggler_evict_samples": "=", "straggler_steps": "=", "straggler_warmup_steps": "=",
    "join_retry": "x5", "rejoin_after": "x5", "catchup_interval": "x5", "direct_votes_max": "=",
    "watch_first": "x5", "watch_interval": "x5", "realert_interval": "x5", "reaggregate_first": "x5",
    "reaggregate_gap_max": "x5", "reaggregate_for": "x5", "report_hold": "x5", "report_poll": "x5",
    "hello_for": "x5", "unfence_after": "x5",
}


def test_agreement_wan_rule_covers_every_field() -> None:
    assert set(AGREEMENT_WAN_RULE) == {f.name for f in dataclasses.fields(AgreementConfig)}
    assert set(AgreementConfig.times()) == {n for n, rule in AGREEMENT_WAN_RULE.items() if rule == "x5"}


@pytest.mark.parametrize("name, rule", sorted(AGREEMENT_WAN_RULE.items()))
def test_agreement_wan_profile_follows_the_rule(name: str, rule: str) -> None:
    lan, wan = getattr(AgreementConfig.profile("lan"), name), getattr(AgreementConfig.profile("wan"), name)
    assert wan == (lan * 5.0 if rule == "x5" else lan)
    assert type(wan) is type(lan)


def test_agreement_profiles_lan_and_sim_are_the_defaults() -> None:
    assert AgreementConfig.profile("lan") == AgreementConfig() == AgreementConfig.profile("sim")
    a = AgreementConfig()
    # the core's timings as they were when they were constants
    assert (a.watch_first, a.watch_interval, a.realert_interval, a.progress_stale, a.answered_within,
            a.report_poll, a.reaggregate_gap_max) == (0.5, 0.25, 1.0, 1.0, 0.5, 0.005, 2.0)
    wan = AgreementConfig.profile("wan")
    assert (wan.alert_after, wan.fence_after, wan.watch_interval, wan.k) == (4.5, 15.0, 1.25, 10)


def test_agreement_profile_overrides_unknowns_and_validation() -> None:
    a = AgreementConfig.profile("wan", k=6, fence_after=4.0)
    assert (a.k, a.fence_after, a.alert_after) == (6, 4.0, 4.5)  # the rest is still wan
    with pytest.raises(ConfigError, match="alert_aftr"):
        AgreementConfig.profile("lan", alert_aftr=1.0)
    with pytest.raises(ConfigError, match="choose one of lan, wan, sim"):
        AgreementConfig.profile("WAN")
    for name in ("hang_floor", "watch_interval", "report_poll"):  # 0 would re-arm a timer forever
        with pytest.raises(ConfigError, match=f"{name} must be > 0"):
            AgreementConfig(**{name: 0.0})
    with pytest.raises(ConfigError, match="watch_first must be a finite number"):
        AgreementConfig(watch_first=float("nan"))
    assert AgreementConfig(**a.to_dict()) == a


@pytest.mark.parametrize("profile", ["lan", "wan"])
def test_agent_settings_take_the_agreement_defaults_from_their_profile(profile: str, tmp_path: Path) -> None:
    """The agent builds its agreement config from the chosen profile, then the ``[protocol]`` table and
    ``--protocol NAME=VALUE`` on top."""
    from gossiprec.agent.settings import load_settings, parse_protocol_overrides

    toml = tmp_path / "agent.toml"
    toml.write_text(f'insecure = true\nprofile = "{profile}"\n[protocol]\nhang_floor = 0.7\n')
    s = load_settings({}, {}, str(toml), parse_protocol_overrides(["k=6"]))
    expected = AgreementConfig.profile(profile, hang_floor=0.7, k=6)
    assert s.agreement_config() == expected
    assert s.agreement_config().fence_after == (15.0 if profile == "wan" else 3.0)
    assert s.protocol_config().probe_timeout == Config.profile(profile).probe_timeout


# --- validation -----------------------------------------------------------------------------------
NAN, INF = float("nan"), float("inf")
BAD_VALUES = [
    ("probe_interval", -0.1), ("probe_interval", 0.0), ("probe_interval", NAN), ("probe_interval", INF),
    ("probe_interval", "0.1"), ("probe_batch", 0), ("probe_batch", 1.5), ("probe_batch", True),
    ("probe_timeout", -1.0), ("indirect_timeout", NAN), ("verify_timeout", -0.5), ("verify_timeout", 0),
    ("gossip_interval", 0.0), ("pushpull_interval", -30.0), ("starve_slack", NAN),
    ("suspicion_mult", -2.0), ("suspicion_floor", NAN), ("suspicion_floor", -INF),
    ("indirect_checks", -1), ("indirect_checks", 1.5), ("gossip_nodes", -3), ("retransmit_mult", -1),
    ("progress_piggyback", -1), ("awareness_max", 0), ("awareness_max", 2.5),
    ("nack_fraction", 0.0), ("nack_fraction", 1.0), ("nack_fraction", NAN), ("nack_fraction", -0.2),
    ("suspicion_max_mult", 0.5), ("suspicion_confirmations", 0), ("suspicion_confirmations", -2),
    ("mtu", 575), ("mtu", 65001), ("mtu", NAN), ("mtu", 0),
    ("cluster", ""), ("cluster", "x" * 65), ("cluster", "\u00e9" * 33),  # 66 UTF-8 bytes
]


@pytest.mark.parametrize("name, value", BAD_VALUES, ids=[f"{n}={v!r}"[:40] for n, v in BAD_VALUES])
def test_bad_value_is_refused_naming_the_field(name: str, value: object) -> None:
    with pytest.raises(ConfigError) as info:
        Config(**{name: value})
    assert name in str(info.value)
    assert isinstance(info.value, GossiprecError) and isinstance(info.value, ValueError)


def test_all_problems_are_reported_at_once() -> None:
    with pytest.raises(ConfigError) as info:
        Config(probe_interval=-1.0, mtu=10, nack_fraction=2.0)
    msg = str(info.value)
    assert "probe_interval" in msg and "mtu" in msg and "nack_fraction" in msg


@pytest.mark.parametrize("name, value", [
    ("mtu", 576), ("mtu", 65000), ("cluster", "c" * 64), ("cluster", "\u00e9" * 32), ("indirect_checks", 0),
    ("gossip_nodes", 0), ("progress_piggyback", 0), ("awareness_max", 1), ("suspicion_max_mult", 1.0),
    ("suspicion_confirmations", 1), ("nack_fraction", 0.01), ("probe_interval", 1),
])
def test_boundary_values_are_accepted(name: str, value: object) -> None:
    assert getattr(Config(**{name: value}), name) == value


# Fields the validator does not look at yet. Each is a real hazard: a negative reap/gossip window; a NaN
# multiplier or K that makes suspicion deadlines NaN (a NaN on top of the timer heap never satisfies
# ``deadline <= now``, so no timer of that node fires again); a zero reference size that divides by zero
# in pushpull_period (ZeroDivisionError from the Membership constructor); max_stream below mtu; and a name
# limit of 0 or above the wire's MAX_NAME (128), which lets a node take a name its peers cannot decode.
UNVALIDATED = [
    ("dead_reap", -1.0), ("gossip_to_dead", -5.0), ("suspicion_max_mult", NAN),
    ("suspicion_confirmations", NAN), ("pushpull_ref_nodes", 0), ("max_stream", 0),
    ("max_name", 0), ("max_name", 1000),
]


@pytest.mark.parametrize("name, value", UNVALIDATED, ids=[f"{n}={v!r}" for n, v in UNVALIDATED])
def test_unvalidated_fields_should_be_refused(name: str, value: object) -> None:
    with pytest.raises(ConfigError, match=name):
        Config(**{name: value})


# --- awareness ------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_mult, start, delta, score", [
    (8, 0, 1, 1), (8, 0, 2, 2), (8, 3, -1, 2), (8, 0, -1, 0), (8, 0, -100, 0), (8, 6, 1, 7),
    (8, 7, 1, 7), (8, 5, 100, 7), (8, 7, -3, 4), (1, 0, 5, 0), (2, 0, 5, 1), (2, 1, -1, 0),
])
def test_awareness_apply_clamps_into_range(max_mult: int, start: int, delta: int, score: int) -> None:
    a = Awareness(max_mult, start)
    assert a.apply(delta) == score
    assert a.score == score


@pytest.mark.parametrize("score, seconds, scaled", [
    (0, 0.1, 0.1), (1, 0.1, 0.2), (3, 0.1, 0.4), (7, 0.1, 0.8), (7, 1.5, 12.0), (2, 0.0, 0.0),
])
def test_awareness_scale(score: int, seconds: float, scaled: float) -> None:
    assert Awareness(8, score).scale(seconds) == pytest.approx(scaled)


def test_awareness_sequence_matches_lifeguard_deltas() -> None:
    a = Awareness(8)
    for delta, expected in [(+2, 2), (+1, 3), (-1, 2), (+3, 5), (+2, 7), (+2, 7), (-1, 6)]:
        assert a.apply(delta) == expected
    assert a.scale(Config().probe_interval) == pytest.approx(0.7)
    assert not math.isnan(a.scale(1.0))
