"""The bootstrap bench's measurement: every rank's first-step file, or a clear failure; nothing left running."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from gossiprec.bench.bootstrap import _first_steps
from gossiprec.cli import build_parser


def test_first_steps_times_the_last_rank(tmp_path: Path) -> None:
    files = [tmp_path / f"r{i}.step" for i in range(2)]
    t0 = time.time()
    writer = (f"import time, pathlib; time.sleep(0.2); pathlib.Path({str(files[0])!r}).write_text('1'); "
              f"time.sleep(0.2); pathlib.Path({str(files[1])!r}).write_text('1')")
    procs = [subprocess.Popen([sys.executable, "-c", writer], start_new_session=True)]
    r = _first_steps(files, procs, t0, tmp_path, timeout=60)
    assert r["ok"] and r["first_step_s"] >= 0.3 and r["spread_s"] >= 0.1, r
    assert procs[0].poll() is not None  # nothing left running


def test_a_job_that_ends_without_its_first_steps_is_a_failure(tmp_path: Path) -> None:
    procs = [subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)]
    r = _first_steps([tmp_path / "r0.step"], procs, time.time(), tmp_path, timeout=60)
    assert r == {"ok": False, "log_dir": str(tmp_path)}


def test_the_bench_command_parses() -> None:
    args = build_parser("bench").parse_args(["bench", "bootstrap", "--ranks", "8,32", "--trials", "2"])
    assert (args.ranks, args.trials, args.spares) == ("8,32", 2, 0)
