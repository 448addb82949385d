"""``gossiprec agent``: run one agent without a training process, until SIGTERM or SIGINT.

The settings come from the flags, the environment and the TOML file (:mod:`gossiprec.agent.settings`);
a bad one exits 2 with every problem listed, a failure while running exits 1, a graceful leave 0. The
event loop is uvloop's where it is installed (:func:`run_async`).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from typing import Any, Coroutine, TypeVar

from gossiprec.agent.logs import configure_logging
from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import AgentSettings, add_agent_arguments, settings_from_args
from gossiprec.errors import ConfigError, GossiprecError

T = TypeVar("T")


def install_event_loop() -> str:
    """Use uvloop's event loop policy when importable; returns ``"uvloop"`` or ``"asyncio"``."""
    try:
        import uvloop
    except ImportError:
        return "asyncio"
    uvloop.install()
    return "uvloop"


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop when available."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(main)
    return uvloop.run(main)


async def serve(settings: AgentSettings, **agent_kwargs: Any) -> int:
    """Run one agent until SIGTERM/SIGINT; 0 after a graceful leave."""
    agent = Agent(settings, handle_signals=True, **agent_kwargs)
    await agent.run()
    if agent.boot_failure is not None:
        print(f"gossiprec agent: error: {agent.boot_failure}", file=sys.stderr)
        return 1
    return 0


def _cmd_agent(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"gossiprec agent: error: {exc}", file=sys.stderr)
        return 2
    configure_logging(settings.log_format, settings.log_level)
    try:
        return run_async(serve(settings))
    except GossiprecError as exc:
        print(f"gossiprec agent: error: {exc}", file=sys.stderr)
        return 1


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``agent`` sub-command (sets ``func``: ``args.func(args) -> exit code``)."""
    p = subparsers.add_parser(
        "agent", help="run a membership agent without a training process",
        description="Run a gossiprec agent: failure detection and progress gossip for this node. "
                    "SIGTERM/SIGINT leave the cluster gracefully; SIGHUP reloads the keyring.")
    add_agent_arguments(p)
    p.set_defaults(func=_cmd_agent)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec agent")
    add_agent_arguments(parser)
    return _cmd_agent(parser.parse_args(argv))


if __name__ == "__main__":
    # Run the package's copy of this module, not __main__'s, so loggers and classes are the real ones.
    from gossiprec.agent.cli import main as _main

    sys.exit(_main())
