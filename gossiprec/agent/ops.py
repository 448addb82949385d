"""Operator commands: ``gossiprec members``, ``gossiprec status`` and ``gossiprec events``.

Theory of operation
-------------------
Both commands are clients of the local agent's control socket (:class:`~gossiprec.local.client.ControlClient`);
they hold no state and change nothing. The socket is ``--control-socket PATH``, else the environment's
``GOSSIPREC_CONTROL`` (what ``gossiprec run`` hands its training process), else the agent's default path
for ``--port`` / ``GOSSIPREC_PORT`` / the default port (:func:`~gossiprec.agent.settings.default_control_path`).

``members`` joins two replies: the ``members`` op (every member SWIM knows: address, liveness, gossiped
training progress) and the ``status`` op (this agent's agreed view: epoch, role and rank of each member
of the view). A row per member, like ``serf members``::

    Node  Address          Role     Rank  Status  Epoch  Step  Step time
    a00   127.0.0.1:7001   trainer  0     alive   3      120   840 ms

``Epoch`` is the epoch of the view this agent has installed, shown for the members of that view (a
member SWIM knows but the view does not hold, e.g. a spare still joining, shows ``-``). Role and rank
come from the view when the member is in it, else from SWIM's record.

``status`` prints this agent's identity, health score (Lifeguard's local health: 0 is healthy), live
and known member counts, the view, the fence state and the recovery plan. ``--json`` prints the raw
replies, for scripts. With no agent listening, both say so and exit 1.

``--agent HOST:PORT`` asks any agent of the cluster instead, at its advertised address, over the
cluster's authenticated protocol (:mod:`gossiprec.agent.remote_client`; the command needs the cluster's
keyring: ``--keyring PATH`` or ``GOSSIPREC_KEYRING``, and its name: ``--cluster`` or
``GOSSIPREC_CLUSTER`` where it is not the default). The answer holds the same data as the control
socket's, so both print alike. With no answer within ``--timeout`` (3 s) it says so and exits 1.

While view 0 is not agreed (an
agent started with ``--nnodes``, no job spec), both say what the agent waits for (``bootstrap``, from
:mod:`gossiprec.core.bootwords`). ``events`` follows the agent's events (:mod:`gossiprec.agent.follow`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Mapping, Sequence, TextIO

from gossiprec.agent.follow import AgentTooOld, follow, words
from gossiprec.errors import GossiprecError
from gossiprec.local.client import ControlClient
from gossiprec.local.protocol import ControlError
from gossiprec.agent.remote_client import DEFAULT_TIMEOUT, RemoteError, fetch_remote
from gossiprec.agent.settings import DEFAULT_PORT, ENV, default_control_path
from gossiprec.security.keyring import KeyringError

EXIT_NO_AGENT = 1


# --- fetching -------------------------------------------------------------------------------------
def resolve_control_path(flag: str | None, port: int | None = None,
                         environ: Mapping[str, str] | None = None) -> str:
    """``--control-socket``, else ``GOSSIPREC_CONTROL``, else the default path of ``port``
    (``--port``, else ``GOSSIPREC_PORT``, else :data:`DEFAULT_PORT`)."""
    env = os.environ if environ is None else environ
    if flag:
        return flag
    if env.get(ENV["control_socket"]):
        return env[ENV["control_socket"]]
    if port is None:
        text = env.get(ENV["port"], "").strip()
        port = int(text) if text.isdigit() else DEFAULT_PORT
    return default_control_path(port, env)


def fetch(path: str, *, members: bool = True, timeout: float = 5.0) -> dict[str, Any]:
    """``{"status": {...}, "members": [...]}`` from the agent at ``path`` (members only if asked).

    Raises :class:`ControlError` (code ``unavailable`` when nothing listens there)."""
    with ControlClient(path, timeout=timeout) as client:
        out: dict[str, Any] = {"status": client.status()}
        if members:
            out["members"] = client.members()
    return out


def member_rows(status: Mapping[str, Any], members: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per member: node, address, role, rank, status, epoch, step, step_ms, phase, behind_ms (how
    long the other ranks wait for it per step: the straggler magnitude), self.

    View members come first in rank order (spares after trainers), then members outside the view."""
    view = status.get("view") or {}
    in_view = {m["node"]: m for m in view.get("members", ())}
    epoch = view.get("epoch")
    rows: list[dict[str, Any]] = []
    for m in members:
        v = in_view.get(m["name"])
        step = m.get("step", -1)
        rows.append({
            "node": m["name"],
            "address": m.get("addr"),
            "role": v["role"] if v is not None else m.get("role"),
            "rank": v.get("rank") if v is not None else None,
            "status": m.get("status"),
            "epoch": epoch if v is not None else None,
            "step": step if isinstance(step, int) and step >= 0 else None,
            "step_ms": m.get("step_ms") if isinstance(step, int) and step >= 0 else None,
            "phase": m.get("phase"),
            "behind_ms": m.get("behind_ms"),
            "in_view": v is not None,
            "self": bool(m.get("self")),
        })
    seen = {r["node"] for r in rows}
    for name, v in in_view.items():  # in the view but unknown to SWIM (should not last)
        if name not in seen:
            rows.append({"node": name, "address": None, "role": v["role"], "rank": v.get("rank"),
                         "status": "unknown", "epoch": epoch, "step": None, "step_ms": None,
                         "phase": None, "behind_ms": None, "in_view": True, "self": False})

    def order(r: dict[str, Any]) -> tuple[int, int, str]:
        if not r["in_view"]:
            return (2, 0, r["node"])
        rank = r["rank"]
        return (0, rank, r["node"]) if isinstance(rank, int) else (1, 0, r["node"])

    rows.sort(key=order)
    return rows


