"""Capture / restore of the complete training state: bit-exact, no pickle, clear refusals."""

from __future__ import annotations

import random
import threading
from typing import Any

import msgpack
import pytest
import torch

try:  # numpy is optional for gossiprec; RNGState covers it only when importable
    import numpy as np
except ImportError:  # pragma: no cover - depends on the environment
    np = None

from gossiprec.errors import ConfigError, DecodeError, TransferError
from gossiprec.trainer.state import rng as rng_mod
from gossiprec.trainer.state.capture import capture_deferred, capture_state
from gossiprec.trainer.config import TrainerConfig
from gossiprec.trainer.state.header import StateHeader, pack_header, tensor_bytes, unpack_header
from gossiprec.trainer.objects import training_state
from gossiprec.trainer.state.receive import (
    ChecksumMismatch, LayoutMismatch, ReceiveTarget, materialize_optimizer_state, restore_state,
)
from gossiprec.trainer.state.rng import RNGState


class DataPosition:
    """A data-loader position: plain Python state."""

    def __init__(self) -> None:
        self.epoch = 0
        self.index = 0
        self.order: list[int] = []

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "order": list(self.order)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.epoch, self.index, self.order = sd["epoch"], sd["index"], list(sd["order"])


Objects = tuple[torch.nn.Module, torch.optim.Optimizer, Any, "DataPosition"]


def build(hidden: int = 16, seed: int = 0) -> Objects:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, hidden), torch.nn.BatchNorm1d(hidden), torch.nn.ReLU(),
                                torch.nn.Dropout(0.3), torch.nn.Linear(hidden, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    sched = torch.optim.lr_scheduler.SequentialLR(
        opt, [torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.5, total_iters=2),
              torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)], milestones=[2])
    return model, opt, sched, DataPosition()


def train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, data: DataPosition) -> None:
    x = torch.randn(6, 8)  # consumes the torch RNG, as does dropout
    loss = model(x).pow(2).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    sched.step()
    data.index += 6
    data.order.append(random.randrange(1000))  # consumes the python RNG
    if np is not None:
        np.random.rand()  # and numpy's


