"""``gossiprec spec``: a job spec computed from a host list, so that nobody writes a member list by hand.

What it decides: every member of view 0 from (the job's hosts in order, processes per host, spares),
the same on every host that computes it. Member ``i`` of host ``h`` is ``{h}-{i}``; slots are ordered
by (host's place in the list, local index); the last ``spares`` slots are hot spares, the others get
ranks 0.. in that order. Ports are never a user's arithmetic: slot ``i`` of a host listens on
``base_port + 3 * i`` (its agent; its store and donor follow at +1 and +2: the launch contract's port
layout, :mod:`gossiprec.local.launch`), counted over the slots
that share one address when several hosts resolve to the same one (emulated nodes on one machine).

Hosts come from ``--hosts`` (Slurm's hostlist syntax: ``node[01-04],gpu7``) or, with ``--slurm``, from
``SLURM_JOB_NODELIST``, with this task's own member from ``SLURMD_NODENAME`` and ``SLURM_LOCALID``.
A host name that does not resolve is looked up with ``scontrol show node`` (its ``NodeAddr``).

The job's topology is plain DDP over the trainers, or a sharded job's device mesh with ``--mesh``
(``replicate=2,shard=4``: :func:`~gossiprec.core.mesh.parse_mesh`), whose ``[job]`` table is the one the
trainer's ``MeshSpec.job_toml()`` writes; its sizes must multiply to the trainers (slots minus spares).
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence, cast

from gossiprec.core.mesh import parse_mesh
from gossiprec.errors import ConfigError
from gossiprec.local.launch import PORTS_PER_AGENT

DEFAULT_BASE_PORT = 29400
MAX_HOSTS = 100_000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compact host list, expanded in order: ``a[1-3,7],b[08-09]x`` -> a1 a2 a3 a7 b08x b09x.
    Several bracket groups in one name multiply (``r[1-2]n[1-2]``: r1n1 r1n2 r2n1 r2n2)."""
    hosts: list[str] = []
    for token in _split_top(text.strip()):
        hosts.extend(_expand_token(token))
        if len(hosts) > MAX_HOSTS:
            raise ConfigError(f"host list {text[:60]!r} names more than {MAX_HOSTS} hosts")
    if len(set(hosts)) != len(hosts):
        raise ConfigError(f"host list {text[:60]!r} names a host twice")
    return hosts


def _split_top(text: str) -> list[str]:
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text[:60]!r}: a ']' without its '['")
        if ch == "," and depth == 0:
            out.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise ConfigError(f"host list {text[:60]!r}: a '[' without its ']'")
    out.append(cur)
    if any(not t.strip() for t in out):
        raise ConfigError(f"host list {text[:60]!r} has an empty entry")
    return [t.strip() for t in out]


def _expand_token(token: str) -> list[str]:
    start = token.find("[")
    if start < 0:
        return [token]
    end = token.index("]", start)
    head, body, tail = token[:start], token[start + 1:end], token[end + 1:]
    values: list[str] = []
    for part in body.split(","):
        m = _RANGE.match(part.strip())
        if m is None:
            raise ConfigError(f"host list entry {token!r}: {part!r} is not a number or a range like 01-08")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ConfigError(f"host list entry {token!r}: the range {part!r} runs backwards")
        width = len(lo) if lo.startswith("0") else 0
        values.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
    return [head + v + rest for v in values for rest in _expand_token(tail)]


@dataclass(frozen=True, slots=True)
class Slot:
    """One member of view 0 as the spec lays it out."""

    name: str
    host: str
    local: int
    addr: str
    role: str
    rank: int | None


def layout(hosts: Sequence[str], nproc_per_node: int, spares: int, base_port: int,
           address_of: Callable[[str], str]) -> list[Slot]:
    """Every slot of the job (see the module docstring)."""
    if not hosts:
        raise ConfigError("the job needs at least one host")
    if nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be at least 1, got {nproc_per_node}")
    total = len(hosts) * nproc_per_node
    if not 0 <= spares < total:
        raise ConfigError(f"--spares must be in 0..{total - 1} (the job has {total} slots), got {spares}")
    top = base_port + PORTS_PER_AGENT * total
    if not 1024 <= base_port or top > 65535:
        raise ConfigError(f"--base-port {base_port} leaves no room for {total} slots of {PORTS_PER_AGENT} ports "
                          "each below 65536")
    addrs = {h: address_of(h) for h in hosts}
    used: dict[str, int] = {}
    slots: list[Slot] = []
    for h in hosts:
        for i in range(nproc_per_node):
            n = used.get(addrs[h], 0)
            used[addrs[h]] = n + 1
            index = len(slots)
            trainer = index < total - spares
            slots.append(Slot(f"{h}-{i}", h, i, _join(addrs[h], base_port + PORTS_PER_AGENT * n),
                              "trainer" if trainer else "spare", index if trainer else None))
    return slots


