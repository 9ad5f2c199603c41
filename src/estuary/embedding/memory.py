"""Zeroed arrays for the large, randomly accessed tables (rows, hash index, metadata).

Why: a lookup touches rows scattered over hundreds of MB. With 4 KiB pages every
touch is also a TLB miss and a page-table walk; on Linux, transparent huge pages
(2 MiB) cover 512x more memory per TLB entry. Measured here on 1M random
256-byte row reads: 49 ns/row with 4 KiB pages, 38-40 ns with huge pages.

``zeros`` maps arrays of ``HUGE_MIN_BYTES`` or more with ``mmap`` and asks for huge
pages (``madvise(MADV_HUGEPAGE)``; a hint: where THP is off, or not Linux, the
array is an ordinary zeroed mapping). Smaller arrays come from ``np.zeros``.
Every array starts on a 64-byte cache line (malloc aligns to 16 B only): a
D=16 float32 weight row is then one line, not two (measured 1.3-2x on random
gathers). Pages are mapped lazily:
nothing is touched before it is used.
"""

from __future__ import annotations

import contextlib
import mmap

import numpy as np

HUGE_MIN_BYTES = 8 << 20  # below this the rounding to 2 MiB pages is not worth it
_HUGE_PAGE = 2 << 20
_LINE = 64
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


def zeros(shape: tuple[int, ...], dtype: np.dtype | type) -> np.ndarray:
    """A zero-filled C-contiguous array of ``shape`` and ``dtype``, 64 B aligned,
    on huge pages where the platform offers them (see module docstring)."""
    dt = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dt.itemsize
    if nbytes >= HUGE_MIN_BYTES and _MADV_HUGEPAGE is not None:
        buf = mmap.mmap(-1, nbytes + _HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        with contextlib.suppress(OSError):  # THP unsupported here: an ordinary mapping
            buf.madvise(_MADV_HUGEPAGE)
        align = _HUGE_PAGE
    else:
        buf = np.zeros(nbytes + _LINE, np.uint8)  # type: ignore[assignment]
        align = _LINE
    raw = np.frombuffer(buf, np.uint8)
    start = -raw.ctypes.data % align
    return raw[start : start + nbytes].view(dt).reshape(shape)


def grown(arr: np.ndarray, rows: int) -> np.ndarray:
    """A new array (``zeros``) of ``rows`` rows holding ``arr``'s rows first; an
    empty ``arr`` (a per-row array that is not kept) stays empty."""
    if arr.size == 0:
        return arr
    out = zeros((rows, *arr.shape[1:]), arr.dtype)
    out[: arr.shape[0]] = arr
    return out


def _mapping_of(arr: np.ndarray) -> mmap.mmap | None:
    # The anonymous mapping ``zeros`` placed ``arr`` in, or None (an np.zeros buffer).
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    if isinstance(base, memoryview) and isinstance(base.obj, mmap.mmap):
        return base.obj
    return None


def shrunk(arr: np.ndarray, rows: int) -> np.ndarray:
    """The first ``rows`` rows of ``arr`` (C-contiguous, from ``zeros``), with the
    memory past them given back to the OS (RSS drops).

    An array in a mapping of its own (``HUGE_MIN_BYTES`` or more) is cut in place:
    the whole pages past row ``rows`` are released (``madvise(MADV_DONTNEED)``;
    the address range stays reserved until the array is dropped) and the result
    is a view of the rows kept: nothing is copied, no memory is added. A smaller
    array is copied into a new one of ``rows`` rows (under ``HUGE_MIN_BYTES``).
    """
    if rows >= arr.shape[0]:
        return arr
    buf = _mapping_of(arr)
    if buf is None or not hasattr(mmap, "MADV_DONTNEED"):
        out = zeros((rows, *arr.shape[1:]), arr.dtype)
        out[...] = arr[:rows]
        return out
    kept = arr[:rows]
    base = np.frombuffer(buf, np.uint8).ctypes.data
    end = kept.ctypes.data + kept.nbytes - base  # first byte past the rows kept
    start = -(-end // mmap.PAGESIZE) * mmap.PAGESIZE
    if start < len(buf):
        buf.madvise(mmap.MADV_DONTNEED, start, len(buf) - start)
    return kept
