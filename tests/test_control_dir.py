"""The default control-socket directory has a predictable name (``$XDG_RUNTIME_DIR/gossiprec``, else
``/tmp/gossiprec-<uid>``): the agent accepts it only as this user's own 0700 directory, checked without
following a symlink, so another local user who took the name first gets a clear refusal, never our
socket. A directory chosen with ``--control-socket`` may still be a sticky shared one, but not through
a symlink someone else owns."""

from __future__ import annotations

import os
import shutil
import stat
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings, default_control_path
from gossiprec.errors import ConfigError
from gossiprec.local.server import bind_unix_socket


@pytest.fixture
def runtime(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="grd", dir="/tmp"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(d))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def agent() -> Agent:
    return Agent(AgentSettings(name="n0", bind_host="127.0.0.1", port=0, insecure=True))


def test_the_runtime_dir_is_preferred_and_created_private(runtime: Path) -> None:
    assert default_control_path(7980) == f"{runtime}/gossiprec/agent-7980.sock"
    assert default_control_path(7980, {}) == f"/tmp/gossiprec-{os.getuid()}/agent-7980.sock"


async def test_the_agent_creates_its_default_directory_0700(runtime: Path) -> None:
    async with agent() as a:
        assert Path(a.control_path).parent == runtime / "gossiprec"
        assert stat.S_IMODE(os.lstat(runtime / "gossiprec").st_mode) == 0o700


async def test_a_symlink_in_place_of_the_default_directory_is_refused(runtime: Path) -> None:
    shared = runtime / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)  # like /tmp: a check that followed the link would accept it
    (runtime / "gossiprec").symlink_to(shared)
    with pytest.raises(ConfigError, match="is a symlink; another local user may have created it"):
        await agent().start()


async def test_an_open_default_directory_is_refused_with_the_fix(runtime: Path) -> None:
    (runtime / "gossiprec").mkdir(mode=0o755)
    os.chmod(runtime / "gossiprec", 0o755)
    with pytest.raises(ConfigError, match="has mode 755; it must be 0700"):
        await agent().start()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to hand a directory to another uid")
async def test_a_default_directory_of_another_user_is_refused(runtime: Path) -> None:
    d = runtime / "gossiprec"
    d.mkdir(mode=0o700)
    os.chown(d, 4242, 4242)
    with pytest.raises(ConfigError, match="belongs to uid 4242, not to you"):
        await agent().start()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to own a symlink as another uid")
def test_a_chosen_directory_through_another_users_symlink_is_refused(runtime: Path) -> None:
    shared = runtime / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    link = runtime / "link"
    link.symlink_to(shared)
    os.lchown(link, 4242, 4242)
    with pytest.raises(ConfigError, match="symlink owned by another user"):
        bind_unix_socket(f"{link}/c.sock")
    sock, _ = bind_unix_socket(f"{shared}/c.sock")  # the shared sticky directory itself is allowed
    sock.close()
