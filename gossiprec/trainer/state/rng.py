"""The process's random generators as one :class:`~gossiprec.trainer.objects.Stateful`.

A replica's state includes where its random streams are: torch's CPU generator, one per CUDA device,
Python's ``random`` and numpy's legacy global generator. The Mersenne Twisters' 625 state words travel
as one little-endian bytes value, not as 625 ints, because the state is read on every commit. By default
Python's and numpy's states are read straight from the generators' C structs
(:mod:`gossiprec.trainer.state.rng_raw`, probed against the public APIs first); ``RNGState(raw=False)``
uses only ``random.getstate()`` and ``numpy.random.get_state()``. Both give identical dicts.
"""

from __future__ import annotations

import random
import struct
from typing import Any, Mapping, Sequence

from gossiprec.errors import TransferError
from gossiprec.trainer.state import rng_raw


class RNGState:
    """The process's random generators as a :class:`~gossiprec.trainer.objects.Stateful`.

    ``state_dict()`` holds ``torch`` (CPU generator state, a uint8 tensor), ``cuda`` (the current
    device's generator, when CUDA is available), ``python`` (``random.getstate()``, its 625 words as
    little-endian bytes) and ``numpy`` (the legacy global ``np.random`` state, keys as little-endian
    bytes, when numpy is importable). Pass ``cuda``/``numpy`` explicitly to
    force the layout, e.g. when donors and receivers differ in what is installed. ``raw=False``: read
    Python's and numpy's states through their public APIs only, never from their C structs.
    """

    def __init__(self, *, cuda: bool | None = None, numpy: bool | None = None, raw: bool = True) -> None:
        import torch

        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        if numpy is None:
            try:
                import numpy as _np  # noqa: F401
                numpy = True
            except ImportError:
                numpy = False
        self.numpy = numpy
        self.raw = raw

    def state_dict(self) -> dict[str, Any]:
        import torch

        raw_python, raw_numpy = raw_readers() if self.raw else (None, None)
        python = raw_python.read() if raw_python is not None else None
        sd: dict[str, Any] = {"torch": torch.get_rng_state(), "python": python or python_rng_state(random)}
        if self.cuda:
            # the current device's generator only: a rank drives one GPU, and the others' generators
            # (other ranks' devices on the same host) differ across replicas without mattering
            sd["cuda"] = torch.cuda.get_rng_state()
        if self.numpy:
            st = raw_numpy.read() if raw_numpy is not None else None
            if st is None:
                import numpy as np

                st = numpy_rng_state(np.random)
            sd["numpy"] = st
        return sd

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        import torch

        try:
            torch.set_rng_state(state_dict["torch"])
            version, internal, gauss = state_dict["python"]
            random.setstate((version, _unpack_words(internal), gauss))
            if self.cuda:
                cuda_state = state_dict["cuda"]
                if isinstance(cuda_state, list):  # the older form: every device's
                    torch.cuda.set_rng_state_all(cuda_state)
                else:
                    torch.cuda.set_rng_state(cuda_state)
            if self.numpy:
                import numpy as np

                st = state_dict["numpy"]
                keys = st["keys"]
                keys = (np.frombuffer(keys, dtype="<u4").astype(np.uint32) if isinstance(keys, bytes)
                        else np.asarray(keys, dtype=np.uint32))
                np.random.set_state((st["algo"], keys, st["pos"], st["has_gauss"], st["cached_gaussian"]))
        except (KeyError, TypeError, ValueError, RuntimeError, struct.error) as exc:
            raise TransferError(f"RNG state does not fit this process ({exc}); donor and receiver must "
                                "agree on CUDA and numpy being present") from exc


def raw_readers() -> tuple[rng_raw.RawPythonRNG | None, rng_raw.RawNumpyRNG | None]:
    """The struct readers that passed their probes against :func:`python_rng_state` and
    :func:`numpy_rng_state` (None for one that did not)."""
    return rng_raw.readers(python_rng_state, numpy_rng_state)


def python_rng_state(gen: Any) -> list[Any]:
    """What :meth:`RNGState.state_dict` stores under ``python`` for ``gen`` (the ``random`` module or a
    ``random.Random``), through ``getstate()``."""
    version, internal, gauss = gen.getstate()
    return [version, _pack_words(internal), gauss]


def numpy_rng_state(gen: Any) -> dict[str, Any]:
    """What :meth:`RNGState.state_dict` stores under ``numpy`` for ``gen`` (``numpy.random`` or a
    ``RandomState``), through ``get_state``."""
    import numpy as np

    algo, keys, pos, has_gauss, cached = gen.get_state(legacy=True)
    return {"algo": str(algo), "keys": np.asarray(keys, dtype="<u4").tobytes(), "pos": int(pos),
            "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}


def _pack_words(words: Sequence[int]) -> bytes:
    """Python ``random``'s internal state (32-bit words) as little-endian bytes."""
    return struct.pack(f"<{len(words)}I", *words)


def _unpack_words(data: bytes | Sequence[int]) -> tuple[int, ...]:
    """Inverse of :func:`_pack_words`; also takes the list form older snapshots used."""
    if isinstance(data, (bytes, bytearray)):
        if len(data) % 4:
            raise ValueError(f"python RNG state of {len(data)} bytes is not whole 32-bit words")
        return struct.unpack(f"<{len(data) // 4}I", data)
    return tuple(data)