def all_tensors(sd: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    if isinstance(sd, torch.Tensor):
        out[prefix] = sd
    elif isinstance(sd, dict):
        for k, v in sd.items():
            out.update(all_tensors(v, f"{prefix}/{k}"))
    elif isinstance(sd, (list, tuple)):
        for i, v in enumerate(sd):
            out.update(all_tensors(v, f"{prefix}/{i}"))
    return out


def test_round_trip_is_bit_exact_and_training_continues_identically() -> None:
    model, opt, sched, data = build()
    for _ in range(3):
        train_step(model, opt, sched, data)
    donor = training_state(model, opt, sched, data)
    snap = capture_state(donor, step=3)
    wire = pack_header(snap.header)
    payload = snap.payload()
    assert snap.header.total_nbytes == len(payload)

    # the donor trains on: the step it takes from here is the reference
    train_step(model, opt, sched, data)
    expected_next = {k: v.clone() for k, v in model.state_dict().items()}
    expected_sched = sched.state_dict()

    # a hot spare: same code, different initial weights, optimizer state materialised
    model2, opt2, sched2, data2 = build(seed=1)
    materialize_optimizer_state(opt2)
    spare = training_state(model2, opt2, sched2, data2)
    restore_state(spare, (wire, payload))  # resets every RNG to the donor's captured state

    got = all_tensors({"m": model2.state_dict(), "o": opt2.state_dict()["state"]})
    want_snap = {s.name: t for s, t in zip(snap.header.tensors, snap.tensors)}
    for name, t in all_tensors({"m": model2.state_dict()}).items():
        assert torch.equal(t, want_snap["model" + name[2:]]), name
    for pid, st in opt2.state_dict()["state"].items():
        for k, t in st.items():
            assert torch.equal(t, want_snap[f"optimizer/state/{pid}/{k}"]), (pid, k)
    assert got  # compared something
    groups = opt2.state_dict()["param_groups"]
    assert isinstance(groups[0]["betas"], tuple)
    assert data2.state_dict() == {"epoch": 0, "index": 18, "order": data.order[:3]}

    train_step(model2, opt2, sched2, data2)
    for k, v in model2.state_dict().items():
        assert torch.equal(v, expected_next[k]), f"{k} diverged after restore"
    assert sched2.state_dict() == expected_sched
    assert data2.order == data.order


def test_rng_state_continues_the_same_streams() -> None:
    def reseed(seed: int) -> None:
        torch.manual_seed(seed)
        random.seed(seed)
        if np is not None:
            np.random.seed(seed)

    def draw() -> tuple[Any, ...]:
        return (torch.rand(4), random.random(), random.gauss(0, 1),
                np.random.rand(3).tolist() if np is not None else None)

    reseed(5)
    random.gauss(0, 1)  # leaves a cached gaussian in the python state
    snap = capture_state({"rng": RNGState()}, step=0)
    a = draw()
    reseed(99)
    restore_state({"rng": RNGState()}, snap)
    b = draw()
    assert torch.equal(a[0], b[0]) and a[1:] == b[1:]
    py = snap.header.trees["rng"]["python"]
    assert isinstance(py, list) and isinstance(py[1], bytes) and len(py[1]) == 625 * 4  # one value, not 625
    assert ("numpy" in snap.header.trees["rng"]) == (np is not None)
    if np is not None:
        assert isinstance(snap.header.trees["rng"]["numpy"]["keys"], bytes)


def _rng_dict_via_public_api() -> dict[str, Any]:
    return RNGState(raw=False).state_dict()  # getstate() / get_state() only: the readers switched off


def _same_rng_dict(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)


def test_raw_rng_readers_read_what_the_public_apis_return() -> None:
    readers = rng_mod.raw_readers()
    assert readers[0] is not None, "CPython on x86-64/arm64: the python reader must pass its probe"
    if np is not None:
        assert readers[1] is not None, "numpy's legacy MT19937 layout: the numpy reader must pass its probe"
    random.seed(11)
    if np is not None:
        np.random.seed(11)
    gauss_cached = {"python": 0, "numpy": 0}
    for i in range(40):  # draws that leave a cached Gaussian (odd counts) and take it (even ones)
        torch.rand(1)
        if i % 3:
            random.gauss(0, 1)
        else:
            random.random()
        if np is not None:
            np.random.standard_normal(i % 3 + 1)
        fast = RNGState().state_dict()
        assert _same_rng_dict(fast, _rng_dict_via_public_api()), f"draw {i}"
        gauss_cached["python"] += fast["python"][2] is not None
        if np is not None:
            gauss_cached["numpy"] += fast["numpy"]["has_gauss"]
    assert 0 < gauss_cached["python"] < 40
    if np is not None:
        assert 0 < gauss_cached["numpy"] < 40


def test_rng_state_without_raw_readers_uses_only_the_public_apis(monkeypatch: pytest.MonkeyPatch) -> None:
    from gossiprec.trainer.state import rng_raw

    random.seed(12)
    random.gauss(0, 1)
    expected = RNGState().state_dict()

    def refuse(*_: Any) -> Any:
        raise AssertionError("RNGState(raw=False) must not probe or use the struct readers")

    monkeypatch.setattr(rng_raw, "readers", refuse)
    assert _same_rng_dict(RNGState(raw=False).state_dict(), expected)
    with pytest.raises(AssertionError, match="must not probe"):
        RNGState().state_dict()


def test_raw_rng_readers_step_aside_when_the_global_generators_are_replaced(monkeypatch: pytest.MonkeyPatch) -> None:
    python_reader, numpy_reader = rng_mod.raw_readers()
    assert python_reader is not None
    monkeypatch.setattr(random, "_inst", random.Random(5))
    assert python_reader.read() is None  # not the probed generator: the caller uses getstate()
    if np is not None:
        assert numpy_reader is not None
        monkeypatch.setattr(np.random.mtrand, "_rand", np.random.RandomState(5))
        assert numpy_reader.read() is None
    monkeypatch.undo()
    assert python_reader.read() is not None
    assert _same_rng_dict(RNGState().state_dict(), _rng_dict_via_public_api())


def test_rng_state_loads_the_older_list_form() -> None:
    random.seed(3)
    version, internal, gauss = random.getstate()
    expected = random.random()
    random.seed(4)
    sd = RNGState(numpy=False).state_dict()
    sd["python"] = [version, list(internal), gauss]  # what snapshots held before the bytes form
    RNGState(numpy=False).load_state_dict(sd)
    assert random.random() == expected
    sd["python"] = [version, b"\x00" * 7, gauss]
    with pytest.raises(TransferError, match="RNG state does not fit"):
        RNGState(numpy=False).load_state_dict(sd)


def test_header_is_plain_msgpack_and_round_trips() -> None:
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    snap = capture_state(training_state(model, opt, sched, data), step=1)
    obj = msgpack.unpackb(pack_header(snap.header), raw=False, strict_map_key=False)
    assert obj["step"] == 1 and obj["total"] == snap.header.total_nbytes
    assert [row[0] for row in obj["tensors"]][:2] == ["model/0.weight", "model/0.bias"]
    assert unpack_header(pack_header(snap.header)) == snap.header
    # offsets are dense, crc32s present
    pos = 0
    for spec in snap.header.tensors:
        assert spec.offset == pos and spec.crc32 is not None
        pos += spec.nbytes


def test_module_metadata_is_reused_only_while_it_is_unchanged() -> None:
    from gossiprec.trainer.state.header import _META_CACHE, decode_tree

    model, opt, sched, data = build()
    objects = training_state(model, opt, sched, data)

    def versions() -> dict[str, int]:
        snap = capture_state(objects, step=1, checksum=False)
        sd = decode_tree(snap.header.trees["model"], snap.tensors)
        return {k: v["version"] for k, v in sd._metadata.items()}

    first = versions()
    assert first == {k: v["version"] for k, v in model.state_dict()._metadata.items()}
    assert ("model",) in _META_CACHE and versions() == first  # the cached encoding, same metadata
    model[1]._version = 7  # a module whose state layout version changed: the cache must not hide it
    assert versions() == {**first, "1": 7}
    del model[1]._version
    assert versions() == first


@pytest.mark.parametrize("mutate, reason", [
    (lambda w: w.update(v=9), "version"),
    (lambda w: w["tensors"][0].__setitem__(1, "notadtype"), "dtype"),
    (lambda w: w["tensors"][1].__setitem__(3, 1), "densely"),
    (lambda w: w["tensors"][0].__setitem__(4, 3), "bytes for shape"),
    (lambda w: w.update(total=1), "add up"),
    (lambda w: (w["tensors"].pop(), w.update(total=sum(r[4] for r in w["tensors"]))), "references"),
    (lambda w: w.update(checksum="md5"), "checksum"),
])
def test_malformed_headers_are_refused(mutate: Any, reason: str) -> None:
    model, opt, sched, data = build()
    snap = capture_state(training_state(model, opt, sched, data, rng=False), step=0)
    wire = snap.header.to_wire()
    mutate(wire)
    with pytest.raises(DecodeError, match=reason):
        StateHeader.from_wire(msgpack.unpackb(msgpack.packb(wire, use_bin_type=True), raw=False,
                                              strict_map_key=False))
    with pytest.raises(DecodeError):
        unpack_header(b"\xc1not msgpack")


def test_layout_mismatch_names_the_tensors() -> None:
    model, opt, sched, data = build(hidden=16)
    train_step(model, opt, sched, data)
    snap = capture_state(training_state(model, opt, sched, data, rng=False), step=1)
    other = build(hidden=32)
    materialize_optimizer_state(other[1])
    with pytest.raises(LayoutMismatch,
                       match=r"model/0.weight: donor float32\[16, 8\], local float32\[32, 8\]"):
        ReceiveTarget(training_state(*other, rng=False)).bind(snap.header)
    # the model is not optimizer state: a missing parameter is a mismatch, not something to allocate
    other_model = torch.nn.Sequential(torch.nn.Linear(8, 16))
    other_opt = torch.optim.AdamW(other_model.parameters())
    with pytest.raises(LayoutMismatch, match=r"donor tensor model/1.weight .* has no local counterpart"):
        ReceiveTarget({"model": other_model, "optimizer": other_opt, "scheduler": other[2],
                       "data": other[3]}).bind(snap.header)


def test_optimizer_state_is_received_whether_or_not_the_receiver_allocated_it() -> None:
    # torch creates optimizer state at the first step: a receiver may have none while the donor has
    # some (a spare that never stepped), or have some the donor lacks (a donor still at step 0)
    model, opt, sched, data = build(hidden=16)
    initial = capture_state(training_state(model, opt, sched, data, rng=False), step=0, checksum=False)
    train_step(model, opt, sched, data)
    stepped = capture_state(training_state(model, opt, sched, data, rng=False), step=1, checksum=False)
    bare = build(hidden=16)
    assert not bare[1].state
    restore_state(training_state(*bare, rng=False), stepped)
    got = capture_state(training_state(*bare, rng=False), step=1, checksum=False)
    assert pack_header(got.header) == pack_header(stepped.header) and got.payload() == stepped.payload()
    assert bare[1].state_dict()["state"][0]["step"] == 1
    restore_state(training_state(*bare, rng=False), initial)  # back to step 0: the state goes away
    assert not bare[1].state


def test_corrupted_payload_fails_crc() -> None:
    model, opt, sched, data = build()
    snap = capture_state(training_state(model, opt, sched, data, rng=False), step=0)
    payload = bytearray(snap.payload())
    spec = snap.header.tensors[2]
    payload[spec.offset + 1] ^= 0x40
    spare = build(seed=3)
    with pytest.raises(ChecksumMismatch, match=spec.name):
        restore_state(training_state(*spare, rng=False), (pack_header(snap.header), bytes(payload)))
    with pytest.raises(TransferError, match="payload is"):
        restore_state(training_state(*spare, rng=False), (pack_header(snap.header), bytes(payload[:-1])))


def test_copy_false_aliases_and_copy_true_does_not() -> None:
    w = torch.arange(6, dtype=torch.float32)

    class Holder:
        def state_dict(self) -> dict[str, Any]:
            return {"w": w, "t": (1, 2.5), "none": None, "b": b"\x00\x01"}

        def load_state_dict(self, sd: dict[str, Any]) -> None:
            self.loaded = sd

    aliased = capture_state({"h": Holder()}, step=0, copy=False)
    copied = capture_state({"h": Holder()}, step=0, copy=True, checksum=False)
    w.add_(1)
    assert torch.equal(aliased.tensors[0], w) and not torch.equal(copied.tensors[0], w)
    assert copied.header.checksum == "none" and copied.header.tensors[0].crc32 is None
    h = Holder()
    restore_state({"h": h}, copied)
    assert h.loaded["t"] == (1, 2.5) and h.loaded["none"] is None and h.loaded["b"] == b"\x00\x01"


def test_unsupported_leaf_is_refused_with_its_path() -> None:
    class Bad:
        def state_dict(self) -> dict[str, Any]:
            return {"ok": 1, "nested": {"fn": object()}}

        def load_state_dict(self, sd: dict[str, Any]) -> None: ...

    with pytest.raises(ConfigError, match="bad/nested/fn is a object"):
        capture_state({"bad": Bad()}, step=0)
    with pytest.raises(ConfigError, match="name"):
        capture_state({"a/b": Bad()}, step=0)


def test_materialize_optimizer_state_leaves_params_and_grads_alone() -> None:
    for make in (lambda p: torch.optim.AdamW(p, lr=0.1, weight_decay=0.5),
                 lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=0.1)):
        model = build()[0]
        opt = make(model.parameters())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        materialize_optimizer_state(opt)
        assert all(opt.state[p] for p in model.parameters())
        assert all(p.grad is None for p in model.parameters())
        assert opt.param_groups[0]["lr"] == 0.1
        for k, v in model.state_dict().items():
            assert torch.equal(v, before[k]), k
        snapshot = {k: v.clone() for k, v in all_tensors(opt.state_dict()["state"]).items()}
        materialize_optimizer_state(opt)  # idempotent: state already there
        for k, v in all_tensors(opt.state_dict()["state"]).items():
            assert torch.equal(v, snapshot[k]), k


