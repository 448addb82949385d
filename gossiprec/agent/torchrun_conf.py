"""What one ``torchrun --rdzv-backend=gossiprec`` node runs, decided from torchrun's rendezvous parameters.

What it decides, from ``--rdzv-conf`` (torchrun's ``KEY=VALUE,...``), ``--rdzv-endpoint``, ``--nnodes``
and this process's environment: the job's slots (every torchrun node is one slot: a trainer or a hot
spare), which slot this node is, and its agent's settings. Nothing here starts anything.

The slots come from a job spec (``spec=PATH``, as ``gossiprec spec`` writes it) or are computed from a
host list the way ``gossiprec spec`` computes them (``hosts=node[01-04]``, ``spares=N``,
``slots_per_host=K``, ``base_port=P``, ``addr=HOST=ADDRESS;...``, ``allow_shrink=1``): ranks in host
order, spares last, ports per slot. torchrun splits ``--rdzv-conf`` at commas, so a host list writes
``;`` (or ``+``) where Slurm's syntax has a comma: ``hosts=gpu[1-4];cpu7``. A sharded job names its
device mesh with ``mesh=`` (:func:`~gossiprec.core.mesh.parse_mesh`), its dimensions ``;``-separated for
the same reason: ``--rdzv-conf 'hosts=gpu[1-4],mesh=replicate=2;shard=2'`` (torch 2.13 splits each item at
its first ``=`` only, so the value keeps its own ``=``); with ``hosts=`` it writes the spec's ``[job]``
table, with ``spec=`` the spec's topology must be the mesh's.

This node's slot is ``name=NODE``, else ``GOSSIPREC_NODE``, else ``{host}-{local_index}`` (how
``gossiprec spec`` names slots) with ``host=`` (default: this machine's host name) and ``local_index=``
(default 0). Its torchrun rank is the slot's index in the spec; the world is every slot, so
``--nnodes`` must count the spares too. The agent binds to the slot's address, joins through
``--rdzv-endpoint`` (``host:port`` entries, ``,`` or ``;`` separated) or else the first three slots,
and takes every other setting from ``keyring=``, ``insecure=``, ``cluster=``, ``profile=``,
``log_level=``, ``config=FILE`` (an agent settings file) or the ``GOSSIPREC_*`` environment, as
``gossiprec run`` does.

Only ``--nproc-per-node 1 --max-restarts 0`` works (see :func:`check_torchrun_argv`): torchrun stops
every local worker when one fails and restarts them all on a re-rendezvous, which would throw away
the in-place recovery gossiprec does instead.

``gossiprec torchrun ARGS`` (:mod:`gossiprec.agent.torchrun_cli`) is torchrun with the backend
registered in-process, for an install whose metadata lacks the ``torchrun.handlers`` entry point: it
checks ``ARGS`` as above, adds ``--rdzv-backend gossiprec`` when they name no backend and refuses
another one (:func:`wrapper_argv`).
"""

from __future__ import annotations

import socket
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Sequence

from gossiprec.agent.jobspec import check_mesh, view0_from_dict
from gossiprec.agent.launcher import DEFAULT_CHILD_NICE
from gossiprec.agent.settings import ENV, AgentSettings, load_settings, split_host_port
from gossiprec.agent.spec import DEFAULT_BASE_PORT, expand_hostlist, layout, resolver, to_toml
from gossiprec.core.mesh import parse_mesh
from gossiprec.errors import ConfigError

