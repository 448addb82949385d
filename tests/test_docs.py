"""The documentation says only what is true of this tree: every command shown in a page's shell blocks (and
every inline ``gossiprec ...`` command) parses with the real argument parser or names a ``make`` target and
files that exist; every test a page cites exists; every relative link, anchor and cited source path
resolves; the README stays a short tour; the example job spec is what the tour's command writes.

A failure names the page and line."""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "examples").glob("*.md"),
                ROOT / "deploy" / "README.md"])
README_MAX_LINES = 300
# shell blocks: ```sh, ```bash, ```shell, ```console and untagged ones; the others (python, diff, toml) are code
SHELL_LANGS = {"", "sh", "bash", "shell", "console"}
# commands a page may show that are neither gossiprec's nor a file of this tree
SHELL_TOOLS = {"pkill", "pgrep", "kill", "scancel", "squeue", "sacct", "apt-get", "export", "cd", "ls", "cat",
               "echo", "sudo", "pip"}
# files a page names that are the reader's own, not this tree's
READERS_FILES = {"train.py", ".venv/bin/activate"}


def _rel(path: Path) -> str:
    return path.relative_to(ROOT).as_posix()


def _blocks(path: Path) -> list[tuple[int, str, list[str]]]:
    """Each fenced block of a page: (line of its first body line, language, body lines)."""
    out: list[tuple[int, str, list[str]]] = []
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = re.match(r"\s*```(\w*)\s*$", lines[i])
        if m is None:
            i += 1
            continue
        lang, start, body = m.group(1), i + 2, []
        i += 1
        while i < len(lines) and not re.match(r"\s*```\s*$", lines[i]):
            body.append(lines[i])
            i += 1
        assert i < len(lines), f"{_rel(path)}:{start - 1}: a code block that never closes"
        out.append((start, lang, body))
        i += 1
    return out


def _prose(path: Path) -> list[tuple[int, str]]:
    """The page's lines outside fenced blocks, numbered."""
    out, inside = [], False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r"\s*```", line):
            inside = not inside
        elif not inside:
            out.append((n, line))
    return out


def _shell_commands(body: list[str], first: int) -> list[tuple[int, list[str]]]:
    """The simple commands of a shell block as (line, words): continuations joined, comments dropped,
    split at pipes, ``&&``, ``||`` and ``;``, leading ``VAR=value`` assignments dropped."""
    out: list[tuple[int, list[str]]] = []
    joined: list[tuple[int, str]] = []
    for n, line in enumerate(body, first):
        if joined and joined[-1][1].endswith("\\"):
            joined[-1] = (joined[-1][0], joined[-1][1][:-1] + " " + line)
        else:
            joined.append((n, line))
    for n, line in joined:
        lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
        lex.whitespace_split, lex.commenters = True, "#"
        words: list[str] = []
        for tok in lex:
            if tok and set(tok) <= set("|&;"):
                out.append((n, words))
                words = []
            else:
                words.append(tok)
        out.append((n, words))
    cleaned = []
    for n, words in out:
        while words and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", words[0]):
            words = words[1:]
        if words:
            cleaned.append((n, words))
    return cleaned


def _gossiprec_parser(command: str) -> argparse.ArgumentParser:
    from gossiprec.cli import build_parser

    return build_parser(command)


def _parse(argv: list[str]) -> argparse.Namespace:
    """Parse a gossiprec argv with the real parser; SystemExit (argparse's error) becomes an AssertionError."""
    assert argv, "a bare `gossiprec`"
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            return _gossiprec_parser(argv[0]).parse_args(argv)
    except SystemExit as exc:
        if exc.code == 0:  # --help, --version
            return argparse.Namespace()
        raise AssertionError(f"`gossiprec {' '.join(argv)}` does not parse: {err.getvalue().strip()}") from exc


def _files_exist(words: list[str], where: str) -> None:
    """Every word that names a file of this tree (deploy/, examples/, tests/, docs/, gossiprec/) exists."""
    for w in words:
        w = w.split("=", 1)[-1].split("::", 1)[0]
        if re.match(r"^(deploy|examples|tests|docs|gossiprec)/", w):
            assert (ROOT / w).exists(), f"{where}: `{w}` does not exist"


