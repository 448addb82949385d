"""The documentation's configuration reference (docs/configuration.md) is the one the code writes, and every
field has its doc."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest

from gossiprec import reference as ref
from gossiprec.agent.settings import AgentSettings
from gossiprec.core.config import AgreementConfig, Config
from gossiprec.errors import ConfigError
from gossiprec.trainer.config import TrainerConfig

ROOT = Path(__file__).resolve().parent.parent


def test_the_docs_hold_the_reference_the_code_writes() -> None:
    got = ref.marked_block((ROOT / ref.DEFAULT_FILE).read_text())
    assert got is not None, f"{ref.DEFAULT_FILE} lost its reference markers"
    stale = f"{ref.DEFAULT_FILE}'s configuration reference is stale: run `gossiprec reference --update`"
    assert got == ref.block(), stale


@pytest.mark.parametrize("cls", [Config, AgreementConfig, AgentSettings, TrainerConfig])
def test_every_field_is_documented(cls: type) -> None:
    docs = ref.field_docs(cls)
    missing = [f.name for f in fields(cls) if f.name not in docs or len(docs[f.name]) < 10]
    assert not missing, f"{cls.__name__} fields without a docstring: {missing}"


def test_the_tables_show_both_profiles_and_every_field() -> None:
    text = ref.reference()
    for cls in (Config, AgreementConfig, TrainerConfig):
        for f in fields(cls):
            assert f"| `{f.name}` |" in text, f.name
    # a timeout differs between the profiles, a count does not
    row = next(line for line in text.splitlines() if line.startswith("| `probe_timeout` |"))
    assert row.split("|")[2:4] == [" 0.1 ", " 0.5 "], row
    row = next(line for line in text.splitlines() if line.startswith("| `indirect_checks` |"))
    assert row.split("|")[3] == " = ", row
    row = next(line for line in text.splitlines() if line.startswith("| `port` |"))
    assert "`--port`" in row and "`GOSSIPREC_PORT`" in row, row


def test_update_rewrites_only_the_block_and_refuses_a_file_without_one(tmp_path: Path) -> None:
    import argparse

    f = tmp_path / "README.md"
    f.write_text(f"intro\n\n{ref.BEGIN}\nold text\n{ref.END}\n\noutro\n")
    assert ref._cmd(argparse.Namespace(update=str(f))) == 0
    text = f.read_text()
    assert text.startswith("intro\n\n") and text.endswith("\n\noutro\n")
    assert ref.marked_block(text) == ref.block()
    bare = tmp_path / "other.md"
    bare.write_text("no markers here\n")
    with pytest.raises(ConfigError, match="no reference block"):
        ref._cmd(argparse.Namespace(update=str(bare)))


def test_every_gossiprec_command_of_the_readmes_shell_blocks_parses() -> None:
    import re
    import shlex

    from gossiprec.cli import build_parser

    seen = 0
    pages = sorted((ROOT / "docs").glob("*.md"))
    for path in (ROOT / "README.md", ROOT / "examples" / "README.md", ROOT / "examples" / "slurm.md", *pages):
        for blk in re.findall(r"```sh\n(.*?)```", path.read_text(), flags=re.S):
            for line in blk.replace("\\\n", " ").splitlines():
                lex = shlex.shlex(line, posix=True, punctuation_chars="|&;")
                lex.whitespace_split, lex.commenters = True, "#"
                tokens = list(lex)
                cmds: list[list[str]] = [[]]
                for tok in tokens:
                    if tok and set(tok) <= set("|&;"):
                        cmds.append([])
                    else:
                        cmds[-1].append(tok)
                for words in cmds:
                    while words and "=" in words[0]:
                        words.pop(0)  # VAR=value prefixes
                    if not words or words[0] != "gossiprec":
                        continue
                    args = words[1:words.index("--")] if "--" in words else words[1:]
                    build_parser(args[0]).parse_args(args)  # SystemExit on an unknown flag
                    seen += 1
    assert seen >= 6, seen