BACKEND = "gossiprec"
"""The ``--rdzv-backend`` name (and the entry point's name)."""
CONF_KEYS = {
    "spec": "job spec file (TOML), as `gossiprec spec` writes it",
    "hosts": "the job's hosts in Slurm's hostlist syntax, ';' for ','",
    "spares": "with hosts: how many of the last slots are hot spares (0)",
    "slots_per_host": "with hosts: torchrun nodes per host (1)",
    "base_port": f"with hosts: first agent port of each host ({DEFAULT_BASE_PORT})",
    "addr": "with hosts: HOST=ADDRESS;... for hosts that do not resolve",
    "allow_shrink": "with hosts: drop replicas instead of stopping when no spare is left (0)",
    "mesh": "the device mesh, NAME=SIZE;NAME=SIZE, replicate dimension first ('mesh=replicate=2;shard=4'): "
            "with hosts, the spec's [job] table; with spec, checked against it",
    "name": "this node's slot name (default GOSSIPREC_NODE, else {host}-{local_index})",
    "host": "this node's host name (default: this machine's)",
    "local_index": "this node's index on its host (0)",
    "keyring": "the cluster keyring (default GOSSIPREC_KEYRING, else the user's default keyring)",
    "insecure": "no encryption or authentication (trusted networks, tests)",
    "cluster": "cluster name (default GOSSIPREC_CLUSTER, else gossiprec)",
    "profile": "protocol timings: lan or wan",
    "log_level": "the agent's log level",
    "config": "an agent settings file (TOML), as `gossiprec run --config` reads it",
    "trainer_nice": f"nice levels the workers run below the agent ({DEFAULT_CHILD_NICE}; 0: same)",
}
"""The ``--rdzv-conf`` keys this backend reads, and what each means."""
TORCH_KEYS = frozenset({"timeout", "join_timeout", "last_call_timeout", "close_timeout", "read_timeout",
                        "heartbeat", "is_host", "rank", "local_addr", "store_type", "use_libuv",
                        "keep_alive_interval", "keep_alive_max_attempt"})
"""Keys torchrun itself adds or other backends read: accepted and ignored (``timeout`` bounds the start)."""
DEFAULT_TIMEOUT_S = 900.0
"""How long the rendezvous may take when torchrun gives no ``timeout`` (torchrun's own default)."""
SEEDS = 3
MESH_WHERE = "--rdzv-conf mesh"
"""Slots a node joins through when ``--rdzv-endpoint`` names none: the first ones, as ``gossiprec spec --me``."""


@dataclass(frozen=True, slots=True)
class Member:
    """One slot of the job: a torchrun node with its agent."""

    name: str
    addr: str
    role: str
    rank: int | None


@dataclass(frozen=True, slots=True)
class NodePlan:
    """This torchrun node's part of the job (see the module docstring)."""

    members: tuple[Member, ...]
    """Every slot, in the job spec's order: the torchrun ranks."""
    index: int
    """This node's slot: its torchrun rank (``GROUP_RANK``)."""
    spec_path: str | None
    """The job spec file given (``spec=``); None: computed from ``hosts=`` (:attr:`spec_text`)."""
    spec_text: str
    """The job spec, as the agent reads it."""
    settings: AgentSettings
    """The agent's settings; its ``job`` is :attr:`spec_path` (None when the spec is to be written)."""
    timeout: float
    """Seconds the agent may take to start and hear from every slot."""
    trainer_nice: int

    @property
    def me(self) -> Member:
        return self.members[self.index]

    @property
    def world_size(self) -> int:
        """torchrun's world: every slot, trainers and spares."""
        return len(self.members)


def _text(conf: Mapping[str, Any], key: str) -> str | None:
    v = conf.get(key)
    return None if v is None else str(v).strip() or None


def _int(conf: Mapping[str, Any], key: str, default: int) -> int:
    v = _text(conf, key)
    if v is None:
        return default
    try:
        return int(v)
    except ValueError:
        raise ConfigError(f"--rdzv-conf {key}={v}: expected an integer") from None


def _bool(conf: Mapping[str, Any], key: str) -> bool | None:
    v = _text(conf, key)
    if v is None:
        return None
    if v.lower() in ("1", "true", "yes", "on"):
        return True
    if v.lower() in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"--rdzv-conf {key}={v}: expected 1/0, true/false or yes/no")


def _split(text: str) -> list[str]:
    return [t.strip() for t in text.replace(";", ",").replace("+", ",").split(",") if t.strip()]


