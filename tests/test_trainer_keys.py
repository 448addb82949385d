"""The trainer's own traffic under the cluster's keyring: forged state and forged store values are refused,
the keys follow a rotation, the servers listen on the agent's address only, and the exit codes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

from gossiprec.errors import SecurityError, TransferError
from gossiprec.security.keyring import Keyring, decode_key, generate_key
from gossiprec.trainer.transfer import donor as donor_mod
from gossiprec.trainer.state.capture import capture_state
from gossiprec.trainer.transfer.donor import DonorServer
from gossiprec.trainer.exits import EXIT_ERROR, EXIT_FINISHED, EXIT_STOPPED, exit_code
from gossiprec.trainer.transfer.fetch import fetch_state
from gossiprec.trainer.collectives.groups import connect_store, start_store_server
from gossiprec.trainer.keys import TransferKeys, insecure_key, open_value, seal_value, sealed_store
from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.receive import ReceiveTarget, materialize_optimizer_state
from gossiprec.trainer.exits import JobFinished, JobStopped, Released
from gossiprec.trainer.settings import TrainerSettings
from gossiprec.trainer.transfer.wire import REQ_PREFIX, TAG_SIZE, TransferRequest

LOCAL = "127.0.0.1"
CLUSTER = "prod"


def _objects(seed: int) -> dict[str, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Linear(16, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    materialize_optimizer_state(opt)
    return training_state(model, opt, rng=False)


def _weights(objects: dict[str, Any]) -> list[torch.Tensor]:
    return [t.clone() for t in objects["model"].state_dict().values()]


def _keyring(path: Path, *keys: bytes) -> Keyring:
    ring = Keyring(list(keys))
    ring.save(path)
    return ring


def test_forged_state_signed_with_the_cluster_name_key_is_refused_on_a_keyed_cluster(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _keyring(tmp_path / "keyring.json", decode_key(generate_key()))
    keys = TrainerSettings(keyring=str(tmp_path / "keyring.json"), cluster=CLUSTER).transfer_keys()
    assert keys.keyed and keys.primary() != insecure_key(CLUSTER)
    forged = capture_state(_objects(1), step=3)
    objects = _objects(2)
    before = _weights(objects)

    # an attacker who knows the cluster's name serves state under the key derived from it: an honest
    # request does not authenticate under that key, so the attacker's donor refuses it...
    with DonorServer(lambda e, s: forged, insecure_key(CLUSTER), host=LOCAL).start() as attacker:
        with pytest.raises(SecurityError):
            fetch_state([(LOCAL, attacker.port)], keys.primary(), ReceiveTarget(objects), step=3, epoch=1)
        assert attacker.counters["auth_failed"] == 1

    # ...and one that skips checking the request and answers anyway is refused by the spare
    def unchecked(key: bytes, frame: bytes, context: bytes = b"") -> tuple[bytes, TransferRequest]:
        _magic, _version, tid, _n = REQ_PREFIX.unpack_from(frame)
        return tid, TransferRequest.from_wire(msgpack.unpackb(frame[REQ_PREFIX.size:-TAG_SIZE], raw=False))

    monkeypatch.setattr(donor_mod, "open_request", unchecked)
    with DonorServer(lambda e, s: forged, insecure_key(CLUSTER), host=LOCAL).start() as attacker:
        with pytest.raises(TransferError):
            fetch_state([(LOCAL, attacker.port)], keys.primary(), ReceiveTarget(objects), step=3, epoch=1)
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(objects)))  # nothing forged was loaded


def test_a_spare_started_after_a_full_rotation_receives_state_from_a_donor_started_before(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    old, new = decode_key(generate_key()), decode_key(generate_key())
    ring = _keyring(path, old)
    donor_keys = TransferKeys.from_file(str(path))  # a survivor, started before the rotation
    objects = _objects(1)
    snap = capture_state(objects, step=3)
    with DonorServer(lambda e, s: snap, donor_keys, host=LOCAL).start() as donor:
        # a full rotation: install the new key everywhere, make it primary, remove the old one
        ring.install(new)
        ring.save()
        mid = TransferKeys.from_file(str(path))
        assert mid.primary() == old and donor_keys.accepted() == [old, new]
        ring.use(new)
        ring.save()
        ring.remove(old)
        ring.save()
        spare_keys = TransferKeys.from_file(str(path))  # a spare started after it
        assert spare_keys.accepted() == [new]
        target_objects = _objects(2)
        fetch_state([(LOCAL, donor.port)], spare_keys.primary(), ReceiveTarget(target_objects), step=3, epoch=1)
        assert all(torch.equal(a, b) for a, b in zip(_weights(objects), _weights(target_objects)))
        assert donor_keys.primary() == new and mid.accepted() == [new]  # the older processes followed
        # the old key is no longer accepted anywhere
        with pytest.raises(SecurityError):
            fetch_state([(LOCAL, donor.port)], old, ReceiveTarget(_objects(3)), step=3, epoch=1)


def test_a_bad_keyring_edit_keeps_the_keys_in_memory(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    key = decode_key(generate_key())
    _keyring(path, key)
    keys = TransferKeys.from_file(str(path))
    path.write_text("not json")
    os.chmod(path, 0o600)
    assert keys.primary() == key


def test_store_values_are_sealed_and_a_forged_one_is_refused(tmp_path: Path) -> None:
    _keyring(tmp_path / "keyring.json", decode_key(generate_key()))
    keys = TransferKeys.from_file(str(tmp_path / "keyring.json"))
    outsider = TransferKeys.insecure(CLUSTER)
    assert open_value(keys, "e1/0", seal_value(keys, "e1/0", b"addr")) == b"addr"
    with pytest.raises(SecurityError, match="does not hold"):
        open_value(keys, "e1/0", seal_value(outsider, "e1/0", b"addr"))
    with pytest.raises(SecurityError, match="failed authentication"):
        open_value(keys, "e1/1", seal_value(keys, "e1/0", b"addr"))  # moved to another key name
    with pytest.raises(SecurityError, match="not sealed"):
        open_value(keys, "e1/0", b"addr")

    server, port = start_store_server(LOCAL, 0, timeout=10)
    client = connect_store(LOCAL, port, timeout=10)
    sealed = sealed_store(client, keys)
    sealed.set("gossiprec/e1/rank0", b"10.0.0.1:1234")
    assert sealed.get("gossiprec/e1/rank0") == b"10.0.0.1:1234"
    client.set("gossiprec/e1/rank1", b"198.51.100.7:6666")  # an outsider writes into the store
    with pytest.raises(SecurityError):
        sealed.get("gossiprec/e1/rank1")
    del server


def test_the_store_listens_on_the_given_address_only() -> None:
    server, port = start_store_server(LOCAL, 0, timeout=10)
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            local, state = row.split()[1], row.split()[3]
            addr, hexport = local.split(":")
            if state == "0A" and int(hexport, 16) == port:
                listening.add(addr)
    assert listening == {"0100007F"}  # 127.0.0.1, not 0.0.0.0 or ::
    del server


@pytest.mark.parametrize(("outcome", "code"), [
    (None, EXIT_FINISHED), (JobFinished("not needed"), 0), (Released("shrunk"), 0),
    (JobStopped("no spare"), EXIT_STOPPED), (RuntimeError("bug"), EXIT_ERROR),
])
def test_exit_codes_say_what_happened(outcome: BaseException | None, code: int) -> None:
    assert exit_code(outcome) == code
    assert EXIT_STOPPED == 75  # sysexits' EX_TEMPFAIL: a scheduler may requeue on it


class _KeyedAgent:
    """A control client whose agent seals its traffic with a keyring."""

    node = "n0"
    path = "/nonexistent.sock"

    def status(self) -> dict[str, Any]:
        return {"secure": True, "view": None}


def test_a_trainer_without_the_keyring_refuses_to_start_on_a_keyed_cluster() -> None:
    from gossiprec.errors import ConfigError
    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.loop import ResilientTrainer

    rt = ResilientTrainer(_objects(1), TrainerConfig(stateless_data=True), control=_KeyedAgent(),  # type: ignore[arg-type]
                          key=TransferKeys.insecure(CLUSTER))
    with pytest.raises(ConfigError, match="cluster is keyed .* GOSSIPREC_KEYRING"):
        rt.start()
    rt.close()
