"""The public trainer API as documented: every name of ``gossiprec.trainer.__all__`` with the signature
docs/training-loop.md lists for it (a changed signature needs its docs, and an upgrade note there), and
``materialize_optimizer_state`` on a rank that trains warns once, as the docs say."""

from __future__ import annotations

import inspect
import re
import warnings
from pathlib import Path
from typing import Any

import pytest

import gossiprec.trainer as api
from gossiprec.trainer.state import receive

DOC = Path(__file__).resolve().parent.parent / "docs" / "training-loop.md"


class _Raw:
    """An annotation string shown as written (``from __future__ import annotations`` keeps them as text)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


def _line(name: str) -> str:
    obj = getattr(api, name)
    if not callable(obj):
        return f"{name} = {obj!r}"
    if getattr(obj, "_is_protocol", False):
        return f"{name}: protocol"
    if isinstance(obj, type) and issubclass(obj, BaseException) and "__init__" not in vars(obj):
        return f"{name}: exception"
    sig = inspect.signature(obj)
    params = [p.replace(annotation=_Raw(p.annotation)) if isinstance(p.annotation, str) else p
              for p in sig.parameters.values()]
    ret = sig.return_annotation
    return f"{name}{sig.replace(parameters=params, return_annotation=_Raw(ret) if isinstance(ret, str) else ret)}"


def _documented() -> list[str]:
    text = DOC.read_text()
    section = text.split("## The `gossiprec.trainer` API", 1)[1]
    block = re.search(r"```text\n(.*?)```", section, re.S)
    assert block is not None, "the API section has no signature block"
    return block.group(1).splitlines()


def test_every_exported_name_has_its_documented_signature() -> None:
    assert _documented() == [_line(n) for n in api.__all__]


def test_the_transfer_key_change_has_an_upgrade_note() -> None:
    notes = DOC.read_text().split("### Upgrade notes", 1)[1]
    params = inspect.signature(api.transfer_key).parameters
    assert list(params) == ["keyring", "cluster"] and params["cluster"].default == "gossiprec"
    assert "transfer_key(cluster=None)" in notes and 'transfer_key(keyring, cluster="gossiprec")' in notes


def _trainer(role: str, rank: int) -> Any:
    torch = pytest.importorskip("torch")
    from gossiprec.trainer import ResilientTrainer, TrainerConfig, training_state
    from tests.test_snapshot_modes import _Control

    model = torch.nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = ResilientTrainer(training_state(model, opt), TrainerConfig(stateless_data=True), control=_Control(),  # type: ignore[arg-type]
                          key=bytes(32))
    rt.install(rt.identity.but(role=role, rank=rank))
    return rt, opt


def test_materialize_on_a_training_rank_warns_once_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receive, "_warned", False)
    rt, opt = _trainer("trainer", 0)
    with pytest.warns(UserWarning, match="rank that trains"):
        api.materialize_optimizer_state(opt)
    assert all(s["step"] == 1 for s in opt.state.values())  # it ran all the same
    rt2, opt2 = _trainer("trainer", 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once per process: a second call, another trainer, stays silent
        api.materialize_optimizer_state(opt)
        api.materialize_optimizer_state(opt2)


def test_materialize_on_a_spare_or_by_the_library_is_silent(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(receive, "_warned", False)
    _, spare_opt = _trainer("spare", -1)
    rt, opt = _trainer("trainer", 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        api.materialize_optimizer_state(spare_opt)  # a spare: what the docs ask for
        receive.materialize_optimizers({"opt": opt})  # the library's own path (a rebuilt mesh, say)
    assert receive._warned is False and all(s["step"] == 1 for s in opt.state.values())