def test_tensor_bytes_is_zero_copy_for_any_dtype() -> None:
    t = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    view = tensor_bytes(t)
    assert view.nbytes == 4 and view.format == "B"
    view[0:2] = bytes(tensor_bytes(torch.tensor([3.0], dtype=torch.bfloat16)))
    assert t[0].item() == 3.0
    assert tensor_bytes(torch.tensor(7, dtype=torch.int64)).nbytes == 8
    with pytest.raises(ConfigError):
        tensor_bytes(torch.zeros(4, 4).t())


def test_capture_can_reuse_an_older_snapshots_memory() -> None:
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    objects = training_state(model, opt, sched, data, rng=False)
    first = capture_state(objects, step=1)
    train_step(model, opt, sched, data)
    second = capture_state(objects, step=2, reuse=first)
    assert [t.data_ptr() for t in second.tensors] == [t.data_ptr() for t in first.tensors]
    fresh = capture_state(objects, step=2)
    assert second.header == fresh.header  # same bytes, so same crc32s
    assert all(torch.equal(a, b) for a, b in zip(second.tensors, fresh.tensors, strict=True))


def _late_ptrs(model: torch.nn.Module, opt: torch.optim.Optimizer) -> set[int]:
    ptrs = {p.data_ptr() for p in model.parameters()}
    for st in opt.state.values():
        ptrs.update(v.data_ptr() for v in st.values() if isinstance(v, torch.Tensor))
    return ptrs


