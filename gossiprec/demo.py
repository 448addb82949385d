"""``gossiprec demo``: kill a rank of a real job on this machine, hang another, watch both recover in place.

Theory of operation
-------------------
The demo starts, on loopback, one ``gossiprec run`` per node (an agent plus its trainer child): ``ranks``
trainers and ``spares`` hot spares, all reading one generated job spec and one generated keyring
(agents and state transfers are authenticated). Each trainer (``python -m gossiprec.demo trainer``)
trains a small MLP with :class:`~gossiprec.trainer.loop.ResilientTrainer` on data generated from
(seed, data position, rank), paced to ``step_ms`` per step. Training starts once every trainer and
spare has loaded (torch imported, model built), so that no fault finds a spare still loading.

Faults (:class:`Fault`) come in two kinds: ``kill`` (SIGKILL) and ``stop`` (SIGSTOP: a hang). The
demo sends them from outside once the victim has passed a step, or a trainer sends one to itself
at a chosen phase of a step (``compute``, ``communicate`` with the all-reduce in flight,
``optimizer``, ``committed``, i.e. between steps; ``serve``: a donor, 0.2 s after a receiver asked it
for state, with the receiver slowed by ``slow_fetch`` seconds per chunk so that it dies mid-transfer).
By default ``gossiprec demo`` runs 4 ranks and 2 spares: at step 80 it SIGKILLs rank 3 (the first
spare takes its place), at step 140 it SIGSTOPs rank 2 (its agent keeps gossiping the stalled step,
the others declare it hung and the second spare takes its place; its launcher kills the stopped
process once the node is out of the view). Two spares, because a spare is spent per fault; with
``allow_shrink`` and no spare left the world shrinks instead (``on_resize`` scales the learning rate
by the linear rule here, :func:`scale_lr`; that is the user's choice). ``checkpoint_every`` makes
rank 0 write a checkpoint, which ``on_no_replica`` loads when no replica survives.

Each trainer writes its recovery records and, at the end, its complete state (model, optimizer, data
position, RNG: the payload of :func:`capture_state`). The demo computes the same training without
failure in this process (:func:`reference_state`, following the world sizes the recoveries chose;
gradients are reduced in rank order, see ``allreduce_gradients(exact=True)``, so one process
reproduces the multi-process result bit for bit) and compares. It prints, per fault, the timeline
measured from the fault: detected (the agents' first failure event), agreed (new view), planned,
state moved, group rebuilt, first step done. ``--json`` prints ``faults`` (one entry per fault:
``rto_s``, ``phases_s``, ``lost_steps``, ``transfer_mb_s``, ...) and, for the first fault, the same keys
at the top level, with ``bit_identical`` and ``median_step_s`` (a hang's RTO bound is
``3 * median_step_s + 1``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Sequence

from gossiprec.bench.agents import free_ports
from gossiprec.errors import ConfigError, GossiprecError

if TYPE_CHECKING:
    import torch

SEED = 1234
FAULT_KINDS = ("kill", "stop", "slow", "hold")
SLOW_S = 0.3
"""How long a ``slow`` fault stalls its trainer at its phase."""
HOLD_MAX_S = 10.0
"""A ``hold`` fault stalls its trainer until its agent has the plan of a newer epoch, at most this long."""
MISTAKES = ("data-write", "numpy-per-rank", "no-data-position", "wide-model")
"""Loop mistakes a trainer can be told to make (``--mistake``), for the tests of what catches them."""
FAULT_PHASES = ("compute", "communicate", "optimizer", "committed", "serve")
SERVE_KILL_DELAY = 0.2
"""A donor with a ``serve`` fault signals itself this long after a receiver asked it for state (it
seals the state and sends the header first; a receiver slowed by ``slow_fetch`` is still reading)."""


# --------------------------------------------------------------------------------------------------
# the workload (identical in trainers and in the reference)


class DataCursor:
    """Data position as a Stateful: which sample block the next step reads."""

    def __init__(self) -> None:
        self.index = 0

    def state_dict(self) -> dict[str, int]:
        return {"index": self.index}

    def load_state_dict(self, sd: dict[str, int]) -> None:
        self.index = int(sd["index"])


def build(hidden: int, layers: int = 2, dim: int = 32) -> tuple[Any, Any, DataCursor]:
    """Model, AdamW optimizer and data cursor, identical in every process (a spare allocates the
    optimizer's state itself in ``start()``)."""
    import torch

    torch.manual_seed(SEED)
    random.seed(SEED)  # every generator in the state must be identical across replicas
    try:
        import numpy as np

        np.random.seed(SEED)
    except ImportError:
        pass
    mods: list[Any] = [torch.nn.Linear(dim, hidden), torch.nn.GELU()]
    for _ in range(layers - 1):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    mods.append(torch.nn.Linear(hidden, dim))
    model = torch.nn.Sequential(*mods)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return model, opt, DataCursor()


def batch(index: int, rank: int, dim: int = 32, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank ``rank``'s batch at data position ``index``: a fixed random linear map plus noise."""
    import torch

    g = torch.Generator().manual_seed(SEED * 1_000_003 + index * 1009 + rank)
    x = torch.randn(size, dim, generator=g)
    w = torch.Generator().manual_seed(SEED)
    target = torch.tanh(x @ torch.randn(dim, dim, generator=w)) + 0.01 * torch.randn(size, dim, generator=g)
    return x, target


def local_gradients(model: Any, cursor: DataCursor, rank: int) -> None:
    import torch

    x, y = batch(cursor.index, rank)
    model.zero_grad(set_to_none=False)
    torch.nn.functional.mse_loss(model(x), y).backward()


def objects_of(model: Any, opt: Any, cursor: DataCursor) -> dict[str, Any]:
    from gossiprec.trainer.objects import training_state

    return training_state(model, opt, data=cursor)


def scale_lr(opt: Any, old_world: int, new_world: int) -> None:
    """The demo's ``on_resize``: the linear scaling rule (learning rate proportional to the global batch)."""
    for group in opt.param_groups:
        group["lr"] = group["lr"] * new_world / old_world


def reference_state(steps: int, world: int, hidden: int, *, worlds: Sequence[tuple[int, int]] = (),
                    lr_scale: bool = False) -> bytes:
    """The payload of the state after ``steps`` failure-free steps of a ``world``-rank job.

    ``worlds``: ``(after_step, world_size)`` changes (a shrink at ``after_step``: later steps run with
    ``world_size`` ranks, :func:`scale_lr` applied first when ``lr_scale``).
    """
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend with the job's processes
    try:
        return _reference(steps, world, hidden, sorted(worlds), lr_scale)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, world: int, hidden: int, worlds: list[tuple[int, int]], lr_scale: bool) -> bytes:
    import torch

    from gossiprec.trainer.loop import rank_ordered_mean
    from gossiprec.trainer.capture import capture_state

    model, opt, cursor = build(hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(1, steps + 1):
        new = next((w for after, w in reversed(worlds) if after < step), world)
        if new != world and lr_scale:
            scale_lr(opt, world, new)
        world = new
        rows = []
        for rank in range(world):
            local_gradients(model, cursor, rank)
            flat = torch.cat([p.grad.reshape(-1) for p in params])
            rows.append(torch.zeros_like(flat) + flat)  # what the rank's row of the all-reduce holds
        mean = rank_ordered_mean(rows)
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(mean[offset:offset + n].view_as(p))
            offset += n
        opt.step()
        cursor.index += 1
    return _state_bytes(capture_state(objects_of(model, opt, cursor), step=steps, checksum=False))


def _state_bytes(snap: Any) -> bytes:
    """Header (every non-tensor value: optimizer settings, data position, RNG) + payload."""
    from gossiprec.trainer.header import pack_header

    return pack_header(snap.header) + snap.payload()


def save_checkpoint(path: Path, objects: Any, step: int) -> None:
    """Write ``objects`` at ``step`` to ``path`` atomically: 8-byte header length, header, payload."""
    from gossiprec.trainer.capture import capture_state
    from gossiprec.trainer.header import pack_header

    snap = capture_state(objects, step=step, copy=False, checksum=True)
    header = pack_header(snap.header)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(len(header).to_bytes(8, "big"))
        f.write(header)
        for view in snap.views():
            f.write(view)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path, objects: Any) -> int:
    """Load a :func:`save_checkpoint` file into ``objects`` (crc32-verified); returns its step."""
    from gossiprec.trainer.header import unpack_header
    from gossiprec.trainer.receive import restore_state

    data = path.read_bytes()
    n = int.from_bytes(data[:8], "big")
    header = data[8:8 + n]
    restore_state(objects, (header, data[8 + n:]))
    return unpack_header(header).step


# --------------------------------------------------------------------------------------------------
# faults


@dataclass(frozen=True, slots=True)
class Fault:
    """A fault for node ``node``'s trainer: ``kind`` kill (SIGKILL), stop (SIGSTOP, a hang), slow (it
    stalls :data:`SLOW_S` seconds) or hold (it stalls until its agent has the plan of a newer view).

    ``phase`` None: the demo sends the signal once the node has committed ``step`` (kill, stop).
    Otherwise the trainer acts itself at that phase of step ``step`` (see the module docstring; for
    ``serve``, at the first request for a step >= ``step``).
    """

    node: str
    kind: str = "kill"
    step: int = 0
    phase: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in FAULT_KINDS:
            raise ConfigError(f"fault kind must be one of {FAULT_KINDS}, got {self.kind!r}")
        if self.phase is not None and self.phase not in FAULT_PHASES:
            raise ConfigError(f"fault phase must be None (sent by the demo) or one of {FAULT_PHASES}, "
                              f"got {self.phase!r}")
        if self.phase is None and self.kind not in ("kill", "stop"):
            raise ConfigError(f"a {self.kind} fault happens inside the trainer: give it a phase")

    def spec(self) -> str:
        """The trainer's ``--fault`` argument: ``KIND@PHASE:STEP``."""
        return f"{self.kind}@{self.phase}:{self.step}"

    @classmethod
    def parse(cls, node: str, text: str) -> Fault:
        try:
            kind, rest = text.split("@", 1)
            phase, step = rest.split(":", 1)
            return cls(node, kind, int(step), phase)
        except ValueError:
            raise ConfigError(f"bad fault {text!r}: write KIND@PHASE:STEP, e.g. kill@communicate:20") from None


class FaultInjector:
    """The trainer's ``on_phase`` hook: signals this process at the faults' phases (once each), and
    sleeps ``slow_fetch`` seconds per received chunk (stretches a transfer). Before a signal it writes
    ``{kind, phase, step, t}`` (``t``: ``time.monotonic()``) to ``record``."""

    def __init__(self, faults: Sequence[Fault], record: Path, slow_fetch: float = 0.0,
                 send: Callable[[int, int], None] = os.kill,
                 plan_epoch: Callable[[], int] = lambda: -1) -> None:
        self.faults = list(faults)
        self.record = record
        self.slow_fetch = slow_fetch
        self.send = send
        self.plan_epoch = plan_epoch
        """The epoch of the newest plan this trainer's agent has (what a ``hold`` fault waits for)."""
        self._lock = threading.Lock()

    def __call__(self, step: int, phase: str) -> None:
        if phase == "fetch":
            if self.slow_fetch > 0:
                time.sleep(self.slow_fetch)
            return
        with self._lock:
            due = next((f for f in self.faults if f.phase == phase and step >= f.step), None)
            if due is None:
                return
            self.faults.remove(due)
        if phase == "serve":  # answer first, die while sending
            timer = threading.Timer(SERVE_KILL_DELAY, self.fire, (due, step))
            timer.daemon = True
            timer.start()
        else:
            self.fire(due, step)

    def fire(self, fault: Fault, step: int) -> None:
        if fault.kind in ("slow", "hold"):  # a stall, not a failure: not recorded as the fault
            if fault.kind == "slow":
                time.sleep(SLOW_S)
                return
            start, deadline = self.plan_epoch(), time.monotonic() + HOLD_MAX_S
            while self.plan_epoch() <= start and time.monotonic() < deadline:
                time.sleep(0.005)
            return
        self.record.write_text(json.dumps({"kind": fault.kind, "phase": fault.phase, "step": step,
                                           "t": time.monotonic()}))
        self.send(os.getpid(), signal.SIGKILL if fault.kind == "kill" else signal.SIGSTOP)


# --------------------------------------------------------------------------------------------------
# one trainer


def trainer_main(args: argparse.Namespace) -> int:
    """One rank (or a spare) under ``gossiprec run``."""
    import torch

    from gossiprec.trainer.config import TrainerConfig
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.recovery import JobFinished, JobStopped, NoReplica, Released
    from gossiprec.trainer.capture import capture_state

    torch.set_num_threads(1)
    out = Path(args.out)
    (out.with_suffix(".pid")).write_text(str(os.getpid()))
    mistake = args.mistake
    model, opt, cursor = build(args.hidden * (2 if mistake == "wide-model" else 1))
    if mistake == "numpy-per-rank":
        import numpy as np

        np.random.seed(int(os.environ.get("GOSSIPREC_RANK", "99")))  # the classic: a seed per rank
    records: list[dict[str, Any]] = []
    resizes: list[list[int]] = []
    loads: list[int] = []
    ckpt = Path(args.checkpoint) if args.checkpoint else None
    faults = [Fault.parse("", f) for f in args.fault]

    def on_resize(old: int, new: int) -> None:
        resizes.append([old, new])
        if args.lr_scale:
            scale_lr(opt, old, new)

    def on_no_replica(info: NoReplica) -> int:
        assert ckpt is not None
        if not ckpt.exists():
            raise JobStopped(f"no replica left ({info.reason}) and no checkpoint at {ckpt} yet")
        loads.append(load_checkpoint(ckpt, rt.objects))
        return loads[-1]

    def on_recovered(rec: Any) -> None:
        records.append({**rec.to_dict(), "node": rt.node})
        with open(out.with_suffix(".records"), "a") as f:  # kept even if this trainer dies later
            f.write(json.dumps(records[-1]) + "\n")

    def plan_epoch() -> int:
        plan = rt.control.status().get("plan")
        return int(plan["epoch"]) if plan else -1

    hook = (FaultInjector(faults, out.with_suffix(".fault"), args.slow_fetch, plan_epoch=plan_epoch)
            if faults or args.slow_fetch else None)
    objects = objects_of(model, opt, cursor)
    if mistake == "no-data-position":
        del objects["data"]  # the cursor still moves, but nobody carries it to a spare
    rt = ResilientTrainer(objects, TrainerConfig(timeout=args.timeout),
                          on_recovered=on_recovered, on_resize=on_resize,
                          on_no_replica=on_no_replica if ckpt is not None else None, on_phase=hook)
    out.with_suffix(".ready").write_text("1")  # torch imported, model and optimizer built
    if args.go:  # start together: a fault must not find a spare still loading
        while not Path(args.go).exists():
            time.sleep(0.01)
    t_start = time.monotonic()
    progress = out.with_suffix(".step")
    commits: list[float] = []
    try:
        rt.start()
        print(f"gossiprec demo trainer {rt.node}: joined as rank {rt.rank} in "
              f"{time.monotonic() - t_start:.2f}s", file=sys.stderr, flush=True)
        while rt.step < args.steps:
            rt.begin_step()
            t0 = time.monotonic()
            if mistake == "data-write":
                with torch.no_grad():
                    next(model.parameters()).data.mul_(0.999)  # a hand-made decay, in the forbidden window
            local_gradients(model, cursor, rt.rank)
            if not rt.allreduce_gradients(model.parameters(), exact=True):
                continue
            opt.step()
            cursor.index += 1
            rt.commit()
            commits.append(time.monotonic())
            progress.write_text(str(rt.step))
            if ckpt is not None and args.checkpoint_every and rt.rank == 0 \
                    and rt.step % args.checkpoint_every == 0:
                save_checkpoint(ckpt, rt.objects, rt.step)
            if args.verbose and rt.step % 10 == 0:
                print(f"{rt.node} step {rt.step} at {time.monotonic():.3f} ({rt._step_ms} ms)", file=sys.stderr,
                      flush=True)
            left = args.step_ms / 1000.0 - (time.monotonic() - t0)
            if left > 0:
                time.sleep(left)  # pacing: stands in for a longer compute step
    except (Released, JobFinished) as exc:
        print(f"gossiprec demo trainer {rt.node}: {exc}", file=sys.stderr, flush=True)
        if isinstance(exc, Released):
            out.write_text(json.dumps({"node": rt.node, "released": True, "step": rt.step, "records": records}))
        rt.close()
        os._exit(0)
    except JobStopped as exc:
        print(f"gossiprec demo trainer {rt.node}: {exc}", file=sys.stderr, flush=True)
        rt.close()
        os._exit(3)
    final = capture_state(objects_of(model, opt, cursor), step=rt.step, checksum=False)
    out.with_suffix(".state").write_bytes(_state_bytes(final))
    out.write_text(json.dumps({"node": rt.node, "rank": rt.rank, "world_size": rt.world_size, "step": rt.step,
                               "records": records, "resizes": resizes, "checkpoint_loads": loads,
                               "commit_times": commits, "state_bytes": final.header.total_nbytes}))
    rt.finish()
    os._exit(0)  # a graveyard may hold a hung group whose destructor would block


# --------------------------------------------------------------------------------------------------
# the orchestrator


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def _read_json(path: Path) -> dict[str, Any] | None:
    try:
        out = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return out if isinstance(out, dict) else None


def _pid_alive(pid: int) -> bool:
    """Running: not gone, not a zombie (exited, not yet reaped), not exiting."""
    from gossiprec.local.bell import exiting

    return not exiting(pid)


def run_demo(ranks: int = 4, steps: int = 200, kill_at: int = 80, hidden: int = 256, step_ms: float = 20.0,
             workdir: str | None = None, victim: int | None = None, timeout: float = 100.0,
             log: Any = None, verbose: bool = False, *, spares: int = 1, hang_at: int | None = None,
             hang_victim: int | None = None, allow_shrink: bool = False) -> dict[str, Any]:
    """SIGKILL rank ``victim`` (default the last) once every rank passed ``kill_at``; with ``hang_at``,
    later SIGSTOP rank ``hang_victim`` (default the one before the last) once it passed ``hang_at``.
    Returns the result dict of :func:`run_scenario`."""
    victim = ranks - 1 if victim is None else victim
    faults = [Fault(f"n{victim}", "kill", kill_at)]
    if hang_at is not None:
        hang_victim = max(0, ranks - 2) if hang_victim is None else hang_victim
        if hang_victim == victim:
            raise ConfigError("the hung rank must differ from the killed one")
        faults.append(Fault(f"n{hang_victim}", "stop", hang_at))
    return run_scenario(ranks, spares, steps, faults, hidden=hidden, step_ms=step_ms, workdir=workdir,
                        timeout=timeout, allow_shrink=allow_shrink, log=log, verbose=verbose)


def run_scenario(ranks: int, spares: int, steps: int, faults: Sequence[Fault], *, hidden: int = 256,
                 step_ms: float = 20.0, workdir: str | None = None, timeout: float = 100.0,
                 allow_shrink: bool = False, checkpoint_every: int = 0, slow_fetch: float = 0.0,
                 lr_scale: bool = False, tp_pp: int = 1, trainer_timeout: float = 30.0, log: Any = None,
                 verbose: bool = False, agent_log_level: str = "warning", protocol: Mapping[str, Any] = {},
                 mistakes: Mapping[str, str] = {}, may_fail: Collection[str] = ()) -> dict[str, Any]:
    """Run a job of ``ranks`` trainers (nodes ``n0``..) and ``spares`` spares, inject ``faults`` (demo-sent
    ones in list order) and compare the final states with the failure-free run.

    ``timeout`` bounds the whole run (GossiprecError on expiry, logs kept in the work directory).
    ``allow_shrink`` goes into the job spec; ``lr_scale`` makes ``on_resize`` apply :func:`scale_lr`;
    ``checkpoint_every`` makes rank 0 checkpoint (``on_no_replica`` loads it); ``slow_fetch`` slows
    every receiver by that many seconds per chunk. ``tp_pp`` > 1 declares the job a grid of
    ``ranks // tp_pp`` replicas of ``tp_pp`` shards (the trainers still train data-parallel: only the
    agents' notion of which ranks hold the same state changes), e.g. ``tp_pp=ranks`` leaves every
    shard without a replica. ``protocol``: agreement settings for every agent (``--protocol``);
    ``mistakes``: node -> a loop mistake of :data:`MISTAKES` its trainer makes; ``may_fail``: nodes whose
    trainer may exit with an error without failing the run. Once the job is done, every process
    left must end by itself: ``exits`` holds each launcher's exit code (None: still running 10 s later).
    """
    from gossiprec.security.keyring import Keyring, decode_key, generate_key

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    tmp = Path(workdir or tempfile.mkdtemp(prefix="gossiprec-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    names = [f"n{i}" for i in range(ranks + spares)]
    # slow and hold are stalls the trainers make themselves, not faults to report on
    everything, faults = list(faults), [f for f in faults if f.kind not in ("slow", "hold")]
    unknown = {f.node for f in everything} - set(names)
    if unknown:
        raise ConfigError(f"faults name unknown nodes {sorted(unknown)}; nodes are {names}")
    ports = free_ports(len(names), width=3)  # agent, store, donor
    if tp_pp < 1 or ranks % tp_pp:
        raise ConfigError(f"tp_pp must divide ranks ({ranks}), got {tp_pp}")
    topology = ['topology = "ddp"'] if tp_pp == 1 else ['topology = "grid"', f"dp = {ranks // tp_pp}",
                                                        f"tp_pp = {tp_pp}"]
    lines = ['[job]', *topology, f'allow_shrink = {"true" if allow_shrink else "false"}', '']
    for i, (name, port) in enumerate(zip(names, ports)):
        role = "trainer" if i < ranks else "spare"
        rank = f"rank = {i}\n" if role == "trainer" else ""
        lines.append(f'[[members]]\nname = "{name}"\naddr = "127.0.0.1:{port}"\nrole = "{role}"\n{rank}')
    (tmp / "job.toml").write_text("\n".join(lines))
    Keyring([decode_key(generate_key())]).save(tmp / "keyring.json")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GOSSIPREC_KEYRING": str(tmp / "keyring.json"),
           "OMP_NUM_THREADS": "1"}
    procs: dict[str, subprocess.Popen[bytes]] = {}
    result: dict[str, Any] = {"ranks": ranks, "spares": spares, "steps": steps,
                              "victim": faults[0].node if faults else None}
    sent = [f for f in faults if f.phase is None]
    fault_at: dict[int, float] = {}
    try:
        for name, port in zip(names, ports):
            cmd = [sys.executable, "-m", "gossiprec", "run", "--name", name, "--bind", "127.0.0.1",
                   "--port", str(port), "--job", str(tmp / "job.toml"), "--seed", f"127.0.0.1:{ports[0]}",
                   "--control-socket", str(tmp / f"{name}.sock"), "--log-level", agent_log_level]
            cmd += [a for k, v in protocol.items() for a in ("--protocol", f"{k}={v}")]
            cmd += ["--",
                   sys.executable, "-m", "gossiprec.demo", "trainer", "--steps", str(steps),
                   "--hidden", str(hidden), "--step-ms", str(step_ms), "--timeout", str(trainer_timeout),
                   "--out", str(tmp / f"{name}.json"), "--slow-fetch", str(slow_fetch), "--go", str(tmp / "go")]
            cmd += [a for f in everything if f.node == name and f.phase is not None for a in ("--fault", f.spec())]
            cmd += ["--mistake", mistakes[name]] if name in mistakes else []
            if checkpoint_every:
                cmd += ["--checkpoint", str(tmp / "ckpt.state"), "--checkpoint-every", str(checkpoint_every)]
            cmd += ["--lr-scale"] * lr_scale + ["--verbose"] * verbose
            procs[name] = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                           stderr=open(tmp / f"{name}.log", "wb"))
        say(f"started {ranks} ranks + {spares} spare(s) in {tmp}")
        deadline = time.monotonic() + timeout
        victims = {f.node for f in faults}
        while not all((tmp / f"{n}.ready").exists() for n in names):  # every trainer and spare loaded
            ended = {n: p.returncode for n, p in procs.items() if p.poll() is not None}
            if ended:
                raise GossiprecError(f"trainers failed before training began: {ended}; see the logs in {tmp}")
            if time.monotonic() > deadline:
                raise GossiprecError(f"the trainers did not start within {timeout:.0f}s; see the logs in {tmp}")
            time.sleep(0.01)
        (tmp / "go").write_text("1")
        while True:
            if time.monotonic() > deadline:
                raise GossiprecError(f"the job did not finish within {timeout:.0f}s; see the logs in {tmp}")
            failed = {n: p.returncode for n, p in procs.items()
                      if n not in victims and n not in may_fail and p.poll() not in (None, 0)}
            if failed:
                raise GossiprecError(f"trainers failed: {failed}; see the logs in {tmp}")
            i = len(fault_at)
            if i < len(sent) and _read_int(tmp / f"{sent[i].node}.step") >= sent[i].step:
                f = sent[i]
                pid = _read_int(tmp / f"{f.node}.pid")
                os.kill(pid, signal.SIGKILL if f.kind == "kill" else signal.SIGSTOP)
                fault_at[i] = time.monotonic()
                say(f"{'SIGKILL' if f.kind == 'kill' else 'SIGSTOP'} trainer of {f.node} at step "
                    f"{_read_int(tmp / f'{f.node}.step')} (pid {pid})")
            outs = [o for o in (_read_json(tmp / f"{n}.json") for n in names) if o is not None]
            done = [o for o in outs if o.get("step") == steps and not o.get("released")]
            if len(fault_at) == len(sent) and done and len(done) >= max(o["world_size"] for o in done):
                break
            time.sleep(0.01)
        stopped = [f.node for f in faults if f.kind == "stop"]
        end_by = time.monotonic() + 10.0  # the trainers that finished leave, and so do the unused spares
        while any(p.poll() is None for p in procs.values()) and time.monotonic() < end_by:
            time.sleep(0.02)
        result["hung_killed_by_launcher"] = {n: procs[n].poll() is not None for n in stopped}
        result["exits"] = {n: p.poll() for n, p in procs.items()}
        return _results(result, tmp, names, faults, sent, fault_at, steps, ranks, hidden, lr_scale)
    finally:
        for f in faults:  # a stopped trainer would ignore its launcher's SIGTERM
            pid = _read_int(tmp / f"{f.node}.pid")
            if f.kind == "stop" and pid > 0 and _pid_alive(pid):
                os.kill(pid, signal.SIGKILL)
        for p in procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)  # spares never needed, victims' launchers
        for p in procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def _results(result: dict[str, Any], tmp: Path, names: list[str], faults: Sequence[Fault], sent: list[Fault],
             fault_at: dict[int, float], steps: int, ranks: int, hidden: int, lr_scale: bool) -> dict[str, Any]:
    """Compare the finished trainers' states with the reference and build the per-fault timelines."""
    outs = {n: o for n in names if (o := _read_json(tmp / f"{n}.json")) is not None}
    finished = {n: o for n, o in outs.items() if not o.get("released")}
    records = [json.loads(line) for n in names if (tmp / f"{n}.records").exists()
               for line in (tmp / f"{n}.records").read_text().splitlines() if line.strip()]
    by_epoch = {r["epoch"]: (r["target_step"], r["world_size"]) for r in sorted(records, key=lambda r: r["epoch"])}
    worlds, world = [], ranks
    for target, w in by_epoch.values():
        if w != world:
            worlds.append((target, w))
            world = w
    t_ref = time.monotonic()
    expected = reference_state(steps, ranks, hidden, worlds=worlds, lr_scale=lr_scale)
    result["reference_s"] = round(time.monotonic() - t_ref, 3)
    result["bit_identical"] = bool(finished) and all((tmp / f"{n}.state").read_bytes() == expected
                                                    for n in finished)
    result["worlds"] = worlds
    times: list[float | None] = []
    for f in faults:
        if f.phase is None:
            times.append(fault_at.get(sent.index(f)))
        else:
            rec = _read_json(tmp / f"{f.node}.fault")
            times.append(float(rec["t"]) if rec else None)
    entries = []
    for i, (f, t) in enumerate(zip(faults, times)):
        entry: dict[str, Any] = {"node": f.node, "kind": f.kind, "phase": f.phase or "any", "fired": t is not None}
        if t is not None:
            rec = _read_json(tmp / f"{f.node}.fault") if f.phase else None
            entry["step"] = rec["step"] if rec else f.step
            later = [u for u in times[i + 1:] if u is not None and u >= t]
            end = min(later, default=float("inf"))
            mine = [r for r in records if t <= r["planned_at"] < end]
            entry.update(_timeline(t, mine))
            entry["epochs"] = sorted({r["epoch"] for r in mine})
            # who holds which rank once the fault's recoveries are over (the latest record per rank)
            entry["assignment_after"] = {r["rank"]: r["node"] for r in sorted(mine, key=lambda r: r["epoch"])}
        entries.append(entry)
    result["faults"] = entries
    first = next((e for e in entries if e["fired"]), {})
    result.update({k: first.get(k) for k in ("rto_s", "phases_s", "lost_steps", "transfer_mb_s",
                                              "transfer_bytes", "epoch", "roles")})
    periods = [b - a for o in finished.values() for a, b in zip(o["commit_times"], o["commit_times"][1:])]
    if periods:
        typical = statistics.median(periods)
        result["median_step_s"] = round(statistics.median(p for p in periods if p < 5 * typical), 4)
    result["state_bytes"] = next(iter(finished.values()))["state_bytes"] if finished else 0
    result["final_step"] = sorted({o["step"] for o in finished.values()})
    result["resizes"] = {n: o["resizes"] for n, o in finished.items() if o.get("resizes")}
    result["checkpoint_loads"] = {n: o["checkpoint_loads"] for n, o in finished.items()
                                  if o.get("checkpoint_loads")}
    result["released"] = sorted(n for n, o in outs.items() if o.get("released"))
    result["workdir"] = str(tmp)
    return result


