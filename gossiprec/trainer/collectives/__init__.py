"""Process groups an agent can interrupt, and the collectives a training step runs on them.

- :mod:`~.groups`: one process group per membership epoch; interruptible waits.
- :mod:`~.managed`: groups that survive a recovery (torch keeps the objects, the backend changes).
- :mod:`~.sharded`: the device mesh of a sharded job and what follows from it.
- :mod:`~.buckets`: gradient buckets all-reduced while backward runs, in a fixed order.
"""
