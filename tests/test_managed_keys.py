"""Managed groups build their epoch backends like the trainer's own groups: gloo bound to the given
address (the agent's), every store value sealed with the cluster's keys; a process with other keys
cannot take part."""

from __future__ import annotations

import os
import threading
from typing import Any, Callable

import pytest
import torch

from gossiprec.errors import SecurityError
from gossiprec.trainer.keys import TransferKeys, open_value

EVENT_TIMEOUT = 60.0


def _in_threads(*fns: Callable[[], Any]) -> list[BaseException | None]:
    out: list[BaseException | None] = [None] * len(fns)

    def run(i: int, fn: Callable[[], Any]) -> None:
        try:
            fn()
        except BaseException as exc:  # reported to the test
            out[i] = exc

    threads = [threading.Thread(target=run, args=(i, fn), daemon=True) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(EVENT_TIMEOUT)
    assert not any(t.is_alive() for t in threads), "a configure or collective did not return"
    return out


def test_managed_groups_bind_the_given_address_and_seal_every_store_value() -> None:
    import torch.distributed as dist

    from gossiprec.trainer.collectives.managed import KEY_PREFIX, ManagedGroup

    keys = TransferKeys.fixed(os.urandom(32))
    store = dist.HashStore()
    a = ManagedGroup.standalone("user", host="127.0.0.1", keys=keys)
    b = ManagedGroup.standalone("user", host="127.0.0.1", keys=keys)
    assert _in_threads(lambda: a.configure(0, store, rank=0, size=2),
                       lambda: b.configure(0, store, rank=1, size=2)) == [None, None]
    ta, tb = torch.ones(2), torch.full((2,), 2.0)
    assert _in_threads(lambda: a.allreduce([ta]).wait(), lambda: b.allreduce([tb]).wait()) == [None, None]
    assert ta.tolist() == tb.tolist() == [3.0, 3.0]
    # the arrival mark the build writes is sealed under its whole name in the store, the group's
    # prefix included
    name = f"{KEY_PREFIX}{a.key}/gossiprec/e0/arrived/0"
    raw = bytes(store.get(name))
    assert raw != b"1" and open_value(keys, name, raw) == b"1"
    with pytest.raises(SecurityError, match="failed authentication"):
        open_value(keys, "gossiprec/e0/arrived/0", raw)


def test_a_value_copied_from_another_managed_group_of_the_epoch_is_refused() -> None:
    import torch.distributed as dist

    from gossiprec.trainer.collectives.managed import KEY_PREFIX, ManagedGroup

    keys = TransferKeys.fixed(os.urandom(32))
    store = dist.HashStore()
    a0, a1 = (ManagedGroup.standalone("one", host="127.0.0.1", keys=keys) for _ in range(2))
    b = ManagedGroup.standalone("two", host="127.0.0.1", keys=keys)
    assert a0.key == a1.key != b.key
    assert _in_threads(lambda: a0.configure(0, store, rank=0, size=2),
                       lambda: a1.configure(0, store, rank=1, size=2)) == [None, None]
    assert _in_threads(lambda: b.configure(0, store, rank=0, size=1)) == [None]
    # someone with access to the store copies group one's arrival mark of rank 1 under group two's name
    raw = bytes(store.get(f"{KEY_PREFIX}{a0.key}/gossiprec/e0/arrived/1"))
    store.set(f"{KEY_PREFIX}{b.key}/gossiprec/e0/arrived/1", raw)
    seen_by_b = b._epochs.shared_store()  # group two's sealing layer, as its builds read the store
    assert seen_by_b.get("gossiprec/e0/arrived/0") == b"1"  # its own mark
    with pytest.raises(SecurityError, match="failed authentication"):
        seen_by_b.get("gossiprec/e0/arrived/1")


def test_a_managed_group_with_other_keys_cannot_join() -> None:
    import torch.distributed as dist

    from gossiprec.trainer.collectives.groups import CollectiveAborted
    from gossiprec.trainer.collectives.managed import ManagedGroup

    store = dist.HashStore()
    a = ManagedGroup.standalone("user", timeout=5.0, host="127.0.0.1", keys=TransferKeys.fixed(os.urandom(32)))
    b = ManagedGroup.standalone("user", timeout=5.0, host="127.0.0.1", keys=TransferKeys.fixed(os.urandom(32)))
    errors = _in_threads(lambda: a.configure(0, store, rank=0, size=2),
                         lambda: b.configure(0, store, rank=1, size=2))
    assert all(isinstance(e, CollectiveAborted) and "does not hold" in str(e) for e in errors), errors
