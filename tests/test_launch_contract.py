"""The launch contract: what the launcher writes, the trainer reads back, and each side refuses."""

from __future__ import annotations

import os

import pytest

from gossiprec.core.config import Config
from gossiprec.errors import ConfigError
from gossiprec.local.launch import (
    CLUSTER_ENV, CONTROL_ENV, DEFAULT_CLUSTER, DONOR_OFFSET, KEYRING_ENV, KEYRING_FD_ENV, NODE_ENV,
    PORTS_PER_AGENT, RANK_ENV, ROLE_ENV, LaunchEnv, keyring_message, read_keyring_message, read_launch_env,
    local_placement, trainer_environment,
)
from gossiprec.security.keyring import Keyring, decode_key, generate_key


def test_what_the_launcher_writes_the_trainer_reads_back() -> None:
    stale = {RANK_ENV: "7", KEYRING_FD_ENV: "9", KEYRING_ENV: "/old.json", "PATH": "/bin"}
    env = trainer_environment(stale, control="/run/a.sock", node="n1", role="spare", rank=None, cluster="c1",
                              keyring="/k.json")
    assert env[CONTROL_ENV] == "/run/a.sock" and env[NODE_ENV] == "n1" and env[ROLE_ENV] == "spare"
    assert RANK_ENV not in env and KEYRING_FD_ENV not in env and env["PATH"] == "/bin"
    assert read_launch_env(env) == LaunchEnv(control="/run/a.sock", cluster="c1", keyring="/k.json")
    env = trainer_environment(stale, control="/run/a.sock", node="n1", role="trainer", rank=3, cluster="c1",
                              keyring_fd=5)
    assert env[RANK_ENV] == "3" and KEYRING_ENV not in env
    assert read_launch_env(env) == LaunchEnv(control="/run/a.sock", cluster="c1", keyring_fd=5)
    assert read_launch_env({}) == LaunchEnv(cluster=DEFAULT_CLUSTER)
    assert read_launch_env({CLUSTER_ENV: "x"}).cluster == "x"


@pytest.mark.parametrize("bad", [
    {"role": "boss"}, {"rank": -1}, {"control": ""}, {"keyring": "/k.json", "keyring_fd": 3}, {"keyring_fd": -2},
    {"local": (2, 2)}, {"local": (-1, 1)},
])
def test_the_launcher_refuses_what_the_trainer_could_not_read(bad: dict[str, object]) -> None:
    kwargs: dict[str, object] = {"control": "/s", "node": "n", "role": "trainer", "rank": 0, "cluster": "c", **bad}
    with pytest.raises(ConfigError):
        trainer_environment({}, **kwargs)  # type: ignore[arg-type]


def test_the_trainer_refuses_a_descriptor_that_is_no_number() -> None:
    with pytest.raises(ConfigError, match=KEYRING_FD_ENV):
        read_launch_env({KEYRING_FD_ENV: "keys.json"})


def test_defaults_are_the_protocols_and_the_ports_fit_the_layout() -> None:
    assert DEFAULT_CLUSTER == Config().cluster
    assert DONOR_OFFSET < PORTS_PER_AGENT


def test_keyring_messages_round_trip_and_end_at_end_of_file() -> None:
    k1, k2 = decode_key(generate_key()), decode_key(generate_key())
    r, w = os.pipe()
    try:
        os.write(w, keyring_message(Keyring([k1, k2], primary=k2)))
        os.close(w)
        w = -1
        ring = read_keyring_message(r, None)
        assert ring is not None and ring.primary == k2 and len(ring) == 2
        assert read_keyring_message(r, None) is None
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_a_broken_keyring_stream_is_refused() -> None:
    r, w = os.pipe()
    try:
        os.write(w, (10**6).to_bytes(4, "big"))
        with pytest.raises(ValueError, match="at most"):
            read_keyring_message(r, None)
    finally:
        os.close(r)
        os.close(w)


def test_a_slot_knows_its_place_on_its_host() -> None:
    # two hosts of three slots; a host's slots are numbered in port order (names need not sort so)
    members = [(f"h{h}-{i}", f"10.0.0.{h}:{29400 + 3 * i}", f"h{h}") for h in (1, 2) for i in (0, 1, 2)]
    members.append(("h2-10", "10.0.0.2:29430", "h2"))
    assert local_placement(members, "h1-2") == (2, 3)
    assert local_placement(members, "h2-0") == (0, 4)
    assert local_placement(members, "h2-10") == (3, 4)
    assert local_placement(members, "joiner") == (0, 1)  # not in the view: alone unless told
    assert local_placement(members, "joiner", given=5) == (5, 6)
    assert local_placement(members, "h1-0", given=1) == (1, 3)  # --local-index / SLURM_LOCALID wins
    assert local_placement([("x", "10.0.0.9:1", "")], "x") == (0, 1)  # no host: no neighbours known
    env = trainer_environment({"RANK": "4", "WORLD_SIZE": "9"}, control="/s", node="n", role="spare", rank=None,
                              cluster="c", local=(1, 2), world_size=4)
    assert (env.get("RANK"), env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == (None, "4", "1", "2")