def test_deferred_capture_equals_a_full_copy_once_run() -> None:
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    objects = training_state(model, opt, sched, data)
    reference = capture_state(objects, step=1, checksum=False)
    snap, deferred = capture_deferred(objects, step=1, defer=_late_ptrs(model, opt))
    # parameters and optimizer moments wait; BatchNorm's running stats (changed by a forward pass) do not
    assert deferred.pairs and all(not n.startswith("model/1.running") for n in deferred.names)
    assert any(n.startswith("optimizer/state/") for n in deferred.names)
    assert deferred.nbytes < snap.header.total_nbytes
    model(torch.randn(6, 8)).sum().backward()  # the next step's forward/backward: sources unchanged
    deferred.run()
    assert deferred.modified() == []
    assert snap.header == reference.header
    assert snap.payload() == reference.payload()


def test_deferred_capture_reports_sources_changed_before_the_copy() -> None:
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    objects = training_state(model, opt, sched, data)
    snap, deferred = capture_deferred(objects, step=1, defer=_late_ptrs(model, opt))
    train_step(model, opt, sched, data)  # the optimizer ran before the copy: the snapshot would be torn
    changed = deferred.modified()
    assert "model/0.weight" in changed and any(n.endswith("exp_avg") for n in changed)
    with pytest.raises(ConfigError, match="checksum"):
        capture_deferred(objects, step=2, checksum=True, defer=_late_ptrs(model, opt))


