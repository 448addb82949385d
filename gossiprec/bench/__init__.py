"""Benchmarks of real processes (``gossiprec bench ...``); the simulator has its own (``gossiprec sim``),
and ``bench agreement`` sweeps its agreement scenarios over many seeds.

Each sub-command lives in its own module and prints one JSON report; :func:`add_cli` registers them.
"""

from __future__ import annotations

import argparse
from typing import Any


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``bench`` with its sub-commands (``agents``, ``recovery``, ``baseline``, ``device-transfer``,
    ``commit``, ``ddp``, ``digest``, ``bootstrap``, ``agreement``, ``sharded``, ``transfer``, ``scale``) to
    the ``gossiprec`` parser."""
    from gossiprec.bench import (agents, agreement, baseline, bootstrap, commit, ddp, device, digest, recovery,
                                 scale, seeded, sharded, transfer)

    p = subparsers.add_parser("bench", help="benchmarks of real agent processes",
                              description="Benchmarks of real agent processes; each prints JSON.")
    sub = p.add_subparsers(dest="bench", metavar="BENCH")
    agents.add_cli(sub, seeded.run_seeded)
    recovery.add_cli(sub)
    baseline.add_cli(sub)
    device.add_cli(sub)
    commit.add_cli(sub)
    ddp.add_cli(sub)
    digest.add_cli(sub)
    bootstrap.add_cli(sub)
    agreement.add_cli(sub)
    sharded.add_cli(sub)
    transfer.add_cli(sub)
    scale.add_cli(sub)
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])
    return p  # type: ignore[no-any-return]
