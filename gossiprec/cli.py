"""The ``gossiprec`` command: one entry point, sub-commands registered by the modules that own them."""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

from gossiprec import __version__
from gossiprec.errors import GossiprecError

# Which module registers each sub-command (its ``add_cli(subparsers)``), imported lazily: ``gossiprec
# agent`` / ``run`` (long-lived, one per node) import only their own module, not the simulator, the
# benchmarks and the demo (~2 MB of RSS less per agent), and ``gossiprec sim`` does not pay for torch.
_OWNER: dict[str, str] = {
    "sim": "gossiprec.sim.cli", "keys": "gossiprec.security.keys_cli", "agent": "gossiprec.agent.cli",
    "run": "gossiprec.agent.launcher", "demo": "gossiprec.demo", "members": "gossiprec.agent.ops",
    "status": "gossiprec.agent.ops", "events": "gossiprec.agent.ops", "bench": "gossiprec.bench",
    "spec": "gossiprec.agent.spec",
    "reference": "gossiprec.reference", "torchrun": "gossiprec.agent.torchrun_cli",
    "report": "gossiprec.report.cli",
}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser with every sub-command, or only ``command``'s when it names one (faster, leaner)."""
    parser = argparse.ArgumentParser(
        prog="gossiprec",
        description="Masterless failure detection, agreement and in-place recovery for distributed training.",
    )
    parser.add_argument("--version", action="version", version=f"gossiprec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    owner = _OWNER.get(command or "")
    for module in dict.fromkeys(_OWNER.values()):
        if owner is not None and module != owner:
            continue
        try:
            mod = importlib.import_module(module)
        except ImportError as exc:  # an optional part (e.g. torch) is missing
            print(f"gossiprec: {module} unavailable: {exc}", file=sys.stderr)
            continue
        mod.add_cli(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_in = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_in[0] if args_in else None)
    args = parser.parse_args(args_in)
    func = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    try:
        return int(func(args) or 0)
    except GossiprecError as exc:
        print(f"gossiprec: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
