"""``gossiprec demo``: kill a rank of a real job on this machine and watch it recover in place.

Theory of operation
-------------------
The demo starts, on loopback, one ``gossiprec run`` per node (an agent plus its trainer child): ``ranks``
trainers and one hot spare, all reading one generated job spec and one generated keyring (agents and
state transfers are authenticated). Each trainer (``python -m gossiprec.demo trainer``) trains a small
MLP with :class:`~gossiprec.trainer.loop.ResilientTrainer` on data generated from (seed, data
position, rank), paced to ``step_ms`` per step. When every rank has passed ``kill_at``, the demo
SIGKILLs one trainer process; its launcher announces the exit, the agents agree on a new view and a
plan, the spare fetches the state from a surviving replica, every rank builds the new epoch's group
and training goes on to ``steps``.

Each trainer writes its recovery records and, at the end, its complete state (model, optimizer, data
position, RNG: the payload of :func:`capture_state`). The demo computes the same training without
failure in this process (:func:`reference_state`; gradients are reduced in rank order, see
``allreduce_gradients(exact=True)``, so one process reproduces the multi-process result bit for bit)
and compares. It prints the timeline measured from the kill: detected (the agents' first failure
event), agreed (new view), planned, state moved, group rebuilt, first step done; ``--json`` prints
``rto_s`` (kill to the last rank's first completed step after recovery), ``phases_s``,
``bit_identical``, ``lost_steps`` and ``transfer_mb_s``.
"""

from __future__ import annotations

import argparse
import random
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

from gossiprec.errors import GossiprecError

if TYPE_CHECKING:
    import torch

SEED = 1234


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
    """Model, AdamW optimizer (state allocated) and data cursor, identical in every process."""
    import torch

    from gossiprec.trainer.state import materialize_optimizer_state

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
    materialize_optimizer_state(opt)
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
    from gossiprec.trainer.state import training_state

    return training_state(model, opt, data=cursor)


def reference_state(steps: int, world: int, hidden: int) -> bytes:
    """The payload of the state after ``steps`` failure-free steps of a ``world``-rank job."""
    import torch

    from gossiprec.trainer.loop import rank_ordered_mean
    from gossiprec.trainer.state import capture_state

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny ops: threads only contend with the job's processes
    try:
        return _reference(steps, world, hidden)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int, world: int, hidden: int) -> bytes:
    import torch

    from gossiprec.trainer.loop import rank_ordered_mean
    from gossiprec.trainer.state import capture_state

    model, opt, cursor = build(hidden)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(1, steps + 1):
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
    from gossiprec.trainer.state import pack_header

    return pack_header(snap.header) + snap.payload()


def trainer_main(args: argparse.Namespace) -> int:
    """One rank (or the spare) under ``gossiprec run``."""
    import torch

    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.state import capture_state

    torch.set_num_threads(1)
    out = Path(args.out)
    (out.with_suffix(".pid")).write_text(str(os.getpid()))
    model, opt, cursor = build(args.hidden)
    records: list[dict[str, Any]] = []
    rt = ResilientTrainer(objects_of(model, opt, cursor), timeout=args.timeout,
                          on_recovered=lambda r: records.append(r.to_dict()))
    t_start = time.monotonic()
    rt.start()
    print(f"gossiprec demo trainer {rt.node}: joined as rank {rt.rank} in {time.monotonic() - t_start:.2f}s",
          file=sys.stderr, flush=True)
    progress = out.with_suffix(".step")
    while rt.step < args.steps:
        rt.begin_step()
        t0 = time.monotonic()
        local_gradients(model, cursor, rt.rank)
        if not rt.allreduce_gradients(model.parameters(), exact=True):
            continue
        opt.step()
        cursor.index += 1
        rt.commit()
        if rt.step % 10 == 0:
            progress.write_text(str(rt.step))
            if args.verbose:
                print(f"{rt.node} step {rt.step} at {time.monotonic():.3f} ({rt._step_ms} ms)", file=sys.stderr,
                      flush=True)
        left = args.step_ms / 1000.0 - (time.monotonic() - t0)
        if left > 0:
            time.sleep(left)  # pacing: stands in for a longer compute step
    final = capture_state(objects_of(model, opt, cursor), step=rt.step, checksum=False)
    out.with_suffix(".state").write_bytes(_state_bytes(final))
    out.write_text(json.dumps({"node": rt.node, "rank": rt.rank, "step": rt.step, "records": records,
                               "state_bytes": final.header.total_nbytes}))
    rt.finish()
    os._exit(0)  # a graveyard may hold a hung group whose destructor would block


