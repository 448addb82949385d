"""``torchrun --rdzv-backend=gossiprec``: the rendezvous conf planned into slots as ``gossiprec spec`` lays
them out, the options that defeat in-place recovery refused, handlers that rendezvous through their
agents with no shared store and leave no thread or socket behind, and a real torchrun launch of three
nodes (two trainers and a spare; two through the entry point, one through ``gossiprec torchrun``) that
loses a worker and finishes bit-identical, in place."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from importlib.metadata import entry_points
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the torchrun backend needs torch (pip install gossiprec[torch])")

import torch.distributed.elastic.utils.store as store_util  # noqa: E402
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters  # noqa: E402
from torch.distributed.elastic.rendezvous.api import RendezvousHandlerRegistry  # noqa: E402

from gossiprec.agent.settings import AgentSettings  # noqa: E402
from gossiprec.agent.spec import layout, to_toml  # noqa: E402
from gossiprec.agent.torchrun import EXIT_BARRIER_DONE, AgentThread, GossiprecRendezvous  # noqa: E402
from gossiprec.agent.torchrun_conf import BACKEND, check_torchrun_argv, plan_node, wrapper_argv  # noqa: E402
from gossiprec.agent.torchrun_entry import create_handler, torchrun_backend  # noqa: E402
from gossiprec.cli import build_parser  # noqa: E402
from gossiprec.core.events import Fenced, ViewInstalled  # noqa: E402
from gossiprec.errors import ConfigError  # noqa: E402
from gossiprec.harness.job import read_json  # noqa: E402
from gossiprec.harness.ports import free_ports  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
ENTRY_POINT = "[torchrun.handlers]\ngossiprec = gossiprec.agent.torchrun_entry:torchrun_backend\n"
"""What pyproject.toml's ``[project.entry-points."torchrun.handlers"]`` table puts in the package's metadata."""
LOOPBACK = {"addr": "n1=127.0.0.1;n2=127.0.0.1;n3=127.0.0.1"}


def _conf(base_port: int, **more: str) -> dict[str, str]:
    return {"hosts": "n[1-3]", "spares": "1", "base_port": str(base_port), **LOOPBACK, **more}


# --------------------------------------------------------------------------------------------------
# the plan


def test_hosts_give_the_slots_gossiprec_spec_computes_and_this_node_its_own() -> None:
    plan = plan_node(_conf(29400, host="n2", insecure="1"), "", 3, 3, {})
    expected = to_toml(layout(["n1", "n2", "n3"], 1, 1, 29400, {"n1": "127.0.0.1", "n2": "127.0.0.1",
                                                                  "n3": "127.0.0.1"}.__getitem__))
    assert plan.spec_text == expected and plan.spec_path is None
    assert [(m.name, m.role, m.rank) for m in plan.members] == [
        ("n1-0", "trainer", 0), ("n2-0", "trainer", 1), ("n3-0", "spare", None)]
    assert (plan.index, plan.world_size, plan.me.name) == (1, 3, "n2-0")
    s = plan.settings
    assert (s.name, s.bind_host, s.port, s.job) == ("n2-0", "127.0.0.1", 29403, None)
    assert s.seeds == ("127.0.0.1:29400", "127.0.0.1:29403", "127.0.0.1:29406")  # as `gossiprec spec --me`
    # ';' or '+' where Slurm writes ',', and seeds from --rdzv-endpoint when it names some
    other = plan_node({**_conf(29400, insecure="1"), "hosts": "n1;n[2-3]", "name": "n3-0"},
                      "127.0.0.1:29403,127.0.0.1:29406", 2, 4, {})
    assert other.spec_text == expected and other.index == 2
    assert other.settings.seeds == ("127.0.0.1:29403", "127.0.0.1:29406")


def test_a_spec_file_names_the_slots_and_the_environment_names_this_node(tmp_path: Path) -> None:
    spec = tmp_path / "job.toml"
    spec.write_text(to_toml(layout(["a", "b"], 2, 1, 30000, lambda h: "127.0.0.1")))
    plan = plan_node({"spec": str(spec), "insecure": "1", "cluster": "j7"}, "", 4, 4,
                     {"GOSSIPREC_NODE": "b-0"})
    assert (plan.index, plan.me.role, plan.me.rank) == (2, "trainer", 2)
    assert (plan.settings.job, plan.settings.cluster, plan.settings.port) == (str(spec), "j7", 30006)
    assert plan.trainer_nice == 5


@pytest.mark.parametrize("conf, nodes, why", [
    ({"hosts": "n[1-3]", "spare": "1"}, 3, "unknown key(s) spare"),
    ({}, 3, "needs the job's slots"),
    ({"hosts": "n[1-3]", "spec": "job.toml"}, 3, "one of the two"),
    ({"hosts": "n[1-3]", "spares": "1"}, 2, "use --nnodes 3"),
    ({"hosts": "n[1-3]", "name": "n9-0"}, 3, "not a slot of the job"),
    ({"hosts": "n[1-3]", "trainer_nice": "40"}, 3, "expected 0..19"),
    ({"hosts": "n[1-3]", "addr": "n1"}, 3, "HOST=ADDRESS"),
    ({"spec": "/nonexistent/job.toml"}, 3, "cannot read job spec"),
])
def test_a_bad_conf_says_what_to_do(conf: dict[str, str], nodes: int, why: str) -> None:
    conf = {**LOOPBACK, "insecure": "1", "host": "n1", **conf}
    with pytest.raises(ConfigError, match=__import__("re").escape(why)):
        plan_node(conf, "", nodes, nodes, {})


def test_torchrun_options_that_defeat_in_place_recovery_are_refused() -> None:
    good = ["torchrun", "--nnodes", "3", "--nproc-per-node", "1", "--max-restarts", "0",
            "--rdzv-backend", "gossiprec", "train.py", "--nproc-per-node", "8"]  # the script's own flag
    check_torchrun_argv(good)
    check_torchrun_argv(["torchrun", "--nnodes", "3", "train.py"])  # torchrun's defaults: 1 worker, 0 restarts
    with pytest.raises(ConfigError, match="--nproc-per-node 1"):
        check_torchrun_argv(["torchrun", "--nproc-per-node", "2", "train.py"])
    with pytest.raises(ConfigError, match="--max-restarts 0"):
        check_torchrun_argv(["/x/torch/distributed/run.py", "--max-restarts", "3", "train.py"])
    check_torchrun_argv(["my_launcher.py", "--nproc-per-node", "2"])  # not torchrun: not ours to judge


def test_the_wrapper_passes_torchruns_arguments_through_with_the_backend_named() -> None:
    args = build_parser("torchrun").parse_args(["torchrun", "--nnodes", "3", "--rdzv-conf", "hosts=n[1-3]",
                                                "train.py", "--lr", "0.1"])
    assert args.args == ["--nnodes", "3", "--rdzv-conf", "hosts=n[1-3]", "train.py", "--lr", "0.1"]
    assert wrapper_argv(args.args) == ["--rdzv-backend", "gossiprec", *args.args]
    named = ["--rdzv_backend=gossiprec", "train.py", "--rdzv-backend", "c10d"]  # the script's own flag
    assert wrapper_argv(named) == named
    with pytest.raises(ConfigError, match="not --rdzv-backend c10d"):
        wrapper_argv(["--rdzv-backend", "c10d", "train.py"])
    with pytest.raises(ConfigError, match="--standalone"):
        wrapper_argv(["--standalone", "train.py"])
    with pytest.raises(ConfigError, match="--max-restarts 0"):
        wrapper_argv(["--max-restarts", "1", "train.py"])


def test_the_entry_point_costs_other_torchrun_runs_nothing() -> None:
    # torchrun loads every torchrun.handlers entry point in every run, whatever its backend
    code = ("import sys; from gossiprec.agent.torchrun_entry import torchrun_backend; torchrun_backend();"
            "print(sorted(m for m in sys.modules if m.startswith(('torch', 'gossiprec.agent.', 'gossiprec.core'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == "['gossiprec.agent.torchrun_entry']"


def test_the_entry_point_registers_a_creator_torchrun_accepts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GOSSIPREC_NODE", raising=False)
    registry = RendezvousHandlerRegistry()
    registry.register(BACKEND, torchrun_backend())
    registry.register(BACKEND, torchrun_backend())  # a second discovery of the same entry point is harmless
    params = RendezvousParameters(BACKEND, "", "run-1", 3, 3, **_conf(29400, host="n3", insecure="1"))
    handler = registry.create_handler(params)  # checks get_backend() against the name
    assert isinstance(handler, GossiprecRendezvous) and torchrun_backend() is create_handler
    assert (handler.get_run_id(), handler.num_nodes_waiting(), handler.use_agent_store) == ("run-1", 0, False)
    assert handler.shutdown() and handler.is_closed()  # never started: nothing to stop
    with pytest.raises(RendezvousClosedError):
        handler.next_rendezvous()
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from gossiprec.agent.torchrun_cli import register

    register()
    register()  # as `gossiprec torchrun` does, beside an entry point discovered already: harmless
    assert isinstance(rendezvous_handler_registry.create_handler(params), GossiprecRendezvous)


class _Events:
    def __init__(self, events: list[object]) -> None:
        self.events = events

    def __aiter__(self) -> _Events:
        return self

    async def __anext__(self) -> object:
        if not self.events:
            raise StopAsyncIteration
        return self.events.pop(0)


class _FakeAgent:
    name = "n2-0"

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.machine = SimpleNamespace(view={"n1-0", "n2-0"})
        self.left: list[tuple[str, bool]] = []

    def leave_now(self, reason: str, failed: bool = False) -> None:
        self.left.append((reason, failed))


@pytest.mark.parametrize("removal, why", [
    (ViewInstalled(2, "c", ("n1-0", "n3-0"), ("n2-0",), (), False, False, 1.0), "removed from the view of epoch 2"),
    (Fenced(3, "removed by a view this node missed", 1.0), "removed by a view this node missed (epoch 3)"),
])
async def test_a_node_out_of_the_view_kills_torchruns_workers(removal: object, why: str) -> None:
    killed: list[bool] = []

    def kill() -> list[int]:
        killed.append(True)
        return [4242]

    runner, agent = AgentThread(AgentSettings(insecure=True), kill=kill), _FakeAgent()
    benign = [ViewInstalled(1, "b", ("n1-0", "n2-0", "n3-0"), (), ("n3-0",), True, True, 0.5),
              Fenced(1, "minority side", 0.6)]  # a new member, a partition: not a removal
    await runner._fence_watch(agent, _Events([*benign]))  # type: ignore[arg-type]
    assert (killed, agent.left, runner.fenced) == ([], [], None)
    await runner._fence_watch(agent, _Events([*benign, removal]))  # type: ignore[arg-type]
    assert killed == [True] and runner.fenced == why and agent.left == [
        (f"fenced ({why}): torchrun's workers are killed", True)]


# --------------------------------------------------------------------------------------------------
# handlers in this process


def _sockets() -> set[str]:
    out = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:"):
            out.add(f"{fd.name} {target}")
    return out


def test_handlers_rendezvous_through_their_agents_and_leave_nothing_behind() -> None:
    base = free_ports(1, width=9)[0]
    threads_before, sockets_before = set(threading.enumerate()), _sockets()
    envs: dict[int, dict[str, str]] = {i: {"GOSSIPREC_RANK": "stale"} for i in (1, 2, 3)}
    handlers = {i: GossiprecRendezvous(plan_node(_conf(base, host=f"n{i}", insecure="1", trainer_nice="0",
                                                       log_level="warning"), "", 3, 3, {}),
                                       "run", environ=envs[i]) for i in (1, 2, 3)}
    infos: dict[int, object] = {}
    errors: list[BaseException] = []

    def meet(i: int) -> None:
        try:
            info = handlers[i].next_rendezvous()
            store_util.barrier(info.store, info.world_size, EXIT_BARRIER_DONE.rsplit("/", 1)[0],
                               barrier_timeout=5)  # torchrun's exit barrier: passes here and now
            infos[i] = info
        except BaseException as exc:
            errors.append(exc)

    meeters = [threading.Thread(target=meet, args=(i,)) for i in handlers]
    try:
        for t in meeters:
            t.start()
        for t in meeters:
            t.join(120)
        assert not errors, errors
        assert [(infos[i].rank, infos[i].world_size) for i in (1, 2, 3)] == [(0, 3), (1, 3), (2, 3)]  # type: ignore[attr-defined]
        for i, role, rank in ((1, "trainer", "0"), (2, "trainer", "1"), (3, "spare", None)):
            env = envs[i]
            assert (env["GOSSIPREC_NODE"], env["GOSSIPREC_ROLE"], env.get("GOSSIPREC_RANK")) == (f"n{i}-0", role, rank)
            assert env["GOSSIPREC_CONTROL"] == handlers[i].runner.agent.control_path  # type: ignore[union-attr]
            assert env["TORCH_ELASTIC_WORKER_IDENTICAL"] == "1" and env["GOSSIPREC_CLUSTER"] == "gossiprec"
        assert all(h.num_nodes_waiting() == 0 for h in handlers.values())
        with pytest.raises(RendezvousClosedError, match="--max-restarts 0"):
            handlers[1].next_rendezvous()  # torchrun restarting workers: refused
    finally:
        assert all(h.shutdown() for h in handlers.values())
    assert all(h.shutdown() for h in handlers.values())  # idempotent
    assert set(threading.enumerate()) == threads_before
    assert _sockets() <= sockets_before  # every UDP, TCP and control socket closed


# --------------------------------------------------------------------------------------------------
# a real torchrun


def _torchrun() -> list[str]:
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def _torchrun_missing() -> str:
    if importlib.util.find_spec("torch.distributed.run") is None:
        return "torchrun is not installed (pip install torch)"
    return ""


def _entry_point_dir(tmp: Path) -> str | None:
    """A folder whose metadata registers the entry point, for a checkout not installed with it (None when
    the installed package registers it already)."""
    if any(ep.name == BACKEND for ep in entry_points(group="torchrun.handlers")):
        return None
    info = tmp / "ep" / "gossiprec_torchrun_test-0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: gossiprec-torchrun-test\nVersion: 0\n")
    (info / "entry_points.txt").write_text(ENTRY_POINT)
    return str(tmp / "ep")


def _ours(mark: str) -> list[tuple[int, str]]:
    """(pid, command line) of every process whose environment holds ``mark`` (all the test started)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if mark.encode() in (d / "environ").read_bytes().split(b"\0"):
                out.append((int(d.name), (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")))
        except OSError:
            continue
    return out


@pytest.mark.slow
@pytest.mark.skipif(bool(_torchrun_missing()), reason=_torchrun_missing() or "torchrun available")
def test_torchrun_loses_a_worker_and_a_spare_takes_its_rank_in_place(tmp_path: Path) -> None:
    from gossiprec.harness.workload import reference_state
    from gossiprec.security.keyring import Keyring, decode_key, generate_key

    steps, hidden, kill_at = 60, 32, 20
    work = tmp_path / "job"
    work.mkdir()
    Keyring([decode_key(generate_key())]).save(tmp_path / "keyring.json")
    mark = f"GOSSIPREC_TEST_RUN={uuid.uuid4().hex}"
    ep = _entry_point_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), ep) if p),
           "GOSSIPREC_KEYRING": str(tmp_path / "keyring.json"), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           mark.split("=")[0]: mark.split("=")[1]}
    env.pop("GOSSIPREC_NODE", None)
    base = free_ports(1, width=9)[0]
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for i in (1, 2, 3):
            # n1-0 and n2-0 train (ranks 0 and 1), n3-0 is the spare; n2-0's worker SIGKILLs itself once it
            # has committed step `kill_at` (a fault at a known step, not at a moment the test hopes to hit)
            fault = f" --fault kill@committed:{kill_at}" if i == 2 else ""
            worker = (f"exec {sys.executable} -m gossiprec.harness.trainer --steps {steps} --hidden {hidden} "
                      f"--step-ms 20 --wait-for-spares 120 --out {work}/$GOSSIPREC_NODE.json{fault}")
            conf = ",".join(f"{k}={v}" for k, v in _conf(base, host=f"n{i}").items())
            common = ["--nnodes", "3", "--nproc-per-node", "1", "--max-restarts", "0", "--rdzv-id", "torchrun-test",
                      "--rdzv-conf", conf, "--monitor-interval", "0.1", "--no-python", "sh", "-c", worker]
            if i == 3:  # the wrapper: the backend registered in-process, named by default
                argv = [sys.executable, "-m", "gossiprec", "torchrun", *common]
                node_env = {**env, "PYTHONPATH": str(ROOT)}  # without the entry point's metadata
            else:
                argv, node_env = [*_torchrun(), "--rdzv-backend", "gossiprec", *common], env
            with open(work / f"torchrun-n{i}.log", "wb") as log:
                procs[f"n{i}-0"] = subprocess.Popen(argv, env=node_env, stdout=log, stderr=subprocess.STDOUT)

        def logs() -> str:
            return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}"
                             for p in sorted(work.glob("*.log")))

        deadline = time.monotonic() + 300  # a guard against a hang, not a figure (a loaded machine takes minutes)
        while not all((work / f"n{i}-0.ready").exists() for i in (1, 2, 3)):  # every worker loaded
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs.values()), logs()
            time.sleep(0.05)
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun of {name} did not end\n{logs()}") from None
        assert (work / "n2-0.fault").exists() and not (work / "n2-0.json").exists(), logs()  # killed mid-run
        # the killed worker's torchrun fails; the others finish: the spare took rank 1 in place
        assert codes["n1-0"] == 0 and codes["n3-0"] == 0 and codes["n2-0"] != 0, (codes, logs())
        spare, first = read_json(work / "n3-0.json"), read_json(work / "n1-0.json")
        assert spare is not None and first is not None, logs()
        assert (spare["rank"], spare["step"], first["rank"], first["step"]) == (1, steps, 0, steps)
        assert spare["records"] and first["records"], logs()  # both recovered in place, no restart
        expected = reference_state(steps, 2, hidden)
        assert (work / "n1-0.state").read_bytes() == expected, "rank 0 is not bit-identical"
        assert (work / "n3-0.state").read_bytes() == expected, "the spare's rank 1 is not bit-identical"
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        left = _ours(mark)
        for pid, _ in left:  # so that a failing run leaves nothing either
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, left  # every torchrun and worker the test started had ended by itself