class _StubControl:
    """The few ControlClient calls a trainer makes while committing (no agent needed)."""

    path = "/nonexistent"
    node = "n0"

    def __init__(self) -> None:
        self.states: list[int] = []
        self.reports: list[tuple[int, str]] = []

    def set_state(self, step: int, *_: Any, wait: bool = False) -> None:
        self.states.append(step)

    def report(self, step: int, phase: str, *_: Any, wait: bool = False) -> None:
        self.reports.append((step, phase))


def test_a_spare_starting_after_its_promotion_takes_the_current_plan() -> None:
    """A spare whose trainer comes up after the view that gave it a rank (slow start, loaded machine)
    must apply that view's plan, not wait for a newer one while the survivors wait for it."""
    from gossiprec.harness.ports import free_ports
    from gossiprec.trainer.loop import ResilientTrainer

    port = free_ports(1, width=3)[0]
    view = {"epoch": 1, "config_id": "c1", "replica_groups": [[0, 1]], "stopped": "", "group_epoch": 1,
            "members": [{"node": "n0", "role": "trainer", "rank": 0}, {"node": "n2", "role": "trainer", "rank": 1}]}

    class Control(_StubControl):
        node = "n2"

        def status(self) -> dict[str, Any]:
            return {"view": view, "plan": None}

        def members(self) -> list[dict[str, str]]:
            return [{"name": "n0", "addr": "127.0.0.1:1"}, {"name": "n2", "addr": f"127.0.0.1:{port}"}]

    model, opt, sched, data = build()
    rt = ResilientTrainer(training_state(model, opt, sched, data), TrainerConfig(bind_host="127.0.0.1"),
                          control=Control())  # type: ignore[arg-type]
    waited: list[int] = []
    rt._recover = lambda cause, spare=False: waited.append(rt.epoch)  # type: ignore[method-assign]
    rt._follower.start = lambda: None  # type: ignore[method-assign]
    rt.start()
    assert waited == [0]  # the plan of epoch 1 (> 0) is the one it waits for
    rt.close()