# --- formatting -----------------------------------------------------------------------------------
def _cell(v: Any) -> str:
    return "-" if v is None or v == "" else str(v)


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    return "\n".join(lines)


def format_members(rows: Sequence[Mapping[str, Any]]) -> str:
    headers = ("Node", "Address", "Role", "Rank", "Status", "Epoch", "Step", "Step time", "Behind")
    table = [(("* " if r["self"] else "") + r["node"], r["address"], r["role"], r["rank"], r["status"],
              r["epoch"], r["step"], None if r["step_ms"] is None else f"{r['step_ms']} ms",
              # (a rank that waits more than the median of the others is behind no one: 0)
              None if r.get("behind_ms") is None else f"{max(0, r['behind_ms'])} ms") for r in rows]
    return format_table(headers, table)


def format_status(st: Mapping[str, Any]) -> str:
    """Human-readable ``status``."""
    boot = st.get("bootstrap")
    lines = [
        f"node        {st.get('node')} ({st.get('addr')}), cluster {st.get('cluster')}, "
        f"version {st.get('version')}",
        f"role        {st.get('role')}" + (f", rank {st['rank']}" if st.get("rank") is not None else "")
        + f", profile {st.get('profile')}, {'encrypted' if st.get('secure') else 'INSECURE'}",
        f"agent       {st.get('state')}, up {st.get('uptime_s', 0):.1f} s"
        + (f", leaving: {st.get('leave_reason')}" if st.get("leaving") else ""),
        f"health      {st.get('health')} (0 = healthy; higher = this node slows its own probing)",
        f"members     {st.get('live')} live of {st.get('known')} known",
    ]
    if boot:
        lines.append(f"bootstrap   {boot.get('text')}")
    view = st.get("view")
    if view is None:
        lines.append("view        none (view 0 not agreed yet: see bootstrap)" if boot else
                     "view        none (joining, or an agent without the agreement core)")
    else:
        ms = view.get("members", [])
        trainers = sum(1 for m in ms if m.get("role") == "trainer")
        lines.append(f"view        epoch {view.get('epoch')}, {len(ms)} members ({trainers} trainers, "
                     f"{len(ms) - trainers} spares), config {str(view.get('config_id'))[:16]}"
                     + (f", STOPPED: {view['stopped']}" if view.get("stopped") else ""))
        lines.append(f"fenced      {st.get('fenced') or 'no'}")
        plan = st.get("plan")
        if plan is None:
            lines.append("plan        none yet for this epoch (waiting for state reports)")
        else:
            lines.append(f"plan        epoch {plan.get('epoch')}: {plan.get('action')} ({plan.get('reason')}), "
                         f"world size {plan.get('world_size')}, {len(plan.get('transfers', []))} transfer(s), "
                         f"target step {_cell(plan.get('target_step'))}")
            for rank, node in sorted(plan.get("replacements", {}).items(), key=lambda kv: int(kv[0])):
                lines.append(f"            rank {rank} -> {node}")
    rejects = (st.get("transport") or {}).get("rejects") or {}
    bad = {k: v for k, v in rejects.items() if v}
    lines.append("rejected    " + (", ".join(f"{k} {v}" for k, v in sorted(bad.items())) if bad else "none"))
    return "\n".join(lines)


