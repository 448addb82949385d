"""Agent settings: the one place that reads ``GOSSIPREC_*`` environment variables and the TOML file.

Theory of operation
-------------------
:class:`AgentSettings` is a frozen dataclass of everything an agent process needs to start: identity
(name, role, rank), network (bind address, port, advertised address, seeds), protocol (profile, cluster
name, overrides of :class:`~gossiprec.core.config.Config` fields), security (keyring path or insecure
mode), the control socket path and logging. It validates itself on construction and reports *every*
bad value in one :class:`~gossiprec.errors.ConfigError`, each problem naming where the value came from
(``--port``, ``GOSSIPREC_PORT``, ``file.toml: port``) and what would be accepted.

Sources, highest precedence first::

    command-line flags  >  environment (GOSSIPREC_*)  >  TOML file (--config / GOSSIPREC_CONFIG)  >  defaults

:func:`load_settings` merges raw values from the three sources field by field; :func:`add_agent_arguments`
adds the flags to an :mod:`argparse` parser (every default is ``None`` so that "not given" is visible)
and :func:`settings_from_args` turns parsed flags plus an environment mapping into settings. Nothing
else in the agent reads the environment or a settings file; the core gets a frozen ``Config``. The
variables a training process reads are the launch contract's (:mod:`gossiprec.local.launch`).

Environment variables (``GOSSIPREC_CONTROL``, ``GOSSIPREC_NODE`` and ``GOSSIPREC_RANK`` are also what
``gossiprec run`` hands to the training process, with the same meaning)::

    GOSSIPREC_NODE GOSSIPREC_BIND GOSSIPREC_PORT GOSSIPREC_ADVERTISE GOSSIPREC_SEEDS (comma separated)
    GOSSIPREC_ROLE GOSSIPREC_RANK GOSSIPREC_PROFILE GOSSIPREC_CLUSTER GOSSIPREC_KEYRING
    GOSSIPREC_INSECURE (1/0, true/false, yes/no) GOSSIPREC_CONTROL GOSSIPREC_LOG_FORMAT
    GOSSIPREC_LOG_LEVEL GOSSIPREC_METRICS_PORT GOSSIPREC_METRICS_BIND GOSSIPREC_TIMELINE GOSSIPREC_JOB
    GOSSIPREC_ALIGN_TIMERS (1/0)
    GOSSIPREC_EXIT_BELL (1/0) GOSSIPREC_MESH (the device mesh, as --mesh) GOSSIPREC_CONFIG (path of the TOML file)

TOML file: the same names as the dataclass fields at top level (``port = 7980``, ``seeds = ["a:7980"]``),
plus an optional ``[protocol]`` table of ``Config`` overrides (``probe_interval = 0.2``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import socket
import tomllib
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any, Callable, Mapping

from gossiprec.core.config import AgreementConfig, Config
from gossiprec.core.mesh import MeshShape, parse_mesh
from gossiprec.errors import ConfigError
from gossiprec.local.launch import (
    CLUSTER_ENV, CONTROL_ENV, DEFAULT_CLUSTER, KEYRING_ENV, LOG_FORMAT_ENV, LOG_LEVEL_ENV, NODE_ENV, PORTS_PER_AGENT,
    RANK_ENV, ROLE_ENV, ROLES,
)

log = logging.getLogger(__name__)

DEFAULT_PORT = 7980
DEFAULT_TIMELINE = "gossiprec-timeline.jsonl"
"""The timeline file of ``gossiprec agent`` and ``gossiprec run`` (in their working directory) when none is given."""
"""UDP and TCP port of the agent (both protocols share the number)."""
AGENT_STARTUP_GRACE = 30.0
"""Seconds an agent waits before probing a view-0 member it has not heard from yet (see the core's
``Config.startup_grace``). On a loaded machine a job's agents come up seconds apart; without a grace
their peers suspected the late ones, raised alerts that could not be decided under that load, and
fenced the whole cluster before training began."""
AGENT_PROFILES = ("lan", "wan")
LOG_FORMATS = ("json", "text")
LOG_LEVELS = ("debug", "info", "warning", "error")
UNIX_PATH_MAX = 107
"""Longest path a Unix socket can bind on Linux (sun_path is 108 bytes with the terminating NUL)."""

ENV: dict[str, str] = {
    "name": NODE_ENV,
    "bind_host": "GOSSIPREC_BIND",
    "port": "GOSSIPREC_PORT",
    "advertise": "GOSSIPREC_ADVERTISE",
    "seeds": "GOSSIPREC_SEEDS",
    "role": ROLE_ENV,
    "rank": RANK_ENV,
    "profile": "GOSSIPREC_PROFILE",
    "cluster": CLUSTER_ENV,
    "keyring": KEYRING_ENV,
    "signing_key": "GOSSIPREC_SIGNING_KEY",
    "insecure": "GOSSIPREC_INSECURE",
    "control_socket": CONTROL_ENV,
    "log_format": LOG_FORMAT_ENV,
    "log_level": LOG_LEVEL_ENV,
    "metrics_port": "GOSSIPREC_METRICS_PORT",
    "metrics_bind": "GOSSIPREC_METRICS_BIND",
    "timeline": "GOSSIPREC_TIMELINE",
    "timeline_interval": "GOSSIPREC_TIMELINE_INTERVAL",
    "job": "GOSSIPREC_JOB",
    "align_timers": "GOSSIPREC_ALIGN_TIMERS",
    "exit_bell": "GOSSIPREC_EXIT_BELL",
    "nnodes": "GOSSIPREC_NNODES",
    "nproc_per_node": "GOSSIPREC_NPROC_PER_NODE",
    "spares": "GOSSIPREC_SPARES",
    "allow_shrink": "GOSSIPREC_ALLOW_SHRINK",
    "local_index": "GOSSIPREC_LOCAL_INDEX",
    "host": "GOSSIPREC_HOST",
    "bootstrap_timeout": "GOSSIPREC_BOOTSTRAP_TIMEOUT",
    "public_keys": "GOSSIPREC_PUBLIC_KEYS",
    "mesh": "GOSSIPREC_MESH",
}
"""Setting field -> environment variable."""
ENV_CONFIG_FILE = "GOSSIPREC_CONFIG"


@dataclass(frozen=True, slots=True)
class AgentSettings:
    """Everything an agent process needs to start. Validated on construction (:class:`ConfigError`)."""

    name: str | None = None
    """Node name, unique in the cluster. None: ``<hostname>:<port>`` once the port is bound."""
    bind_host: str = "0.0.0.0"
    """Address the UDP and TCP sockets bind to. Default: with a job spec that lists this member, the address
    of its line there; else every interface."""
    port: int = DEFAULT_PORT
    """Port for UDP and TCP (0: any free port, for tests)."""
    advertise: str | None = None
    """``host`` or ``host:port`` other members use to reach this node. None: the bind address, or when
    that is a wildcard, the address of the interface that routes to the first seed."""
    seeds: tuple[str, ...] = ()
    """``host:port`` of members to join through (any live member will do; this node's own is skipped)."""
    role: str = "trainer"
    """``trainer`` (runs a training process) or ``spare`` (hot spare, takes over a failed rank)."""
    rank: int | None = None
    """The training rank this node runs, if known at start."""
    profile: str = "lan"
    """Protocol timing profile: ``lan`` (training fabric) or ``wan`` (10x the timeouts)."""
    cluster: str = DEFAULT_CLUSTER
    """Cluster name: packets of other clusters never open (it is part of the authenticated data)."""
    keyring: str | None = None
    """Keyring file (see ``gossiprec keys``). Required unless ``insecure``; :func:`load_settings` falls
    back to :func:`default_keyring_path` when that file exists."""
    signing_key: str | None = None
    """This agent's persistent Ed25519 key file (gossiprec.security.signing; created, mode 0600, when
    absent). Needed when the job spec pins this member's public key. None: a fresh key each start."""
    insecure: bool = False
    """Send and accept unauthenticated, unencrypted packets (trusted networks and tests only)."""
    control_socket: str | None = None
    """Unix socket for the training process. None: ``default_control_path(port)``."""
    log_format: str = "text"
    """``text`` (for people) or ``json`` (one object per line, for log shippers)."""
    log_level: str = "info"
    """``debug``, ``info``, ``warning`` or ``error``."""
    metrics_port: int | None = None
    """Port of the Prometheus endpoint; None: no endpoint."""
    metrics_bind: str | None = None
    """Address the Prometheus endpoint listens on. None: :meth:`metrics_host` (the agent's own address,
    never every interface unless asked)."""
    timeline: str | None = None
    """File the agent appends its trainer's recoveries and step samples to, as JSON lines (see
    gossiprec.agent.recoveries). ``gossiprec agent`` and ``gossiprec run`` default to
    ``gossiprec-timeline.jsonl`` in their working directory; ``-`` or empty: none. None: none (an agent
    built in code)."""
    timeline_interval: float = 5.0
    """Seconds between two ``steps`` samples of the timeline (step and step time of the trainer)."""
    protocol: tuple[tuple[str, Any], ...] = ()
    """Overrides of :class:`~gossiprec.core.config.Config` fields, as sorted (name, value) pairs."""
    job: str | None = None
    """Job spec (TOML): the members of view 0, their ranks and the topology (see gossiprec.agent.jobspec).
    None: this agent joins an existing job through its seeds, as a spare."""
    align_timers: bool = True
    """Set the pump's timer on uvloop's millisecond clock and sleep out a timer that fires up to 2 ms
    early (see gossiprec.agent.timers). False: plain ``call_later``; a timer that fires early goes once
    more around the event loop."""
    exit_bell: bool = True
    """Watch the trainer's exit bell (gossiprec.local.bell), so that a dying trainer is seen before the
    kernel has torn its memory down. False: no bell; its death is seen when it has exited (by the
    launcher of ``gossiprec run``)."""
    nnodes: int | None = None
    """Hosts of a job started without a job spec: view 0 is then agreed by the agents through their
    seeds (``nnodes * nproc_per_node`` members, see gossiprec.core.bootstrap). None: a job spec
    (``job``) or a joiner."""
    nproc_per_node: int = 1
    """Agents (agent + trainer pairs) per host, with ``nnodes``."""
    spares: int = 0
    """With ``nnodes``: how many of the members are hot spares (the last in rank order)."""
    allow_shrink: bool = False
    """With ``nnodes``: with no spare left, drop data-parallel replicas instead of stopping."""
    local_index: int | None = None
    """This agent's index on its host (its rank order there), with ``nnodes``. None: by port."""
    host: str | None = None
    """The host name ranks are ordered by, with ``nnodes``. None: this machine's host name."""
    bootstrap_timeout: float = 300.0
    """Seconds an agent started with ``nnodes`` waits for view 0 before it gives up, naming who it
    found (too few agents started, or a majority of the seeds is not up)."""
    public_keys: str | None = None
    """With ``nnodes``: a TOML file whose ``[public_keys]`` table pins agents' public keys, as a job spec's
    does (``gossiprec keys public``); then only the agents it names take part in the bootstrap, and each
    runs with its ``signing_key``. None: keys bound on first use."""
    mesh: str | None = None
    """The job's device mesh, ``NAME=SIZE,NAME=SIZE``, the replicate (data-parallel) dimension first
    (``replicate=2,shard=4``; a single ``replicate=N`` is plain DDP; see gossiprec.core.mesh). With ``nnodes``
    view 0's topology is the mesh's; with a job spec the spec's topology must be the mesh's. None: the
    job spec's topology, or plain DDP (also when empty)."""
    config_file: str | None = None
    """The TOML file these settings were read from (informational)."""
    origins: Mapping[str, str] = field(default_factory=dict, compare=False, repr=False)
    """Where each non-default value came from, for error messages (field -> "--port" etc.)."""

    def __post_init__(self) -> None:
        problems: list[str] = []

        def bad(name: str, msg: str) -> None:
            where = self.origins.get(name, name)
            problems.append(f"{where}: {msg}")

        if self.name is not None and not 1 <= len(self.name.encode()) <= 128:
            bad("name", f"node name must be 1..128 bytes, got {self.name!r}")
        if not self.bind_host:
            bad("bind_host", "bind address is empty; use 0.0.0.0 to listen on every interface")
        if not _is_port(self.port):
            bad("port", f"expected a port number 0..65535, got {self.port!r}")
        if self.advertise is not None:
            try:
                host, port = split_host_port(self.advertise, default_port=0)
                if _is_wildcard(host):
                    bad("advertise", f"{self.advertise!r} is a wildcard address; others cannot reach it, "
                                     "advertise this host's routable address")
            except ConfigError as exc:
                bad("advertise", str(exc))
        for seed in self.seeds:
            try:
                split_host_port(seed, default_port=DEFAULT_PORT)
            except ConfigError as exc:
                bad("seeds", str(exc))
        if self.role not in ROLES:
            bad("role", f"expected one of {', '.join(ROLES)}, got {self.role!r}")
        if self.rank is not None and (type(self.rank) is not int or self.rank < 0):
            bad("rank", f"expected a non-negative integer, got {self.rank!r}")
        if self.profile not in AGENT_PROFILES:
            bad("profile", f"expected one of {', '.join(AGENT_PROFILES)}, got {self.profile!r}")
        if self.log_format not in LOG_FORMATS:
            bad("log_format", f"expected one of {', '.join(LOG_FORMATS)}, got {self.log_format!r}")
        if self.log_level not in LOG_LEVELS:
            bad("log_level", f"expected one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.metrics_port is not None and not _is_port(self.metrics_port):
            bad("metrics_port", f"expected a port number 0..65535, got {self.metrics_port!r}")
        if self.metrics_bind is not None and not self.metrics_bind.strip():
            bad("metrics_bind", "empty address; give a host (0.0.0.0 for every interface)")
        if self.insecure and self.keyring is not None:
            bad("insecure", f"insecure mode and a keyring ({self.keyring}) exclude each other; drop one")
        if not self.insecure and self.keyring is None:
            bad("keyring", "no keyring: pass --keyring PATH (create one with `gossiprec keys generate | "
                           "gossiprec keys install --keyring PATH`), or --insecure on a trusted network")
        if self.control_socket is not None:
            if not self.control_socket:
                bad("control_socket", "empty path")
            elif len(os.fsencode(self.control_socket)) > UNIX_PATH_MAX:
                bad("control_socket", f"path is {len(os.fsencode(self.control_socket))} bytes; a Unix "
                                      f"socket path must be at most {UNIX_PATH_MAX}; choose a shorter one")
        if self.nnodes is not None:
            if type(self.nnodes) is not int or self.nnodes < 1:
                bad("nnodes", f"expected a number of hosts >= 1, got {self.nnodes!r}")
            elif self.job is not None:
                bad("nnodes", f"a job spec ({self.job}) and --nnodes exclude each other: the spec lists view 0, "
                              "--nnodes has the agents agree on it; drop one")
            elif not self.seeds:
                bad("nnodes", "--nnodes needs --seed HOST:PORT (the same list on every agent; several, so that a "
                              "minority of them may be dead at the start)")
            elif type(self.nproc_per_node) is int and type(self.spares) is int and not (
                    0 <= self.spares < self.nnodes * max(self.nproc_per_node, 1)):
                bad("spares", f"expected 0 <= spares < nnodes x nproc_per_node = "
                              f"{self.nnodes * max(self.nproc_per_node, 1)}, got {self.spares!r}")
        if type(self.nproc_per_node) is not int or self.nproc_per_node < 1:
            bad("nproc_per_node", f"expected an integer >= 1, got {self.nproc_per_node!r}")
        if type(self.spares) is not int or self.spares < 0:
            bad("spares", f"expected an integer >= 0, got {self.spares!r}")
        if self.local_index is not None and (type(self.local_index) is not int or self.local_index < 0):
            bad("local_index", f"expected an integer >= 0, got {self.local_index!r}")
        if self.host is not None and not self.host:
            bad("host", "empty host name")
        if self.mesh:
            try:
                trainers = None
                if type(self.nnodes) is int and type(self.nproc_per_node) is int and type(self.spares) is int:
                    trainers = self.nnodes * self.nproc_per_node - self.spares
                parse_mesh(self.mesh, trainers, where=self.origins.get("mesh", "mesh"))
            except ConfigError as exc:
                problems.append(str(exc))
        if self.public_keys is not None and self.nnodes is None:
            bad("public_keys", "pins the keys of a bootstrap (--nnodes); a job spec pins them in its own "
                               "[public_keys] table")
        if isinstance(self.timeline_interval, bool) or not isinstance(self.timeline_interval, (int, float)) \
                or not 0 < self.timeline_interval < math.inf:
            bad("timeline_interval", f"expected seconds > 0, got {self.timeline_interval!r}")
        if isinstance(self.bootstrap_timeout, bool) or not isinstance(self.bootstrap_timeout, (int, float)) \
                or not 0 < self.bootstrap_timeout < math.inf:
            bad("bootstrap_timeout", f"expected seconds > 0, got {self.bootstrap_timeout!r}")
        if self.profile in AGENT_PROFILES and self.cluster:
            try:
                self.protocol_config()
                self.agreement_config()
            except (ConfigError, TypeError) as exc:
                bad("protocol", str(exc))
        elif not self.cluster:
            bad("cluster", "cluster name is empty")
        if problems:
            raise ConfigError("invalid agent settings:\n  " + "\n  ".join(problems))

    def protocol_config(self) -> Config:
        """The core's frozen :class:`Config` for these settings. An agent gets ``startup_grace`` =
        :data:`AGENT_STARTUP_GRACE` unless the ``[protocol]`` table sets it: a job's agents start one by
        one, and none should be judged before it had the time to come up."""
        over = {k: v for k, v in self.protocol if k not in _AGREEMENT_FIELDS}
        return Config.profile(self.profile, cluster=self.cluster, **{"startup_grace": AGENT_STARTUP_GRACE, **over})

    def agreement_config(self) -> AgreementConfig:
        """The agreement layer's parameters: the profile's, with the ``[protocol]`` table's agreement fields."""
        return AgreementConfig.profile(self.profile, **{k: v for k, v in self.protocol if k in _AGREEMENT_FIELDS})

    def metrics_host(self, advertised: str | None = None) -> str:
        """Where the metrics endpoint listens: ``metrics_bind`` if set; else the bind address unless it
        is a wildcard; else the host of this node's ``advertised`` ``host:port`` (reachable by whoever
        reaches the agent, not every interface), and loopback without one."""
        if self.metrics_bind is not None:
            return self.metrics_bind.strip()
        if not _is_wildcard(self.bind_host):
            return self.bind_host
        if advertised:
            try:
                host, _ = split_host_port(advertised, default_port=0)
            except ConfigError:
                host = ""
            if host and not _is_wildcard(host):
                return host
        return "127.0.0.1"

    def mesh_shape(self) -> MeshShape | None:
        """The launched mesh (:attr:`mesh`, checked on construction), None without one."""
        return parse_mesh(self.mesh) if self.mesh else None

    def seed_addrs(self) -> tuple[str, ...]:
        """Seeds normalised to ``host:port``."""
        return tuple(join_host_port(*split_host_port(s, default_port=DEFAULT_PORT)) for s in self.seeds)


# --- addresses --------------------------------------------------------------------------------------
def _is_port(v: object) -> bool:
    return type(v) is int and 0 <= v <= 65535


def _is_wildcard(host: str) -> bool:
    return host in ("0.0.0.0", "::", "")


def split_host_port(text: str, default_port: int) -> tuple[str, int]:
    """``"host:port"``, ``"host"``, ``"[v6]:port"`` or ``"[v6]"`` -> (host, port)."""
    t = text.strip()
    if not t:
        raise ConfigError("empty address; expected host:port")
    if t.startswith("["):
        end = t.find("]")
        if end < 0:
            raise ConfigError(f"address {text!r} opens '[' without ']'; write [IPv6]:port")
        host, rest = t[1:end], t[end + 1:]
        if rest and not rest.startswith(":"):
            raise ConfigError(f"address {text!r}: expected ':port' after ']'")
        port_text = rest[1:] if rest else ""
    elif t.count(":") == 1:
        host, port_text = t.split(":")
    elif t.count(":") > 1:
        host, port_text = t, ""  # bare IPv6 literal
        try:
            ipaddress.IPv6Address(host)
        except ValueError:
            raise ConfigError(f"address {text!r} is not host:port; write IPv6 as [addr]:port") from None
    else:
        host, port_text = t, ""
    if not host:
        raise ConfigError(f"address {text!r} has no host")
    if port_text:
        try:
            port = int(port_text)
        except ValueError:
            raise ConfigError(f"address {text!r}: port {port_text!r} is not a number") from None
        if not 0 < port <= 65535:
            raise ConfigError(f"address {text!r}: port must be 1..65535")
    else:
        port = default_port
    return host, port


def join_host_port(host: str, port: int) -> str:
    """Inverse of :func:`split_host_port` (brackets IPv6 literals)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def default_control_path(port: int, environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_RUNTIME_DIR/gossiprec/agent-<port>.sock``, else ``/tmp/gossiprec-<uid>/agent-<port>.sock``."""
    env = os.environ if environ is None else environ
    runtime = env.get("XDG_RUNTIME_DIR")
    base = Path(runtime) / "gossiprec" if runtime else Path("/tmp") / f"gossiprec-{os.getuid()}"
    return str(base / f"agent-{port}.sock")


def default_keyring_path(environ: Mapping[str, str] | None = None) -> str:
    """``$XDG_CONFIG_HOME/gossiprec/keyring.json`` (``~/.config`` when unset)."""
    env = os.environ if environ is None else environ
    base = env.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return str(Path(base) / "gossiprec" / "keyring.json")


def default_node_name(port: int) -> str:
    return f"{socket.gethostname()}:{port}"


# --- raw value conversion (each source gives strings or TOML values) --------------------------------
def _as_int(v: Any, where: str) -> int:
    if type(v) is int:
        return v
    if isinstance(v, str):
        try:
            return int(v.strip())
        except ValueError:
            pass
    raise ConfigError(f"{where}: expected an integer, got {v!r}")


def _as_bool(v: Any, where: str) -> bool:
    if type(v) is bool:
        return v
    if isinstance(v, str):
        t = v.strip().lower()
        if t in ("1", "true", "yes", "on"):
            return True
        if t in ("0", "false", "no", "off", ""):
            return False
    raise ConfigError(f"{where}: expected a boolean (1/0, true/false, yes/no), got {v!r}")


def _as_str(v: Any, where: str) -> str:
    if isinstance(v, str):
        return v
    raise ConfigError(f"{where}: expected a string, got {v!r}")


def _as_opt_str(v: Any, where: str) -> str | None:
    s = _as_str(v, where)
    return s or None


def _as_seeds(v: Any, where: str) -> tuple[str, ...]:
    if isinstance(v, str):
        items = [s for s in (x.strip() for x in v.split(",")) if s]
    elif isinstance(v, (list, tuple)) and all(isinstance(x, str) for x in v):
        items = [s for s in (x.strip() for x in v) if s]
    else:
        raise ConfigError(f"{where}: expected a list of host:port strings, got {v!r}")
    return tuple(items)


def _as_seconds(v: Any, where: str) -> float:
    if type(v) in (int, float):
        return float(v)
    try:
        return float(_as_str(v, where))
    except ValueError:
        raise ConfigError(f"{where}: expected a number of seconds, got {v!r}") from None


def _as_opt_int(v: Any, where: str) -> int | None:
    if isinstance(v, str) and not v.strip():
        return None
    return _as_int(v, where)


_CONVERT: dict[str, Callable[[Any, str], Any]] = {
    "name": _as_opt_str, "bind_host": _as_str, "port": _as_int, "advertise": _as_opt_str,
    "seeds": _as_seeds, "role": _as_str, "rank": _as_opt_int, "profile": _as_str, "cluster": _as_str,
    "keyring": _as_opt_str, "signing_key": _as_opt_str, "insecure": _as_bool, "control_socket": _as_opt_str,
    "log_format": _as_str, "log_level": _as_str, "metrics_port": _as_opt_int, "metrics_bind": _as_opt_str,
    "timeline": _as_str, "timeline_interval": _as_seconds,
    "job": _as_opt_str, "align_timers": _as_bool, "exit_bell": _as_bool, "nnodes": _as_opt_int,
    "nproc_per_node": _as_int, "spares": _as_int, "allow_shrink": _as_bool, "local_index": _as_opt_int,
    "host": _as_opt_str, "bootstrap_timeout": _as_seconds, "public_keys": _as_opt_str, "mesh": _as_opt_str,
}
_CONFIG_FIELDS = {f.name: f for f in fields(Config)}
_AGREEMENT_FIELDS = {f.name: f for f in fields(AgreementConfig)}
"""The ``[protocol]`` table (and ``--protocol``) takes the fields of both :class:`Config` (detection) and
:class:`AgreementConfig` (agreement, hang detection: ``hang_floor``, ``hang_mult``, ``fence_after``...)."""


def _protocol_value(name: str, v: Any, where: str) -> Any:
    if name not in _CONFIG_FIELDS and name not in _AGREEMENT_FIELDS:
        known = ", ".join(sorted([*_CONFIG_FIELDS, *_AGREEMENT_FIELDS]))
        raise ConfigError(f"{where}: unknown protocol setting {name!r}; known: {known}")
    default = getattr(Config() if name in _CONFIG_FIELDS else AgreementConfig(), name)
    if isinstance(default, bool):
        return _as_bool(v, where)
    if isinstance(default, int):
        return _as_int(v, where)
    if isinstance(default, float):
        if type(v) in (int, float):
            out = float(v)
        else:
            try:
                out = float(_as_str(v, where))
            except ValueError:
                raise ConfigError(f"{where}: expected a number, got {v!r}") from None
        if not math.isfinite(out):
            raise ConfigError(f"{where}: expected a finite number, got {v!r}")
        return out
    return _as_str(v, where)


def parse_protocol_overrides(items: list[str] | None, where: str = "--protocol") -> dict[str, Any]:
    """``["probe_interval=0.2", ...]`` -> typed Config overrides."""
    out: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ConfigError(f"{where}: expected NAME=VALUE, got {item!r}")
        out[key] = _protocol_value(key, value.strip(), f"{where} {key}")
    return out


def read_settings_file(path: str | os.PathLike[str]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read a TOML settings file -> (agent fields, protocol overrides), typed and checked."""
    p = Path(path).expanduser()
    try:
        with open(p, "rb") as f:
            doc = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"settings file {p} does not exist; fix --config / {ENV_CONFIG_FILE}") from None
    except OSError as exc:
        raise ConfigError(f"cannot read settings file {p}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"settings file {p} is not valid TOML: {exc}") from None
    values: dict[str, Any] = {}
    protocol: dict[str, Any] = {}
    for raw_key, v in doc.items():
        key = raw_key.replace("-", "_")
        where = f"{p}: {raw_key}"
        if key == "protocol":
            if not isinstance(v, dict):
                raise ConfigError(f"{where}: expected a [protocol] table")
            for pk, pv in v.items():
                pkey = pk.replace("-", "_")
                protocol[pkey] = _protocol_value(pkey, pv, f"{p}: protocol.{pk}")
        elif key in _CONVERT:
            values[key] = _CONVERT[key](v, where)
        else:
            known = ", ".join(sorted([*_CONVERT, "protocol"]))
            raise ConfigError(f"{where}: unknown setting; known settings: {known}")
    return values, protocol


def load_settings(
    flags: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
    config_file: str | None = None,
    flag_protocol: Mapping[str, Any] | None = None,
) -> AgentSettings:
    """Merge flags > environment > file > defaults into validated :class:`AgentSettings`.

    ``flags`` maps field names to already-typed values (None = not given). ``environ`` defaults to
    :data:`os.environ`. ``config_file`` (else ``GOSSIPREC_CONFIG``) names the TOML file.
    """
    env = os.environ if environ is None else environ
    flags = {k: v for k, v in (flags or {}).items() if v is not None}
    unknown = set(flags) - set(_CONVERT)
    if unknown:
        raise ConfigError(f"unknown setting(s): {', '.join(sorted(unknown))}")
    path = config_file or env.get(ENV_CONFIG_FILE) or None
    file_values: dict[str, Any] = {}
    protocol: dict[str, Any] = {}
    if path:
        file_values, protocol = read_settings_file(path)
    values: dict[str, Any] = {}
    origins: dict[str, str] = {}
    problems: list[str] = []
    for name, convert in _CONVERT.items():
        flag_name = "--" + _FLAG_NAMES.get(name, name).replace("_", "-")
        if name in flags:
            values[name], origins[name] = flags[name], flag_name
        elif ENV[name] in env:
            try:
                values[name] = convert(env[ENV[name]], ENV[name])
                origins[name] = ENV[name]
            except ConfigError as exc:
                problems.append(str(exc))
        elif name in file_values:
            values[name], origins[name] = file_values[name], f"{path}: {name}"
    if problems:
        raise ConfigError("invalid agent settings:\n  " + "\n  ".join(problems))
    protocol.update(flag_protocol or {})
    fallback = default_keyring_path(env)
    if "keyring" not in values and os.path.exists(fallback):
        if not values.get("insecure"):
            values["keyring"], origins["keyring"] = fallback, f"default keyring {fallback}"
        elif origins.get("insecure") != "--insecure":
            # an exported variable or a settings file must not turn a keyed node into an open one
            raise ConfigError(f"{origins['insecure']} asks for insecure mode, but this user has a keyring "
                              f"({fallback}): unset {ENV['insecure']} to use the key, or pass --insecure "
                              "on the command line to run without it")
        else:
            log.warning("--insecure: running unauthenticated and unencrypted although a keyring exists "
                        "at %s (it is not used)", fallback)
    if values.get("job"):
        _defaults_from_job_spec(str(values["job"]), values, origins)
    elif values.get("nnodes") is not None and values.get("local_index") is not None and "port" not in values:
        # several agents per host with no port arithmetic: the i-th takes the default port + 3 i
        local = values["local_index"]
        if type(local) is int and local >= 0:
            values["port"] = DEFAULT_PORT + PORTS_PER_AGENT * local
            origins["port"] = f"{DEFAULT_PORT} + {PORTS_PER_AGENT} x {origins.get('local_index', 'local_index')}"
    if "timeline" not in values:  # (an agent built in code writes none unless asked)
        values["timeline"] = DEFAULT_TIMELINE
    if protocol:
        origins["protocol"] = "--protocol / [protocol]"
    return AgentSettings(**values, protocol=tuple(sorted(protocol.items())), config_file=path,
                         origins=origins)


def _defaults_from_job_spec(path: str, values: dict[str, Any], origins: dict[str, str]) -> None:
    """What the job spec already says, so that ``--job FILE --name N`` is enough: a member of view 0
    binds the address of its line there (unless ``--bind`` says otherwise) and its port, and advertises
    that address; a node the spec does not
    list joins through the spec's members. Given values win; a spec that cannot be read is left to the
    job spec's own loader, which names the problem."""
    try:
        rows = tomllib.loads(Path(path).read_text()).get("members")
    except (OSError, tomllib.TOMLDecodeError):
        return
    if not isinstance(rows, list):
        return
    addrs = {str(r.get("name")): str(r.get("addr")) for r in rows if isinstance(r, dict) and "addr" in r}
    name = values.get("name")
    where = f"job spec {path}"
    if name in addrs:
        host, sep, port = addrs[name].rpartition(":")
        if not sep or not port.isdigit():
            return
        if "port" not in values:
            values["port"], origins["port"] = int(port), f"{where}: {name}'s addr"
        if "bind_host" not in values and host.strip("[]"):
            # the member's own address, not every interface: what the spec publishes is what listens
            values["bind_host"], origins["bind_host"] = host.strip("[]"), f"{where}: {name}'s addr (--bind overrides)"
        if "advertise" not in values and values.get("bind_host", "0.0.0.0") in ("0.0.0.0", "::"):
            # a bind to one address advertises that one: a mismatch with the spec is then an error
            values["advertise"], origins["advertise"] = addrs[name], f"{where}: {name}'s addr"
    elif "seeds" not in values and addrs:
        values["seeds"], origins["seeds"] = tuple(addrs.values()), f"{where}: its members"


# --- command line -----------------------------------------------------------------------------------
_FLAG_NAMES = {"bind_host": "bind", "control_socket": "control_socket", "name": "name"}


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the agent flags to ``parser`` (every default None: unset flags fall through to env/file)."""
    g = parser.add_argument_group("agent")
    g.add_argument("--config", metavar="FILE", default=None,
                   help=f"TOML settings file (env {ENV_CONFIG_FILE})")
    g.add_argument("--name", default=None, help="node name, unique in the cluster (default host:port)")
    g.add_argument("--bind", dest="bind_host", metavar="HOST", default=None,
                   help="address to bind UDP and TCP to (default 0.0.0.0)")
    g.add_argument("--port", type=int, default=None, help=f"UDP+TCP port (default {DEFAULT_PORT}; 0: any)")
    g.add_argument("--advertise", metavar="HOST[:PORT]", default=None,
                   help="address other members reach this node at (default: derived from --bind)")
    g.add_argument("--seed", dest="seeds", metavar="HOST:PORT", action="append", default=None,
                   help="member to join through (repeatable, or comma separated)")
    g.add_argument("--role", choices=ROLES, default=None, help="trainer (default) or spare")
    g.add_argument("--rank", type=int, default=None, help="training rank of this node, if known")
    g.add_argument("--profile", choices=AGENT_PROFILES, default=None, help="protocol timings (default lan)")
    g.add_argument("--cluster", default=None, help=f"cluster name (default {DEFAULT_CLUSTER})")
    g.add_argument("--keyring", metavar="PATH", default=None, help="keyring file (see `gossiprec keys`)")
    g.add_argument("--signing-key", dest="signing_key", metavar="PATH", default=None,
                   help="persistent signing key file (created when absent; needed where the job spec pins "
                        "public keys; print the key to pin with `gossiprec keys public`)")
    g.add_argument("--job", metavar="FILE", default=None,
                   help="job spec TOML: members of view 0, ranks, topology (env GOSSIPREC_JOB)")
    g.add_argument("--insecure", action=argparse.BooleanOptionalAction, default=None,
                   help="no encryption or authentication (trusted networks, tests)")
    g.add_argument("--control-socket", dest="control_socket", metavar="PATH", default=None,
                   help="Unix socket for the training process (env GOSSIPREC_CONTROL)")
    g.add_argument("--log-format", dest="log_format", choices=LOG_FORMATS, default=None)
    g.add_argument("--log-level", dest="log_level", choices=LOG_LEVELS, default=None)
    g.add_argument("--metrics-port", dest="metrics_port", type=int, default=None,
                   help="Prometheus endpoint port (default: none)")
    g.add_argument("--metrics-bind", dest="metrics_bind", metavar="HOST", default=None,
                   help="address of the Prometheus endpoint (default: the agent's own address, else "
                        "127.0.0.1; 0.0.0.0 for every interface)")
    g.add_argument("--timeline", metavar="PATH", default=None,
                   help="JSON lines file of the trainer's recoveries and steps (default gossiprec-timeline.jsonl "
                        "in the working directory; - for none; env GOSSIPREC_TIMELINE)")
    g.add_argument("--timeline-interval", dest="timeline_interval", type=float, metavar="SECONDS", default=None,
                   help="seconds between two step samples of the timeline (default 5)")
    g.add_argument("--align-timers", dest="align_timers", action=argparse.BooleanOptionalAction, default=None,
                   help="align the protocol timer with uvloop's millisecond clock (default on)")
    g.add_argument("--exit-bell", dest="exit_bell", action=argparse.BooleanOptionalAction, default=None,
                   help="watch the trainer's exit bell: see a dying trainer before it has exited (default on)")
    b = parser.add_argument_group("bootstrap without a job spec (view 0 agreed through the seeds)")
    b.add_argument("--nnodes", type=int, default=None,
                   help="hosts of the job; with --seed, the agents agree on view 0 (no --job)")
    b.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, default=None,
                   help="agent + trainer pairs per host (default 1)")
    b.add_argument("--spares", type=int, default=None,
                   help="how many members are hot spares, the last in rank order (0)")
    b.add_argument("--allow-shrink", dest="allow_shrink", action=argparse.BooleanOptionalAction, default=None,
                   help="with no spare left, drop data-parallel replicas instead of stopping")
    b.add_argument("--local-index", dest="local_index", type=int, default=None,
                   help="this agent's index on its host (default: by port)")
    b.add_argument("--host", default=None, help="host name ranks are ordered by (default: this machine's)")
    b.add_argument("--bootstrap-timeout", dest="bootstrap_timeout", type=float, default=None,
                   help="seconds to wait for view 0 before giving up (default 300)")
    b.add_argument("--mesh", default=None, metavar="NAME=SIZE,...",
                   help="the device mesh, replicate (data-parallel) dimension first, e.g. replicate=2,shard=4 or "
                        "dp=2,tp=2 (',' or ';' between dimensions; a single replicate=N is plain DDP): view 0's "
                        "replica groups with --nnodes; with --job, checked against the spec (env GOSSIPREC_MESH)")
    b.add_argument("--public-keys", dest="public_keys", metavar="FILE", default=None,
                   help="TOML file whose [public_keys] table pins the agents' keys: only they take part")
    g.add_argument("--protocol", metavar="NAME=VALUE", action="append", default=None,
                   help="override a protocol Config field (repeatable), e.g. probe_interval=0.2")


def settings_from_args(args: argparse.Namespace, environ: Mapping[str, str] | None = None) -> AgentSettings:
    """Settings from parsed :func:`add_agent_arguments` flags, the environment and the TOML file."""
    flags: dict[str, Any] = {}
    for name in _CONVERT:
        v = getattr(args, name, None)
        if v is not None:
            flags[name] = v
    if "seeds" in flags:
        flags["seeds"] = tuple(s for item in flags["seeds"] for s in _as_seeds(item, "--seed"))
    protocol = parse_protocol_overrides(getattr(args, "protocol", None))
    return load_settings(flags, environ, getattr(args, "config", None), protocol)


def with_overrides(settings: AgentSettings, **changes: Any) -> AgentSettings:
    """A copy with some fields replaced (validated again)."""
    return replace(settings, **changes)

