"""The keyring handed to the trainer down an inherited descriptor (``gossiprec run --keyring-fd``): the
environment names only the descriptor's number, the trainer's own children do not inherit it, and a
rotation the agent reloads reaches the running trainer."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import tempfile
from typing import Iterator

import pytest

from gossiprec.agent.launcher import Launcher
from gossiprec.agent.settings import AgentSettings
from gossiprec.errors import ConfigError
from gossiprec.security.keyring import Keyring, decode_key, encode_key, generate_key, key_id_hex
from gossiprec.local.launch import KEYRING_FD_ENV, keyring_message
from gossiprec.trainer.keys import TransferKeys
from gossiprec.trainer.settings import TrainerSettings

EVENT_TIMEOUT = 30.0


def _key() -> bytes:
    return decode_key(generate_key())


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    r, w = os.pipe()
    fds = [r, w]
    yield r, w
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def test_keys_from_a_descriptor_follow_each_keyring_sent_and_skip_a_bad_one(pipe: tuple[int, int]) -> None:
    r, w = pipe
    k1, k2 = _key(), _key()
    os.set_inheritable(r, True)  # as pass_fds leaves it in the child
    os.write(w, keyring_message(Keyring([k1])))
    keys = TransferKeys.from_fd(r)
    assert keys.keyed and keys.primary() == k1 and keys.accepted() == [k1]
    assert not os.get_inheritable(r)  # the trainer's own children get nothing
    body = b"{not json"
    os.write(w, len(body).to_bytes(4, "big") + body)  # well framed, bad: refused, the stream goes on
    os.write(w, keyring_message(Keyring([k1, k2], primary=k2)))  # a rotation: k2 signs, k1 still accepted
    assert keys.reloaded.wait(EVENT_TIMEOUT)
    assert keys.primary() == k2 and keys.accepted() == [k2, k1]
    keys.reloaded.clear()
    os.write(w, keyring_message(Keyring([k2])))  # k1 removed
    assert keys.reloaded.wait(EVENT_TIMEOUT)
    assert keys.accepted() == [k2] and keys.by_id(bytes.fromhex(key_id_hex(k1))) is None


def test_a_descriptor_that_is_not_open_or_closes_first_is_refused_with_what_to_do(pipe: tuple[int, int]) -> None:
    r, w = pipe
    with pytest.raises(ConfigError, match="not an open descriptor.*--keyring-fd"):
        TransferKeys.from_fd(987654)
    os.close(w)
    with pytest.raises(ConfigError, match="closed before a keyring arrived"):
        TransferKeys.from_fd(r)
    with pytest.raises(ConfigError, match="not a descriptor number"):
        TrainerSettings.from_env({KEYRING_FD_ENV: "keys.json"})
    assert TrainerSettings.from_env({KEYRING_FD_ENV: "7", "GOSSIPREC_KEYRING": "/k.json"}).keyring_fd == 7


CHILD = """
import json, os
from gossiprec.security.keyring import key_id_hex
from gossiprec.trainer.settings import TrainerSettings
st = TrainerSettings.from_env()
keys = st.transfer_keys()
env = {k: v for k, v in os.environ.items() if k.startswith("GOSSIPREC_")}
print(json.dumps({"env": env, "primary": key_id_hex(keys.primary()), "source": keys.source,
                  "inheritable": os.get_inheritable(st.keyring_fd)}), flush=True)
assert keys.reloaded.wait(30)
print(json.dumps({"accepted": [key_id_hex(k) for k in keys.accepted()]}), flush=True)
"""


async def test_the_launcher_passes_the_keyring_down_a_descriptor_and_then_its_rotation() -> None:
    d = tempfile.mkdtemp(prefix="gr", dir="/tmp")
    try:
        path = f"{d}/keyring.json"
        k1, k2 = _key(), _key()
        Keyring([k1]).save(path)
        s = AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=False, keyring=path, role="spare",
                          control_socket=f"{d}/n0.sock", protocol=(("suspicion_floor", 0.5),))
        env = {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": os.environ.get("PYTHONPATH", ""),
               "GOSSIPREC_KEYRING": path, KEYRING_FD_ENV: "3"}  # stale values from outside
        launcher = Launcher(s, [sys.executable, "-c", CHILD], forward_signals=False, environ=env, keyring_fd=True,
                            child_kwargs={"stdout": asyncio.subprocess.PIPE})
        task = asyncio.ensure_future(launcher.run())
        try:
            await asyncio.wait_for(launcher.started.wait(), EVENT_TIMEOUT)
            assert launcher.proc is not None and launcher.proc.stdout is not None and launcher.agent is not None
            first = json.loads(await asyncio.wait_for(launcher.proc.stdout.readline(), EVENT_TIMEOUT))
            fd = first["env"][KEYRING_FD_ENV]
            assert "GOSSIPREC_KEYRING" not in first["env"] and fd.isdigit(), first  # no path, only a number
            assert first["primary"] == key_id_hex(k1) and first["source"] == f"descriptor {fd}", first
            assert first["inheritable"] is False, first
            text = json.dumps(first)
            assert encode_key(k1) not in text and k1.hex() not in text
            ring = Keyring.load(path)  # rotate: install k2 and sign with it, as `gossiprec keys` does
            ring.install(k2)
            ring.use(k2)
            ring.save()
            assert launcher.agent.reload_keyring(force=True)
            second = json.loads(await asyncio.wait_for(launcher.proc.stdout.readline(), EVENT_TIMEOUT))
            assert second["accepted"] == [key_id_hex(k2), key_id_hex(k1)], second
            assert await asyncio.wait_for(task, EVENT_TIMEOUT) == 0
        finally:
            if not task.done():
                task.cancel()
    finally:
        shutil.rmtree(d, ignore_errors=True)
