"""examples/gpt_hsdp.py: its tokenizer, corpus, data position and digest check, then the script itself as a
user launches it (``gossiprec run --nnodes 5 --spares 1 --mesh replicate=2,shard=2``, four ranks of an HSDP
mesh and a hot spare): a failure-free run, and a run where a rank is SIGKILLed mid-run and replaced by the
spare, whose every rank ends with the failure-free run's state, bit for bit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.gpt import SCRIPT, STEPS, run_job, sha256s



@pytest.fixture(scope="module")
def gpt() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpt_hsdp", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpt_hsdp"] = module  # (its dataclass looks its module up there)
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["gpt_hsdp"]
    return module


# ---------------------------------------------------------------------------------------------- the parts
def test_the_corpus_is_the_standard_librarys_source_the_same_each_time(gpt: ModuleType) -> None:
    text = gpt.load_corpus()
    assert len(text) > 30_000 and "def bisect_left" in text and "class TextWrapper" in text
    assert text == gpt.load_corpus()
    assert list(gpt.CORPUS_FILES) == sorted(gpt.CORPUS_FILES)


def test_the_tokenizer_round_trips_and_is_deterministic(gpt: ModuleType) -> None:
    text = gpt.load_corpus()
    tok = gpt.CharTokenizer.from_text(text)
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.vocab_size == len(set(text)) and max(ids) == tok.vocab_size - 1
    again = gpt.CharTokenizer.from_text(text)
    assert again.chars == tok.chars and again.encode(text[:500]) == ids[:500]
    assert tok.chars == "".join(sorted(tok.chars))  # the order does not depend on the text's
    with pytest.raises(ValueError, match="character '\u2603' is not in the vocabulary"):
        tok.encode("snow \u2603")
    with pytest.raises(ValueError, match="twice"):
        gpt.CharTokenizer("aba")


def test_a_batch_is_a_function_of_the_data_position_and_the_data_index(gpt: ModuleType) -> None:
    import torch

    tokens = torch.arange(1000)
    cursor = gpt.TokenCursor(tokens, 4, 16)
    x, y = cursor.batch(0)
    assert x.shape == y.shape == (4, 16) and torch.equal(x[:, 1:], y[:, :-1])  # targets: the next token
    assert torch.equal(cursor.batch(0)[0], x) and not torch.equal(cursor.batch(1)[0], x)
    cursor.advance()
    assert not torch.equal(cursor.batch(0)[0], x)
    other = gpt.TokenCursor(tokens, 4, 16)
    other.load_state_dict(cursor.state_dict())  # what a spare receives
    assert torch.equal(other.batch(3)[0], cursor.batch(3)[0])
    with pytest.raises(ValueError, match="too few for --seq 16"):
        gpt.TokenCursor(torch.arange(17), 4, 16)


def test_the_digest_check_names_what_differs(gpt: ModuleType, tmp_path: Path) -> None:
    mine = {"rank": 1, "step": 40, "state_sha256": "a" * 64, "corpus_sha256": "c" * 64}
    assert "no digest to compare with" in gpt.compare(mine, tmp_path)
    (tmp_path / "rank1.json").write_text(json.dumps(mine))
    assert gpt.compare(mine, tmp_path) == ""
    assert gpt.compare({**mine, "state_sha256": "b" * 64}, tmp_path).startswith("state_sha256 differs")
    assert gpt.compare({**mine, "step": 39}, tmp_path).startswith("step differs")
    assert gpt.compare({**mine, "corpus_sha256": "d" * 64}, tmp_path).startswith("corpus_sha256 differs")


def test_the_command_line_refuses_a_mesh_that_is_not_hsdp(gpt: ModuleType, capsys: pytest.CaptureFixture[str]) -> None:
    assert gpt.parse_args(["--mesh", "replicate=2;shard=4"]).mesh == "replicate=2;shard=4"
    for mesh, message in (("replicate=4", "HSDP takes two dimensions"), ("dp2", "is not NAME=SIZE")):
        with pytest.raises(SystemExit):
            gpt.parse_args(["--mesh", mesh])
        assert message in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- end to end
@pytest.fixture
def reference(gpt_reference: dict[str, Any]) -> dict[str, Any]:
    return gpt_reference  # (the session's failure-free run, shared with the Slurm test)


def test_a_failure_free_run_trains_and_writes_each_ranks_digest(reference: dict[str, Any]) -> None:
    where = f"logs in {reference['logs']['n0'].parent}"
    assert reference["exits"] == {f"n{i}": 0 for i in range(5)}, where  # the unused spare too
    digests = reference["digests"]
    assert sorted(digests) == [0, 1, 2, 3], where
    assert {d["step"] for d in digests.values()} == {STEPS}
    # replica groups [0, 2] and [1, 3]: the two replicas of a shard hold the same state, the shards differ
    sha = {r: d["state_sha256"] for r, d in digests.items()}
    assert sha[0] == sha[2] and sha[1] == sha[3] and sha[0] != sha[1], where
    log = reference["logs"]["n0"].read_text()
    losses = [float(line.split(" loss ")[1].split()[0]) for line in log.splitlines() if " loss " in line]
    assert len(losses) == STEPS // 10 and losses[-1] < 3.2, (losses, where)  # from ln(97) = 4.57 at the start


def test_a_rank_killed_mid_run_is_replaced_and_the_run_ends_bit_identical(
        reference: dict[str, Any], tmp_path: Path) -> None:
    ref_out = reference["logs"]["n0"].parent / "out"
    res = run_job(tmp_path, "--expect", str(ref_out), kill=["n1"])
    where = f"logs in {tmp_path}"
    assert res["killed"], where
    assert res["exits"] == {"n0": 0, "n1": 137, "n2": 0, "n3": 0, "n4": 0}, (res["exits"], where)
    assert sha256s(res) == sha256s(reference), where
    assert res["digests"][1]["node"] == "n4", where  # the spare finished rank 1
    for node in ("n0", "n2", "n3", "n4"):  # and the script itself said so on every rank
        assert "final state equals the failure-free run's, bit for bit" in res["logs"][node].read_text(), where
    assert "rank 1 recovered in epoch 1 (spare waiting for a rank): resume from step 1" in \
        res["logs"]["n4"].read_text(), where


@pytest.mark.long  # test_slurm_sharded.py runs this restart under sbatch --requeue
def test_a_job_stopped_without_spares_restarts_from_its_checkpoint_and_ends_bit_identical(
        reference: dict[str, Any], tmp_path: Path) -> None:
    """``--ckpt DIR --ckpt-every 10``: a job without a spare that loses a rank stops in good order (exit 75,
    a scheduler's requeue); the same command started again resumes from the newest complete checkpoint and
    ends with the failure-free run's state (which saved none), bit for bit."""
    from gossiprec.trainer import DcpCheckpoints

    ckpt = tmp_path / "ckpt"
    first = run_job(tmp_path / "first", "--ckpt", str(ckpt), "--ckpt-every", "10", kill=["n1"],
                    after="checkpoint of step 20 saved", spares=0)
    where = f"logs in {tmp_path}"
    assert first["killed"] and first["digests"] == {}, where
    assert first["exits"] == {"n0": 75, "n1": 137, "n2": 75, "n3": 75}, (first["exits"], where)
    saved = DcpCheckpoints(ckpt).steps()
    assert saved and saved[-1] in (20, 30), (saved, where)
    ref_out = reference["logs"]["n0"].parent / "out"
    second = run_job(tmp_path / "second", "--ckpt", str(ckpt), "--ckpt-every", "10", "--expect", str(ref_out))
    assert second["exits"] == {f"n{i}": 0 for i in range(5)}, (second["exits"], where)
    assert sha256s(second) == sha256s(reference), where
    log = second["logs"]["n0"].read_text()
    assert f"rank 0 resumed from the checkpoint of step {saved[-1]}" in log, where
    assert f"step {saved[-1]} loss" not in log and f"step {saved[-1] + 10} loss" in log, where


@pytest.mark.long  # test_dcp_fallback.py covers it for both layouts
def test_a_shard_lost_with_every_holder_comes_back_from_the_checkpoint_bit_identical(
        reference: dict[str, Any], tmp_path: Path) -> None:
    """Both holders of shard 0 (ranks 0 and 2, replica group [0, 2]) SIGKILLed at once, two spares: no
    replica is left to stream shard 0 from, so the plan is ``checkpoint``: every rank loads the newest
    complete checkpoint (``on_no_replica``), training goes on from its step, and the job still ends with
    the failure-free run's state, bit for bit."""
    ckpt = tmp_path / "ckpt"
    res = run_job(tmp_path / "job", "--ckpt", str(ckpt), "--ckpt-every", "10", kill=["n0", "n2"],
                  after="checkpoint of step 20 saved", spares=2)
    where = f"logs in {tmp_path}"
    assert res["killed"], where
    assert res["exits"] == {"n0": 137, "n1": 0, "n2": 137, "n3": 0, "n4": 0, "n5": 0}, (res["exits"], where)
    assert sha256s(res) == sha256s(reference), where
    assert {res["digests"][0]["node"], res["digests"][2]["node"]} == {"n4", "n5"}, where
    for node in ("n1", "n3", "n4", "n5"):  # every rank of the new world, survivors too, went back to step 20
        assert "recovered in epoch 1 (" in res["logs"][node].read_text(), (node, where)
        assert "): checkpoint from step 20\n" in res["logs"][node].read_text(), (node, where)