def _join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def to_toml(slots: Sequence[Slot], *, allow_shrink: bool = False, mesh: str | None = None,
            where: str = "--mesh") -> str:
    """The job spec file (see :mod:`gossiprec.agent.jobspec`). ``mesh``: the device mesh (``--mesh``), whose
    ``[job]`` table it writes (:meth:`~gossiprec.core.mesh.MeshShape.job_toml`, as the trainer's
    ``MeshSpec.job_toml`` does); ConfigError, naming ``where``, when its sizes do not multiply to the trainers."""
    lines = ["# written by `gossiprec spec`: the same on every host that computes it"]
    if mesh:
        shape = parse_mesh(mesh, sum(1 for s in slots if s.role == "trainer"), where=where)
        lines += [f"# the device mesh: {shape.text} (replicate dimension first)",
                  *shape.job_toml(allow_shrink=allow_shrink).splitlines(), ""]
    else:
        lines += ["[job]", 'topology = "ddp"', f"allow_shrink = {'true' if allow_shrink else 'false'}", ""]
    for s in slots:
        lines += ["[[members]]", f'name = "{s.name}"', f'addr = "{s.addr}"', f'role = "{s.role}"',
                  f'host = "{s.host}"']
        if s.rank is not None:
            lines.append(f"rank = {s.rank}")
        lines.append("")
    return "\n".join(lines)


def shared_hosts(slots: Sequence[Slot], mesh: str) -> list[str]:
    """What is wrong with the placement of ``mesh`` on ``slots``: one line per replica group (the ranks
    that hold the same shard) with two or more ranks on one host. Losing that host loses those copies at
    once; when it holds them all, only a checkpoint restores the shard. Ranks fill hosts in order, so the
    replicas of a shard are on distinct hosts exactly when the mesh's dimensions after the replicate one
    multiply to a multiple of the ranks per host."""
    trainers = [s for s in slots if s.role == "trainer"]
    host_of = {s.rank: s.host for s in trainers if s.rank is not None}
    lines = []
    for group in parse_mesh(mesh, len(trainers)).topology().replica_groups:
        where = [host_of[r] for r in group]
        for h in sorted({h for h in where if where.count(h) > 1}):
            on = [r for r in group if host_of[r] == h]
            loss = ("every copy of their shard: only a checkpoint can restore it" if len(on) == len(group)
                    else f"{len(on)} of the {len(group)} copies of their shard at once")
            ranks = ", ".join(map(str, on))
            lines.append(f"ranks {ranks} hold the same shard and share host {h}: losing it loses {loss}")
    return lines


def resolver(overrides: Mapping[str, str], slurm: bool, wait: float = 0.0,
             clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep
             ) -> Callable[[str], str]:
    """Host name -> address: ``overrides`` first, then the resolver, then (``slurm``) Slurm's NodeAddr.
    ``wait``: keep asking this many seconds (peers whose DNS records appear as they start, as pods'
    do), saying once which host it waits for."""
    def address_of(host: str) -> str:
        if host in overrides:
            return overrides[host]
        deadline, said = clock() + wait, False
        while True:
            try:
                return cast(str, socket.getaddrinfo(host, None, proto=socket.IPPROTO_UDP)[0][4][0])  # an IP address
            except OSError:
                pass
            if slurm:
                addr = _slurm_node_addr(host)
                if addr:
                    return addr
            if clock() >= deadline:
                break
            if not said:
                print(f"gossiprec spec: waiting up to {wait:.0f} s for {host} to resolve", file=sys.stderr)
                said = True
            sleep(min(1.0, max(0.0, deadline - clock())))
        raise ConfigError(f"cannot resolve host {host!r}"
                          + (f" within {wait:.0f} s" if wait else "")
                          + f"; give its address with --addr {host}=ADDRESS")
    return address_of


def _slurm_node_addr(host: str) -> str | None:
    try:
        out = subprocess.run(["scontrol", "show", "node", host], capture_output=True, text=True, timeout=10,
                             check=False).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r"\bNodeAddr=(\S+)", out)
    return m.group(1) if m else None


def slurm_environment(environ: Mapping[str, str]) -> tuple[list[str], str | None, int | None, int | None]:
    """(hosts, this node, this task's local index, tasks per node) from a Slurm task's environment."""
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if not nodelist:
        raise ConfigError("--slurm: SLURM_JOB_NODELIST is not set; run this inside a Slurm job (sbatch/srun)")
    local = environ.get("SLURM_LOCALID")
    per_node = environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return (expand_hostlist(nodelist), environ.get("SLURMD_NODENAME"), int(local) if local else None,
            int(per_node) if per_node.isdigit() else None)