def spec_from_hosts(conf: Mapping[str, Any]) -> str:
    """The job spec ``gossiprec spec`` writes for the ``hosts=`` keys of ``conf``."""
    hosts = expand_hostlist(",".join(_split(str(conf["hosts"]))))
    overrides: dict[str, str] = {}
    for item in _split(_text(conf, "addr") or ""):
        host, sep, addr = item.partition("=")
        if not sep or not host.strip() or not addr.strip():
            raise ConfigError(f"--rdzv-conf addr takes HOST=ADDRESS;HOST=ADDRESS..., got {item!r}")
        overrides[host.strip()] = addr.strip()
    slots = layout(hosts, _int(conf, "slots_per_host", 1), _int(conf, "spares", 0),
                   _int(conf, "base_port", DEFAULT_BASE_PORT), resolver(overrides, slurm=False))
    return to_toml(slots, allow_shrink=bool(_bool(conf, "allow_shrink")), mesh=_text(conf, "mesh"),
                   where=MESH_WHERE)


def members_of(text: str, where: str) -> tuple[Member, ...]:
    """The slots of a job spec, in its order (checked as the agent checks it)."""
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job spec {where} is not valid TOML: {exc}") from None
    view0_from_dict(doc, where)
    return tuple(Member(str(r["name"]), str(r["addr"]), str(r.get("role", "trainer")), r.get("rank"))
                 for r in doc["members"])


def this_node(conf: Mapping[str, Any], environ: Mapping[str, str]) -> str:
    """This node's slot name (see the module docstring)."""
    name = _text(conf, "name") or environ.get(ENV["name"])
    if name:
        return name
    host = _text(conf, "host") or socket.gethostname()
    return f"{host}-{_int(conf, 'local_index', 0)}"


def plan_node(conf: Mapping[str, Any], endpoint: str, min_nodes: int, max_nodes: int,
              environ: Mapping[str, str]) -> NodePlan:
    """This node's plan from torchrun's rendezvous parameters (``conf`` is ``params.config``)."""
    unknown = sorted(set(conf) - set(CONF_KEYS) - TORCH_KEYS)
    if unknown:
        known = "; ".join(f"{k}: {v}" for k, v in CONF_KEYS.items())
        hint = (" (torchrun splits --rdzv-conf at ',': separate the mesh's dimensions with ';', as in "
                "'mesh=dp=2;tp=2')" if "mesh" in conf else "")
        raise ConfigError(f"--rdzv-conf: unknown key(s) {', '.join(unknown)} for the gossiprec backend{hint}; "
                          f"known: {known}")
    mesh_text = _text(conf, "mesh")
    mesh = parse_mesh(mesh_text, where=MESH_WHERE) if mesh_text else None
    spec_path = _text(conf, "spec")
    if (spec_path is None) == (_text(conf, "hosts") is None):
        raise ConfigError("the gossiprec backend needs the job's slots: give --rdzv-conf spec=job.toml (from "
                          "`gossiprec spec`) or hosts=HOSTLIST[,spares=N] (one of the two)")
    if spec_path is not None:
        try:
            text = Path(spec_path).read_text()
        except OSError as exc:
            raise ConfigError(f"cannot read job spec {spec_path}: {exc.strerror}") from None
    else:
        text = spec_from_hosts(conf)
    members = members_of(text, spec_path or "computed from hosts=")
    if spec_path is not None:
        check_mesh(view0_from_dict(tomllib.loads(text), spec_path), mesh, MESH_WHERE, spec_path)
    names = [m.name for m in members]
    if not min_nodes <= len(members) <= max_nodes:
        raise ConfigError(f"torchrun --nnodes {min_nodes if min_nodes == max_nodes else f'{min_nodes}:{max_nodes}'}"
                          f", but the job has {len(members)} slots (trainers and spares, each one torchrun "
                          f"node): use --nnodes {len(members)}")
    name = this_node(conf, environ)
    if name not in names:
        shown = ", ".join(names[:8]) + (" ..." if len(names) > 8 else "")
        raise ConfigError(f"this node is {name!r}, which is not a slot of the job ({shown}); name it with "
                          f"--rdzv-conf name=NODE or {ENV['name']}=NODE, or host=HOST for {{host}}-0")
    me = members[names.index(name)]
    host, port = split_host_port(me.addr, default_port=0)
    seeds = tuple(_split(endpoint)) or tuple(m.addr for m in members[:SEEDS])
    flags: dict[str, Any] = {"name": name, "bind_host": host, "port": port, "seeds": seeds, "job": spec_path,
                             "keyring": _text(conf, "keyring"), "insecure": _bool(conf, "insecure"),
                             "cluster": _text(conf, "cluster"), "profile": _text(conf, "profile"),
                             "log_level": _text(conf, "log_level"), "mesh": mesh.text if mesh else None}
    settings = load_settings(flags, environ, _text(conf, "config"))
    timeout = float(_int(conf, "timeout", int(DEFAULT_TIMEOUT_S)))
    nice = _int(conf, "trainer_nice", DEFAULT_CHILD_NICE)
    if not 0 <= nice <= 19:
        raise ConfigError(f"--rdzv-conf trainer_nice={nice}: expected 0..19")
    return NodePlan(members, names.index(name), spec_path, text, settings, timeout, nice)