# --------------------------------------------------------------------------------------------------
# the orchestrator


def _free_port_block(n: int, width: int = 3) -> list[int]:
    """``n`` ports p such that TCP p..p+width-1 and UDP p are free (agent, store, donor)."""
    ports: list[int] = []
    while len(ports) < n:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        base = s.getsockname()[1]
        s.close()
        if base + width >= 65535 or any(abs(base - p) < width + 1 for p in ports):
            continue
        held: list[socket.socket] = []
        try:
            for i in range(width):
                t = socket.socket()
                t.bind(("127.0.0.1", base + i))
                held.append(t)
            u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            u.bind(("127.0.0.1", base))
            held.append(u)
            ports.append(base)
        except OSError:
            pass
        finally:
            for h in held:
                h.close()
    return ports


def _read_int(path: Path) -> int:
    try:
        return int(path.read_text() or -1)
    except (OSError, ValueError):
        return -1


def run_demo(ranks: int = 4, steps: int = 200, kill_at: int = 80, hidden: int = 256, step_ms: float = 20.0,
             workdir: str | None = None, victim: int | None = None, timeout: float = 100.0,
             log: Any = None, verbose: bool = False) -> dict[str, Any]:
    """Run the demo; returns the result dict (see the module docstring)."""
    from gossiprec.io.keyring import Keyring, generate_key, decode_key

    def say(msg: str) -> None:
        if log is not None:
            print(msg, file=log, flush=True)

    tmp = Path(workdir or tempfile.mkdtemp(prefix="gossiprec-demo-"))
    tmp.mkdir(parents=True, exist_ok=True)
    names = [f"n{i}" for i in range(ranks + 1)]
    ports = _free_port_block(len(names))
    lines = ['[job]', 'topology = "ddp"', '']
    for i, (name, port) in enumerate(zip(names, ports)):
        role = "trainer" if i < ranks else "spare"
        rank = f"rank = {i}\n" if role == "trainer" else ""
        lines.append(f'[[members]]\nname = "{name}"\naddr = "127.0.0.1:{port}"\nrole = "{role}"\n{rank}')
    (tmp / "job.toml").write_text("\n".join(lines))
    ring = Keyring([decode_key(generate_key())])
    ring.save(tmp / "keyring.json")
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "GOSSIPREC_KEYRING": str(tmp / "keyring.json"),
           "OMP_NUM_THREADS": "1"}
    procs: list[subprocess.Popen[bytes]] = []
    victim = ranks - 1 if victim is None else victim
    result: dict[str, Any] = {"ranks": ranks, "spares": 1, "steps": steps, "victim": names[victim]}
    try:
        for name, port in zip(names, ports):
            cmd = [sys.executable, "-m", "gossiprec", "run", "--name", name, "--bind", "127.0.0.1",
                   "--port", str(port), "--job", str(tmp / "job.toml"), "--seed", f"127.0.0.1:{ports[0]}",
                   "--control-socket", str(tmp / f"{name}.sock"), "--log-level", "warning", "--",
                   sys.executable, "-m", "gossiprec.demo", "trainer", "--steps", str(steps),
                   "--hidden", str(hidden), "--step-ms", str(step_ms), *(["--verbose"] if verbose else []), "--out", str(tmp / f"{name}.json")]
            procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL,
                                          stderr=open(tmp / f"{name}.log", "wb")))
        say(f"started {ranks} ranks + 1 spare in {tmp}")
        deadline = time.monotonic() + timeout
        while min(_read_int(tmp / f"{n}.step") for n in names[:ranks]) < kill_at:
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise GossiprecError(f"the job did not reach step {kill_at}; see the logs in {tmp}")
            time.sleep(0.02)
        pid = _read_int(tmp / f"{names[victim]}.pid")
        os.kill(pid, signal.SIGKILL)
        t_kill = time.monotonic()
        say(f"SIGKILL trainer of {names[victim]} (rank {victim}, pid {pid})")
        survivors = [p for i, p in enumerate(procs) if i != victim]
        for p in survivors:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        outs = {n: json.loads((tmp / f"{n}.json").read_text()) for i, n in enumerate(names) if i != victim}
        bad = {n: p.returncode for n, p in zip(names, procs) if p is not procs[victim] and p.returncode}
        if bad:
            raise GossiprecError(f"trainers failed: {bad}; see the logs in {tmp}")
        t_ref = time.monotonic()
        expected = reference_state(steps, ranks, hidden)
        ref_s = time.monotonic() - t_ref
        states = {n: (tmp / f"{n}.state").read_bytes() for n in outs}
        result["bit_identical"] = all(s == expected for s in states.values())
        result["reference_s"] = round(ref_s, 3)
        result.update(_timeline(t_kill, [r for o in outs.values() for r in o["records"]]))
        result["state_bytes"] = next(iter(outs.values()))["state_bytes"]
        result["final_step"] = sorted({o["step"] for o in outs.values()})
        result["workdir"] = str(tmp)
        return result
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()


