"""``MemoryWatch``: a data executor's base (between reads) and peak (during
reads) resident memory, as the scaling manager reads them."""

from __future__ import annotations

import numpy as np

from estuary.data.graph.executor_memory import MemoryWatch, resident_bytes

MB = 2**20


def test_a_read_s_high_point_is_its_peak_and_the_base_is_between_reads() -> None:
    watch = MemoryWatch()
    assert resident_bytes() > 0 and watch.base > 0
    watch.read_started()
    held = np.ones(64 * MB // 8)  # 64 MiB, every page touched
    watch.sample()  # a block handed on while the read holds it
    del held
    watch.read_ended()
    base, peak = watch.take()
    assert peak - base >= 48 * MB  # the read's 64 MiB, whatever the allocator kept
    _, again = watch.take()
    assert again < peak - 32 * MB  # the peak starts again from the last take


def test_the_base_is_not_moved_while_a_read_is_in_flight() -> None:
    watch = MemoryWatch()
    watch.read_started()
    watch.read_started()
    first = watch.base
    held = np.ones(32 * MB // 8)
    watch.read_ended()  # one read still in flight: base stays
    assert watch.base == first
    del held
    watch.read_ended()
    base, _ = watch.take()
    assert base < first + 16 * MB