def check_torchrun_argv(argv: Sequence[str]) -> None:
    """Refuse torchrun options that defeat in-place recovery, when ``argv`` is torchrun's command line.

    ``--nproc-per-node`` above 1: torchrun would stop every worker of the node when one fails, and all
    of them would share one agent. ``--max-restarts`` above 0: a restart would start the workers again
    under an agent that has left the job. A programmatic launch (``elastic_launch``) is not checked.
    """
    if not argv or not _is_torchrun(argv[0]):
        return
    from torch.distributed.run import determine_local_world_size, get_args_parser

    try:
        args, _ = get_args_parser().parse_known_args(list(argv[1:]))
    except SystemExit:
        return  # torchrun's own parser has said what is wrong
    nproc = determine_local_world_size(args.nproc_per_node)
    problems = []
    if nproc != 1:
        problems.append(f"--nproc-per-node {args.nproc_per_node} ({nproc} workers): torchrun stops every worker "
                        "of a node when one fails, so run one torchrun per worker (--nproc-per-node 1)")
    if args.max_restarts != 0:
        problems.append(f"--max-restarts {args.max_restarts}: gossiprec recovers failed ranks in place with its "
                        "spares; a torchrun restart would start workers whose agent has left (--max-restarts 0)")
    if problems:
        raise ConfigError("the gossiprec rendezvous backend cannot run with " + "; ".join(problems))


def _is_torchrun(arg0: str) -> bool:
    p = Path(arg0)
    return p.name == "torchrun" or (p.name == "run.py" and p.parent.name == "distributed"
                                    and p.parent.parent.name == "torch")


def wrapper_argv(argv: Sequence[str]) -> list[str]:
    """torchrun's arguments for ``gossiprec torchrun ARGV``: checked (:func:`check_torchrun_argv`), with
    ``--rdzv-backend gossiprec`` first when ``argv`` names no backend."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.set_defaults(rdzv_backend=None)  # tells a backend not given from torchrun's default (static)
    try:
        args, _ = parser.parse_known_args(list(argv))
    except SystemExit:
        raise ConfigError("torchrun cannot parse these arguments (see its message above)") from None
    if args.standalone:
        raise ConfigError("gossiprec torchrun: --standalone makes torchrun use its c10d backend; drop it")
    out = list(argv)
    if args.rdzv_backend is None:
        out = ["--rdzv-backend", BACKEND, *out]
    elif args.rdzv_backend != BACKEND:
        raise ConfigError(f"gossiprec torchrun runs the gossiprec backend, not --rdzv-backend {args.rdzv_backend}:"
                          " drop the option, or run plain torchrun for another backend")
    check_torchrun_argv(["torchrun", *out])
    return out
