"""Who a rank is now: its epoch, rank, world size, role and last committed step, as one frozen value.

The loop holds one :class:`RankIdentity` and is its one writer (``install``); the start and each
recovery compute the next value and hand it over whole, so no reader (a collective's check, a donor
thread, a report) sees a rank of one epoch with the world size of another.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Generic, NoReturn, TypeVar, overload

_T = TypeVar("_T")


@dataclass(frozen=True, slots=True)
class RankIdentity:
    """A rank's place in the job: ``epoch`` (the membership epoch its group belongs to; -1 before the
    first), ``rank`` and ``world_size`` in it (-1 and 0 when it has none), ``role`` (``trainer`` or
    ``spare``) and ``step``, the last committed step (0: the initial state)."""

    epoch: int = -1
    rank: int = -1
    world_size: int = 0
    role: str = "trainer"
    step: int = 0

    def but(self, *, epoch: int | None = None, rank: int | None = None, world_size: int | None = None,
            role: str | None = None, step: int | None = None) -> RankIdentity:
        """This identity with the fields given changed."""
        changes: dict[str, Any] = {k: v for k, v in (("epoch", epoch), ("rank", rank), ("world_size", world_size),
                                     ("role", role), ("step", step)) if v is not None}
        return replace(self, **changes)


class IdentityField(Generic[_T]):
    """A read-only attribute of the holder of a ``_identity`` (a :class:`RankIdentity`): the field of
    the same name. Assigning it raises; the holder installs a new identity instead."""

    def __set_name__(self, owner: type, name: str) -> None:
        self._name = name

    @overload
    def __get__(self, obj: None, owner: type) -> IdentityField[_T]: ...
    @overload
    def __get__(self, obj: object, owner: type) -> _T: ...
    def __get__(self, obj: object, owner: type) -> Any:
        if obj is None:
            return self
        return getattr(obj._identity, self._name)  # type: ignore[attr-defined]

    def __set__(self, obj: object, value: NoReturn) -> None:
        raise AttributeError(f"{self._name} is read-only: install() a new RankIdentity")
