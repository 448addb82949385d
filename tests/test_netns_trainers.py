"""Trainers on hosts of their own: five network namespaces (tests.support.netns), each with an agent and
a trainer (``gossiprec run`` of the demo trainer), 3 ranks and 2 hot spares, faults from iptables.

- A 3/2 partition mid-training, the epoch-0 store's host (n0) on the minority side: the majority (one
  rank and both spares) recovers and trains on; the minority's trainers fence, drop their state and wait
  as spares in the same process; after the heal all five are in one view again (the ranks wait for
  it), and the job ends bit-identical to a failure-free 3-rank run. Meanwhile every listening socket of
  every host (agent, epoch store, state donor, gloo) is on that host's address, none on a wildcard.
- The host of the current epoch's store dies whole (its network cut, then every process in its
  namespace SIGKILLed: nothing says goodbye), at epoch 0 and at a later epoch: recovery proceeds each
  time (the next store is another host's), bit-identical.
- A sharded job (dp x tp, four ranks and a spare on five hosts): a rank's host vanishes mid-step; the
  survivors' collectives, waiting on it with no reset to end them, return when the agreed view does.

The processes and the test share the file system: the harness reads each node's files in the work
directory; every wait is for such an event, bounded by a generous timeout. Skipped without root,
``ip netns`` or ``iptables``. Figures are printed (``pytest -s`` shows them).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Iterator, Sequence

import pytest

from gossiprec.harness.faults import Fault
from gossiprec.harness.job import HOST_PORT, LocalJob, read_int
from gossiprec.harness.scenario import STORE_HOST, Action, run_scenario
from gossiprec.harness.timeline import timeline
from tests.support.netns import NetnsCluster, kill_netns_pids

pytestmark = [pytest.mark.netns, pytest.mark.slow]

RANKS, SPARES = 3, 2
HIDDEN = 32
RUN_TIMEOUT = 240.0
"""Bound on a whole job (start-up of ten Python processes on a busy machine dominates)."""


class NetnsHosts:
    """A :class:`~tests.support.netns.NetnsCluster` as the harness's :class:`~gossiprec.harness.job.Hosts`."""

    def __init__(self, net: NetnsCluster) -> None:
        self.net = net

    def addr(self, index: int) -> str:
        return self.net.hosts[index].addr

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        return self.net.argv(index, argv)

    def cut(self, index: int) -> None:
        self.net.drop_from(index)  # nobody hears it (a dying kernel's RSTs and FINs included)
        self.net.drop_to(index)  # it hears nobody

    def kill_all(self, index: int) -> None:
        kill_netns_pids(self.net.hosts[index].netns)


@pytest.fixture
def hosts(netns_ok: None) -> Iterator[NetnsHosts]:
    with NetnsCluster(RANKS + SPARES) as net:
        yield NetnsHosts(net)
    assert not net.exists(), f"namespaces left behind: {net.exists()}"


def _listeners(net: NetnsCluster, index: int) -> list[tuple[str, int]]:
    """Every listening TCP socket of host ``index``'s namespace: (address, port)."""
    out = net.run(index, ["cat", "/proc/net/tcp", "/proc/net/tcp6"])
    found = []
    for line in out.splitlines():
        fields = line.split()
        if len(fields) < 4 or fields[3] != "0A" or ":" not in fields[1]:  # 0A: LISTEN
            continue
        hexaddr, hexport = fields[1].split(":")
        if len(hexaddr) == 8:
            addr = ".".join(str(b) for b in reversed(bytes.fromhex(hexaddr)))
        else:
            addr = "::" if int(hexaddr, 16) == 0 else hexaddr
        found.append((addr, int(hexport, 16)))
    return found


def _step(job: LocalJob, node: str) -> int:
    return read_int(job.path(node, ".step"))


def _records(workdir: Path, nodes: Sequence[str]) -> list[dict[str, Any]]:
    import json

    return [json.loads(line) for n in nodes if (workdir / f"{n}.records").exists()
            for line in (workdir / f"{n}.records").read_text().splitlines() if line.strip()]


