"""`--job FILE --name N` is enough: the job spec gives a member its port and address, a joiner its seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from gossiprec.agent.jobspec import node_factory
from gossiprec.agent.settings import load_settings
from gossiprec.errors import ConfigError

SPEC = """
[job]
topology = "ddp"

[[members]]
name = "a"
addr = "127.0.0.1:7301"
rank = 0

[[members]]
name = "b"
addr = "127.0.0.2:7401"
rank = 1
"""


@pytest.fixture
def spec(tmp_path: Path) -> str:
    p = tmp_path / "job.toml"
    p.write_text(SPEC)
    return str(p)


def test_a_member_takes_its_port_and_address_from_the_spec(spec: str) -> None:
    s = load_settings({"job": spec, "name": "b", "insecure": True}, environ={})
    # it listens on its own address, not every interface (and so advertises what it binds)
    assert (s.bind_host, s.port, s.advertise) == ("127.0.0.2", 7401, None)
    assert "job spec" in s.origins["port"] and "b's addr" in s.origins["port"] and "--bind" in s.origins["bind_host"]
    assert s.seeds == ()  # a member of view 0 knows the others from the view
    s = load_settings({"job": spec, "name": "b", "bind_host": "0.0.0.0", "insecure": True}, environ={})
    assert (s.bind_host, s.advertise) == ("0.0.0.0", "127.0.0.2:7401")  # --bind wins, the spec's address is told
    s = load_settings({"job": spec, "name": "b", "insecure": True}, environ={"GOSSIPREC_BIND": "::"})
    assert (s.bind_host, s.advertise) == ("::", "127.0.0.2:7401")


def test_given_values_win_and_a_bind_to_one_address_advertises_that_one(spec: str, tmp_path: Path) -> None:
    s = load_settings({"job": spec, "name": "b", "port": 7999, "insecure": True}, environ={})
    assert s.port == 7999
    s = load_settings({"job": spec, "name": "b", "insecure": True}, environ={"GOSSIPREC_PORT": "7555"})
    assert s.port == 7555 and s.origins["port"] == "GOSSIPREC_PORT"
    s = load_settings({"job": spec, "name": "b", "bind_host": "127.0.0.1", "insecure": True}, environ={})
    assert s.advertise is None and s.port == 7401
    # the spec says 127.0.0.2, the agent listens on 127.0.0.1 only: refused with both addresses named
    make = node_factory(s)
    with pytest.raises(ConfigError, match=r"lists b at 127\.0\.0\.2:7401.*127\.0\.0\.1:7401"):
        import random
        from gossiprec.core.config import Config
        make(Config(), "b", "127.0.0.1:7401", incarnation=1, role="trainer", now=0.0, rng=random.Random(0))


def test_a_node_not_in_the_spec_joins_through_its_members(spec: str) -> None:
    s = load_settings({"job": spec, "name": "spare-9", "port": 7600, "insecure": True}, environ={})
    assert s.seeds == ("127.0.0.1:7301", "127.0.0.2:7401") and "its members" in s.origins["seeds"]
    s = load_settings({"job": spec, "name": "spare-9", "seeds": ("10.1.1.1:7980",), "insecure": True}, environ={})
    assert s.seeds == ("10.1.1.1:7980",)


def test_a_spec_that_cannot_be_read_is_left_to_its_loader(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[[members]\nname=")
    s = load_settings({"job": str(bad), "name": "a", "insecure": True}, environ={})
    assert s.port != 7301
    with pytest.raises(ConfigError, match="not valid TOML"):
        node_factory(s)


def test_with_nnodes_the_local_index_chooses_the_port_and_a_seed_needs_no_port() -> None:
    s = load_settings({"nnodes": 2, "nproc_per_node": 2, "local_index": 1, "seeds": ("node01",), "insecure": True},
                      environ={})
    assert s.port == 7983 and "local-index" in s.origins["port"]
    assert s.seed_addrs() == ("node01:7980",)
    s = load_settings({"nnodes": 2, "local_index": 1, "port": 9000, "seeds": ("a:1",), "insecure": True}, environ={})
    assert s.port == 9000


@pytest.mark.parametrize("flags, match", [
    ({"nnodes": 2}, "needs --seed"),
    ({"nnodes": 2, "seeds": ("a:1",), "spares": 2}, "spares < nnodes x nproc_per_node = 2"),
    ({"nnodes": 0, "seeds": ("a:1",)}, "hosts >= 1"),
    ({"nnodes": 2, "seeds": ("a:1",), "nproc_per_node": 0}, "nproc-per-node"),
])
def test_bad_bootstrap_settings_are_refused_with_the_fix(flags: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings({**flags, "insecure": True}, environ={})


def test_a_job_spec_and_nnodes_exclude_each_other(spec: str) -> None:
    with pytest.raises(ConfigError, match="exclude each other"):
        load_settings({"job": spec, "name": "a", "nnodes": 2, "seeds": ("a:1",), "insecure": True}, environ={})
