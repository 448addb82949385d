"""Python's and numpy's global Mersenne Twister states read straight from their C structs.

:class:`~gossiprec.trainer.state.rng.RNGState` reads both on every commit; the public APIs build hundreds of
Python ints each time, these readers copy one block of memory. Nothing about the layouts is assumed:
each reader's :meth:`probe` locates the fields on a scratch generator and must reproduce the public
API's result exactly, there and on the global generator, or it is not used; every read checks that the
global generator is still the probed one (else it returns None and the caller falls back). Turn them
off with ``RNGState(raw=False)``.
"""

from __future__ import annotations

import ctypes
import random
import struct
from typing import Any, Callable


class RawPythonRNG:
    """Python ``random``'s global state read from its C struct: what ``RNGState.state_dict()`` stores
    under ``python``, without ``random.getstate()`` building 625 ints that are then packed again.

    CPython's ``RandomObject`` is ``{PyObject_HEAD; int index; uint32_t state[624]}``. The offsets are
    not assumed: :meth:`probe` finds them on a scratch generator and checks the reading against
    ``getstate()`` (after draws and a ``gauss()``, and on the global generator too); anything
    unexpected (another interpreter, a replaced ``random._inst``, a big-endian machine) leaves the
    reader unset and ``getstate()`` in use. Every :meth:`read` first checks that ``random._inst`` is
    still the generator it was probed on, else returns None (the caller falls back).
    """

    INDEX_AT = struct.calcsize("P") * 2
    """Offset of ``index`` (after PyObject_HEAD: refcount and type); the 624 words follow it."""

    def __init__(self, inst: Any) -> None:
        self.inst = inst

    @staticmethod
    def _read(gen: Any) -> list[Any]:
        raw = ctypes.string_at(id(gen) + RawPythonRNG.INDEX_AT, 2500)  # one read: index and words of one state
        return [gen.VERSION, raw[4:] + raw[:4], gen.gauss_next]

    def read(self) -> list[Any] | None:
        inst = random._inst
        return self._read(inst) if inst is self.inst else None

    @classmethod
    def probe(cls, reference: Callable[[Any], list[Any]]) -> RawPythonRNG | None:
        """A reader of the global generator, if it reads what ``reference(gen)`` (the public API's form)
        gives; else None."""
        import sys

        inst = getattr(random, "_inst", None)
        if (sys.byteorder != "little" or sys.implementation.name != "cpython" or type(inst) is not random.Random
                or getattr(random.getstate, "__self__", None) is not inst):
            return None
        scratch = random.Random(20260301)
        scratch.random()
        scratch.gauss()
        try:
            if any(cls._read(gen) != reference(gen) for gen in (scratch, inst)):
                return None
        except (struct.error, TypeError, ValueError):
            return None
        return cls(inst)


