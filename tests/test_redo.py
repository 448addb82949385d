"""A redone step starts clean (gossiprec.trainer.redo): the gradients an interrupted step leaves are
found and dropped, FSDP2's unsharded ones included, and the guard refuses one the redone step did not
produce, before that step's backward could add to it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gossiprec.errors import RecoveryError
from gossiprec.trainer.redo import RedoGuard, clear_gradients, grad_slots


def _objects() -> dict[str, object]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.LayerNorm(3))
    extra = torch.nn.Parameter(torch.ones(2))  # an optimizer's parameter that no registered module holds
    opt = torch.optim.SGD([*model.parameters(), extra], lr=0.1)
    return {"model": model, "optimizer": opt}


def test_every_gradient_of_the_objects_is_found_once_and_dropped() -> None:
    objects = _objects()
    model, opt = objects["model"], objects["optimizer"]
    assert isinstance(model, torch.nn.Module) and isinstance(opt, torch.optim.Optimizer)
    model(torch.ones(1, 3)).sum().backward()
    extra = opt.param_groups[0]["params"][-1]
    extra.grad = torch.ones(2)
    names = [n for n, _, _ in grad_slots(objects)]
    assert names == ["model.0.weight", "model.0.bias", "model.1.weight", "model.1.bias",
                     "optimizer.param_groups[0][4]"]
    assert clear_gradients(objects) == 5
    assert all(getattr(h, a) is None for _, h, a in grad_slots(objects))
    assert clear_gradients(objects) == 0


def test_the_guard_refuses_a_gradient_the_redone_step_did_not_produce() -> None:
    objects = _objects()
    model = objects["model"]
    assert isinstance(model, torch.nn.Module)
    guard = RedoGuard()
    guard.arm(objects)
    guard.check()  # not started (the trainer's own commit barrier): nothing checked, still armed
    assert guard.armed
    guard.start()
    model[1].weight.grad = torch.zeros(3)  # left by something the reset did not know
    with pytest.raises(RecoveryError, match=r"did not produce.*model\.1\.weight"):
        guard.check()
    assert not guard.armed and not guard.watching  # checked once


def test_the_guard_lets_the_redone_steps_own_gradients_pass() -> None:
    """A collective inside backward, or after a backward of this step (micro-batches), sees gradients this
    step produced: no error."""
    objects = _objects()
    model = objects["model"]
    assert isinstance(model, torch.nn.Module)
    guard = RedoGuard()
    guard.arm(objects)
    guard.start()
    model(torch.ones(1, 3)).sum().backward()  # a first micro-batch, no collective in it
    guard.check()
    assert not guard.armed
    guard.arm(objects)
    guard.start()
    seen: list[bool] = []
    out = model(torch.ones(1, 3)).sum()
    out.register_hook(lambda g: (guard.check(), seen.append(True))[1] and None)  # a collective in backward
    out.backward()
    assert seen == [True] and not guard.armed
    guard.arm(objects)
    guard.disarm()  # a step that committed without a collective: hooks gone
    assert all(not getattr(h, "_post_accumulate_grad_hooks", None) for _, h, a in grad_slots(objects) if a == "grad")


_FSDP_ABORTED = """
import json, torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from gossiprec.trainer.collectives.managed import init_managed_world
from gossiprec.trainer.redo import RedoGuard, clear_gradients, grad_slots
from gossiprec.trainer.collectives.sharded import MeshSpec, ShardedWorld

init_managed_world(0, 1, timeout=10)
mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("shard",))

def build():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4), torch.nn.LayerNorm(4))
    for block in model[:2]:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)  # the LayerNorm: the root's group
    return model

def grads(model):
    return {n: p.grad.to_local().tolist() for n, p in model.named_parameters()}

x = torch.arange(8.0).reshape(2, 4)
clean = build()
clean(x).pow(2).sum().backward()
model = build()
class Abort(Exception):
    pass
def boom(_g):
    raise Abort()
h = model[1].register_full_backward_pre_hook(lambda m, g: boom(g))  # backward stops between the blocks
try:
    model(x).pow(2).sum().backward()
except Abort:
    pass
h.remove()
world = ShardedWorld(MeshSpec((1,), ("shard",)), lambda mesh: {}, timeout=10, poll_interval=0.01,
                     slow_after=None, on_slow=None)
world.reset_modules({"model": model})
left = sorted(n for n, hold, a in grad_slots({"model": model}) if getattr(hold, a) is not None)
guard = RedoGuard()
guard.arm({"model": model})
guard.start()
try:
    guard.check()  # a redo without the drop, at its first collective (a world of one issues none: called here)
    refused = ""
except Exception as exc:
    refused = f"{type(exc).__name__}: {exc}"
dropped = clear_gradients({"model": model})
guard.arm({"model": model})
guard.start()
guard.check()
model(x).pow(2).sum().backward()  # the redo
print(json.dumps({"left": left, "refused": refused, "dropped": dropped, "same": grads(model) == grads(clean),
                  "armed": guard.armed}))
"""


def test_an_aborted_fsdp2_backward_leaves_the_roots_unsharded_gradients_and_they_are_dropped() -> None:
    """torch's reset_iter_state reshards the root's group but keeps its unsharded parameters' gradients
    (here the LayerNorm's, which the root reduces last): the guard refuses a redo that kept them;
    dropped, the redone backward gives the clean run's gradients exactly."""
    out = subprocess.run([sys.executable, "-c", _FSDP_ABORTED], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    assert res["left"] == ["model.2.bias (FSDP2 unsharded)", "model.2.weight (FSDP2 unsharded)"], res
    assert res["refused"].startswith("RecoveryError: the step redone after a recovery holds gradients"), res
    assert "model.2.weight (FSDP2 unsharded)" in res["refused"], res
    assert res["dropped"] == 2 and res["same"] and not res["armed"], res