# --------------------------------------------------------------------------------------------------
# the command


def _cmd(args: argparse.Namespace) -> int:
    environ = dict(os.environ)
    me_host, me_local = args.node, args.local_index
    if args.slurm:
        hosts, node, local, per_node = slurm_environment(environ)
        me_host = me_host or node
        me_local = local if me_local is None else me_local
        nproc = args.nproc_per_node or per_node or 1
    else:
        if not args.hosts:
            raise ConfigError("give the job's hosts (--hosts 'node[01-04]') or --slurm inside a Slurm job")
        hosts, nproc = expand_hostlist(args.hosts), args.nproc_per_node or 1
    overrides = {}
    for item in args.addr:
        name, sep, addr = item.partition("=")
        if not sep or not name or not addr:
            raise ConfigError(f"--addr takes HOST=ADDRESS, got {item!r}")
        overrides[name] = addr
    if args.mesh:
        parse_mesh(args.mesh)  # its syntax, before any host is resolved (its size once the slots are known)
    slots = layout(hosts, nproc, args.spares, args.base_port, resolver(overrides, args.slurm, args.resolve_wait))
    text = to_toml(slots, allow_shrink=args.allow_shrink, mesh=args.mesh)
    for line in shared_hosts(slots, args.mesh) if args.mesh else ():
        print(f"gossiprec spec: warning: {line} (with {nproc} ranks per host, a mesh whose dimensions after the "
              f"replicate one multiply to a multiple of {nproc} puts a shard's replicas on distinct hosts)",
              file=sys.stderr)
    if args.out:
        path = Path(args.out)
        tmp = path.with_name(path.name + f".{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, path)  # hosts sharing a file system write the same bytes: last one wins, whole
    else:
        sys.stdout.write(text)
    if args.me:
        if me_host is None or me_local is None:
            raise ConfigError("--me needs this task's host and local index (--node, --local-index, or --slurm)")
        mine = next((s for s in slots if s.host == me_host and s.local == me_local), None)
        if mine is None:
            raise ConfigError(f"this task ({me_host}, local index {me_local}) is not in the job's hosts")
        seeds = [s.addr for s in slots[:3]]
        host, _, port = mine.addr.rpartition(":")
        words = ["--name", mine.name, "--bind", host.strip("[]"), "--port", port]
        for seed in seeds:
            words += ["--seed", seed]
        print(" ".join(shlex.quote(w) for w in words), file=sys.stderr if not args.out else sys.stdout)
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "spec", help="write a job spec from a host list or a Slurm job (no member list by hand)",
        description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--hosts", help="the job's hosts in Slurm's hostlist syntax, e.g. 'node[01-04],gpu7'")
    p.add_argument("--slurm", action="store_true", help="take hosts, this node and local index from SLURM_*")
    p.add_argument("--nproc-per-node", dest="nproc_per_node", type=int, default=None,
                   help="processes (agent + trainer pairs) per host (default: Slurm's tasks per node, else 1)")
    p.add_argument("--spares", type=int, default=0, help="how many of the last slots are hot spares (0)")
    p.add_argument("--base-port", dest="base_port", type=int, default=DEFAULT_BASE_PORT,
                   help=f"first agent port of each host ({DEFAULT_BASE_PORT}); slot i uses base + {PORTS_PER_AGENT} i")
    p.add_argument("--allow-shrink", dest="allow_shrink", action="store_true",
                   help="with no spare left, drop data-parallel replicas instead of stopping")
    p.add_argument("--mesh", default=None, metavar="NAME=SIZE,...",
                   help="the device mesh of a sharded job, replicate (data-parallel) dimension first, e.g. "
                        "replicate=2,shard=4 (HSDP) or dp=2,tp=2 (',' or ';' between dimensions; the sizes multiply "
                        "to the trainers; a single replicate=N, or none, is plain DDP): writes its [job] table")
    p.add_argument("--addr", action="append", default=[], metavar="HOST=ADDRESS",
                   help="the address of a host that does not resolve (repeatable)")
    p.add_argument("--resolve-wait", dest="resolve_wait", type=float, default=0.0, metavar="SECONDS",
                   help="keep trying to resolve host names this long (peers that are still starting)")
    p.add_argument("--node", default=None, help="this task's host (for --me; default from Slurm)")
    p.add_argument("--local-index", dest="local_index", type=int, default=None,
                   help="this task's index on its host (for --me; default from Slurm)")
    p.add_argument("--out", default=None, help="write the spec to this file (default: standard output)")
    p.add_argument("--me", action="store_true",
                   help="also print this task's `gossiprec run` arguments (--name, --bind, --port, --seed ...): "
                        "on standard output with --out, else on standard error")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]
