"""The launch contract: everything ``gossiprec run`` hands its training process, in one place.

Both sides go through this module: the launcher (:mod:`gossiprec.agent.launcher`, and the torchrun
backend, :mod:`gossiprec.agent.torchrun`) writes the training process's environment with
:func:`trainer_environment` (which refuses a value the trainer could not read back) and the keyring
down its descriptor with :func:`keyring_message`; the trainer (:mod:`gossiprec.trainer.settings`,
:mod:`gossiprec.trainer.keys`) reads them back with :func:`read_launch_env`, which refuses a malformed
variable with a :class:`~gossiprec.errors.ConfigError` saying how to start the process instead, and
:func:`read_keyring_message`. Neither side imports the other.

The environment::

    GOSSIPREC_CONTROL     the agent's control socket (the trainer's channel to its agent)
    GOSSIPREC_NODE        this node's name in the cluster
    GOSSIPREC_RANK        the training rank in view 0, for a trainer (absent otherwise)
    GOSSIPREC_ROLE        ``trainer`` or ``spare``
    GOSSIPREC_CLUSTER     the cluster name (default :data:`DEFAULT_CLUSTER`)
    GOSSIPREC_KEYRING     the keyring file's path on a keyed cluster (never the key itself)
    GOSSIPREC_KEYRING_FD  instead of the path: the descriptor the keyring arrives on
    GOSSIPREC_LOG_FORMAT  the agent's log format, ``text`` or ``json``, and
    GOSSIPREC_LOG_LEVEL   its level: a trainer whose ``gossiprec`` logger has no handler, in a process whose
                          root logger has none either (nobody configured logging), logs its ``gossiprec``
                          lines (one per recovery, at info) to stderr in that format and level

and torch's own variables, so that a script written for torchrun runs unchanged (but see the spares)::

    LOCAL_RANK        this process's index among the job's slots on its host (trainers and spares alike:
                      ``torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))`` gives a spare a device of its own)
    LOCAL_WORLD_SIZE  the job's slots on this host
    RANK              the training rank in view 0, for a trainer; absent for a spare, whose rank comes with
                      the plan that promotes it (read ``rt.rank``: after a recovery it is the truth, not RANK)
    WORLD_SIZE        the trainers of view 0 (``rt.world_size`` after a shrink)

:func:`local_placement` derives the first two from the job's members and their hosts.

**The keyring descriptor** carries a stream of messages, each a 4-byte big-endian length and the
keyring's compact JSON (at most :data:`MAX_MESSAGE` bytes): the launcher writes the first before the
trainer starts, and another each time its agent's keyring changes.

**The port layout**: an agent listens on its port, its trainer's TCPStore server on that port +
:data:`STORE_OFFSET` and its state donor on + :data:`DONOR_OFFSET`; agents on one host are
:data:`PORTS_PER_AGENT` ports apart. Every member uses the same offsets, so any member's store and donor
follow from its address in the view.

**Exit codes**: a trainer that stops in good order exits with :data:`EXIT_STOPPED`, which the launcher
treats as a graceful end, like 0.
"""

from __future__ import annotations

import json
import os
import select
import time
from dataclasses import dataclass
from typing import Iterable, Mapping

from gossiprec.core.config import Config
from gossiprec.core.wire import ROLES as ROLES  # what GOSSIPREC_ROLE may say: a member's roles
from gossiprec.errors import ConfigError, SecurityError
from gossiprec.security.keyring import Keyring

CONTROL_ENV = "GOSSIPREC_CONTROL"
NODE_ENV = "GOSSIPREC_NODE"
RANK_ENV = "GOSSIPREC_RANK"
ROLE_ENV = "GOSSIPREC_ROLE"
CLUSTER_ENV = "GOSSIPREC_CLUSTER"
KEYRING_ENV = "GOSSIPREC_KEYRING"
KEYRING_FD_ENV = "GOSSIPREC_KEYRING_FD"
"""The variable naming the descriptor the keyring arrives on (``gossiprec run --keyring-fd``)."""
LOG_FORMAT_ENV = "GOSSIPREC_LOG_FORMAT"
LOG_LEVEL_ENV = "GOSSIPREC_LOG_LEVEL"

DEFAULT_CLUSTER: str = Config().cluster
"""The cluster name when none is given: the protocol's own default (agent and trainer agree on it)."""

