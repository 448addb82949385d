"""``gossiprec report FILE... [--plot OUT.png] [--json]``: the recoveries of a run, as a table and a picture.

Reads the timeline files the agents wrote (one per agent, merged by time; see
:mod:`gossiprec.report.timeline`), prints the summary (:mod:`gossiprec.report.summary`) as a table, or
as one JSON object with ``--json``, and with ``--plot`` draws it (:mod:`gossiprec.report.plot`). A file
that is missing or holds a bad line exits 2 with a message naming the file and the line; a timeline with
no recovery prints ``no recoveries`` (exit 0).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from gossiprec.report.summary import render_text, summarize
from gossiprec.report.timeline import TimelineError, read_timelines

EXIT_BAD_INPUT = 2


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "report", help="summarize and plot the recovery timelines agents wrote",
        description="Summarize the recovery timeline files (JSON lines) that agents write: one row per "
                    "recovery per rank, totals per run, step time per rank; --plot draws the timelines.")
    p.add_argument("files", nargs="+", metavar="FILE", help="timeline files (one per agent); merged by time")
    p.add_argument("--plot", metavar="OUT.png", default=None,
                   help="draw the recovery timelines and the step time per rank into this image (needs matplotlib)")
    p.add_argument("--json", action="store_true", help="print one JSON object (summary, rows, step_time)")
    p.set_defaults(func=_cmd)
    return p  # type: ignore[no-any-return]


def _cmd(args: argparse.Namespace) -> int:
    try:
        tl = read_timelines(args.files)
        report = summarize(tl)
        if args.plot:
            from gossiprec.report.plot import plot  # matplotlib only when a plot is asked for

            plot(tl, args.plot)
    except TimelineError as exc:
        print(f"gossiprec report: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.json:
        print(json.dumps(report, sort_keys=False))
    else:
        print(render_text(report))
        if args.plot:
            print(f"plot written to {args.plot}")
    return 0