def _timeline(t_kill: float, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Phases measured from the kill, over the records of the first recovery."""
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
    phases = {"detected": rel("detected_at", min), "noticed_by_trainers": rel("noticed_at", max),
              "agreed": rel("agreed_at", max), "planned": rel("planned_at", max),
              "state_moved": rel("state_at", max), "group_rebuilt": rel("group_at", max),
              "first_step_done": rel("first_step_at", max)}
    return {"rto_s": phases["first_step_done"], "phases_s": phases,
            "lost_steps": max(r["lost_steps"] for r in recs),
            "transfer_mb_s": round(nbytes / secs / 1e6, 1) if secs > 0 else None,
            "transfer_bytes": nbytes, "epoch": epoch,
            "roles": {r["rank"]: r["role"] for r in recs}}


def _print_human(res: dict[str, Any], out: Any) -> None:
    print(f"\n{res['ranks']} ranks + {res['spares']} spare, {res['steps']} steps, killed {res['victim']}, "
          f"state {res.get('state_bytes', 0) / 1e6:.2f} MB", file=out)
    print("timeline (seconds after SIGKILL):", file=out)
    for k, v in res.get("phases_s", {}).items():
        print(f"  {k:22s} {'-' if v is None else f'{v:8.3f}'}", file=out)
    print(f"RTO (kill -> every rank finished its first step after recovery): {res.get('rto_s')} s", file=out)
    print(f"transfer: {res.get('transfer_bytes', 0)} bytes at {res.get('transfer_mb_s')} MB/s; "
          f"committed steps lost: {res.get('lost_steps')}", file=out)
    print(f"final state equals the failure-free run bit for bit: {res.get('bit_identical')}", file=out)


def _cmd_demo(args: argparse.Namespace) -> int:
    if args.demo_cmd == "trainer":
        return trainer_main(args)
    try:
        res = run_demo(args.ranks, args.steps, args.kill_at, args.hidden, args.step_ms, args.workdir,
                       log=None if args.json else sys.stderr)
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
    p.add_argument("--ranks", type=int, default=4, help="trainer ranks (plus one spare)")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-at", dest="kill_at", type=int, default=80, help="kill once every rank passed this step")
    p.add_argument("--hidden", type=int, default=256, help="MLP width (state size grows with its square)")
    p.add_argument("--step-ms", dest="step_ms", type=float, default=20.0, help="pace each step to this long")
    p.add_argument("--workdir", default=None, help="where logs and outputs go (default: a temp dir)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--out", default="", help=argparse.SUPPRESS)
    p.add_argument("--verbose", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=30.0, help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_demo)


def add_cli(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("demo", help="kill a rank of a local job and watch it recover in place",
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
