"""Gradient buckets: all-reduce gradients while backward still produces them, in a fixed order.

What it decides: which parameters share a bucket, when a bucket's all-reduce is issued, and how the
reduced gradients come back; from the parameter list (order, sizes, dtypes, devices) alone.

Buckets are filled in *reverse* parameter order, as torch DDP does: backward produces the last layers'
gradients first. A ``post_accumulate_grad`` hook counts each parameter's gradient; once every
parameter of a bucket has one, its gradients are copied into the bucket's flat buffer, but the bucket's
all-reduce is issued only when every bucket before it has been issued (bucket ``i`` after ``0..i-1``),
so every rank issues the same collectives in the same order whatever the order gradients arrived in.
:meth:`GradientBuckets.finish` (from ``allreduce_gradients``) issues the buckets backward did not
complete (a parameter that got no gradient counts as zero), waits for each (interruptibly: the wait
raises :class:`~gossiprec.trainer.collectives.groups.CollectiveAborted` when the agent aborts the group) and copies
the averages back into ``.grad``. A hook never raises into backward: a collective that cannot be
issued (the group was aborted) is remembered and raised by ``finish``.

**Deterministic.** The result of each element depends only on which bucket holds it and on the
reduction of that bucket: membership is a function of the parameter list, the issue order is the
bucket index, and the reduction is ``exact`` (each rank's gradients in its own row, rows added in rank
order: :func:`rank_ordered_mean`, bit-identical to the flat path) or the
backend's average, whose order for a given buffer size and world size does not change between runs.
Nothing depends on timing, so a run with failures reduces exactly as the failure-free run does.

After a failed step the buffers are dropped, not reused: an aborted collective may still write into
its buffer later (:mod:`gossiprec.trainer.collectives.groups`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Iterable

from gossiprec.errors import ConfigError
from gossiprec.trainer.collectives.groups import CollectiveAborted

if TYPE_CHECKING:
    import torch

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
"""torch DDP's default bucket size (``bucket_cap_mb=25``)."""

Issue = Callable[["torch.Tensor", str], Any]
"""Issue an asynchronous all-reduce of a tensor (op "sum" or "avg"); returns its pending work, or None
when it was not issued (a view change is known)."""


def rank_ordered_mean(rows: list[torch.Tensor]) -> torch.Tensor:
    """``(((rows[0] + rows[1]) + rows[2]) + ...) / len(rows)``: the reduction of ``exact`` gradients,
    reproducible in one process (e.g. a failure-free reference run)."""
    total = rows[0].clone()
    for r in rows[1:]:
        total.add_(r)
    return total.div_(len(rows))


def allreduce_flat(plist: list[torch.Tensor], allreduce: Callable[[torch.Tensor, str], bool], rank: int,
                   world_size: int, *, exact: bool) -> bool:
    """Average the gradients of ``plist`` with one flat all-reduce (``allreduce(tensor, op)``; False when
    it was interrupted, and then nothing is written back). A parameter without a gradient counts as
    zero; ``exact``: each rank's gradients in their own row, added in rank order
    (:func:`rank_ordered_mean`)."""
    import torch

    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in plist]
    flat = torch.cat([g.reshape(-1) for g in grads])  # a fresh buffer: an aborted one may be written later
    if exact:
        rows = flat.new_zeros((world_size, flat.numel()))
        rows[rank] = flat
        if not allreduce(rows, "sum"):
            return False
        flat = rank_ordered_mean(list(rows.unbind(0)))
    elif not allreduce(flat, "avg"):
        return False
    offset = 0
    for p, g in zip(plist, grads, strict=True):
        n = g.numel()
        chunk = flat[offset:offset + n].view_as(g)
        if p.grad is None:
            p.grad = chunk.clone()
        else:
            p.grad.copy_(chunk)
        offset += n
    return True


