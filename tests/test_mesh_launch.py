"""The mesh travels with the launch: one ``--mesh`` syntax on every launcher (``gossiprec spec``, ``gossiprec
run --nnodes``, torchrun's ``--rdzv-conf mesh=``, ``GOSSIPREC_MESH``), the topology derived from it exactly
as the trainer's ``MeshSpec`` derives its own, bad input refused before any agent starts, and a trainer
whose mesh is not the launched one refused at start in one line naming both."""

from __future__ import annotations

import math
import random
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from gossiprec.agent.jobspec import check_mesh, node_factory, view0_from_dict
from gossiprec.agent.settings import load_settings
from gossiprec.cli import main as cli_main
from gossiprec.core.bootstrap import BootParams, Bootstrap, Candidate, view_zero
from gossiprec.core.events import BootMismatch
from gossiprec.core.mesh import MeshShape, parse_mesh
from gossiprec.core.wire import BootHello
from gossiprec.errors import ConfigError
from gossiprec.trainer.collectives.sharded import MeshSpec


# ---------------------------------------------------------------------------------------------- the parser
@pytest.mark.parametrize("text, names, sizes", [
    ("replicate=2,shard=4", ("replicate", "shard"), (2, 4)),
    ("dp=2;tp=2", ("dp", "tp"), (2, 2)),
    (" dp=2 ; tp=2 ", ("dp", "tp"), (2, 2)),
    ("replicate=2,shard=2,tp=2", ("replicate", "shard", "tp"), (2, 2, 2)),
    ("replicate=4", ("replicate",), (4,)),
])
def test_the_parser_reads_every_launchers_syntax(text: str, names: tuple[str, ...], sizes: tuple[int, ...]) -> None:
    mesh = parse_mesh(text, trainers=MeshShape(names, sizes).world_size)
    assert (mesh.names, mesh.sizes, mesh.replicate) == (names, sizes, names[:1])
    # the topology is exactly the trainer's MeshSpec's (replicate dimension first)
    assert mesh.topology() == MeshSpec(sizes, names).topology()


def test_a_single_replicate_dimension_is_plain_ddp() -> None:
    mesh = parse_mesh("replicate=4", 4)
    assert mesh.topology().replica_groups == ((0, 1, 2, 3),)
    assert mesh.job_toml().startswith('[job]\ntopology = "ddp"')


@pytest.mark.parametrize("shape, names, replicate", [
    ((2, 2), ("dp", "tp"), "dp"), ((2, 3), ("replicate", "shard"), ""), ((2, 2, 2), ("a", "b", "c"), "b"),
    ((2, 2, 3), ("a", "b", "c"), ("a", "c")), ((3, 2), ("tp", "dp"), "dp"),
])
def test_the_pure_derivation_equals_torchs_device_mesh_lines(shape: tuple[int, ...], names: tuple[str, ...],
                                                            replicate: str | tuple[str, ...]) -> None:
    """What core.mesh computes without torch is what the trainer reads of a real rank grid."""
    import torch

    from gossiprec.trainer.collectives.managed import mesh_topology

    grid = SimpleNamespace(mesh=torch.arange(math.prod(shape)).reshape(shape), mesh_dim_names=names)
    spec = MeshSpec(shape, names, replicate)
    assert spec.topology() == mesh_topology(grid, spec.replicated)


@pytest.mark.parametrize("text, trainers, message", [
    ("", None, "--mesh is empty: expected NAME=SIZE"),
    ("dp2", None, "'dp2' is not NAME=SIZE; expected NAME=SIZE[,NAME=SIZE...]"),
    ("dp=2,,tp=2", None, "'' is not NAME=SIZE"),
    ("dp=x", None, "'dp=x' is not NAME=SIZE"),
    ("2=dp", None, "'2=dp' is not NAME=SIZE"),
    ("dp=2:tp=2", None, "is not NAME=SIZE"),
    ("dp=0,tp=2", None, "dimension 'dp' has size 0; every size must be an integer >= 1"),
    ("dp=2,tp=-1", None, "dimension 'tp' has size -1; every size must be an integer >= 1"),
    ("dp=2,dp=2", None, "names the dimension 'dp' twice"),
    ("replicate=2,shard=4", 6, "makes 8 ranks (2 x 4) but the job has 6 trainers"),
    ("dp=3", 1, "makes 3 ranks (3) but the job has 1 trainer "),
])
def test_bad_input_is_refused_with_what_was_expected(text: str, trainers: int | None, message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        parse_mesh(text, trainers)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)