class RawNumpyRNG:
    """numpy's legacy global ``RandomState`` read from its C structs: what ``RNGState.state_dict()``
    stores under ``numpy``, without ``get_state`` copying the 624 key words one by one into a new array.

    The MT19937 state (``uint32_t key[624]; int pos``) is at the bit generator's
    ``ctypes.state_address``; the cached Gaussian (``has_gauss``, ``gauss``) lives in the
    ``RandomState`` object, in an ``aug_bitgen_t`` (``{bitgen_t *bit_generator; int has_gauss; double
    gauss}``) whose first field points at the object's own ``bitgen_t`` copy, which starts with the
    state address. :meth:`probe` finds both offsets by those two pointers, within the object's
    ``__basicsize__``, on a scratch ``RandomState``, and checks the reading against ``get_state``
    with and without a cached Gaussian, then on the global one; if anything differs it returns None
    and ``get_state`` stays in use. Every :meth:`read` checks that the global generator, its bit
    generator and both pointers are still the probed ones, else returns None (the caller falls back).
    """

    def __init__(self, mtrand: Any, bitgen_at: int, aug_at: int) -> None:
        self.mtrand = mtrand
        self.rs = mtrand._rand
        self.bg = self.rs._bit_generator
        self.state_address = int(self.bg.ctypes.state_address)
        self.bitgen_at, self.aug_at = bitgen_at, aug_at

    def _fields(self, rs: Any) -> tuple[int, int, float] | None:
        """(state address, has_gauss, gauss) as read in ``rs``; None if its aug_bitgen_t does not point
        at its own bitgen_t."""
        base = id(rs)
        state_ptr, = struct.unpack("=Q", ctypes.string_at(base + self.bitgen_at, 8))
        aug_ptr, has_gauss, gauss = struct.unpack("=Qi4xd", ctypes.string_at(base + self.aug_at, 24))
        if aug_ptr != base + self.bitgen_at:
            return None
        return state_ptr, has_gauss, gauss

    def _read(self, rs: Any, state_address: int) -> dict[str, Any] | None:
        f = self._fields(rs)
        if f is None or f[0] != state_address:
            return None
        raw = ctypes.string_at(state_address, 2500)  # one read: keys and pos of one state
        if self._fields(rs) != f:  # another thread seeded or set the state in between: use get_state
            return None
        pos, = struct.unpack("=i", raw[2496:])
        return {"algo": "MT19937", "keys": raw[:2496], "pos": pos, "has_gauss": f[1], "cached_gaussian": f[2]}

    def read(self) -> dict[str, Any] | None:
        rs = self.mtrand._rand
        if rs is not self.rs or rs._bit_generator is not self.bg:
            return None
        return self._read(rs, self.state_address)

    @classmethod
    def probe(cls, reference: Callable[[Any], dict[str, Any]]) -> RawNumpyRNG | None:
        """A reader of numpy's global generator, if it reads what ``reference(gen)`` (the public API's
        form) gives; else None (also without numpy)."""
        import sys

        try:
            import numpy as np
            from numpy.random import MT19937, RandomState
        except ImportError:
            return None
        rs = getattr(np.random.mtrand, "_rand", None)
        if (sys.byteorder != "little" or sys.implementation.name != "cpython" or struct.calcsize("P") != 8
                or type(rs) is not RandomState
                or type(rs._bit_generator) is not MT19937):
            return None
        scratch = RandomState(20260301)
        size = type(scratch).__basicsize__
        base, address = id(scratch), int(scratch._bit_generator.ctypes.state_address)
        words = struct.unpack(f"={size // 8}Q", ctypes.string_at(base, size // 8 * 8))
        bitgen = [i * 8 for i, w in enumerate(words) if w == address]
        if len(bitgen) != 1:
            return None
        aug = [i * 8 for i, w in enumerate(words) if w == base + bitgen[0]]
        if len(aug) != 1 or aug[0] + 24 > size:
            return None
        reader = cls(np.random.mtrand, bitgen[0], aug[0])
        try:
            scratch.standard_normal()  # leaves one Gaussian cached
            ok = reader._read(scratch, address) == reference(scratch)
            scratch.standard_normal()  # takes it
            scratch.random_sample(3)
            ok = (ok and reader._read(scratch, address) == reference(scratch)
                  and reader.read() == reference(rs))
        except (struct.error, TypeError, ValueError):
            return None
        return reader if ok else None


_READERS: list[Any] = []
"""``[python reader or None, numpy reader or None]`` once probed (on the first :func:`readers` call: numpy
is not imported before, as agents import the trainer's modules)."""


def readers(python_form: Callable[[Any], list[Any]], numpy_form: Callable[[Any], dict[str, Any]]
            ) -> tuple[RawPythonRNG | None, RawNumpyRNG | None]:
    """The readers, probed once against ``python_form(gen)`` and ``numpy_form(gen)`` (the public APIs'
    results in the stored form)."""
    if not _READERS:
        _READERS[:] = [RawPythonRNG.probe(python_form), RawNumpyRNG.probe(numpy_form)]
    return _READERS[0], _READERS[1]
