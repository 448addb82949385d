"""Keyring: key encoding, install/use/remove rules, the 0600 file, reload, and the `keys` CLI."""

from __future__ import annotations

import argparse
import base64
import hashlib
import io
import json
import os
import stat
import sys
from pathlib import Path

import pytest

from gossiprec.errors import SecurityError
from gossiprec.security.keyring import (
    KEY_SIZE,
    Keyring,
    KeyringError,
    decode_key,
    encode_key,
    generate_key,
    key_id,
    key_id_hex,
)
from gossiprec.security.keys_cli import add_cli, parse_key_arg

K1 = bytes(range(32))
K2 = bytes(range(1, 33))
K3 = bytes(range(2, 34))


def test_key_text_round_trip_and_id() -> None:
    text = generate_key()
    raw = decode_key(text)
    assert len(raw) == KEY_SIZE and len(text) == 44
    assert encode_key(raw) == text
    assert key_id(raw) == hashlib.sha256(raw).digest()[:8]
    assert key_id_hex(raw) == hashlib.sha256(raw).hexdigest()[:16]
    assert generate_key() != text


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("", "empty key"),
        ("not base64!!", "not valid base64"),
        (base64.b64encode(b"x" * 16).decode(), "16 bytes, expected 32"),
        (base64.b64encode(b"x" * 33).decode(), "33 bytes, expected 32"),
    ],
)
def test_decode_key_refuses_malformed_with_clear_message(text: str, needle: str) -> None:
    with pytest.raises(KeyringError, match=needle) as info:
        decode_key(text)
    assert isinstance(info.value, SecurityError)
    assert "gossiprec keys generate" in str(info.value)


def test_install_use_remove_rules() -> None:
    ring = Keyring()
    assert ring.primary is None and len(ring) == 0
    assert ring.install(K1) is True
    assert ring.primary == K1  # first key of an empty ring becomes primary
    assert ring.install(K1) is False  # idempotent
    assert ring.install(K2) is True
    assert ring.primary == K1  # installing never changes the primary
    assert [(i.key_id, i.primary) for i in ring.list()] == [(key_id_hex(K1), True), (key_id_hex(K2), False)]

    with pytest.raises(KeyringError, match="refusing to remove the primary"):
        ring.remove(K1)
    with pytest.raises(KeyringError, match="not installed"):
        ring.use(K3)
    with pytest.raises(KeyringError, match="not installed"):
        ring.remove(K3)

    before = ring.keyset
    ring.use(key_id(K2))  # by id works too
    assert ring.primary == K2
    assert before.primary == K1, "old snapshots are immutable"
    ring.remove(K1)
    assert K1 not in ring and K2 in ring and ring.get(key_id(K1)) is None


def test_save_writes_0600_atomically_even_with_permissive_umask(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "keyring.json"
    ring = Keyring([K1, K2], primary=K2)
    old = os.umask(0)
    try:
        ring.save(path)
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert os.listdir(path.parent) == ["keyring.json"], "no temp file left behind"
    doc = json.loads(path.read_text())
    assert doc["primary"] == encode_key(K2) and doc["keys"] == [encode_key(K1), encode_key(K2)]
    loaded = Keyring.load(path)
    assert loaded.keyset.keys == (K1, K2) and loaded.primary == K2


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o620])
def test_load_refuses_file_accessible_by_group_or_others(tmp_path: Path, mode: int) -> None:
    path = tmp_path / "keyring.json"
    Keyring([K1]).save(path)
    path.chmod(mode)
    with pytest.raises(KeyringError) as info:
        Keyring.load(path)
    msg = str(info.value)
    assert f"{mode:04o}" in msg and f"chmod 600 {path}" in msg
    path.chmod(0o600)
    assert Keyring.load(path).primary == K1


def test_load_refuses_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real.json"
    Keyring([K1]).save(real)
    link = tmp_path / "link.json"
    link.symlink_to(real)
    with pytest.raises(KeyringError, match="symlink"):
        Keyring.load(link)