def test_checkpointing_reports_the_checkpoint_phase_around_the_work() -> None:
    from gossiprec.trainer.loop import ResilientTrainer

    model, opt, sched, data = build()
    control = _StubControl()
    phases: list[tuple[int, str]] = []
    rt = ResilientTrainer(training_state(model, opt, sched, data), control=control,  # type: ignore[arg-type]
                          on_phase=lambda step, phase: phases.append((step, phase)))
    rt.install(rt.identity.but(step=7))
    with pytest.raises(OSError):
        with rt.checkpointing():
            assert control.reports == [(7, "checkpoint")]
            raise OSError("disk full")  # the phase ends even when the save fails
    assert control.reports == [(7, "checkpoint"), (7, "idle")]
    assert phases == [(7, "checkpoint")]
    rt.close()


def test_trainer_commits_in_the_background_and_refuses_a_torn_snapshot(monkeypatch: pytest.MonkeyPatch) -> None:
    from gossiprec.errors import RecoveryError
    from gossiprec.trainer.state import snapshots
    from gossiprec.trainer.loop import ResilientTrainer

    monkeypatch.setattr(snapshots, "BACKGROUND_MIN_BYTES", 0)  # this small state would be held, not threaded
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    control = _StubControl()
    rt = ResilientTrainer(training_state(model, opt, sched, data), TrainerConfig(snapshot_copies=2),
                          control=control)  # type: ignore[arg-type]  # two copies: the torn one leaves step 2
    rt._commit_snapshot(1)
    rt.snapshots.update_late(list(model.parameters()))  # what allreduce_gradients does
    train_step(model, opt, sched, data)
    rt._commit_snapshot(2)  # parameters and moments are copied by the background thread
    expected = capture_state(rt.objects, step=2, checksum=False)
    snap = rt.snapshots.at(2)  # waits for the copy
    assert snap is not None and snap.payload() == expected.payload()
    assert control.states == [1, 2]

    train_step(model, opt, sched, data)
    rt._commit_snapshot(3)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # a loop changing a parameter before the next allreduce_gradients
    with pytest.raises(RecoveryError, match="background_snapshot=False"):
        rt.snapshots.settle()
    assert [s.step for s in rt.snapshots.held] == [2] and not rt.snapshots.background
    rt.close()


