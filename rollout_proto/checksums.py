"""Per-tensor checksums of a weight push: the algorithms of
`WeightsHeader.checksum_algo` as incremental hashers (`update`, `hexdigest`).

xxh3 is xxHash's C implementation (the one python-xxhash ships), called
through ctypes so that the hashing releases the GIL: a sender hashes on a
thread while its event loop streams, and the service hashes on its writer
thread while its event loop receives. python-xxhash's own calls hold the GIL
(they are the fallback where the C symbols cannot be found). sha256 is
hashlib's, which releases the GIL itself.
"""
from __future__ import annotations

import ctypes
import hashlib

import numpy as np

# Checksum algorithms -> length of their hex digest.
ALGOS = {"sha256": 64, "xxh3_64": 16, "xxh3_128": 32}


class _H128(ctypes.Structure):
    _fields_ = [("low64", ctypes.c_uint64), ("high64", ctypes.c_uint64)]


def _load():
    """xxHash's streaming XXH3 functions, or None."""
    try:
        import xxhash._xxhash as ext

        lib = ctypes.CDLL(ext.__file__)
        fns = {}
        for name, argtypes, restype in (
            ("XXH3_createState", [], ctypes.c_void_p),
            ("XXH3_freeState", [ctypes.c_void_p], ctypes.c_int),
            ("XXH3_64bits_reset", [ctypes.c_void_p], ctypes.c_int),
            ("XXH3_64bits_update", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
            ("XXH3_64bits_digest", [ctypes.c_void_p], ctypes.c_uint64),
            ("XXH3_128bits_reset", [ctypes.c_void_p], ctypes.c_int),
            ("XXH3_128bits_update", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t], ctypes.c_int),
            ("XXH3_128bits_digest", [ctypes.c_void_p], _H128),
        ):
            fn = getattr(lib, name)
            fn.argtypes, fn.restype = argtypes, restype
            fns[name] = fn
        return fns
    except (ImportError, OSError, AttributeError):
        return None


_XXH = _load()


def _address(data) -> tuple[int, int, object]:
    """(address, length, the object keeping the memory alive) of a
    contiguous buffer, read-only ones included."""
    arr = np.frombuffer(data, np.uint8)
    return arr.ctypes.data, arr.size, arr


class _Xxh3:
    """XXH3 (64 or 128 bits) through the C library, without the GIL."""

    __slots__ = ("_state", "_bits", "_update", "_digest")

    def __init__(self, bits: int) -> None:
        self._bits = bits
        self._state = _XXH["XXH3_createState"]()
        if not self._state:
            raise MemoryError("XXH3_createState")
        _XXH[f"XXH3_{bits}bits_reset"](self._state)
        self._update = _XXH[f"XXH3_{bits}bits_update"]
        self._digest = _XXH[f"XXH3_{bits}bits_digest"]

    def update(self, data) -> None:
        addr, n, _keep = _address(data)
        if n:
            self._update(self._state, addr, n)

    def hexdigest(self) -> str:
        d = self._digest(self._state)
        return f"{d.high64:016x}{d.low64:016x}" if self._bits == 128 else f"{d:016x}"

    def __del__(self) -> None:
        if self._state:
            _XXH["XXH3_freeState"](self._state)
            self._state = None


def new_hasher(algo: str):
    """An incremental hasher (`update`, `hexdigest`) for one of ALGOS."""
    if algo == "sha256":
        return hashlib.sha256()
    bits = {"xxh3_64": 64, "xxh3_128": 128}[algo]
    if _XXH is not None:
        return _Xxh3(bits)
    import xxhash

    return xxhash.xxh3_64() if bits == 64 else xxhash.xxh3_128()


def hexdigest(algo: str, data) -> str:
    h = new_hasher(algo)
    h.update(data)
    return h.hexdigest()