# ------------------------------------------------------------------------------------------- gossiprec spec
def _spec(tmp_path: Path, *args: str) -> tuple[int, str]:
    out = tmp_path / "job.toml"
    rc = cli_main(["spec", "--hosts", "n[1-3]", "--nproc-per-node", "2", "--addr", "n1=127.0.0.1",
                   "--addr", "n2=127.0.0.2", "--addr", "n3=127.0.0.3", "--out", str(out), *args])
    return rc, out.read_text() if out.exists() else ""


@pytest.mark.parametrize("mesh, shape, names", [
    ("replicate=2,shard=2", (2, 2), ("replicate", "shard")),
    ("dp=2;tp=2", (2, 2), ("dp", "tp")),
    ("dp=4", (4,), ("dp",)),
])
def test_spec_writes_the_job_table_meshspec_writes(tmp_path: Path, mesh: str, shape: tuple[int, ...],
                                                   names: tuple[str, ...]) -> None:
    rc, text = _spec(tmp_path, "--spares", "2", "--mesh", mesh)
    assert rc == 0
    doc = tomllib.loads(text)
    spec = MeshSpec(shape, names)
    assert doc["job"] == tomllib.loads(spec.job_toml())["job"]
    assert view0_from_dict(doc).topology == spec.topology()
    assert [m["role"] for m in doc["members"]] == ["trainer"] * 4 + ["spare"] * 2


def test_spec_with_a_mesh_keeps_allow_shrink_and_without_one_writes_ddp(tmp_path: Path) -> None:
    rc, text = _spec(tmp_path, "--spares", "2", "--mesh", "replicate=2,shard=2", "--allow-shrink")
    assert rc == 0 and tomllib.loads(text)["job"]["allow_shrink"] is True
    rc, text = _spec(tmp_path, "--spares", "2", "--mesh", "")  # GOSSIPREC_MESH empty: plain DDP
    assert rc == 0 and tomllib.loads(text)["job"] == {"topology": "ddp", "allow_shrink": False}