def test_a_small_state_is_copied_by_the_thread_from_begin_step_or_by_the_first_to_need_it() -> None:
    from gossiprec.errors import RecoveryError
    from gossiprec.trainer.loop import ResilientTrainer
    from gossiprec.trainer.state.snapshots import BACKGROUND_MIN_BYTES

    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    rt = ResilientTrainer(training_state(model, opt, sched, data), TrainerConfig(snapshot_copies=2),
                          control=_StubControl())  # type: ignore[arg-type]  # two copies: the torn one leaves 4
    rt._commit_snapshot(1)
    rt.snapshots.update_late(list(model.parameters()))
    assert rt.snapshots.late  # parameters and moments could be deferred ...
    train_step(model, opt, sched, data)
    rt._commit_snapshot(2)
    assert rt.snapshots.held[-1].header.total_nbytes < BACKGROUND_MIN_BYTES
    # ... and under BACKGROUND_MIN_BYTES commit() holds them: no thread is woken between two steps
    assert rt.snapshots.copier._waits_for == "caller" and rt.snapshots.copier._thread is None
    expected = capture_state(rt.objects, step=2, checksum=False)
    rt.begin_step()  # hands them to the thread, which copies while the step computes
    assert rt.snapshots.copier._thread is not None and rt.snapshots.copier._thread.is_alive()
    snap = rt.snapshots.at(2)
    assert rt.snapshots.copier._waits_for is None
    assert snap is not None and snap.payload() == expected.payload()
    rt.snapshots.settle()

    train_step(model, opt, sched, data)
    rt._commit_snapshot(3)  # a loop without begin_step: the main thread copies once the collective is launched
    assert rt.snapshots.copier._waits_for == "caller"
    expected = capture_state(rt.objects, step=3, checksum=False)
    rt.snapshots.copier.run_held()  # what allreduce() does after issuing the collective
    assert rt.snapshots.copier._waits_for is None and not rt.snapshots.copier._running
    snap = rt.snapshots.at(3)
    assert snap is not None and snap.payload() == expected.payload()
    rt.snapshots.settle()

    train_step(model, opt, sched, data)
    rt._commit_snapshot(4)
    expected = capture_state(rt.objects, step=4, checksum=False)
    got: list[object] = []
    waiter = threading.Thread(target=lambda: got.append(rt.snapshots.at(4)))  # a donor thread asking first
    waiter.start()
    waiter.join()
    assert rt.snapshots.copier._waits_for is None and got[0] is not None and got[0].payload() == expected.payload()  # type: ignore[attr-defined]
    rt.snapshots.settle()

    train_step(model, opt, sched, data)
    rt._commit_snapshot(5)
    with torch.no_grad():
        model[0].weight.add_(1.0)  # against the contract: a parameter changed before the copies were made
    rt.begin_step()
    with pytest.raises(RecoveryError, match="modified in place"):
        rt.snapshots.settle()
    assert [s.step for s in rt.snapshots.held] == [4]  # the torn snapshot is dropped
    rt.close()


class _Job:
    """Stands in for DeferredCopies: records which thread ran it; fails if asked to."""

    def __init__(self, fail: bool = False) -> None:
        self.ran_on: list[str] = []
        self.fail = fail

    def run(self) -> None:
        self.ran_on.append(threading.current_thread().name)
        if self.fail:
            raise OSError("disk on fire")


def test_copier_leaves_submitted_jobs_to_its_thread_and_reports_an_error_once() -> None:
    from gossiprec.errors import RecoveryError
    from gossiprec.trainer.state.copier import Copier

    copier = Copier()
    for _ in range(20):  # a submitted job (large, or from a GPU) is never taken by the all-reduce's run_held
        job = _Job()
        copier.submit(job)  # type: ignore[arg-type]
        copier.run_held()
        assert copier.wait() is job and job.ran_on == ["gossiprec-snapshot"]
    held = _Job()
    copier.hold(held)  # type: ignore[arg-type]
    copier.run_held()  # a held job is: by the caller, now
    assert copier.wait() is held and held.ran_on == [threading.current_thread().name]
    released = _Job()
    copier.hold(released)  # type: ignore[arg-type]
    copier.release()
    copier.run_held()  # whoever comes first, once
    assert copier.wait() is released and len(released.ran_on) == 1
    copier.hold(_Job(fail=True))  # type: ignore[arg-type]
    with pytest.raises(RecoveryError, match="disk on fire"):
        copier.wait()
    assert copier.wait() is None  # reported once: a later settle has nothing pending