def _check_torchrun(argv: list[str], where: str) -> None:
    from torch.distributed.run import get_args_parser

    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            args = get_args_parser().parse_args(argv)
    except SystemExit as exc:
        raise AssertionError(f"{where}: `torchrun {' '.join(argv)}` does not parse: {err.getvalue()}") from exc
    assert (ROOT / args.training_script).exists(), f"{where}: `{args.training_script}` does not exist"


def _check_command(words: list[str], where: str) -> str:
    """Check one simple command; returns what kind it was."""
    head = words[0]
    if head == "python" and words[1:3] == ["-m", "gossiprec"]:
        words, head = ["gossiprec", *words[3:]], "gossiprec"
    if head == "gossiprec":
        argv = words[1:]
        if argv[:1] == ["torchrun"] and argv[1:]:  # every further argument is torchrun's
            _check_torchrun(["--rdzv-backend", "gossiprec", *argv[1:]], where)
            return "gossiprec"
        try:
            _parse(argv)
        except AssertionError as exc:
            raise AssertionError(f"{where}: {exc}") from None
        _files_exist(argv, where)
        if "--" in argv:  # the trainer command a launcher starts
            _check_command(argv[argv.index("--") + 1:], where)
        return "gossiprec"
    if head == "make":
        targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
        for t in (w for w in words[1:] if not w.startswith("-") and "=" not in w):
            assert t in targets, f"{where}: `make {t}`: the Makefile has no target {t!r}"
        return "make"
    if head in ("python", "bash", "sh", "pytest", "sbatch", "kubectl", "."):
        if head == "python" and words[1:2] == ["-m"]:
            assert importlib.util.find_spec(words[2]) is not None, f"{where}: no module {words[2]!r}"
            if words[2] == "pytest":
                _files_exist(words[3:], where)
            return "python"
        if head == "sbatch":  # sbatch [OPTIONS] SCRIPT [TRAINER COMMAND ...]
            script = next(w for w in words[1:] if not w.startswith("-"))
            assert (ROOT / script).is_file(), f"{where}: `{script}` does not exist"
            rest = words[words.index(script) + 1:]
            if rest:
                _check_command(rest, where)
            return "sbatch"
        files = [w for w in words[1:] if not w.startswith("-")][:1]
        if head not in ("pytest", "kubectl"):
            assert files, f"{where}: `{' '.join(words)}` names no file"
            target = files[0]
            assert (ROOT / target).exists() or target in READERS_FILES, f"{where}: `{target}` does not exist"
        _files_exist(words[1:], where)
        return head
    if head == "torchrun":
        _check_torchrun(words[1:], where)
        return "torchrun"
    assert head in SHELL_TOOLS, f"{where}: `{head}`: a command this test does not know (add a check for it)"
    return "tool"


def _block_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for first, lang, body in _blocks(page):
            if lang in SHELL_LANGS:
                for n, words in _shell_commands(body, first):
                    out.append((f"{_rel(page)}:{n}", words))
    return out


# inline `gossiprec ...` spans are commands too, unless they show a synopsis ([optional], A | B, ...); a
# ``double-quoted`` span is a docstring's name of a command (the generated reference), not a command line
INLINE = re.compile(r"(?<!`)`((?:python -m )?gossiprec [^`]+)`(?!`)")


def _inline_commands() -> list[tuple[str, list[str]]]:
    out = []
    for page in PAGES:
        for n, line in _prose(page):
            for m in INLINE.finditer(line):
                text = m.group(1)
                if any(s in text for s in ("[", "...", "|", "<")):
                    continue
                out.append((f"{_rel(page)}:{n}", shlex.split(text)))
    return out


def test_every_command_in_a_shell_block_parses_or_names_what_exists() -> None:
    kinds = [_check_command(words, where) for where, words in _block_commands()]
    assert kinds.count("gossiprec") >= 30 and "make" in kinds, kinds  # the pages do show commands


def test_every_inline_gossiprec_command_parses() -> None:
    cmds = _inline_commands()
    for where, words in cmds:
        _check_command(words, where)
    assert len(cmds) >= 20, len(cmds)


def _test_defs() -> dict[str, set[str]]:
    defs: dict[str, set[str]] = {}
    for f in (ROOT / "tests").rglob("*.py"):
        for name in re.findall(r"^\s*(?:async\s+)?def (test_\w+)\(", f.read_text(), flags=re.M):
            defs.setdefault(name, set()).add(f.relative_to(ROOT / "tests").as_posix())
    return defs