STORE_OFFSET = 1
"""Default port offset of every trainer's TCPStore server from its agent's port."""
DONOR_OFFSET = 2
"""Default port offset of every trainer's state donor from its agent's port."""
PORTS_PER_AGENT = 3
"""Ports one agent and its trainer use: the agent's, the epoch store's (+1), the state donor's (+2)."""

EXIT_STOPPED = 75
"""A trainer's exit code for a job stopped in good order (sysexits' EX_TEMPFAIL: a scheduler may requeue)."""

FIRST_KEYS_TIMEOUT = 30.0
"""How long a trainer waits for the first keyring on its descriptor (the launcher writes it before it
starts the trainer, so it is there at once unless the descriptor is not the launcher's)."""
MAX_MESSAGE = 64 * 1024
"""Largest keyring message accepted (a keyring file is at most as large)."""

CONTROL_MISSING = (f"{CONTROL_ENV} is not set: start the training process with `gossiprec run ... -- python "
                   "train.py`, or pass the agent's control socket path")


# --- the environment --------------------------------------------------------------------------------
def trainer_environment(
    base: Mapping[str, str], *, control: str, node: str, role: str, rank: int | None, cluster: str,
    keyring: str | None = None, keyring_fd: int | None = None, local: tuple[int, int] = (0, 1),
    world_size: int | None = None, log: tuple[str, str] | None = None,
) -> dict[str, str]:
    """``base`` with the launch variables set: each given value written, each absent one removed (a value
    inherited from elsewhere would be taken for this agent's). ``keyring`` and ``keyring_fd`` exclude
    each other; ``local`` is ``(LOCAL_RANK, LOCAL_WORLD_SIZE)``; ``world_size`` the trainers of view 0;
    ``log`` the agent's (log format, log level), None: ``base``'s are kept.
    :class:`ConfigError` for a value the trainer could not read back."""
    if not control:
        raise ConfigError(f"{CONTROL_ENV}: the agent's control socket path is empty")
    if role not in ROLES:
        raise ConfigError(f"{ROLE_ENV}: expected one of {', '.join(ROLES)}, got {role!r}")
    if rank is not None and (type(rank) is not int or rank < 0):
        raise ConfigError(f"{RANK_ENV}: expected a non-negative integer, got {rank!r}")
    if keyring is not None and keyring_fd is not None:
        raise ConfigError(f"{KEYRING_ENV} and {KEYRING_FD_ENV} exclude each other: the keyring is handed over "
                          "by path or down a descriptor")
    if keyring_fd is not None and (type(keyring_fd) is not int or keyring_fd < 0):
        raise ConfigError(f"{KEYRING_FD_ENV}: expected a descriptor number, got {keyring_fd!r}")
    env = dict(base)
    env[CONTROL_ENV] = control
    env[NODE_ENV] = node
    env[ROLE_ENV] = role
    env[CLUSTER_ENV] = cluster
    _put(env, KEYRING_ENV, keyring)
    _put(env, KEYRING_FD_ENV, None if keyring_fd is None else str(keyring_fd))
    _put(env, RANK_ENV, None if rank is None else str(rank))
    index, count = local
    if not 0 <= index < count:
        raise ConfigError(f"LOCAL_RANK {index} is not below LOCAL_WORLD_SIZE {count}")
    env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"] = str(index), str(count)
    _put(env, "RANK", None if rank is None else str(rank))
    _put(env, "WORLD_SIZE", None if world_size is None else str(world_size))
    if log is not None:
        env[LOG_FORMAT_ENV], env[LOG_LEVEL_ENV] = log
    return env


def local_placement(members: Iterable[tuple[str, str, str]], me: str,
                    given: int | None = None) -> tuple[int, int]:
    """``(LOCAL_RANK, LOCAL_WORLD_SIZE)`` of member ``me`` among ``members`` (``(name, addr, host)``): its
    index among the members of its host, in port order (``gossiprec spec`` numbers a host's slots so),
    and how many there are. ``given`` (``--local-index``, ``SLURM_LOCALID``) wins for the index. A member
    with no host, or absent (a spare that joined later), is alone on its host unless ``given`` says."""
    rows = list(members)
    host = next((h for n, _, h in rows if n == me), "")
    same = sorted((_port_of(a), n) for n, a, h in rows if host and h == host)
    index = next((i for i, (_, n) in enumerate(same) if n == me), 0)
    if given is not None:
        index = given
    return index, max(len(same), index + 1)


def _port_of(addr: str) -> int:
    port = addr.rpartition(":")[2]
    return int(port) if port.isdigit() else 0


def _put(env: dict[str, str], name: str, value: str | None) -> None:
    if value is None:
        env.pop(name, None)
    else:
        env[name] = value