# --- commands -------------------------------------------------------------------------------------
def _no_agent(prog: str, path: str, exc: ControlError, err: TextIO) -> int:
    if exc.code == "unavailable":
        print(f"{prog}: error: no agent is listening on {path}. Start one (`gossiprec agent ...` or "
              "`gossiprec run ... -- CMD`), or point at its socket with --control-socket PATH "
              f"(or {ENV['control_socket']}).", file=err)
    else:
        print(f"{prog}: error: the agent at {path} failed the request: {exc}", file=err)
    return EXIT_NO_AGENT


def _fetch(prog: str, args: argparse.Namespace, what: str, err: TextIO) -> dict[str, Any] | None:
    """``what`` ("status" or "members") from the agent ``--agent`` names, else from the local agent; None
    when there is no answer (the error printed)."""
    if getattr(args, "agent", None):
        return _fetch_remote(prog, args, what, err)
    path = resolve_control_path(args.control_socket, args.port)
    try:
        return fetch(path, members=what == "members", timeout=5.0 if args.timeout is None else args.timeout)
    except ControlError as exc:
        _no_agent(prog, path, exc, err)
        return None


def _fetch_remote(prog: str, args: argparse.Namespace, what: str, err: TextIO) -> dict[str, Any] | None:
    """The answer of the agent ``--agent`` names, or None (the error printed)."""
    timeout = DEFAULT_TIMEOUT if args.timeout is None else args.timeout
    if args.control_socket or args.port is not None:
        print(f"{prog}: error: --agent asks another agent over the network; drop --control-socket / --port "
              "(they pick a local agent)", file=err)
        return None
    try:
        return fetch_remote(args.agent, what, keyring_file=args.keyring, cluster=args.cluster, timeout=timeout)
    except (RemoteError, KeyringError) as exc:
        print(f"{prog}: error: {exc}", file=err)
        return None