class GradientBuckets:
    """The buckets of ``params`` (trainable parameters, in the model's order) and their hooks.

    ``issue(tensor, op)`` starts an all-reduce (see :data:`Issue`); ``rank_world()`` gives this rank and
    the world size at issue time (``exact`` rows); ``on_issue()`` is called before the first bucket of
    a step is issued. Call :meth:`finish` once per step after backward, :meth:`reset` when a step is
    abandoned, :meth:`remove` to unhook.
    """

    def __init__(self, params: Iterable[torch.Tensor], *, issue: Issue, rank_world: Callable[[], tuple[int, int]],
                 exact: bool = False, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                 on_issue: Callable[[], None] = lambda: None) -> None:
        if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes <= 0:
            raise ConfigError(f"bucket_bytes must be an int > 0, got {bucket_bytes!r}")
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ConfigError("no trainable parameter to all-reduce gradients of")
        self.exact = exact
        self._issue_fn, self._rank_world, self._on_issue = issue, rank_world, on_issue
        self.buckets: list[list[int]] = []
        """Parameter indices of each bucket, in issue order (the last parameters first)."""
        size = 0
        for i in reversed(range(len(self.params))):
            p = self.params[i]
            last = self.params[self.buckets[-1][-1]] if self.buckets else None
            if (last is None or size + p.nbytes > bucket_bytes and self.buckets[-1]
                    or (last.dtype, last.device) != (p.dtype, p.device)):
                self.buckets.append([])
                size = 0
            self.buckets[-1].append(i)
            size += p.nbytes
        self._bucket_of = {}
        for b, members in enumerate(self.buckets):
            for i in members:
                self._bucket_of[i] = b
        self._buffers: list[torch.Tensor | None] = [None] * len(self.buckets)
        self._handles = [p.register_post_accumulate_grad_hook(self._hook_for(i)) for i, p in enumerate(self.params)]
        self.reset()

    # ------------------------------------------------------------------ per step
    def reset(self, drop_buffers: bool = False) -> None:
        """Forget this step's gradients and collectives (``drop_buffers``: after a failed collective,
        which may still write into its buffer)."""
        self._seen: set[int] = set()
        self._count = [0] * len(self.buckets)
        self._next = 0
        self._pending: list[tuple[Any, torch.Tensor]] = []
        self._failed: CollectiveAborted | None = None
        self._stopped = False
        self._twice = False
        if drop_buffers:
            self._buffers = [None] * len(self.buckets)

    def _hook_for(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(_p: torch.Tensor) -> None:
            if i in self._seen:
                self._twice = True  # a second backward in one step: its gradients would be missed
                return
            self._seen.add(i)
            b = self._bucket_of[i]
            self._count[b] += 1
            while self._next < len(self.buckets) and self._count[self._next] == len(self.buckets[self._next]):
                self._start(self._next)
                self._next += 1
        return hook

    def _buffer(self, b: int, world: int) -> torch.Tensor:
        import torch

        n = sum(self.params[i].numel() for i in self.buckets[b])
        buf = self._buffers[b]
        shape = (world, n) if self.exact else (n,)
        if buf is None or tuple(buf.shape) != shape:
            p = self.params[self.buckets[b][0]]
            buf = self._buffers[b] = torch.zeros(shape, dtype=p.dtype, device=p.device)
        elif self.exact:
            buf.zero_()  # the other ranks' rows of the last step's sum
        return buf

    def _start(self, b: int) -> None:
        """Copy bucket ``b``'s gradients into its buffer and issue its all-reduce (never raises)."""
        import torch

        if self._failed is not None or self._stopped:
            return
        rank, world = self._rank_world()
        buf = self._buffer(b, world)
        flat = buf[rank] if self.exact else buf
        members = [self.params[i] for i in self.buckets[b]]
        views, grads, offset = [], [], 0
        for p in members:
            n = p.numel()
            if p.grad is None:
                flat[offset:offset + n].zero_()
            else:
                views.append(flat[offset:offset + n].view_as(p.grad))
                grads.append(p.grad)
            offset += n
        with torch.no_grad():
            if views:
                torch._foreach_copy_(views, grads)
        if b == 0:
            self._on_issue()
        try:
            pending = self._issue_fn(buf, "sum" if self.exact else "avg")
        except CollectiveAborted as exc:
            self._failed = exc
            return
        if pending is None:
            self._stopped = True  # a view change is known: finish() recovers
            return
        self._pending.append((pending, buf))

    def finish(self, params: list[torch.Tensor], wait: Callable[[Any], None]) -> bool:
        """Issue what backward left, wait for every bucket (``wait(pending)`` raises CollectiveAborted when
        interrupted) and write the averaged gradients into ``.grad``. False: a view change stopped the
        issue (nothing written). The step's state is reset either way."""
        import torch

        try:
            if self._twice:
                raise ConfigError(
                    "a gradient arrived twice in one step (gradient accumulation over several backward passes?): "
                    "with overlapped buckets each backward pass starts the all-reduce; accumulate without "
                    "overlap_gradients(), or call backward once per step")
            if [id(p) for p in params] != [id(p) for p in self.params]:
                raise ConfigError("allreduce_gradients() got other parameters than overlap_gradients() hooked")
            while self._next < len(self.buckets):
                self._start(self._next)
                self._next += 1
            if self._failed is not None:
                raise self._failed
            if self._stopped:  # the redone step's backward must find a fresh step, not this one's gradients
                self.reset(drop_buffers=bool(self._pending))
                return False
            rank, world = self._rank_world()
            for b, (pending, buf) in enumerate(self._pending):
                wait(pending)
                flat = rank_ordered_mean(list(buf.unbind(0))) if self.exact else buf
                offset = 0
                for i in self.buckets[b]:
                    p = self.params[i]
                    n = p.numel()
                    chunk = flat[offset:offset + n].view_as(p)
                    if p.grad is None:
                        p.grad = chunk.clone()
                    else:
                        with torch.no_grad():
                            p.grad.copy_(chunk)
                    offset += n
            self.reset()
            return True
        except CollectiveAborted:
            self.reset(drop_buffers=True)
            raise
        except BaseException:
            self.reset(drop_buffers=bool(self._pending))
            raise

    def remove(self) -> None:
        """Unhook the parameters."""
        for h in self._handles:
            h.remove()
        self._handles = []