def _timeline(t_kill: float, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Phases measured from the fault, over the records of the first recovery after it."""
    if not records:
        return {"rto_s": None, "phases_s": {}, "lost_steps": None, "transfer_mb_s": None}
    epoch = min(r["epoch"] for r in records)
    recs = [r for r in records if r["epoch"] == epoch]

    def rel(key: str, agg: Any = max) -> float | None:
        vals = [r[key] for r in recs if r.get(key) is not None]
        return round(agg(vals) - t_kill, 4) if vals else None

    recv = [r for r in recs if r["role"] == "receiver"]
    nbytes = sum(r["bytes_received"] for r in recv)
    secs = sum(r["transfer_s"] for r in recv)
    trainers = [r for r in recs if r.get("previous_role", "trainer") == "trainer"]
    noticed = [r["noticed_at"] for r in trainers]
    phases = {"detected": rel("detected_at", min),
              "noticed_by_trainers": round(max(noticed) - t_kill, 4) if noticed else None,
              "agreed": rel("agreed_at", max), "planned": rel("planned_at", max),
              "state_moved": rel("state_at", max), "group_rebuilt": rel("group_at", max),
              "first_step_done": rel("first_step_at", max)}
    return {"rto_s": phases["first_step_done"], "phases_s": phases,
            "lost_steps": max(r["lost_steps"] for r in recs),
            "transfer_mb_s": round(nbytes / secs / 1e6, 1) if secs > 0 else None,
            "transfer_bytes": nbytes, "epoch": epoch, "action": recs[0].get("action", "resume"),
            "roles": {r["rank"]: r["role"] for r in recs},
            "assignment": {r["rank"]: r["node"] for r in recs if "node" in r}}


def _print_human(res: dict[str, Any], out: Any) -> None:
    print(f"\n{res['ranks']} ranks + {res['spares']} spare(s), {res['steps']} steps, "
          f"state {res.get('state_bytes', 0) / 1e6:.2f} MB, median step {res.get('median_step_s')} s", file=out)
    for f in res.get("faults", []):
        what = {"kill": "SIGKILL", "stop": "SIGSTOP (hang)"}[f["kind"]]
        where = "sent by the demo" if f["phase"] == "any" else f"by itself, {f['phase']} phase"
        print(f"\n{what} of {f['node']} at step {f.get('step')} ({where})", file=out)
        if not f["fired"]:
            print("  never happened", file=out)
            continue
        print(f"  timeline (seconds after the signal), epoch {f.get('epoch')}, plan {f.get('action')}:", file=out)
        for k, v in f.get("phases_s", {}).items():
            print(f"    {k:22s} {'-' if v is None else f'{v:8.3f}'}", file=out)
        print(f"  RTO (signal -> every rank finished its first step after recovery): {f.get('rto_s')} s", file=out)
        if f["kind"] == "stop" and res.get("median_step_s"):
            bound = 3 * res["median_step_s"] + 1.0
            print(f"  hang RTO bound 3 x median step + 1 s = {bound:.3f} s", file=out)
        print(f"  transfer: {f.get('transfer_bytes', 0)} bytes at {f.get('transfer_mb_s')} MB/s; "
              f"committed steps lost: {f.get('lost_steps')}; recoveries: epochs {f.get('epochs')}", file=out)
    for node, killed in res.get("hung_killed_by_launcher", {}).items():
        print(f"\nhung trainer of {node} killed by its launcher when removed from the view: {killed}", file=out)
    print(f"final state equals the failure-free run bit for bit: {res.get('bit_identical')}", file=out)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.demo_cmd == "trainer":
        return trainer_main(args)
    try:
        res = run_demo(args.ranks, args.steps, args.kill_at, args.hidden, args.step_ms, args.workdir,
                       log=None if args.json else sys.stderr, spares=args.spares,
                       hang_at=args.hang_at if args.hang_at > 0 else None, allow_shrink=args.allow_shrink)
    except (GossiprecError, OSError, subprocess.TimeoutExpired) as exc:
        print(f"gossiprec demo: error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(res))
    else:
        _print_human(res, sys.stdout)
    return 0 if res.get("bit_identical") else 1


def _add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("demo_cmd", nargs="?", choices=("run", "trainer"), default="run",
                   help=argparse.SUPPRESS)
    p.add_argument("--ranks", type=int, default=4, help="trainer ranks")
    p.add_argument("--spares", type=int, default=2, help="hot spares (one is spent per fault)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", dest="kill_at", type=int, default=80, help="SIGKILL the last rank at this step")
    p.add_argument("--hang-at", dest="hang_at", type=int, default=140,
                   help="SIGSTOP the rank before the last at this step (0: no hang)")
    p.add_argument("--allow-shrink", dest="allow_shrink", action="store_true",
                   help="with no spare left, shrink the data-parallel world instead of stopping")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (state size grows with its square)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=20.0, help="pace each step to this long")
    p.add_argument("--workdir", default=None, help="where logs and outputs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    p.add_argument("--fault", action="append", default=[], help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", default="", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint-every", dest="checkpoint_every", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--slow-fetch", dest="slow_fetch", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--lr-scale", dest="lr_scale", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--go", default="", help=argparse.SUPPRESS)
    p.add_argument("--mistake", choices=MISTAKES, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="kill and hang ranks of a local job and watch them recover in place",
                              description=__doc__.split("\n\n")[0] if __doc__ else None)
    _add_arguments(p)
    return p  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gossiprec demo")
    _add_arguments(parser)
    args = parser.parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
