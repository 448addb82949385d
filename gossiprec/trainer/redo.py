"""A step redone after a recovery starts clean: no gradient of the interrupted step survives into it.

An interrupted step leaves gradients behind wherever its backward got to: on the parameters, and in
FSDP2 on the *unsharded* parameters of every group whose reduce-scatter had not run yet (the root's
group, holding the parameters outside every ``fully_shard``ed block, is the last to reduce) and in its
accumulation buffers. Backward adds to a gradient that is there, and FSDP2 reduces the sum, so every
replica would agree on a wrong step. torch's ``reset_iter_state`` reshards the groups but keeps those
gradients.

- :func:`clear_gradients` drops every gradient the registered objects hold (:func:`grad_slots`): each
  module's parameters, each FSDP2 parameter's unsharded parameter and accumulated gradient, each
  optimizer's parameters. The trainer calls it after every recovery, once the state is restored.
- :class:`RedoGuard` checks the redone step at its first collective: until that step's backward has
  produced a gradient, no slot may hold one. A slot that does (left by state the library did not know
  to reset, or written by the loop) raises :class:`~gossiprec.errors.RecoveryError` naming
  it, instead of training on. What it cannot see: a leftover on a parameter whose gradient this step's
  backward had already reached before its first collective (a loop whose first collective comes after
  backward, as plain data-parallel loops: their gradients are overwritten by the average, not added to).

The user's own step state (a gradient-accumulation buffer, a loss scaler's per-step flags) is theirs
to reset: a redone step is the same step again, so whatever the loop keeps outside the registered
objects between micro-batches must start again with it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterator, Mapping

from gossiprec.errors import RecoveryError

if TYPE_CHECKING:
    import torch

Slot = tuple[str, Any, str]
"""A place a gradient can live: (name, holder, attribute): ``holder.attribute`` is a tensor or None."""


def grad_slots(objects: Mapping[str, Any]) -> Iterator[Slot]:
    """Every gradient slot of the registered objects (see the module docstring), each once."""
    import torch

    seen: set[int] = set()
    for key, obj in objects.items():
        if isinstance(obj, torch.nn.Module):
            for name, p in obj.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield f"{key}.{name}", p, "grad"
            for module in obj.modules():
                get_state = getattr(module, "_get_fsdp_state", None)  # (FSDP2 modules only)
                state = get_state() if get_state is not None else None
                for group in getattr(state, "_fsdp_param_groups", ()) if state is not None else ():
                    for fp in group.fsdp_params:
                        fqn = f"{key}.{fp._param_fqn or '?'}"
                        unsharded = getattr(fp, "_unsharded_param", None)
                        if unsharded is not None and id(unsharded) not in seen:
                            seen.add(id(unsharded))
                            yield f"{fqn} (FSDP2 unsharded)", unsharded, "grad"
                        if id(fp) not in seen:
                            seen.add(id(fp))
                            yield f"{fqn} (FSDP2 accumulated)", fp, "unsharded_accumulated_grad"
        elif isinstance(obj, torch.optim.Optimizer):
            for i, group in enumerate(obj.param_groups):
                for j, p in enumerate(group["params"]):
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield f"{key}.param_groups[{i}][{j}]", p, "grad"


def clear_gradients(objects: Mapping[str, Any]) -> int:
    """Drop every gradient of the registered objects; returns how many there were."""
    n = 0
    for _, holder, attr in grad_slots(objects):
        if getattr(holder, attr, None) is not None:
            setattr(holder, attr, None)
            n += 1
    return n


class RedoGuard:
    """Checks a redone step at its first collective (see the module docstring). ``arm`` after the
    recovery; ``start`` once the trainer's own collectives of the step's beginning are issued (the
    commit barrier: the loop's code runs next); ``check`` as a collective is entered; ``disarm`` when
    the step commits or recovers."""

    def __init__(self) -> None:
        self._objects: Mapping[str, Any] | None = None
        self._hooks: list[Any] = []
        self._backward = False
        self.watching = False
        """Started: the next collective entered is checked."""

    @property
    def armed(self) -> bool:
        return self._objects is not None

    def start(self) -> None:
        self.watching = True

    def arm(self, objects: Mapping[str, Any]) -> None:
        """The next step is a redo of ``objects``' interrupted one: watch for its backward."""
        self.disarm()
        self._objects, self._backward = objects, False
        for _, holder, attr in grad_slots(objects):
            if attr == "grad" and getattr(holder, "requires_grad", False) and holder.is_leaf:
                self._hooks.append(holder.register_post_accumulate_grad_hook(self._produced))

    def _produced(self, _param: torch.Tensor) -> None:
        self._backward = True  # this step's backward is under way: its gradients are its own

    def check(self) -> None:
        """A collective of the redone step is entered: raise if a gradient is held that no backward of
        this step produced. Checks once (the first collective), then stands down."""
        objects = self._objects
        if objects is None or not self.watching:
            return
        import torch

        backward = self._backward or torch._C._current_graph_task_id() != -1  # (inside a backward: its own)
        self.disarm()
        if backward:
            return
        stale = [name for name, holder, attr in grad_slots(objects) if getattr(holder, attr, None) is not None]
        if stale:
            shown = ", ".join(stale[:8]) + (f" and {len(stale) - 8} more" if len(stale) > 8 else "")
            raise RecoveryError(
                f"the step redone after a recovery holds gradients it did not produce, at its first collective: "
                f"{shown}. Backward would add to them and every replica would train on the same wrong step. "
                "Something kept the interrupted step's gradients after the trainer dropped them (the loop, "
                "or state of the step that gossiprec does not reset): clear them when a step starts again")

    def disarm(self) -> None:
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._objects, self.watching = None, False
