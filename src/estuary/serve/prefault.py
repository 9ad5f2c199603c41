"""``Prefaulter``: map the pages of a shared file mapping that a reader will use,
before it uses them, and only those.

A server maps each slot file (``estuary.serve.slots``) once; a file has room
to grow (spare rows per table, and spare bytes at its end that tmpfs does not
back with memory until they are written). ``MAP_POPULATE`` would map every page
of the file, its room included, at a cost per page paid whenever a new file is
mapped (2-16 ms of the follower thread's CPU for a 6-43 MiB file of the bench
model); and reading a page of room would make tmpfs back it with memory. Here
only the spans the reader names (a table's region) are mapped in, each once per
mapping: a span seen before costs a dict lookup, a span grown since only its
new pages. So the pages a lookup reads are in place before the version is
served, not faulted in one by one on the prediction thread.

Pages are mapped with ``madvise(MADV_POPULATE_READ)`` (Linux 5.14+) called
through ctypes, which releases the GIL for the call; where the kernel or the C
library lacks it, one byte of every page is read instead (numpy, the GIL held).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
from collections.abc import Callable

import numpy as np

__all__ = ["MADV_POPULATE_READ", "Prefaulter"]

MADV_POPULATE_READ = 22  # <linux/mman.h>; EINVAL before Linux 5.14
_PAGE = mmap.PAGESIZE


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` (``None`` where there is no libc to load)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name, use_errno=True).madvise  # a CDLL call releases the GIL
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_MADVISE = _libc_madvise()


class Prefaulter:
    """Maps in the byte ranges of one mapping ``buf`` that readers will use.

    Args:
        buf: a mapping (read-only or not).
    """

    def __init__(self, buf: mmap.mmap) -> None:
        self._bytes = np.frombuffer(buf, np.uint8)  # (size,) a view: its address, no copy
        self._base = int(self._bytes.ctypes.data)
        self._done: dict[int, int] = {}  # range start -> the end mapped in so far
        self.madvise = _MADVISE is not None  # False after the kernel refused it
        self.pages = 0  # pages mapped in (asked for) so far

    def span(self, begin: int, end: int) -> None:
        """Map in bytes ``[begin, end)`` of the mapping, but for what was mapped in
        for a span starting at ``begin`` already: a span seen before costs a dict
        lookup, a span that grew its new pages."""
        if begin < 0 or end > self._bytes.size:
            raise ValueError(f"bytes {begin}..{end} are not in the mapping of {self._bytes.size}")
        start = max(begin, self._done.get(begin, begin))
        if start >= end:
            return
        self._done[begin] = end
        self._range(start - start % _PAGE, end)

    def _range(self, begin: int, end: int) -> None:
        """Map in pages ``[begin, end)`` (``begin`` page-aligned)."""
        self.pages += -(-(end - begin) // _PAGE)
        if self.madvise and _MADVISE is not None:
            if _MADVISE(self._base + begin, end - begin, MADV_POPULATE_READ) == 0:
                return
            if ctypes.get_errno() != errno.EINVAL:
                return  # e.g. ENOMEM: the pages left to fault in when first read
            self.madvise = False  # an older kernel: read a byte of each page instead
        # One read per page faults it in (the sum only makes numpy read them).
        int(self._bytes[begin:end:_PAGE].sum(dtype=np.uint64))
