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

    [public_keys]           # optional: pinned signing keys (`gossiprec keys public`)
    node-a = "3b6a27bc..."  # 64 hex digits; that agent runs with --signing-key holding it

Every agent of the job reads the same file, so all derive the same view 0 without any coordinator;
:func:`node_factory` builds the machine an agent runs from it.

Pinned keys sit in the job spec because it is the one file every agent already reads and the operator
already distributes (a separate file would be one more to keep in step): a pinned member's key is
bound from the start and never taken from a claim, so no holder of the cluster key can bind its own
key to that name, even before the member's first message (trust on first use otherwise). A pinned
member gossips no key claim; members the table does not name (joiners) still claim theirs. The table
may name only members of view 0, and a pinned agent refuses to start without ``--signing-key`` or
with a key that does not match its pin. A job without a spec (``--nnodes``) reads the same table from
``--public-keys FILE``; there it names every agent that may take part in the bootstrap.
"""

from __future__ import annotations

import logging
import random
import socket
import tomllib
from pathlib import Path
from typing import Any

from gossiprec.agent.settings import AgentSettings
from gossiprec.core.auth import KeyBook
from gossiprec.security.signing import Ed25519Crypto, load_signing_key, parse_public_key
from gossiprec.core.bootstrap import Booting, BootParams, Bootstrap, Candidate
from gossiprec.core.config import Config
from gossiprec.core.machine import Machine, MachineFactory
from gossiprec.core.mesh import MeshShape, describe_groups, describe_topology, parse_mesh
from gossiprec.core.node import Node
from gossiprec.core.records import MemberInfo
from gossiprec.core.topology import JobTopology
from gossiprec.core.view import View, ViewMember
from gossiprec.errors import ConfigError, SecurityError

log = logging.getLogger(__name__)


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


def pins_from_dict(doc: dict[str, Any], view: View | None, where: str = "job spec") -> dict[str, bytes]:
    """The ``[public_keys]`` table: member name -> pinned Ed25519 public key (only members of ``view``,
    where one is given)."""
    table = doc.get("public_keys", {})
    if not isinstance(table, dict):
        raise ConfigError(f"{where}: public_keys must be a table of member = \"hex key\"")
    pins: dict[str, bytes] = {}
    for name, text in table.items():
        if view is not None and view.member(name) is None:
            raise ConfigError(f"{where}: public_keys names {name!r}, which is not a member of the job; "
                              "add it under [[members]] or drop its key")
        try:
            pins[name] = parse_public_key(text, f"{where}: public_keys.{name}")
        except SecurityError as exc:
            raise ConfigError(str(exc)) from None
    return pins


def _read_spec(path: str, what: str = "job spec") -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read {what} {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None


def load_view0(path: str) -> View:
    return view0_from_dict(_read_spec(path), path)


def load_job(path: str) -> tuple[View, dict[str, bytes]]:
    """View 0 and the pinned public keys of the job spec at ``path``."""
    doc = _read_spec(path)
    view = view0_from_dict(doc, path)
    return view, pins_from_dict(doc, view, path)


def load_pins(path: str) -> dict[str, bytes]:
    """The ``[public_keys]`` table of the file at ``path`` (``--public-keys``, for a bootstrap)."""
    pins = pins_from_dict(_read_spec(path, "public keys file"), None, path)
    if not pins:
        raise ConfigError(f"public keys file {path} pins no key: give it a [public_keys] table of "
                          "NAME = \"hex key\" lines (`gossiprec keys public --signing-key PATH --name NAME`)")
    return pins


def check_mesh(view0: View, mesh: MeshShape | None, where: str, spec: str) -> None:
    """Refuse (ConfigError) a job spec whose topology is not the launched mesh's (``--mesh``,
    ``GOSSIPREC_MESH``: ``where``), naming both: the agents would run one topology and the trainers
    build another. ``spec`` names the job spec."""
    if mesh is None:
        return
    topo = view0.topology
    parse_mesh(mesh.text, topo.world_size, where=f"{where} (with job spec {spec})")
    if topo.replica_groups != mesh.topology().replica_groups:
        raise ConfigError(f"{where} {mesh.text} has replica groups {describe_groups(mesh.topology())}, but job spec "
                          f"{spec} says {describe_topology(topo.world_size, topo.replica_groups)}: write the spec "
                          f"with `gossiprec spec --mesh {mesh.text}`, or drop {where}")


def check_member(view0: View, settings: AgentSettings) -> None:
    """Refuse (ConfigError, listing the spec's members) a trainer named outside the job spec: a mistyped
    ``--name`` would otherwise join the running job as a spare and never train. A spare (``--spare``,
    ``--role spare``) may join under a name the spec does not list: that is how a spare is added to a
    running job."""
    name = settings.name
    if name is None or settings.role == "spare" or view0.member(name) is not None:
        return
    names = [m.node for m in view0.members]
    shown = ", ".join(names[:16]) + (f" ... ({len(names)} in all)" if len(names) > 16 else "")
    raise ConfigError(f"{settings.origins.get('name', '--name')} {name!r} is not a member of job spec "
                      f"{settings.job} ({shown}): give one of its names, or --spare (--role spare for "
                      "`gossiprec agent`) to join the running job as a hot spare")


def signing_crypto(settings: AgentSettings) -> Ed25519Crypto:
    """The key this agent signs with: its ``--signing-key`` file (made when absent), else a fresh one."""
    if settings.signing_key is None:
        return Ed25519Crypto.generate()  # this process's own key: it speaks only for itself
    crypto, created = load_signing_key(settings.signing_key)
    if created:
        log.warning("created a new signing key at %s (mode 0600); its public key is %s: pin it in the job "
                    "spec's [public_keys] table", settings.signing_key, crypto.public_key.hex())
    return crypto


def key_book(name: str, crypto: Ed25519Crypto, pins: dict[str, bytes], settings: AgentSettings) -> KeyBook:
    """``name``'s key book: ``pins`` bound from the start; a pinned member makes no claims, and must sign
    with the key its pin names."""
    pin = pins.get(name)
    source = f"job spec {settings.job}" if settings.job else f"public keys file {settings.public_keys}"
    if pin is None and pins and settings.nnodes is not None:
        raise ConfigError(f"{source} names no key for {name}: only the agents it names take part in the "
                          "bootstrap; add this one (`gossiprec keys public --signing-key PATH --name NODE`)")
    if pin is not None and settings.signing_key is None:
        raise ConfigError(f"{source} pins a public key for {name}; start this agent with "
                          "--signing-key PATH, the file holding that key")
    if pin is not None and pin != crypto.public_key:
        raise ConfigError(f"{source} pins {name} to key {pin.hex()}, but the signing key "
                          f"{settings.signing_key} is {crypto.public_key.hex()}: pass the right --signing-key, "
                          "or pin this key (`gossiprec keys public --signing-key PATH --name NODE`)")
    return KeyBook(name, crypto, pinned=pins, claims=pin is None)


def node_factory(settings: AgentSettings) -> MachineFactory:
    """The machine agents run by default: the whole core (:class:`~gossiprec.core.node.Node`).

    With a job spec (``--job``) every agent starts from the same view 0; a spare not listed there, or
    an agent started without a job spec, joins the running job through its seeds (as a spare); a trainer
    named outside the spec is refused (:func:`check_member`).
    """
    if settings.nnodes is not None:
        return boot_factory(settings)
    view0, pins = load_job(settings.job) if settings.job else (None, {})
    if view0 is not None:
        check_mesh(view0, settings.mesh_shape(), settings.origins.get("mesh", "--mesh"), str(settings.job))
        check_member(view0, settings)
    agreement = settings.agreement_config()
    crypto = signing_crypto(settings)
    if settings.name is not None:
        key_book(settings.name, crypto, pins, settings)  # a wrong or missing key: refused before binding

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
                        host=host, rack=rack, members=members, agreement=agreement,
                        auth=key_book(name, crypto, pins, settings))
        # not in view 0: joins the running job through its seeds; the view admits it as a spare
        return Node(config, name, addr, incarnation=incarnation, rng=rng, now=now, view=None, role=role,
                    seeds=seeds, agreement=agreement, auth=key_book(name, crypto, pins, settings))

    return make


def boot_factory(settings: AgentSettings) -> MachineFactory:
    """The machine of an agent started with ``--nnodes`` and no job spec: view 0 agreed through the
    seeds (:mod:`gossiprec.core.bootstrap`), then the whole core from that view."""
    assert settings.nnodes is not None
    seeds = settings.seed_addrs()
    params = BootParams(settings.nnodes * settings.nproc_per_node, settings.spares, seeds,
                        allow_shrink=settings.allow_shrink, mesh=settings.mesh_shape())
    agreement = settings.agreement_config()
    host = settings.host or socket.gethostname()
    crypto = signing_crypto(settings)
    pins = load_pins(settings.public_keys) if settings.public_keys else {}  # none: bound on first use
    if settings.name is not None:
        key_book(settings.name, crypto, pins, settings)  # a wrong or missing key: refused before binding

    def make(config: Config, name: str, addr: str, *, incarnation: int, role: str, now: float,
             rng: random.Random, seeds: tuple[str, ...] = ()) -> Machine:
        local = settings.local_index if settings.local_index is not None else int(addr.rpartition(":")[2] or 0)
        me = Candidate(name, addr, host, local, spare=settings.role == "spare")

        def make_node(view: View | None, at: float, keys: dict[str, bytes]) -> Machine:
            # view 0's members' keys, agreed with it, bound from the start (no first use after the bootstrap);
            # unless --public-keys pins them, a member that leaves the view loses its binding, so that a
            # restarted process (a new key) can rejoin
            auth = key_book(name, crypto, pins, settings)
            auth.keys.update((n, k) for n, k in keys.items() if n != name)
            if view is not None:
                m = view.member(name)
                assert m is not None
                members = {v.node: MemberInfo(v.node, v.addr, 1) for v in view.members if v.node != name}
                return Node(config, name, addr, incarnation=incarnation, rng=rng, now=at, view=view, role=m.role,
                            host=m.host, members=members, agreement=agreement, auth=auth)
            return Node(config, name, addr, incarnation=incarnation, rng=rng, now=at, view=None, role="spare",
                        host=host, seeds=seeds, agreement=agreement, auth=auth)

        boot = Bootstrap(params, me, now, rng, key_book(name, crypto, pins, settings))
        return Booting(boot, make_node, seeds, incarnation, config.max_stream)

    return make