def test_partition_3_2_of_trainers_on_separate_hosts_majority_trains_on_minority_waits_all_converge(
        hosts: NetnsHosts, tmp_path: Path) -> None:
    net = hosts.net
    majority, minority = ["n2", "n3", "n4"], ["n0", "n1"]
    listening: dict[int, list[tuple[str, int]]] = {}

    def cut(job: LocalJob) -> None:
        # every trainer is past start(), whose barrier waited for the spares' servers: all listen now
        listening.update({i: _listeners(net, i) for i in range(RANKS + SPARES)})
        net.partition([int(n[1:]) for n in majority], [int(n[1:]) for n in minority])
        job.path("go", "").touch()  # the ranks waiting after step 4 go on, into the cut

    def healed_may_begin(job: LocalJob) -> bool:
        # the majority has recovered and trained on (the spares commit steps only once they hold a rank),
        # and the minority's trainers have dropped their state
        return all(_step(job, n) >= 7 for n in ("n3", "n4")) and \
            all(job.path(n, ".dropped").exists() for n in minority)

    actions = [
        Action("partition", lambda job: all(_step(job, f"n{r}") >= 4 for r in range(RANKS)), cut),
        Action("heal", healed_may_begin, lambda job: net.heal()),
    ]
    t0 = time.monotonic()
    # the ranks wait after step 4 for the cut (however far a loaded machine lets them run ahead of this
    # process), and after step 10 until the view holds all five again: the job cannot end before the heal
    res = run_scenario(RANKS, SPARES, 14, [], hidden=HIDDEN, step_ms=30.0, workdir=str(tmp_path),
                       timeout=RUN_TIMEOUT, hosts=hosts, actions=actions,
                       trainer_args=["--gate", f"4:{tmp_path / 'go'}", "--await-view", "10:5"])
    wall = time.monotonic() - t0
    assert res["bit_identical"] and res["final_step"] == [14], res
    assert res["worlds"] == [], res  # the same size throughout: 3 ranks

    for i, socks in listening.items():
        addr = net.hosts[i].addr
        assert socks and all(a == addr for a, _ in socks), (i, addr, socks)
        assert {HOST_PORT, HOST_PORT + 1, HOST_PORT + 2} <= {p for _, p in socks}, (i, socks)  # agent, store, donor

    t_cut, t_heal = res["actions"]["partition"], res["actions"]["heal"]
    records = _records(tmp_path, majority + minority)
    after_cut = [r for r in records if t_cut <= r["planned_at"] < t_heal]
    assert after_cut and {r["node"] for r in after_cut} == set(majority), after_cut
    assert {r["rank"]: r["node"] for r in after_cut}[2] == "n2", after_cut  # the survivor keeps its rank
    for n in minority:
        dropped = (tmp_path / f"{n}.dropped").read_text().splitlines()
        assert dropped and all("fenced" in why or "no rank" in why for why in dropped), (n, dropped)
        log = (tmp_path / f"{n}.log").read_text()
        assert "Traceback" not in log, log[-3000:]
        assert "is kept" in log, log[-3000:]  # its launcher kept the process that had dropped its state
        assert res["exits"][n] == 0, (res["exits"], log[-3000:])  # it ended with the job, an unused spare
    rec = timeline(t_cut, after_cut)
    print(f"\n3/2 partition of trainers on 5 hosts: majority recovered in {rec['rto_s']} s "
          f"(phases {rec['phases_s']}, lost steps {rec['lost_steps']}); heal {t_heal - t_cut:.2f} s after the cut; "
          f"whole job {wall:.1f} s, median step {res.get('median_step_s')} s")


def test_the_store_hosts_whole_host_dies_at_epoch_0_and_at_a_later_epoch(hosts: NetnsHosts, tmp_path: Path) -> None:
    faults = [Fault(STORE_HOST, "crash", 4), Fault(STORE_HOST, "crash", 10)]
    t0 = time.monotonic()
    res = run_scenario(RANKS, SPARES, 16, faults, hidden=HIDDEN, step_ms=30.0, workdir=str(tmp_path),
                       timeout=RUN_TIMEOUT, hosts=hosts, lockstep=True)
    wall = time.monotonic() - t0
    assert res["bit_identical"] and res["final_step"] == [16], res
    assert res["worlds"] == [], res
    first, second = res["faults"]
    assert first["fired"] and second["fired"], res["faults"]
    assert first["node"] == "n0", first  # epoch 0's store host
    assert second["node"] != "n0" and second["epochs"] and min(second["epochs"]) > min(first["epochs"]), res
    for f in (first, second):
        assert f["node"] not in f["assignment_after"].values(), f  # a spare took its rank
        assert f["lost_steps"] == 0, f
    print(f"\nstore host's whole host dies (network cut, every process SIGKILLed): epoch-0 store host "
          f"{first['node']}: recovered in {first['rto_s']} s {first['phases_s']}; later store host {second['node']} "
          f"(epoch {min(second['epochs']) - 1}): {second['rto_s']} s {second['phases_s']}; whole job {wall:.1f} s")


