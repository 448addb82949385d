"""``gossiprec report``: a synthetic timeline in the agents' format (two files, one per agent) read back,
summed exactly, printed as a table and as JSON, drawn as a PNG; bad lines named by file and line; a last
line cut short by a killed agent dropped; an empty file says so."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gossiprec.cli import main
from gossiprec.report.timeline import PHASES, TimelineError, read_timeline, read_timelines

T0 = 1_800_000_000.0
PHASES_2S = {"detect": 0.25, "agree": 0.5, "plan": 0.125, "group": 0.25, "state": 0.5, "first_step": 0.375}
PHASES_3S = {"detect": 0.5, "agree": 0.5, "plan": 0.25, "group": 0.5, "state": 1.0, "first_step": 0.25}
PHASES_1_5S = {"detect": 0.0, "agree": 0.5, "plan": 0.25, "group": 0.25, "state": 0.25, "first_step": 0.25}


def recovery(time: float, node: str, epoch: int, rank: int, **kw: Any) -> dict[str, Any]:
    line = {"v": 1, "kind": "recovery", "time": time, "node": node, "epoch": epoch, "cause": "unreachable",
            "action": "resume", "role": "survivor", "rank": rank, "world_size": 2, "previous_world_size": 2,
            "target_step": 100, "lost_steps": 1, "rto_s": 2.0, "phases": PHASES_2S, "bytes": 0,
            "transfer_s": 0.0, "donors": [], "digest": "ok"}
    line.update(kw)
    return line


def steps(time: float, node: str, rank: int, step: int, step_s: float, behind_ms: float = 0.0) -> dict[str, Any]:
    return {"v": 1, "kind": "steps", "time": time, "node": node, "rank": rank, "step": step, "step_s": step_s,
            "behind_ms": behind_ms}


def write(path: Path, lines: list[dict[str, Any]], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(line) + "\n" for line in lines) + tail)
    return path


@pytest.fixture
def files(tmp_path: Path) -> list[Path]:
    """Agent a00 (rank 0) and agent a01 (rank 1): a resume at epoch 3 (a01 received 50 MB from a00 in
    0.5 s), then a shrink at epoch 5 that leaves rank 0 alone; step samples every 5 s."""
    a = write(tmp_path / "a00.jsonl", [
        steps(T0 + 0, "a00", 0, 10, 0.1),
        steps(T0 + 5, "a00", 0, 60, 0.2),
        recovery(T0 + 12.0, "a00", 3, 0, role="donor"),
        steps(T0 + 15, "a00", 0, 90, 0.3),
        recovery(T0 + 30.0, "a00", 5, 0, action="shrink", cause="hung", world_size=1, rto_s=1.5,
                 phases=PHASES_1_5S, lost_steps=2, target_step=200),
        steps(T0 + 35, "a00", 0, 250, 0.4, behind_ms=12.5),
        {"v": 1, "kind": "future-kind", "time": T0 + 36, "node": "a00"},
    ])
    b = write(tmp_path / "a01.jsonl", [
        steps(T0 + 1, "a01", 1, 11, 0.5),
        recovery(T0 + 13.0, "a01", 3, 1, role="receiver", rto_s=3.0, phases=PHASES_3S, bytes=50_000_000,
                 transfer_s=0.5, donors=["a00"]),
        steps(T0 + 16, "a01", 1, 91, 0.7),
        steps(T0 + 21, "a01", 1, 140, 0.6),
    ])
    return [a, b]


def run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["report", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def test_the_synthetic_phases_sum_to_their_rto() -> None:
    for phases, rto in ((PHASES_2S, 2.0), (PHASES_3S, 3.0), (PHASES_1_5S, 1.5)):
        assert list(phases) == list(PHASES) and sum(phases.values()) == rto


def test_summary_numbers_are_exact(files: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = run([str(f) for f in files] + ["--json"], capsys)
    assert rc == 0 and err == ""
    report = json.loads(out)
    s = report["summary"]
    assert s["files"] == [str(f) for f in files]
    assert s["recoveries"] == 2 and s["lines"] == 3
    assert s["by_action"] == {"resume": 1, "shrink": 1}
    assert s["rto_p50_s"] == 2.25 and s["rto_max_s"] == 3.0  # epoch 3: max(2.0, 3.0); epoch 5: 1.5
    assert s["lost_steps"] == 3  # epoch 3: 1 (the same loss on both ranks), epoch 5: 2
    assert s["bytes"] == 50_000_000 and s["digest_mismatches"] == 0 and s["phase_sum_off"] == 0
    assert s["step_samples"] == 7 and s["truncated_lines"] == 0 and s["skipped_lines"] == 1
    assert report["step_time"] == {
        "0": {"median_step_s": 0.25, "samples": 4, "last_step": 250, "max_behind_ms": 12.5},
        "1": {"median_step_s": 0.6, "samples": 3, "last_step": 140, "max_behind_ms": 0.0},
    }
    rows = report["rows"]
    assert [(r["node"], r["epoch"], r["rank"], r["action"]) for r in rows] == [
        ("a00", 3, 0, "resume"), ("a01", 3, 1, "resume"), ("a00", 5, 0, "shrink")]  # merged by time
    recv = rows[1]
    assert recv["role"] == "receiver" and recv["mb_s"] == 100.0 and recv["donors"] == ["a00"]
    assert recv["phases"] == PHASES_3S and recv["rto_s"] == 3.0 and recv["time"] == T0 + 13.0
    assert rows[0]["mb_s"] is None and rows[2]["cause"] == "hung" and rows[2]["world_size"] == 1


def test_the_text_table(files: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, _ = run([str(f) for f in files], capsys)
    assert rc == 0
    lines = out.splitlines()
    header = lines[0].split()
    assert header[:3] == ["time", "(UTC)", "node"] and "detect" in header and header[-1] == "digest"
    recv = next(line for line in lines if " a01 " in line and "receiver" in line)
    assert recv.split()[:3] == ["2027-01-15", "08:00:13.0Z", "a01"]
    assert "3.000" in recv.split() and "50.0 MB" in recv and "100.0" in recv.split()
    assert "2 recoveries (3 rank lines): resume 1, shrink 1" in lines
    assert "RTO p50 2.250 s, max 3.000 s; lost steps 3; bytes 50.0 MB; digest mismatches 0" in lines
    rank1 = next(line for line in lines if line.startswith("1 "))
    assert rank1.split() == ["1", "0.6000", "3", "140", "0.0"]


def test_plot_writes_a_png_with_both_panels(files: list[Path], tmp_path: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    import matplotlib.image

    from gossiprec.report.plot import PHASE_COLOURS

    png = tmp_path / "report.png"
    rc, out, _ = run([str(f) for f in files] + ["--plot", str(png)], capsys)
    assert rc == 0 and f"plot written to {png}" in out
    assert png.stat().st_size > 0
    img = matplotlib.image.imread(str(png))
    # 11 in wide at 100 dpi; 2.5 + 0.28 * 4 (at least four bar slots) + 3.5 in high
    assert img.shape == (712, 1100, 4)
    colours = {tuple(int(round(c * 255)) for c in px[:3]) for px in img.reshape(-1, 4)[::7]}
    for hexa in PHASE_COLOURS:  # every phase's bar is drawn (solid fills of its colour)
        assert tuple(int(hexa[i:i + 2], 16) for i in (1, 3, 5)) in colours, hexa


def test_phases_that_miss_their_rto_are_counted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    f = write(tmp_path / "t.jsonl", [recovery(T0, "a00", 3, 0, rto_s=2.0009),  # within 1 ms: fine
                                     recovery(T0 + 1, "a01", 3, 1, rto_s=2.1, digest="mismatch")])
    rc, out, _ = run([str(f)], capsys)
    assert rc == 0 and "(1 line(s) whose phases do not add up to their RTO within 1 ms)" in out
    assert "digest mismatches 1" in out


def test_a_large_job_draws_one_bar_per_recovery(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gossiprec.report.plot import MAX_BARS, _bars
    from gossiprec.report.summary import by_epoch

    lines = [recovery(T0 + 10 * e + rank / 100, f"a{rank:02d}", e, rank, rto_s=2.0 + rank / 64)
             for e in (3, 4, 5) for rank in range(30)]
    tl = read_timeline(write(tmp_path / "big.jsonl", lines))
    bars, what = _bars(by_epoch(tl.recoveries))
    assert [(b.epoch, b.rank) for b in bars] == [(3, 29), (4, 29), (5, 29)]  # the slowest rank of each
    assert what == "the slowest rank of each (90 rank lines)"
    many = read_timeline(write(tmp_path / "many.jsonl", [recovery(T0 + e, "a00", e, 0) for e in range(60)]))
    bars, what = _bars(by_epoch(many.recoveries))
    assert [b.epoch for b in bars] == list(range(60 - MAX_BARS, 60))
    assert what == f"the slowest rank of the last {MAX_BARS}"
    png = tmp_path / "many.png"
    rc, _, _ = run([str(tmp_path / "many.jsonl"), "--plot", str(png)], capsys)
    import matplotlib.image

    assert rc == 0 and matplotlib.image.imread(str(png)).shape[:2] == (1944, 1100)


def test_an_empty_file_has_no_recoveries(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    rc, out, _ = run([str(empty)], capsys)
    assert rc == 0 and out.strip() == "no recoveries"
    rc, out, _ = run([str(empty), "--json"], capsys)
    assert rc == 0 and json.loads(out)["summary"]["recoveries"] == 0 and json.loads(out)["rows"] == []
    png = tmp_path / "empty.png"
    rc, out, _ = run([str(empty), "--plot", str(png)], capsys)
    assert rc == 0 and png.stat().st_size > 0


@pytest.mark.parametrize("line, message", [
    ("not json at all", "not JSON"),
    ('["a list"]', "not a JSON object"),
    ('{"v": 2, "kind": "recovery", "time": 1.0, "node": "a"}', "format version 2; this gossiprec reads version 1"),
    (json.dumps({k: v for k, v in recovery(1.0, "a", 1, 0).items() if k != "rto_s"}), "missing field 'rto_s'"),
    (json.dumps(recovery(1.0, "a", 1, 0, action="reboot")), "field 'action' must be resume | shrink"),
    (json.dumps(recovery(1.0, "a", 1, 0, phases={**PHASES_2S, "agree": -1})), "field 'agree' must be"),
    (json.dumps(recovery(1.0, "a", 1, 0, phases={**PHASES_2S, "nap": 1.0})), "unknown phase(s) 'nap'"),
    (json.dumps(steps(1.0, "a", 0, 1, 0.1) | {"rank": "0"}), "field 'rank' must be an integer, got '0'"),
])
def test_a_bad_line_names_its_file_and_line(line: str, message: str, files: list[Path],
                                            capsys: pytest.CaptureFixture[str]) -> None:
    bad = files[1]
    lines = bad.read_text().splitlines(keepends=True)
    bad.write_text("".join(lines[:2]) + line + "\n" + "".join(lines[2:]))
    rc, out, err = run([str(files[0]), str(bad)], capsys)
    assert rc == 2 and out == ""
    assert err.startswith(f"gossiprec report: error: {bad}:3: ") and message in err, err


def test_a_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, _, err = run([str(tmp_path / "nope.jsonl")], capsys)
    assert rc == 2 and f"{tmp_path / 'nope.jsonl'}: no such file" in err
    rc, _, err = run([str(tmp_path)], capsys)
    assert rc == 2 and "a directory" in err
    binary = tmp_path / "x.bin"
    binary.write_bytes(b'{"v": 1}\n\xff\xfe')
    rc, _, err = run([str(binary)], capsys)
    assert rc == 2 and f"{binary}:2: not UTF-8" in err


def test_a_truncated_last_line_is_dropped(files: list[Path], capsys: pytest.CaptureFixture[str]) -> None:
    whole = read_timelines(files)
    with files[0].open("a") as f:
        f.write(json.dumps(recovery(T0 + 50, "a00", 7, 0))[:40])  # killed mid-write: no newline
    tl = read_timelines(files)
    assert tl.truncated == 1 and tl.recoveries == whole.recoveries and tl.steps == whole.steps
    rc, out, _ = run([str(f) for f in files], capsys)
    assert rc == 0 and "(1 truncated last line(s) dropped; 1 line(s) of other kinds skipped)" in out
    # the same cut line followed by a newline is a whole line, and a bad one
    with files[0].open("a") as f:
        f.write("\n")
    with pytest.raises(TimelineError, match=r"a00\.jsonl:8: not JSON"):
        read_timeline(files[0])


def test_a_last_line_without_newline_that_parses_is_kept(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text(json.dumps(recovery(T0, "a00", 3, 0)))
    tl = read_timeline(f)
    assert len(tl.recoveries) == 1 and tl.truncated == 0


def test_a_missing_matplotlib_is_a_clear_error(files: list[Path], tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    rc, _, err = run([str(files[0]), "--plot", str(tmp_path / "x.png")], capsys)
    assert rc == 2 and "--plot needs matplotlib: pip install 'gossiprec[plot]'" in err


def test_the_command_is_wired_into_gossiprec(files: list[Path]) -> None:
    proc = subprocess.run([sys.executable, "-m", "gossiprec", "report", "--json", *map(str, files)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["summary"]["recoveries"] == 2