def test_restore_skips_only_tensors_unchanged_since_the_capture() -> None:
    model, opt, sched, data = build()
    train_step(model, opt, sched, data)
    objects = training_state(model, opt, sched, data)
    snap = capture_state(objects, step=1, checksum=False)
    late = _late_ptrs(model, opt)
    late_bytes = sum(s.nbytes for s, (ptr, _) in zip(snap.header.tensors, snap.sources) if ptr in late)
    assert 0 < late_bytes < snap.header.total_nbytes
    # nothing changed: only the tensors outside `unchanged` (buffers, RNG) are copied
    assert restore_state(objects, snap, unchanged=late) == snap.header.total_nbytes - late_bytes
    snap = capture_state(objects, step=1, checksum=False)  # load_state_dict moved the parameters' versions
    expected = snap.payload()
    with torch.no_grad():
        model[0].weight.add_(1.0)  # through torch: its version moves, so it must be copied back
    copied = restore_state(objects, snap, unchanged=late)
    assert copied == snap.header.total_nbytes - late_bytes + model[0].weight.numel() * 4
    assert capture_state(objects, step=1, checksum=False).payload() == expected
    # bytes written behind torch's back are invisible to versions: that is why callers pass nothing then
    tensor_bytes(model[0].bias.data)[:4] = b"\xff\xff\xff\xff"
    assert restore_state(objects, snap) == snap.header.total_nbytes
    assert capture_state(objects, step=1, checksum=False).payload() == expected


def test_restores_in_a_row_each_end_at_their_own_snapshot() -> None:
    # a survivor that applies two plans in one recovery (targets s - 1, then s) restores twice; the
    # first restore writes through memoryviews, which must count as a change for the second
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    objects: dict[str, Any] = {"model": model, "optimizer": opt}

    def step() -> None:
        opt.zero_grad()
        model(torch.randn(4, 8)).sum().backward()
        opt.step()

    for _ in range(24):
        step()
    s24 = capture_state(objects, step=24, checksum=False)
    step()
    s25 = capture_state(objects, step=25, checksum=False)
    live = frozenset(_late_ptrs(model, opt))
    for snap in (s24, s25, s24, s24, s25):
        restore_state(objects, snap, unchanged=live)
        assert capture_state(objects, step=snap.step, checksum=False).payload() == snap.payload()
        assert opt.state_dict()["state"][0]["step"] == snap.step


def test_late_tensor_set_is_rebuilt_only_when_its_key_moves() -> None:
    from gossiprec.trainer.loop import ResilientTrainer

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters())
    rt = ResilientTrainer(training_state(model, opt, rng=False), TrainerConfig(stateless_data=True),
                          control=_StubControl())  # type: ignore[arg-type]
    params = list(model.parameters())
    rt.snapshots.update_late(params)
    first = rt.snapshots.late
    assert first == {p.data_ptr() for p in params}  # no optimizer state yet
    rt.snapshots.update_late(params)
    assert rt.snapshots.late is first  # same key: not rebuilt on the training step's path
    model(torch.randn(3, 4)).sum().backward()
    opt.step()  # creates the moments: the key moves
    rt.snapshots.update_late(params)
    moments = {v.data_ptr() for st in opt.state.values() for v in st.values()}
    assert rt.snapshots.late == first | moments and rt.snapshots.late is not first
    rt.snapshots.late = frozenset()  # what a recovery does
    rt.snapshots.update_late(params)
    assert rt.snapshots.late == first | moments
    rt.close()


def test_written_tensors_are_marked_one_by_one_where_torch_takes_no_list(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.autograd.graph as graph

    from gossiprec.trainer.state.receive import mark_written

    real = graph.increment_version

    def one_at_a_time(t: Any) -> None:  # torch 2.4's increment_version
        if isinstance(t, list):
            raise TypeError("increment_version(): argument 'tensor' must be Tensor, not list")
        real(t)

    monkeypatch.setattr(graph, "increment_version", one_at_a_time)
    ts = [torch.zeros(3), torch.zeros(2)]
    mark_written(ts)
    assert [t._version for t in ts] == [1, 1]
