"""A rank's training state: capturing it into snapshots, its serialized form, receiving it, and checking replicas.

- :mod:`~.capture`: copy the registered objects' state into a snapshot, now or deferred.
- :mod:`~.copier`: the background thread that finishes a commit's deferred copies.
- :mod:`~.snapshots`: the committed snapshots kept for recovery, and when their copies are made.
- :mod:`~.header`: the serialized form (a msgpack header and raw tensor bytes).
- :mod:`~.receive`: land a donor's bytes in the local tensors and load them.
- :mod:`~.digest`, :mod:`~.checks`: digests of a state, and the comparison of replicas.
- :mod:`~.rng`, :mod:`~.rng_raw`: the process's random generators as one stateful object.
"""
