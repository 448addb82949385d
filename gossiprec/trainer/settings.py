"""Where the trainer finds its agent and its key: the one place the trainer reads ``GOSSIPREC_*`` variables.

``gossiprec run`` hands its training process the agent's coordinates in ``GOSSIPREC_*`` variables
(the launch contract, :mod:`gossiprec.local.launch`); :meth:`TrainerSettings.from_env` reads the ones
the trainer uses through it, and ``ResilientTrainer`` calls it only when its caller passes no control
client or no key.
Everything else in the trainer takes these values as arguments. (The one other variable the trainer
looks at is torch's own ``TORCH_NCCL_ASYNC_ERROR_HANDLING``, which NCCL reads itself: building an NCCL
group checks it, see :mod:`gossiprec.trainer.collectives.groups`.)

**Keys.** State transfers and the epoch stores are authenticated with the cluster's keyring, whose path
(never the key) ``gossiprec run`` puts in ``GOSSIPREC_KEYRING``, or which arrives on the descriptor
``GOSSIPREC_KEYRING_FD`` names (``gossiprec run --keyring-fd``); it is followed as it rotates
(:mod:`gossiprec.trainer.keys`). Without one (``--insecure`` clusters) a key derived from the cluster name
is used, which protects against accidents, not attackers; ``ResilientTrainer.start`` refuses it when the
agent says the cluster is keyed.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Mapping

from gossiprec.errors import ConfigError
from gossiprec.local.client import ControlClient
from gossiprec.local.launch import CONTROL_MISSING, DEFAULT_CLUSTER, read_launch_env
from gossiprec.local.logformat import log_handler
from gossiprec.trainer.keys import TransferKeys

CONTROL_TIMEOUT = 30.0
"""Seconds a trainer waits for its agent's reply to a request (the state and report messages of every
step are not requests: they never wait). Generous: when a whole job starts at once on few cores, an
agent may take many seconds to answer its first request; a dead agent closes the socket, which fails
at once."""


@dataclass(frozen=True, slots=True)
class TrainerSettings:
    """The trainer's coordinates, as ``gossiprec run`` hands them to its training process."""

    control_path: str | None = None
    """The agent's control socket (``GOSSIPREC_CONTROL``); None: not known (pass a connected client)."""
    cluster: str = DEFAULT_CLUSTER
    """The cluster name (``GOSSIPREC_CLUSTER``): what the insecure transfer key is derived from."""
    keyring: str | None = None
    """Path of the cluster's keyring (``GOSSIPREC_KEYRING``); None: an ``--insecure`` cluster."""
    keyring_fd: int | None = None
    """The descriptor the keyring arrives on (``GOSSIPREC_KEYRING_FD``), instead of a path."""
    log_format: str | None = None
    """The agent's log format (``GOSSIPREC_LOG_FORMAT``, ``text`` or ``json``); None: not under ``gossiprec run``."""
    log_level: str = "info"
    """The agent's log level (``GOSSIPREC_LOG_LEVEL``)."""

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> TrainerSettings:
        """The settings ``environ`` (default :data:`os.environ`) holds; unset variables stay None.
        :class:`~gossiprec.errors.ConfigError` for a malformed one."""
        env = read_launch_env(environ)
        return cls(control_path=env.control, cluster=env.cluster, keyring=env.keyring, keyring_fd=env.keyring_fd,
                   log_format=env.log_format, log_level=env.log_level)

    def configure_logging(self, stream: object = None) -> bool:
        """Under ``gossiprec run`` (a log format is set), log the ``gossiprec`` logger's lines in the agent's
        format and level, unless this process configured logging (the ``gossiprec`` logger or the root
        has a handler): a library leaves the user's logging alone. Returns whether it configured."""
        logger = logging.getLogger("gossiprec")
        if self.log_format is None or logger.handlers or logging.getLogger().handlers:
            return False
        logger.addHandler(log_handler(self.log_format, stream))
        level = logging.getLevelName(self.log_level.upper())
        logger.setLevel(level if isinstance(level, int) else logging.INFO)
        logger.propagate = False  # (the root has no handler: its last resort would print warnings twice)
        return True

    def connect(self, *, timeout: float = CONTROL_TIMEOUT) -> ControlClient:
        """A client connected to the agent's control socket (requests wait ``timeout`` seconds)."""
        if not self.control_path:
            raise ConfigError(CONTROL_MISSING)
        return ControlClient(self.control_path, timeout=timeout)

    def transfer_keys(self) -> TransferKeys:
        """The keys state transfers and stores are authenticated with (see the module docstring)."""
        if self.keyring_fd is not None:
            return TransferKeys.from_fd(self.keyring_fd)
        if self.keyring:
            return TransferKeys.from_file(self.keyring)
        return TransferKeys.insecure(self.cluster)

    def transfer_key(self) -> bytes:
        """The 32-byte key a transfer is signed with now (the keyring's primary)."""
        return self.transfer_keys().primary()


def transfer_key(keyring: str | None, cluster: str = DEFAULT_CLUSTER) -> bytes:
    """The primary key of the keyring at ``keyring``, else a key derived from ``cluster`` (insecure)."""
    return TrainerSettings(keyring=keyring, cluster=cluster).transfer_key()