def test_a_sharded_jobs_rank_whose_host_vanishes_mid_step_is_replaced(hosts: NetnsHosts, tmp_path: Path) -> None:
    """dp x tp on five hosts: rank 3 stops before its row-parallel layer (its TP peer, rank 2, waits inside
    the TP all-reduce; ranks 0 and 1 in the data-parallel one), then its host vanishes: its network is
    cut and every process on it killed, so no reset reaches the survivors' gloo connections. Each
    survivor's collective returns when the agreed view reaches it (within 0.2 s), the spare takes rank 3
    from its replica peer, and the job ends bit-identical to a failure-free run on loopback."""
    from gossiprec.harness.sharded import run_sharded

    steps = 8
    reference = run_sharded("tp", steps, spares=0, workdir=str(tmp_path / "ref"), timeout=RUN_TIMEOUT)["states"]
    vanish = Action("n3's host vanishes", lambda job: job.path("n3", ".fault").exists(), lambda job: job.crash("n3"))
    res = run_sharded("tp", steps, [Fault("n3", "stop", 4, "forward")], spares=1, workdir=str(tmp_path / "job"),
                      timeout=RUN_TIMEOUT, hosts=hosts, actions=[vanish], may_fail={"n3"})
    where = f"(logs in {res['workdir']})"
    assert res["final_step"] == [steps] and res["states"] == reference, (res, where)
    (fault,) = res["faults"]
    assert fault["fired"] and "n3's host vanishes" in res["actions"], (res, where)
    assert fault["donors"] == {3: ["n1"]} and res["assignment"][3] == "n4", (fault, where)
    assert "allreduce" in fault["causes"][2], (fault, where)  # its TP peer waited inside the TP all-reduce
    survivors = [r for r in fault["records"] if r["role"] != "receiver"]
    assert {r["rank"] for r in survivors} == {0, 1, 2}, (fault, where)
    for r in survivors:  # nothing but the agreed view ends a wait on a peer that vanished
        assert r["agreed_at"] is not None and r["noticed_at"] - r["agreed_at"] < 0.2, (r, where)
    print(f"\nsharded (dp x tp) rank's host vanished mid-step: recovered in {fault['rto_s']} s {fault['phases_s']}; "
          f"survivors' collectives returned {[round(r['noticed_at'] - r['agreed_at'], 4) for r in survivors]} s "
          "after the agreed view")


class PairedHosts(NetnsHosts):
    """Two nodes per host: node i runs on host i // 2 (its port the second slot's when i is odd)."""

    def addr(self, index: int) -> str:
        return super().addr(index // 2)

    def command(self, index: int, argv: Sequence[str]) -> list[str]:
        return super().command(index // 2, argv)

    def cut(self, index: int) -> None:
        super().cut(index // 2)

    def kill_all(self, index: int) -> None:
        super().kill_all(index // 2)


def test_a_host_of_two_hsdp_ranks_cut_from_the_network_is_replaced_whole(netns_ok: None, tmp_path: Path) -> None:
    """HSDP replicate=2 x shard=2, two nodes per host: ranks 0-1 on host 0, ranks 2-3 (replica group 1) on
    host 1, the two spares on host 2. Host 1's network is cut mid-training and every process on it killed:
    one view change replaces both of its ranks from host 2's spares, rank 2 from rank 0 and rank 3 from
    rank 1 (each its own shard's replica), and the job ends bit-identical to the failure-free run."""
    from gossiprec.harness.sharded import run_sharded
    from tests.support.sharded import STEPS, reference_run

    ref = reference_run("hsdp", tmp_path)["states"]
    cut = Action("host 1 (n2, n3) is cut off", lambda job: read_int(job.path("n2", ".step")) >= 3,
                 lambda job: job.crash("n2"))
    with NetnsCluster(3) as net:
        res = run_sharded("hsdp", STEPS, [], spares=2, workdir=str(tmp_path / "job"), timeout=RUN_TIMEOUT,
                          hosts=PairedHosts(net), actions=[cut], may_fail={"n2", "n3"},
                          step_ms=150)
    assert not net.exists(), f"namespaces left behind: {net.exists()}"
    where = f"(logs in {res['workdir']})"
    assert "host 1 (n2, n3) is cut off" in res["actions"], (res, where)
    assert res["final_step"] == [STEPS] and res["states"] == ref, (res, where)
    assert res["assignment"] == {0: "n0", 1: "n1", 2: "n4", 3: "n5"}, (res, where)
    receivers = [r for r in res["records"] if r["role"] == "receiver"]
    assert len({r["epoch"] for r in receivers}) == 1, (receivers, where)  # one view change for the whole host
    assert {r["rank"]: r["donors"] for r in receivers} == {2: ["n0"], 3: ["n1"]}, (receivers, where)
