"""The trainer's config (validated, with derived timeouts) and its settings (the one place it reads the
environment)."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from gossiprec.errors import ConfigError
from gossiprec.local.launch import DONOR_OFFSET, STORE_OFFSET
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.settings import TrainerSettings, transfer_key


def test_defaults_and_derived_timeouts() -> None:
    c = TrainerConfig()
    assert (c.backend, c.timeout, c.poll_interval, c.store_offset, c.donor_offset) == (
        "gloo", 30.0, 0.002, STORE_OFFSET, DONOR_OFFSET)
    assert (c.fetch_timeout, c.stall_timeout, c.finish_timeout) == (60.0, 5.0, 10.0)
    short = TrainerConfig(timeout=2.0)
    assert (short.fetch_timeout, short.stall_timeout, short.finish_timeout) == (60.0, 2.0, 2.0)
    with pytest.raises(AttributeError):
        c.timeout = 1.0  # type: ignore[misc]


@pytest.mark.parametrize("changes, match", [
    ({"backend": "mpi"}, "backend"),
    ({"timeout": 0}, "timeout"),
    ({"timeout": "30"}, "timeout"),
    ({"poll_interval": 2.0}, "poll_interval"),
    ({"wait_report_after": -1}, "wait_report_after"),
    ({"linger": -0.5}, "linger"),
    ({"store_offset": 0}, "store_offset"),
    ({"donor_offset": 1}, "must differ"),
    ({"bind_host": ""}, "bind_host"),
    ({"background_snapshot": 1}, "background_snapshot"),
    ({"verify_every": -1}, "verify_every"),
    ({"verify_every": True}, "verify_every"),
])
def test_bad_values_are_config_errors(changes: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        TrainerConfig(**changes)  # type: ignore[arg-type]


def test_settings_from_env_read_only_what_the_trainer_uses() -> None:
    env = {"GOSSIPREC_CONTROL": "/run/a.sock", "GOSSIPREC_CLUSTER": "blue", "GOSSIPREC_KEYRING": "/k.toml",
           "GOSSIPREC_NODE": "n3"}
    assert TrainerSettings.from_env(env) == TrainerSettings("/run/a.sock", "blue", "/k.toml")
    assert TrainerSettings.from_env({"GOSSIPREC_KEYRING": ""}) == TrainerSettings(None, "gossiprec", None)
    with pytest.raises(ConfigError, match="GOSSIPREC_CONTROL is not set"):
        TrainerSettings().connect(timeout=1.0)


def test_insecure_key_is_derived_from_the_cluster_name() -> None:
    expected = hashlib.sha256(b"gossiprec-insecure-transfer\x00blue").digest()
    assert TrainerSettings(cluster="blue").transfer_key() == expected == transfer_key(None, "blue")
    assert transfer_key(None) != expected and len(transfer_key(None)) == 32


def test_a_keyring_gives_its_primary_key(tmp_path: Path) -> None:
    from gossiprec.security.keyring import Keyring

    key = bytes(range(32))
    path = tmp_path / "keyring.json"
    Keyring([key], primary=key).save(path)
    assert TrainerSettings(keyring=str(path)).transfer_key() == key
    Keyring([key]).save(path)
    if Keyring.load(path).primary is None:
        with pytest.raises(ConfigError, match="no primary key"):
            transfer_key(str(path))