@pytest.mark.parametrize("mesh, message", [
    ("replicate=2,shard=2", "--mesh 'replicate=2,shard=2' makes 4 ranks (2 x 2) but the job has 5 trainers"),
    ("replicate=2,shard=0", "dimension 'shard' has size 0"),
    ("replicate:2", "'replicate:2' is not NAME=SIZE"),
])
def test_spec_refuses_a_bad_mesh_and_writes_nothing(tmp_path: Path, mesh: str, message: str,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    rc, text = _spec(tmp_path, "--spares", "1", "--mesh", mesh)
    assert rc == 1 and text == ""
    assert message in capsys.readouterr().err


# -------------------------------------------------------------------------------------------------- torchrun
def _conf(**extra: str) -> dict[str, str]:
    return {"hosts": "h[1-5]", "spares": "1", "addr": "h1=127.0.0.1;h2=127.0.0.2;h3=127.0.0.3;h4=127.0.0.4;"
            "h5=127.0.0.5", "name": "h1-0", "insecure": "1", **extra}


def test_spec_warns_when_replicas_of_a_shard_share_a_host(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gossiprec.agent.spec import layout, shared_hosts

    slots = layout(["n1", "n2"], 4, 0, 29400, lambda h: "127.0.0.1")
    assert shared_hosts(slots, "replicate=2,shard=4") == []  # a shard's two replicas on n1 and n2
    assert shared_hosts(slots, "replicate=4,shard=2")[0] == (
        "ranks 0, 2 hold the same shard and share host n1: losing it loses 2 of the 4 copies of their shard at once")
    one = layout(["n1", "n2"], 4, 4, 29400, lambda h: "127.0.0.1")  # the second host is all spares
    assert shared_hosts(one, "replicate=2,shard=2") == [
        "ranks 0, 2 hold the same shard and share host n1: losing it loses every copy of their shard: only a "
        "checkpoint can restore it",
        "ranks 1, 3 hold the same shard and share host n1: losing it loses every copy of their shard: only a "
        "checkpoint can restore it"]
    capsys.readouterr()
    rc, _ = _spec(tmp_path, "--spares", "2", "--mesh", "replicate=2,shard=2")  # 3 hosts x 2: replicas apart
    assert rc == 0 and "warning" not in capsys.readouterr().err


def test_torchrun_keeps_a_semicolon_separated_mesh_whole() -> None:
    """torch 2.13 splits --rdzv-conf at ',' and each item at its first '=' only: ';' survives, ',' does not."""
    from torch.distributed.elastic.rendezvous.utils import _parse_rendezvous_config

    conf = _parse_rendezvous_config("hosts=h[1-5],spares=1,mesh=dp=2;tp=2")
    assert conf["mesh"] == "dp=2;tp=2" and parse_mesh(conf["mesh"]).sizes == (2, 2)
    split = _parse_rendezvous_config("mesh=dp=2,tp=2")
    assert split == {"mesh": "dp=2", "tp": "2"}  # the comma cut the mesh in two


def test_torchrun_conf_mesh_writes_the_specs_topology() -> None:
    from gossiprec.agent.torchrun_conf import plan_node

    plan = plan_node(_conf(mesh="dp=2;tp=2"), "", 5, 5, {})
    doc = tomllib.loads(plan.spec_text)
    assert view0_from_dict(doc).topology == MeshSpec((2, 2), ("dp", "tp")).topology()
    assert plan.settings.mesh == "dp=2,tp=2"


@pytest.mark.parametrize("conf, message", [
    ({"mesh": "dp=2;tp=3"}, "--rdzv-conf mesh 'dp=2;tp=3' makes 6 ranks (2 x 3) but the job has 4 trainers"),
    ({"mesh": "dp=2", "tp": "2"}, "separate the mesh's dimensions with ';'"),
    ({"mesh": "dp=2;tp"}, "--rdzv-conf mesh 'dp=2;tp': 'tp' is not NAME=SIZE"),
])
def test_torchrun_conf_refuses_a_bad_mesh(conf: dict[str, str], message: str) -> None:
    from gossiprec.agent.torchrun_conf import plan_node

    with pytest.raises(ConfigError) as exc:
        plan_node(_conf(**conf), "", 5, 5, {})
    assert message in str(exc.value)


def test_torchrun_conf_checks_a_given_spec_against_the_mesh(tmp_path: Path) -> None:
    from gossiprec.agent.torchrun_conf import plan_node, spec_from_hosts

    path = tmp_path / "job.toml"
    path.write_text(spec_from_hosts(_conf()))  # plain DDP
    conf = {k: v for k, v in _conf().items() if k not in ("hosts", "spares", "addr")}
    with pytest.raises(ConfigError, match=r"mesh dp=2,tp=2 has replica groups \[\[0, 2\], \[1, 3\]\], but job spec "):
        plan_node({**conf, "spec": str(path), "mesh": "dp=2;tp=2"}, "", 5, 5, {})
    path.write_text(spec_from_hosts(_conf(mesh="dp=2;tp=2")))
    assert plan_node({**conf, "spec": str(path), "mesh": "dp=2;tp=2"}, "", 5, 5, {}).settings.mesh == "dp=2,tp=2"


# --------------------------------------------------------------------------------- agent settings, gossiprec run
def test_gossiprec_mesh_is_read_from_the_environment_and_checked_against_the_bootstrap_size() -> None:
    env = {"GOSSIPREC_MESH": "replicate=2;shard=2"}
    s = load_settings({"insecure": True, "nnodes": 2, "nproc_per_node": 3, "spares": 2, "seeds": ("a:1",)}, env)
    assert s.mesh_shape() == parse_mesh("replicate=2,shard=2")
    with pytest.raises(ConfigError) as exc:
        load_settings({"insecure": True, "nnodes": 2, "nproc_per_node": 3, "spares": 0, "seeds": ("a:1",)}, env)
    assert "GOSSIPREC_MESH 'replicate=2;shard=2' makes 4 ranks (2 x 2) but the job has 6 trainers" in str(exc.value)
    assert load_settings({"insecure": True}, {"GOSSIPREC_MESH": ""}).mesh_shape() is None


def test_gossiprec_run_refuses_a_bad_mesh_before_any_agent_starts(capsys: pytest.CaptureFixture[str]) -> None:
    from gossiprec.agent.launcher import main

    rc = main(["--insecure", "--nnodes", "2", "--nproc-per-node", "2", "--seed", "127.0.0.1:1", "--mesh",
               "replicate=2,shard=4", "--", "true"])
    assert rc == 2
    assert "--mesh 'replicate=2,shard=4' makes 8 ranks (2 x 4) but the job has 4 trainers" in capsys.readouterr().err


def test_an_agent_refuses_a_job_spec_that_is_not_the_launched_mesh(tmp_path: Path) -> None:
    rc, _ = _spec(tmp_path, "--spares", "2")  # plain DDP over 4
    assert rc == 0
    job = str(tmp_path / "job.toml")
    settings = load_settings({"insecure": True, "job": job, "name": "n1-0", "mesh": "replicate=2,shard=2"}, {})
    with pytest.raises(ConfigError) as exc:
        node_factory(settings)
    msg = str(exc.value)
    assert ("--mesh replicate=2,shard=2 has replica groups [[0, 2], [1, 3]], but job spec" in msg
            and "says replicate=4 (plain DDP, replica groups [[0, 1, 2, 3]])" in msg), msg
    _spec(tmp_path, "--spares", "2", "--mesh", "replicate=2,shard=2")
    node_factory(settings)  # the spec written with the mesh: accepted
    view = view0_from_dict(tomllib.loads(Path(job).read_text()))
    with pytest.raises(ConfigError, match=r"makes 6 ranks \(2 x 3\) but the job has 4 trainers"):
        check_mesh(view, parse_mesh("replicate=2,shard=3"), "--mesh", job)


# ------------------------------------------------------------------------------------------------ bootstrap
def _decide(params: BootParams, n: int) -> list[Bootstrap]:
    """Run ``n`` candidates (the first ones are the seeds) in process until every one has decided."""
    boots = [Bootstrap(params, Candidate(f"c{i}", f"c{i}:1", "host", i), 0.0, random.Random(i)) for i in range(n)]
    by_addr = {b.me.addr: b for b in boots}
    now = 0.0
    while now < 30.0 and not all(b.decided for b in boots):
        for b in boots:
            b.tick(now)
        for _ in range(20):  # deliver until quiet
            out = [(a, m) for b in boots for a, m, _ in b.take()]
            if not out:
                break
            for addr, msg in out:
                if addr in by_addr:
                    by_addr[addr].on_message(msg, now)
        now += 0.05
    assert all(b.decided for b in boots), [b.known for b in boots]
    return boots


def test_the_bootstrap_carries_the_mesh_in_view_zero() -> None:
    mesh = parse_mesh("replicate=2,shard=2")
    params = BootParams(5, 1, ("c0:1", "c1:1", "c2:1"), mesh=mesh)
    boots = _decide(params, 5)
    views = [view_zero(b.decided or (), b.params) for b in boots]
    view = views[0]
    assert all(v == view for v in views)  # every agent the same view 0
    assert view.topology == MeshSpec((2, 2), ("replicate", "shard")).topology()
    assert [m.rank for m in view.members] == [0, 1, 2, 3, None]


def test_the_bootstrap_refuses_a_mesh_that_is_not_its_trainer_count() -> None:
    with pytest.raises(ConfigError, match=r"--mesh dp=2,tp=2 makes 4 ranks but the job has 3 trainers"):
        BootParams(4, 1, ("a:1",), mesh=parse_mesh("dp=2,tp=2"))


def test_a_candidate_started_with_another_mesh_is_not_counted_and_both_sides_say_so() -> None:
    mesh = parse_mesh("replicate=2,shard=2")
    seed = Bootstrap(BootParams(4, 0, ("s:1",), mesh=mesh), Candidate("s", "s:1"), 0.0, random.Random(1))
    other = Candidate("o", "o:1")
    seed.on_message(BootHello(other.row(), 4, 0, 1, "s:1", 1), 0.1)  # started without the mesh
    assert "o" not in seed.known
    (event,) = seed.events
    assert isinstance(event, BootMismatch) and (event.shards, event.our_shards) == (1, 2)
    (addr, reply, _), = seed.take()
    assert addr == "o:1" and isinstance(reply, BootHello) and reply.shards == 2
    cand = Bootstrap(BootParams(4, 0, ("s:1",)), other, 0.0, random.Random(2))
    cand.on_message(reply, 0.2)
    assert [type(e) for e in cand.events] == [BootMismatch]
    # the same mesh under other names is the same topology: counted
    same = Bootstrap(BootParams(4, 0, ("s:1",), mesh=parse_mesh("dp=2;tp=2")), other, 0.0, random.Random(3))
    same.tick(0.0)
    (_, hello, _), = same.take()
    seed.on_message(hello, 0.3)
    assert "o" in seed.known


# ------------------------------------------------------------------------------------------------- the trainer
def test_a_trainer_whose_mesh_is_not_the_launched_one_fails_in_one_line_naming_both() -> None:
    with pytest.raises(ConfigError) as exc:
        MeshSpec((4,), ("dp",)).check_view(4, [[0, 2], [1, 3]])
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("the launched mesh is replicate=2,shard=2 (replica groups [[0, 2], [1, 3]]) but this "
                          "trainer's MeshSpec is dp=4 (4 ranks, replica groups [[0, 1, 2, 3]])"), msg
    assert "launch it with --mesh dp=4" in msg
    with pytest.raises(ConfigError) as exc:
        MeshSpec((2, 2), ("replicate", "shard")).check_view(4, [[0, 1, 2, 3]])
    msg = str(exc.value)
    assert msg.startswith("the launched mesh is replicate=4 (plain DDP, replica groups [[0, 1, 2, 3]]) but this "
                          "trainer's MeshSpec is replicate=2,shard=2 (4 ranks, replica groups [[0, 2], [1, 3]])")
    assert "--rdzv-conf 'mesh=replicate=2;shard=2'" in msg and "\n" not in msg
    MeshSpec((2, 2), ("replicate", "shard")).check_view(4, parse_mesh("dp=2,tp=2").topology().replica_groups)


# ------------------------------------------------------------------------------- a name outside the job spec
def test_a_trainer_named_outside_the_job_spec_is_refused_with_the_specs_names(tmp_path: Path) -> None:
    rc, _ = _spec(tmp_path, "--spares", "2")
    assert rc == 0
    job = str(tmp_path / "job.toml")
    with pytest.raises(ConfigError) as exc:
        node_factory(load_settings({"insecure": True, "job": job, "name": "n1-2"}, {}))
    assert str(exc.value) == (f"--name 'n1-2' is not a member of job spec {job} (n1-0, n1-1, n2-0, n2-1, n3-0, "
                              "n3-1): give one of its names, or --spare (--role spare for `gossiprec agent`) to "
                              "join the running job as a hot spare")
    # a spare may join under a name the spec does not list; a member of the spec starts as listed
    node_factory(load_settings({"insecure": True, "job": job, "name": "n1-2", "role": "spare"}, {}))
    node_factory(load_settings({"insecure": True, "job": job, "name": "n1-1"}, {}))


def test_gossiprec_run_refuses_a_trainer_outside_the_spec_before_its_agent_binds(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gossiprec.agent.launcher import main

    _spec(tmp_path, "--spares", "2")
    job = str(tmp_path / "job.toml")
    rc = main(["--insecure", "--job", job, "--name", "typo", "--port", "0", "--control-socket",
               str(tmp_path / "a.sock"), "--", "true"])
    assert rc == 1
    assert "--name 'typo' is not a member of job spec" in capsys.readouterr().err


def test_an_agent_binds_its_members_address_and_says_so_when_the_machine_lacks_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from gossiprec.agent.launcher import main

    job = tmp_path / "job.toml"  # 192.0.2.0/24 is TEST-NET-1: no machine has it
    job.write_text('[job]\ntopology = "ddp"\n[[members]]\nname = "a"\naddr = "192.0.2.7:7301"\nrank = 0\n')
    rc = main(["--insecure", "--job", str(job), "--name", "a", "--control-socket", str(tmp_path / "a.sock"),
               "--", "true"])
    assert rc == 1
    assert ("cannot bind UDP 192.0.2.7:7301: Cannot assign requested address; this machine has no address "
            "192.0.2.7") in capsys.readouterr().err
    assert load_settings({"insecure": True, "job": str(job), "name": "a"}, {}).bind_host == "192.0.2.7"


# ------------------------------------------------------------------------------------------------ end to end
def test_a_mesh_launched_with_nnodes_recovers_a_killed_rank_bit_identically(tmp_path: Path, ref_dir: Path) -> None:
    """``gossiprec run --nnodes 5 --spares 1 --mesh replicate=2,shard=2``, no job spec: view 0 carries the
    HSDP mesh, the trainers' MeshSpec accepts it, and a rank killed in backward is replaced by the spare
    from its shard's replica peer, ending byte-identical to the failure-free run launched from a job spec."""
    from gossiprec.harness.faults import Fault
    from gossiprec.harness.sharded import run_sharded
    from tests.support.sharded import STEPS, check_job, reference

    res = run_sharded("hsdp", STEPS, [Fault("n1", "kill", 4, "backprop")], spares=1, workdir=str(tmp_path / "job"),
                      timeout=300.0, mesh="replicate=2,shard=2")
    check_job(res, reference("hsdp", ref_dir))
    assert res["replica_groups"] == [[0, 2], [1, 3]]