def test_every_cited_test_exists() -> None:
    defs = _test_defs()
    seen = 0
    for page in PAGES:
        for n, line in _prose(page):
            where = f"{_rel(page)}:{n}"
            for m in re.finditer(r"(?<![\w/])(tests/[\w/]+\.py|test_\w+\.py)(?:::(test_\w+))?", line):
                path = m.group(1) if m.group(1).startswith("tests/") else f"tests/{m.group(1)}"
                assert (ROOT / path).is_file(), f"{where}: cites {path}, which does not exist"
                if m.group(2):
                    assert m.group(2) in defs and Path(path).name in {Path(p).name for p in defs[m.group(2)]}, \
                        f"{where}: cites {m.group(0)}, but {path} has no {m.group(2)}"
                seen += 1
            for name in re.findall(r"`(test_\w+)`", line):
                assert name in defs, f"{where}: cites the test `{name}`, which no file under tests/ defines"
                seen += 1
    assert seen >= 20, seen


def _slug(heading: str) -> str:
    """Python-Markdown's toc slug of a heading (what mkdocs builds anchors from)."""
    text = re.sub(r"[`*]", "", heading).strip()
    text = unicodedata.normalize("NFKD", text).encode("ascii", "ignore").decode("ascii")
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def _anchors(path: Path) -> set[str]:
    return {_slug(m.group(1)) for _, line in _prose(path) for m in [re.match(r"#+\s+(.*)", line)] if m}


def test_every_relative_link_and_anchor_resolves() -> None:
    seen = 0
    for page in PAGES:
        for n, line in _prose(page):
            where = f"{_rel(page)}:{n}"
            for target in re.findall(r"\]\(([^)\s]+)\)", line):
                if re.match(r"^[a-z]+:", target):
                    continue  # https:, mailto:
                file, _, anchor = target.partition("#")
                dest = (page.parent / file).resolve() if file else page
                assert dest.exists(), f"{where}: the link {target!r} points at nothing"
                if anchor and dest.suffix == ".md":
                    assert anchor in _anchors(dest), f"{where}: {_rel(dest)} has no heading for #{anchor}"
                seen += 1
    assert seen >= 30, seen


# a path of this tree named in prose: gossiprec/..., deploy/..., examples/..., tests/..., docs/...
TREE_PATH = re.compile(r"(?<![\w./~$-])((?:gossiprec|deploy|examples|tests|docs)/[\w./-]*[\w/])")


def test_every_cited_path_exists() -> None:
    seen = 0
    for page in PAGES:
        for n, line in _prose(page):
            for path in TREE_PATH.findall(line):
                assert (ROOT / path).exists(), f"{_rel(page)}:{n}: `{path}` does not exist"
                seen += 1
    assert seen >= 30, seen


def test_the_readme_is_a_short_tour() -> None:
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines (at most {README_MAX_LINES}): move detail to docs/"


def test_the_example_job_spec_is_what_the_tours_command_writes(tmp_path: Path) -> None:
    tour = (ROOT / "docs" / "tour.md").read_text()
    m = re.search(r"`(gossiprec spec [^`]+)`", tour)
    assert m is not None and "examples/job.toml" in tour
    out = tmp_path / "job.toml"
    args = _parse([*shlex.split(m.group(1))[1:], "--out", str(out)])
    assert args.func(args) == 0
    assert out.read_text() == (ROOT / "examples" / "job.toml").read_text(), \
        f"examples/job.toml is not what `{m.group(1)}` writes: regenerate it with --out examples/job.toml"


@pytest.mark.parametrize("page", [_rel(p) for p in PAGES])
def test_every_page_is_in_the_site_or_beside_the_files_it_describes(page: str) -> None:
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    listed = {f"docs/{v}" for item in nav for v in item.values()}
    assert page in listed or not page.startswith("docs/"), f"{page} is not in mkdocs.yml's nav"


def test_the_sharded_pages_count_the_full_matrix_as_the_tests_do() -> None:
    import importlib

    matrix = importlib.import_module("tests.test_sharded_recovery").FULL_MATRIX
    text = (ROOT / "docs" / "sharded.md").read_text()
    m = re.search(r"`test_sharded_fault_matrix`: (\d+) jobs", text)
    assert m is not None, "docs/sharded.md no longer counts the single-fault matrix"
    assert int(m.group(1)) == len(matrix), f"docs/sharded.md says {m.group(1)} jobs, the matrix has {len(matrix)}"