@dataclass(frozen=True, slots=True)
class LaunchEnv:
    """What a training process reads of the launch variables; an unset one is None."""

    control: str | None = None
    """The agent's control socket (``GOSSIPREC_CONTROL``)."""
    cluster: str = DEFAULT_CLUSTER
    """The cluster name (``GOSSIPREC_CLUSTER``)."""
    keyring: str | None = None
    """Path of the cluster's keyring (``GOSSIPREC_KEYRING``); None: an ``--insecure`` cluster."""
    keyring_fd: int | None = None
    """The descriptor the keyring arrives on (``GOSSIPREC_KEYRING_FD``), instead of a path."""
    log_format: str | None = None
    """The agent's log format (``GOSSIPREC_LOG_FORMAT``); None: not under ``gossiprec run``."""
    log_level: str = "info"
    """The agent's log level (``GOSSIPREC_LOG_LEVEL``)."""


def read_launch_env(environ: Mapping[str, str] | None = None) -> LaunchEnv:
    """The launch variables of ``environ`` (default :data:`os.environ`); an empty one counts as unset,
    except the cluster name. :class:`ConfigError` for a descriptor that is not a number."""
    env = os.environ if environ is None else environ
    fd_text = env.get(KEYRING_FD_ENV) or None
    if fd_text is not None and not fd_text.isdigit():
        raise ConfigError(f"{KEYRING_FD_ENV}={fd_text!r} is not a descriptor number; `gossiprec run "
                          "--keyring-fd` sets it")
    fmt = env.get(LOG_FORMAT_ENV) or None
    if fmt is not None and fmt not in ("text", "json"):
        raise ConfigError(f"{LOG_FORMAT_ENV}={fmt!r}: expected text or json")
    return LaunchEnv(control=env.get(CONTROL_ENV) or None, cluster=env.get(CLUSTER_ENV, DEFAULT_CLUSTER),
                     keyring=env.get(KEYRING_ENV) or None, keyring_fd=None if fd_text is None else int(fd_text),
                     log_format=fmt, log_level=(env.get(LOG_LEVEL_ENV) or "info").lower())


def control_path_from_env(environ: Mapping[str, str] | None = None) -> str:
    """The agent's control socket path handed to a training process (``GOSSIPREC_CONTROL``);
    :class:`ConfigError` when there is none."""
    env = os.environ if environ is None else environ
    path = env.get(CONTROL_ENV)
    if not path:
        raise ConfigError(CONTROL_MISSING)
    return path


# --- the keyring descriptor ------------------------------------------------------------------------
def keyring_message(ring: Keyring) -> bytes:
    """``ring`` as one message down the keyring descriptor: 4-byte big-endian length, compact JSON."""
    body = json.dumps(ring.to_json(), separators=(",", ":")).encode()
    return len(body).to_bytes(4, "big") + body


def read_keyring_message(fd: int, deadline: float | None) -> Keyring | None:
    """The next keyring message on ``fd``; None at end of file. ValueError for a broken stream (it ends
    inside a message, or a length out of bounds), TimeoutError when nothing arrives by ``deadline``
    (``time.monotonic()``; None: wait), :class:`~gossiprec.errors.SecurityError` for a well-framed
    message that is not a keyring."""
    head = _read_exact(fd, 4, deadline)
    if head is None:
        return None
    n = int.from_bytes(head, "big")
    if not 0 < n <= MAX_MESSAGE:
        raise ValueError(f"a keyring message of {n} bytes (at most {MAX_MESSAGE})")
    body = _read_exact(fd, n, deadline)
    if body is None:
        raise ValueError("the descriptor closed in the middle of a keyring")
    try:
        doc = json.loads(body)
    except ValueError as exc:
        raise SecurityError(f"the keyring from descriptor {fd} is not JSON ({exc})") from None
    return Keyring.from_json(doc, where=f"the keyring from descriptor {fd}")


def _read_exact(fd: int, n: int, deadline: float | None) -> bytes | None:
    """``n`` bytes from ``fd``; None at end of file before the first byte; ValueError if it ends half
    way, TimeoutError after ``deadline``."""
    out = b""
    while len(out) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise TimeoutError(f"nothing arrived within {FIRST_KEYS_TIMEOUT:.0f} s")
        chunk = os.read(fd, n - len(out))
        if not chunk:
            if out:
                raise ValueError("the descriptor closed in the middle of a keyring")
            return None
        out += chunk
    return out