def cmd_members(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    got = _fetch("gossiprec members", args, "members", err or sys.stderr)
    if got is None:
        return EXIT_NO_AGENT
    rows = member_rows(got["status"], got["members"])
    boot = got["status"].get("bootstrap")
    if args.json:
        doc: dict[str, Any] = {"node": got["status"].get("node"), "members": rows}
        if boot:
            doc["bootstrap"] = boot
        print(json.dumps(doc, indent=2, default=str), file=out)
    else:
        print(format_members(rows), file=out)
        if boot:  # no view yet, so no ranks: say what the agent waits for
            print(f"bootstrap: {boot.get('text')}", file=out)
    return 0


def cmd_status(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out = out or sys.stdout
    got = _fetch("gossiprec status", args, "status", err or sys.stderr)
    if got is None:
        return EXIT_NO_AGENT
    if args.json:
        print(json.dumps(got["status"], indent=2, default=str), file=out)
    else:
        print(format_status(got["status"]), file=out)
    return 0


def cmd_events(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """Print the local agent's events (:mod:`gossiprec.agent.follow`) until Ctrl-C (0) or until the
    agent goes away (1)."""
    out = out or sys.stdout
    err = err or sys.stderr
    path = resolve_control_path(args.control_socket, args.port)
    try:
        timeout = 5.0 if args.timeout is None else args.timeout
        for rec in follow(path, timeout=timeout, probes=getattr(args, "probes", False)):
            print(json.dumps(rec, default=str) if args.json else words(rec), file=out, flush=True)
    except (KeyboardInterrupt, BrokenPipeError):  # Ctrl-C, or a reader such as `head` that had enough
        return 0
    except AgentTooOld as exc:
        print(f"gossiprec events: error: {exc.message}", file=err)
        return EXIT_NO_AGENT
    except ControlError as exc:
        if exc.code in ("disconnected", "shutdown"):
            print(f"gossiprec events: error: lost the agent at {path}: {exc.message}", file=err)
            return EXIT_NO_AGENT
        return _no_agent("gossiprec events", path, exc, err)
    return 0


def _common(p: argparse.ArgumentParser, remote: bool = True) -> None:
    p.add_argument("--control-socket", dest="control_socket", metavar="PATH", default=None,
                   help=f"the agent's control socket (default: ${ENV['control_socket']}, else the "
                        "default path of --port)")
    p.add_argument("--port", type=int, default=None,
                   help=f"the agent's port, to find its default socket (default ${ENV['port']} or "
                        f"{DEFAULT_PORT})")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--timeout", type=float, default=None,
                   help="seconds to wait for the agent (default 5; 3 with --agent)" if remote
                   else "seconds to wait for the agent to answer (default 5)")
    if not remote:  # events follow the local agent only
        return
    p.add_argument("--agent", metavar="HOST:PORT", default=None,
                   help="ask this agent of the cluster (its advertised address) over the cluster's "
                        "authenticated protocol instead of the local agent")
    p.add_argument("--keyring", metavar="PATH", default=None,
                   help=f"with --agent: the cluster's keyring (default ${ENV['keyring']}, else the "
                        "default keyring)")
    p.add_argument("--cluster", metavar="NAME", default=None,
                   help=f"with --agent: the cluster's name (default ${ENV['cluster']}, else the default)")


def add_cli(subparsers: Any) -> None:
    """Add ``members``, ``status`` and ``events`` (each sets ``func``: ``args.func(args) -> exit code``)."""
    p = subparsers.add_parser("members", help="list the cluster's members as this agent sees them",
                              description="Members known to the local agent (or the one --agent names): "
                                          "address, role, rank, liveness, epoch of the agreed view and "
                                          "training progress.")
    _common(p)
    p.set_defaults(func=cmd_members)
    p = subparsers.add_parser("status", help="this agent's view, plan, health and fence state",
                              description="The local agent's (or --agent's) identity, health score, agreed view, "
                                          "fence state and recovery plan.")
    _common(p)
    p.set_defaults(func=cmd_status)
    p = subparsers.add_parser("events", help="follow this agent's events as they happen, one line each",
                              description="Follow the local agent's events as they happen, like `serf "
                                          "monitor`: view changes, failures with their cause, plans and "
                                          "their transfers, fences, hang and straggler reports, the "
                                          "bootstrap. Ctrl-C stops (exit 0); a lost agent exits 1.")
    _common(p, remote=False)
    p.add_argument("--probes", action="store_true", help="also each probe's outcome (many per second)")
    p.set_defaults(func=cmd_events)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec")
    add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except GossiprecError as exc:
        print(f"gossiprec: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
