"""The job spec: who is in view 0, with which rank, and which ranks hold identical state.

A TOML file, read once at the edge (the core never reads files)::

    [job]
    topology = "ddp"        # or "grid" (then dp = ... and tp_pp = ...)
    allow_shrink = true     # with no spare left, drop data-parallel replicas instead of stopping
    min_replicas = 1

    [[members]]
    name = "node-a"
    addr = "10.0.0.1:7980"
    role = "trainer"        # or "spare"
    rank = 0
    host = "host-a"         # optional; placement for choosing a nearby spare
    rack = "rack-1"         # optional

Every agent of the job reads the same file, so all derive the same view 0 without any coordinator;
:func:`node_factory` builds the machine an agent runs from it.
"""

from __future__ import annotations

import random
import socket
import tomllib
from pathlib import Path
from typing import Any

from gossiprec.agent.settings import AgentSettings
from gossiprec.core.auth import KeyBook
from gossiprec.security.signing import Ed25519Crypto
from gossiprec.core.bootstrap import Booting, BootParams, Bootstrap, Candidate
from gossiprec.core.config import Config
from gossiprec.core.machine import Machine, MachineFactory
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.errors import ConfigError


def view0_from_dict(doc: dict[str, Any], where: str = "job spec") -> View:
    job = doc.get("job", {})
    rows = doc.get("members")
    if not isinstance(job, dict) or not isinstance(rows, list) or not rows:
        raise ConfigError(f"{where}: needs a [job] table and at least one [[members]] entry")
    members = []
    for i, row in enumerate(rows):
        if not isinstance(row, dict):
            raise ConfigError(f"{where}: members[{i}] must be a table")
        unknown = set(row) - {"name", "addr", "role", "rank", "host", "rack"}
        if unknown:
            raise ConfigError(f"{where}: members[{i}] has unknown key(s) {', '.join(sorted(unknown))}")
        try:
            members.append(ViewMember(str(row["name"]), str(row["addr"]), str(row.get("role", "trainer")),
                                      row.get("rank"), str(row.get("host", "")), str(row.get("rack", ""))))
        except KeyError as exc:
            raise ConfigError(f"{where}: members[{i}] lacks {exc.args[0]!r}") from None
        members[-1].as_member()  # validates role and rank
    trainers = sum(1 for m in members if m.role == "trainer")
    kind = job.get("topology", "ddp")
    shrink = bool(job.get("allow_shrink", False))
    min_rep = int(job.get("min_replicas", 1))
    if kind == "ddp":
        topology = JobTopology.ddp(trainers, allow_shrink=shrink, min_replicas=min_rep)
    elif kind == "grid":
        topology = JobTopology.grid(int(job["dp"]), int(job["tp_pp"]), allow_shrink=shrink, min_replicas=min_rep)
    else:
        raise ConfigError(f"{where}: topology must be 'ddp' or 'grid', got {kind!r}")
    return View.initial(members, topology)


def load_view0(path: str) -> View:
    try:
        doc = tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read job spec {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"job spec {path} is not valid TOML: {exc}") from None
    return view0_from_dict(doc, path)


def node_factory(settings: AgentSettings) -> MachineFactory:
    """The machine agents run by default: the whole core (:class:`~gossiprec.core.node.Node`).

    With a job spec (``--job``) every agent starts from the same view 0; a node not listed there, or
    an agent started without a job spec, joins the running job through its seeds (as a spare).
    """
    if settings.nnodes is not None:
        return boot_factory(settings)
    view0 = load_view0(settings.job) if settings.job else None
    agreement = settings.agreement_config()
    crypto = Ed25519Crypto.generate()  # this process's signing key: it speaks only for itself

    def make(config: Config, name: str, addr: str, *, incarnation: int, role: str, now: float,
             rng: random.Random, seeds: tuple[str, ...] = ()) -> Machine:
        view = view0
        host = rack = ""
        if view is not None:
            me = view.member(name)
            if me is None:
                view = None  # not in view 0: join as a spare
            else:
                if me.addr != addr:
                    raise ConfigError(f"job spec lists {name} at {me.addr}, but this agent is reachable at "
                                      f"{addr}; fix --advertise or the job spec")
                role, host, rack = me.role, me.host, me.rack
        if view is not None:
            members = {m.node: MemberInfo(m.node, m.addr, 1) for m in view.members if m.node != name}
            return Node(config, name, addr, incarnation=incarnation, rng=rng, now=now, view=view, role=role,
                        host=host, rack=rack, members=members, agreement=agreement, auth=KeyBook(name, crypto))
        # not in view 0: joins the running job through its seeds; the view admits it as a spare
        return Node(config, name, addr, incarnation=incarnation, rng=rng, now=now, view=None, role=role,
                    seeds=seeds, agreement=agreement, auth=KeyBook(name, crypto))

    return make


def boot_factory(settings: AgentSettings) -> MachineFactory:
    """The machine of an agent started with ``--nnodes`` and no job spec: view 0 agreed through the
    seeds (:mod:`gossiprec.core.bootstrap`), then the whole core from that view."""
    assert settings.nnodes is not None
    seeds = settings.seed_addrs()
    params = BootParams(settings.nnodes * settings.nproc_per_node, settings.spares, seeds,
                        allow_shrink=settings.allow_shrink)
    agreement = settings.agreement_config()
    host = settings.host or socket.gethostname()
    crypto = Ed25519Crypto.generate()

    def make(config: Config, name: str, addr: str, *, incarnation: int, role: str, now: float,
             rng: random.Random, seeds: tuple[str, ...] = ()) -> Machine:
        local = settings.local_index if settings.local_index is not None else int(addr.rpartition(":")[2] or 0)
        me = Candidate(name, addr, host, local, spare=settings.role == "spare")

        def make_node(view: View | None, at: float) -> Machine:
            if view is not None:
                m = view.member(name)
                assert m is not None
                members = {v.node: MemberInfo(v.node, v.addr, 1) for v in view.members if v.node != name}
                return Node(config, name, addr, incarnation=incarnation, rng=rng, now=at, view=view, role=m.role,
                            host=m.host, members=members, agreement=agreement, auth=KeyBook(name, crypto))
            return Node(config, name, addr, incarnation=incarnation, rng=rng, now=at, view=None, role="spare",
                        host=host, seeds=seeds, agreement=agreement, auth=KeyBook(name, crypto))

        return Booting(Bootstrap(params, me, now, rng), make_node, seeds, incarnation, config.max_stream)

    return make
