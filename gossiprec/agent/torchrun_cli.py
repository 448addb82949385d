"""``gossiprec torchrun``: torchrun with the gossiprec rendezvous backend registered in this process.

For an install whose metadata lacks the ``torchrun.handlers`` entry point: :func:`register` hands
torchrun's registry the entry point's own creator (:func:`~gossiprec.agent.torchrun_entry.create_handler`:
the registry refuses a second, different one under the same name), and :func:`launch` runs torchrun's
``main`` on arguments checked by :func:`~gossiprec.agent.torchrun_conf.wrapper_argv`. torch is
imported only when the command runs.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any, Sequence

from gossiprec.agent.torchrun_conf import BACKEND, CONF_KEYS, wrapper_argv
from gossiprec.agent.torchrun_entry import create_handler


def register() -> None:
    """Register the backend in this process's torchrun (what the entry point does); idempotent."""
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    rendezvous_handler_registry.register(BACKEND, create_handler)


def launch(argv: Sequence[str]) -> int:
    """Run torchrun on ``argv`` in this process with the backend registered (``gossiprec torchrun``);
    returns its exit status: 1 when a worker failed (torchrun's report on standard error)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main

    register()
    try:
        main(list(argv))
    except ChildFailedError as exc:
        print(exc, file=sys.stderr)
        return 1
    return 0


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    # every argument is torchrun's: no option of ours, so that argparse passes them all through
    p = subparsers.add_parser(
        "torchrun", prefix_chars="\0", add_help=False,
        help="torchrun with the gossiprec rendezvous backend registered (--rdzv-backend gossiprec)",
        description="torchrun with the gossiprec rendezvous backend (no etcd, no c10d store host).")
    p.add_argument("args", nargs=argparse.REMAINDER)
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]


def _cmd(args: argparse.Namespace) -> int:
    argv = list(args.args)
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gossiprec torchrun [TORCHRUN OPTIONS] SCRIPT [ARGS]\n\n"
              "torchrun with --rdzv-backend gossiprec registered in-process; every option is torchrun's, "
              "--rdzv-conf takes the gossiprec keys below, --nproc-per-node must be 1 and --max-restarts 0.\n")
        for key, what in CONF_KEYS.items():
            print(f"  {key:15} {what}")
        print("\ntorchrun --help lists torchrun's options.")
        return 0 if argv else 2
    return launch(wrapper_argv(argv))
