"""Several real agents in one process: ``python -m gossiprec.bench.agent_host ARGV_FILE``.

``ARGV_FILE`` is a JSON list of ``gossiprec agent`` argument lists; each becomes an
:class:`~gossiprec.agent.pump.Agent` built from the same flags as ``gossiprec agent`` (its own UDP and
TCP sockets, control socket, timers and machine), and all of them run on one event loop. SIGTERM or
SIGINT makes every agent leave gracefully. A benchmark uses this where one process per agent would spend
the machine's CPU on interpreters rather than agents (``gossiprec bench agents --per-process K``); an
agent in a shared process can only die with its neighbours, so the benchmark runs the agents it kills
alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
from pathlib import Path

from gossiprec.agent.logs import configure_logging
from gossiprec.agent.pump import Agent
from gossiprec.agent.settings import add_agent_arguments, settings_from_args
from gossiprec.errors import ConfigError, GossiprecError


async def host(argvs: list[list[str]]) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec agent")
    add_agent_arguments(parser)
    settings = [settings_from_args(parser.parse_args(argv), environ={}) for argv in argvs]
    if settings:
        configure_logging(settings[0].log_format, settings[0].log_level)
    agents = [Agent(s) for s in settings]
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, lambda: [a.stop() for a in agents])  # type: ignore[func-returns-value]
    results = await asyncio.gather(*(a.run() for a in agents), return_exceptions=True)
    failed = [f"{a.name}: {r!r}" for a, r in zip(agents, results) if isinstance(r, BaseException)]
    failed += [f"{a.name}: {a.boot_failure}" for a in agents if a.boot_failure is not None]
    for line in failed:
        print(f"gossiprec agent host: error: {line}", file=sys.stderr)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m gossiprec.bench.agent_host ARGV_FILE", file=sys.stderr)
        return 2
    argvs = json.loads(Path(args[0]).read_text())
    from gossiprec.agent.cli import run_async
    try:
        return run_async(host([[str(x) for x in a] for a in argvs]))
    except (ConfigError, GossiprecError) as exc:
        print(f"gossiprec agent host: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