@pytest.mark.slow
@pytest.mark.skipif(bool(_torchrun_missing()), reason=_torchrun_missing() or "torchrun available")
def test_torchrun_carries_the_mesh_and_recovers_a_killed_rank_of_a_2x2_hsdp_job(tmp_path: Path, ref_dir: Path) -> None:
    """Five torchruns (``--rdzv-conf hosts=n[1-5],spares=1,mesh=replicate=2;shard=2``): the agents' view 0 is
    the HSDP mesh's topology, the workers' MeshSpec accepts it, and rank 1, killed in its backward of step 4,
    is replaced by the spare from rank 3 (the same shard of the other replica), byte-identical at the end."""
    from tests.support.sharded import STEPS, reference

    work = tmp_path / "job"
    work.mkdir()
    mark = f"GOSSIPREC_TEST_RUN={uuid.uuid4().hex}"
    ep = _entry_point_dir(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), ep) if p), "OMP_NUM_THREADS": "1",
           "PYTHONUNBUFFERED": "1", mark.split("=")[0]: mark.split("=")[1]}
    for var in ("GOSSIPREC_NODE", "GOSSIPREC_KEYRING"):
        env.pop(var, None)
    base = free_ports(1, width=15)[0]
    hosts = {"hosts": "n[1-5]", "addr": ";".join(f"n{i}=127.0.0.1" for i in range(1, 6))}
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def logs() -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(work.glob("*.log")))

    try:
        for i in range(1, 6):
            fault = " --fault kill@backprop:4" if i == 2 else ""
            worker = (f"exec {sys.executable} -m gossiprec.harness.sharded_trainer --layout hsdp --steps {STEPS} "
                      f"--step-ms 50 --wait-for-spares 120 --out {work}/$GOSSIPREC_NODE.json{fault}")
            conf = ",".join(f"{k}={v}" for k, v in _conf(base, host=f"n{i}", mesh="replicate=2;shard=2",
                                                          insecure="1", **hosts).items())
            argv = [*_torchrun(), "--rdzv-backend", "gossiprec", "--nnodes", "5", "--nproc-per-node", "1",
                    "--max-restarts", "0", "--rdzv-id", "torchrun-mesh", "--rdzv-conf", conf,
                    "--monitor-interval", "0.1", "--no-python", "sh", "-c", worker]
            with open(work / f"torchrun-n{i}.log", "wb") as log:
                procs[f"n{i}-0"] = subprocess.Popen(argv, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300  # a guard against a hang, not a figure
        codes = {}
        for name, p in procs.items():
            try:
                codes[name] = p.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                raise AssertionError(f"torchrun of {name} did not end\n{logs()}") from None
        assert (work / "n2-0.fault").exists() and not (work / "n2-0.json").exists(), logs()  # killed mid-step
        assert codes["n2-0"] != 0 and all(codes[n] == 0 for n in codes if n != "n2-0"), (codes, logs())
        reports = {r["rank"]: r for r in (read_json(work / f"n{i}-0.json") for i in (1, 3, 4, 5)) if r is not None}
        assert {r: rep["node"] for r, rep in reports.items()} == {0: "n1-0", 1: "n5-0", 2: "n3-0", 3: "n4-0"}, logs()
        states = {r: hashlib.sha256((work / f"{rep['node']}.state").read_bytes()).hexdigest()
                  for r, rep in reports.items()}
        assert states == reference("hsdp", ref_dir), logs()
        receiver = next(rec for rec in reports[1]["records"] if rec["role"] == "receiver")
        assert receiver["donors"] == ["n4-0"], receiver  # rank 3: the same shard of the other replica
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs.values():
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        left = _ours(mark)
        for pid, _ in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    assert not left, left
