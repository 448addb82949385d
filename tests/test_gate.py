"""The sharded job's optimizer gate, in pieces (the whole: tests/test_sharded_recovery.py's snapshot-free
job): a rolled-forward step is committed only if every optimizer stepped, and a donor asked for it
waits for its commit."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest

from gossiprec.errors import RecoveryError
from gossiprec.trainer.gate import OptimizerGate


def _gate(optimizers: int) -> OptimizerGate:
    gate = OptimizerGate(SimpleNamespace(), snapshots=None, follower=None,  # type: ignore[arg-type]
                         announce=print, report=print, interrupted=bool, poll=print, recovery_timeout=1.0)
    gate.optimizers = optimizers
    return gate


def test_a_step_rolled_forward_counts_only_once_every_optimizer_stepped() -> None:
    gate = _gate(2)
    assert not gate.rolled(5)  # nothing rolled forward: the usual undo
    gate._rolling = 5
    gate.after_optimizer()
    gate.after_optimizer()
    assert gate.rolled(5) and not gate.rolled(6)
    gate = _gate(2)
    gate._rolling = 5
    gate.after_optimizer()  # raised between the two optimizers' steps: torn, this rank leaves
    with pytest.raises(RecoveryError, match="1 of 2 optimizer steps"):
        gate.rolled(5)
    assert gate._rolling is None  # and a donor thread waiting for it is let go


def test_a_donor_asked_for_the_step_being_rolled_forward_waits_for_its_commit() -> None:
    gate = _gate(1)
    gate._rolling = 5
    served: list[float] = []
    t = threading.Thread(target=lambda: (gate.wait_rolled(5, 30.0), served.append(time.monotonic())))
    t.start()
    time.sleep(0.05)
    assert not served  # still rolling
    committed_at = time.monotonic()
    gate.committed(5)
    t.join(10)
    assert served and served[0] >= committed_at
    start = time.monotonic()
    gate.wait_rolled(4, 30.0)  # any other step: at once
    gate.wait_rolled(5, 30.0)
    assert time.monotonic() - start < 10
