"""Pinned signing keys: the operator's form of per-member signatures.

A job spec's ``[public_keys]`` table pins each member's Ed25519 public key; each agent signs with its
persistent ``--signing-key`` file. Shown here: the key file's life (made 0600 when absent, refused when
others may read it, printed by ``gossiprec keys public``), the spec's checks (unknown members, bad keys,
an agent without its key or with another key), and against four real pinned agents, a holder of the
cluster key who claims every member's name with its own signing key and then signs leaves and alerts
with it: every claim is refused and counted, nobody is evicted.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from gossiprec.agent.jobspec import load_job, node_factory
from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings
from gossiprec.bench.hostile import KeyHolder
from gossiprec.cli import main as cli_main
from gossiprec.core.auth import KeyBook
from gossiprec.core.view import REMOVE
from gossiprec.core.wire import UNREACHABLE, Alert, Dead, Hello, KeyClaim
from gossiprec.errors import ConfigError, SecurityError
from gossiprec.security.signing import MAX_KEY_FILE, Ed25519Crypto, SigningKeyError, load_signing_key
from tests.test_forgery_live import _addrs, _count, _refused_by_all, _unchanged
from tests.test_security_live import KEY_A, _view, keyed_cluster, write_job, workdir

__all__ = ["workdir"]


# ---------------------------------------------------------------------------------------- key files
def test_a_missing_key_file_is_made_0600_and_then_read_back(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "n0.sign"
    made, created = load_signing_key(path)
    assert created and stat.S_IMODE(path.stat().st_mode) == 0o600
    again, created = load_signing_key(path)
    assert not created and again.public_key == made.public_key
    with pytest.raises(SigningKeyError, match="does not exist"):
        load_signing_key(tmp_path / "absent", create=False)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660])
def test_a_key_file_others_may_read_is_refused_with_what_to_do(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "n0.sign"
    load_signing_key(path)
    os.chmod(path, mode)
    with pytest.raises(SigningKeyError, match=f"{path}.*mode {mode:04o}.*leaked.*chmod 600"):
        load_signing_key(path)


def test_a_symlink_or_a_foreign_file_is_refused(tmp_path: Path) -> None:
    real = tmp_path / "real.sign"
    load_signing_key(real)
    (tmp_path / "link.sign").symlink_to(real)
    with pytest.raises(SigningKeyError, match="symlink"):
        load_signing_key(tmp_path / "link.sign")
    junk = tmp_path / "junk.sign"
    junk.write_text("not a key\n")
    os.chmod(junk, 0o600)
    with pytest.raises(SigningKeyError, match=f"{junk} is not an unencrypted PEM"):
        load_signing_key(junk)
    huge = tmp_path / "huge.sign"
    huge.write_bytes(b"x" * (MAX_KEY_FILE + 1))
    os.chmod(huge, 0o600)
    with pytest.raises(SigningKeyError, match=f"{huge} is {MAX_KEY_FILE + 1} bytes.*right file"):
        load_signing_key(huge)
    with pytest.raises(SigningKeyError, match="not a regular file"):
        load_signing_key(tmp_path)


def test_keys_public_prints_the_line_to_pin(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "n0.sign"
    assert cli_main(["keys", "public", "--signing-key", str(path), "--name", "n0"]) == 0
    out, err = capsys.readouterr()
    assert "created a new signing key" in err
    assert out == f'n0 = "{load_signing_key(path)[0].public_key.hex()}"\n'
    assert cli_main(["keys", "public", "--signing-key", str(path), "--name", "n0"]) == 0
    assert capsys.readouterr().out == out  # the same key, printed again


# ---------------------------------------------------------------------------------------- job spec
def _spec(tmp_path: Path, table: str) -> str:
    job = write_job(tmp_path / "job.toml", ["127.0.0.1:7001", "127.0.0.1:7002"])
    with open(job, "a") as f:
        f.write("\n[public_keys]\n" + table)
    return job


def _hex(tmp_path: Path, name: str) -> tuple[str, str]:
    path = str(tmp_path / f"{name}.sign")
    return path, load_signing_key(path)[0].public_key.hex()


def test_the_spec_pins_its_members_keys(tmp_path: Path) -> None:
    _, k0 = _hex(tmp_path, "n0")
    view, pins = load_job(_spec(tmp_path, f'n0 = "{k0}"\n'))
    assert pins == {"n0": bytes.fromhex(k0)} and tuple(view.nodes) == ("n0", "n1")


def test_a_spec_pinning_an_unknown_member_is_refused(tmp_path: Path) -> None:
    _, k0 = _hex(tmp_path, "n0")
    with pytest.raises(ConfigError, match="public_keys names 'n9', which is not a member"):
        load_job(_spec(tmp_path, f'n9 = "{k0}"\n'))


@pytest.mark.parametrize("text", ['"abc"', '"' + "zz" * 32 + '"', "7"])
def test_a_spec_with_a_malformed_key_is_refused(tmp_path: Path, text: str) -> None:
    with pytest.raises(ConfigError, match="public_keys.n0: expected an Ed25519 public key as 64 hex"):
        load_job(_spec(tmp_path, f"n0 = {text}\n"))


def _settings(tmp_path: Path, job: str, signing_key: str | None) -> AgentSettings:
    return AgentSettings(name="n0", bind_host="127.0.0.1", port=7001, advertise="127.0.0.1:7001",
                         insecure=True, job=job, signing_key=signing_key)


def test_a_pinned_agent_needs_its_own_key(tmp_path: Path) -> None:
    path, k0 = _hex(tmp_path, "n0")
    other, _ = _hex(tmp_path, "other")
    job = _spec(tmp_path, f'n0 = "{k0}"\n')
    with pytest.raises(ConfigError, match="pins a public key for n0; start this agent with --signing-key"):
        node_factory(_settings(tmp_path, job, None))
    with pytest.raises(ConfigError, match=f"pins n0 to key {k0}, but the signing key {other}"):
        node_factory(_settings(tmp_path, job, other))
    node_factory(_settings(tmp_path, job, path))  # the right key


def test_an_agent_refuses_to_start_with_a_readable_key_file(tmp_path: Path) -> None:
    path, k0 = _hex(tmp_path, "n0")
    os.chmod(path, 0o644)
    with pytest.raises(SecurityError, match=f"signing key {path} has mode 0644"):
        Agent(_settings(tmp_path, _spec(tmp_path, f'n0 = "{k0}"\n'), path))


def test_a_pinned_book_refuses_a_first_claim_that_trust_on_first_use_would_bind() -> None:
    member, forger = Ed25519Crypto.generate(), Ed25519Crypto.generate()
    leave = KeyBook("n1", forger).sign(Dead("n1", 1, "n1"))  # the forger's leave "from" n1
    tofu = KeyBook("n0", Ed25519Crypto.generate())
    assert tofu.bind("n1", forger.public_key) and tofu.check("n1", leave)  # the window pins close
    pinned = KeyBook("n0", Ed25519Crypto.generate(), pinned={"n1": member.public_key}, claims=False)
    assert not pinned.bind("n1", forger.public_key) and pinned.counters["rx_key_conflict"] == 1
    assert not pinned.check("n1", leave) and pinned.counters["rx_sig_invalid"] == 1


# ---------------------------------------------------------------------------------------- live
async def test_a_key_holder_cannot_claim_a_pinned_members_name_nor_evict_it(workdir: str) -> None:
    async with keyed_cluster(workdir, pinned=True) as (agents, _):
        for a in agents:  # bound from the pins, none claimed
            book = a.machine.auth  # type: ignore[union-attr]
            assert book is not None and not book.claims and len(book.pinned) == len(agents)
        view = _view(agents[0])
        assert view is not None
        epoch, config, _ = view
        victim = agents[1]
        subs = [a.subscribe() for a in agents]
        # the forger's own signing key, claimed for every member's name, then used for their words
        crypto = Ed25519Crypto.generate()
        claims = [KeyClaim(a.name, crypto.public_key) for a in agents]
        leave = KeyBook(victim.name, crypto).sign(Dead(victim.name, victim.machine.incarnation, victim.name))  # type: ignore[union-attr]
        alerts = [KeyBook(a.name, crypto).sign(Alert(epoch, config, a.name, victim.name, REMOVE, UNREACHABLE,
                                                     False, "", "", ""))
                  for a in agents if a is not victim]
        others = [a for a in agents if a is not victim]
        before = [_count(a, "rx_key_conflict") for a in others]
        forger = KeyHolder(KEY_A)
        forger.send(claims, _addrs(agents))
        await _refused_by_all(others, [b + len(agents) - 1 for b in before], "rx_key_conflict")
        before = [_count(a, "rx_leave_unsigned", "rx_sig_invalid") for a in others]
        forger.send([*claims, leave, *alerts], _addrs(agents, victim.name))
        await _refused_by_all(others, before, "rx_leave_unsigned", "rx_sig_invalid")
        for a in agents:
            book = a.machine.auth  # type: ignore[union-attr]
            assert all(book.key_of(b.name) == b.machine.auth.crypto.public_key for b in agents)  # type: ignore[union-attr]
        await _unchanged(agents, subs, view)


async def test_a_forged_restart_of_a_pinned_member_evicts_nothing(workdir: str) -> None:
    async with keyed_cluster(workdir, pinned=True) as (agents, _):
        view = _view(agents[0])
        assert view is not None
        epoch, config, _ = view
        victim = agents[3]
        node = agents[0].machine
        observers = set(node.overlay(node.view).observers(victim.name))  # type: ignore[union-attr]
        watchers = [a for a in agents if a.name in observers]
        assert watchers
        subs = [a.subscribe() for a in agents]
        # "a new process of the victim started": its observers would alert it as restarted, and evict it
        later = victim.machine.incarnation + 10**6  # type: ignore[union-attr]
        before = [_count(a, "rx_hello_unsigned") for a in watchers]
        KeyHolder(KEY_A).send([Hello(victim.name, victim.addr, later, epoch, config),
                               Hello(victim.name, victim.addr, later + 1, epoch, config, bytes(64))],
                              _addrs(agents, victim.name))
        await _refused_by_all(watchers, [b + 1 for b in before], "rx_hello_unsigned")
        await _unchanged(agents, subs, view)