def _write_private(path: Path, text: str) -> None:
    path.write_text(text)
    path.chmod(0o600)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ("{not json", "not valid JSON"),
        (json.dumps([encode_key(K1)]), "not a gossiprec keyring"),
        (json.dumps({"format": "gossiprec-keyring", "version": 9, "keys": []}), "version 9"),
        (json.dumps({"format": "gossiprec-keyring", "version": 1, "primary": encode_key(K1),
                     "keys": ["AAAA"]}), "key #0"),
        (json.dumps({"format": "gossiprec-keyring", "version": 1, "primary": encode_key(K3),
                     "keys": [encode_key(K1)]}), "not in \"keys\""),
        (json.dumps({"format": "gossiprec-keyring", "version": 1, "primary": encode_key(K1),
                     "keys": [encode_key(K1), encode_key(K1)]}), "appears twice"),
        (json.dumps({"format": "gossiprec-keyring", "version": 1, "keys": [encode_key(K1)]}),
         "\"primary\" is missing"),
    ],
)
def test_load_refuses_malformed_files(tmp_path: Path, doc: str, needle: str) -> None:
    path = tmp_path / "keyring.json"
    _write_private(path, doc)
    with pytest.raises(KeyringError, match=needle):
        Keyring.load(path)


def test_load_missing_file_says_how_to_create(tmp_path: Path) -> None:
    with pytest.raises(KeyringError, match="keys install"):
        Keyring.load(tmp_path / "absent.json")


def test_load_if_changed_reloads_once_and_keeps_keys_on_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "keyring.json"
    Keyring([K1]).save(path)
    agent = Keyring.load(path)
    assert agent.load_if_changed() is False

    cli = Keyring.load(path)  # another process edits the file
    cli.install(K2)
    cli.use(K2)
    cli.save(path)
    assert agent.load_if_changed() is True
    assert agent.primary == K2 and K1 in agent
    assert agent.load_if_changed() is False

    _write_private(path, "{broken")
    with pytest.raises(KeyringError, match="not valid JSON"):
        agent.load_if_changed()
    assert agent.primary == K2 and K1 in agent, "a failed reload keeps the keys in memory"
    path.chmod(0o644)
    with pytest.raises(KeyringError, match="chmod 600"):
        agent.reload()
    assert agent.primary == K2


def test_parse_key_arg_accepts_key_or_id() -> None:
    assert parse_key_arg(encode_key(K1)) == K1
    assert parse_key_arg(key_id_hex(K1)) == key_id(K1)
    with pytest.raises(KeyringError):
        parse_key_arg("zz")


# --- CLI ---------------------------------------------------------------------------------------

def _parser(default_path: Path) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="gossiprec")
    sub = parser.add_subparsers(dest="command")
    add_cli(sub, default_path=str(default_path))
    return parser


def _run(parser: argparse.ArgumentParser, *argv: str) -> int:
    args = parser.parse_args(list(argv))
    rc = args.func(args)
    assert isinstance(rc, int)
    return rc


def test_cli_full_rotation(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keyring.json"
    p = _parser(path)

    assert _run(p, "keys", "generate") == 0
    old = capsys.readouterr().out.strip()
    assert len(decode_key(old)) == 32
    assert not path.exists(), "generate installs nothing"
    assert _run(p, "keys", "generate") == 0
    new = capsys.readouterr().out.strip()

    assert _run(p, "keys", "install", old) == 0
    assert "as the primary" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert _run(p, "keys", "install", new) == 0
    out = capsys.readouterr().out
    assert f"keys use {key_id_hex(decode_key(new))}" in out

    assert _run(p, "keys", "list", "--json") == 0
    listing = json.loads(capsys.readouterr().out)
    assert listing["primary"] == key_id_hex(decode_key(old))
    assert [k["key_id"] for k in listing["keys"]] == [key_id_hex(decode_key(old)),
                                                       key_id_hex(decode_key(new))]

    assert _run(p, "keys", "remove", old) == 1
    err = capsys.readouterr().err
    assert "refusing to remove the primary" in err and err.startswith("gossiprec keys: error:")

    assert _run(p, "keys", "use", key_id_hex(decode_key(new))) == 0
    assert "primary key" in capsys.readouterr().out
    assert _run(p, "keys", "remove", old) == 0
    assert "removed key" in capsys.readouterr().out

    assert _run(p, "keys", "list") == 0
    out = capsys.readouterr().out
    assert key_id_hex(decode_key(new)) in out and "primary" in out
    assert key_id_hex(decode_key(old)) not in out
    assert new not in out and old not in out, "list never prints key material"
    ring = Keyring.load(path)
    assert ring.primary == decode_key(new) and len(ring) == 1


def test_cli_keyring_option_before_or_after_action(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    default = tmp_path / "default.json"
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    p = _parser(default)
    assert _run(p, "keys", "--keyring", str(a), "install", encode_key(K1)) == 0
    assert _run(p, "keys", "install", encode_key(K2), "--keyring", str(b)) == 0
    capsys.readouterr()
    assert Keyring.load(a).primary == K1 and Keyring.load(b).primary == K2
    assert not default.exists()


def test_cli_errors_exit_1_with_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keyring.json"
    p = _parser(path)
    assert _run(p, "keys", "list") == 1
    assert "does not exist" in capsys.readouterr().err
    assert _run(p, "keys", "install", "garbage") == 1
    assert "not valid base64" in capsys.readouterr().err
    assert _run(p, "keys", "install", encode_key(K1)) == 0
    assert _run(p, "keys", "use", encode_key(K2)) == 1
    assert "not installed" in capsys.readouterr().err
    path.chmod(0o644)
    assert _run(p, "keys", "list") == 1
    assert "chmod 600" in capsys.readouterr().err
    assert _run(p, "keys") == 2  # no action: help, usage error


def test_cli_install_reads_key_from_stdin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keyring.json"
    monkeypatch.setattr(sys, "stdin", io.StringIO(encode_key(K3) + "\n"))
    assert _run(_parser(path), "keys", "install", "-") == 0
    assert Keyring.load(path).primary == K3


def test_cli_install_reads_the_key_from_stdin_or_a_file_and_warns_on_argv(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "keyring.json"
    p = _parser(path)
    k1, k2, k3 = (encode_key(bytes([i]) * 32) for i in (1, 2, 3))
    monkeypatch.setattr("sys.stdin", io.StringIO(k1 + "\n"))
    assert _run(p, "keys", "install") == 0  # the documented form: `keys generate | keys install`
    out = capsys.readouterr()
    assert "as the primary" in out.out and out.err == ""
    keyfile = tmp_path / "new.key"
    keyfile.write_text(k2 + "\n")
    assert _run(p, "keys", "install", "--key-file", str(keyfile)) == 0
    assert capsys.readouterr().err == ""
    assert _run(p, "keys", "install", k3) == 0  # still accepted on argv, with a warning
    err = capsys.readouterr().err
    assert "readable by every local user" in err and "/proc/<pid>/cmdline" in err
    assert [i.key_id for i in Keyring.load(path).list()] == [key_id_hex(decode_key(k)) for k in (k1, k2, k3)]
    assert _run(p, "keys", "install", k1, "--key-file", str(keyfile)) == 1
    assert "give the key once" in capsys.readouterr().err


def test_cli_use_warns_that_peers_without_the_key_evict_this_node(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "keyring.json"
    Keyring([K1, K2]).save(path)
    p = _parser(path)
    assert _run(p, "keys", "use", key_id_hex(K2)) == 0
    err = capsys.readouterr().err
    assert "every peer that has not installed it refuses this node's packets" in err
    assert _run(p, "keys", "use", key_id_hex(K1), "--installed-everywhere") == 0
    assert capsys.readouterr().err == ""
    assert Keyring.load(path).keyset.primary_id == key_id(K1)
