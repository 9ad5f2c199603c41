"""Where hybrid/async training runs its sparse work: a policy decides, the
``Prefetcher`` and the ``SparseUpdater`` act on the decision.

The sparse work of a step (reading the batch, dedup + table lookups + pooling,
then scattering the gradient and updating the tables) can run

* ``BACKGROUND``: on helper threads, overlapping torch's compute of other steps
  (the numba kernels release the GIL), or
* ``INLINE``: on the training thread, between torch calls, as sync mode does.

Background threads only pay off when a core is free for them. When torch's
intra-op threads already occupy every core (torch's default: one per core), a
helper thread can only run by preempting one of torch's OpenMP threads inside a
parallel region, and the others then spin at the region's barrier until it
returns: the sparse work costs about twice its own CPU time. Measured on 2 cores
(DLRM, 26 tables, batch 2048, 2 torch threads): dense compute alone 52.9 ms per
step, sparse work inline 58.4, in background threads 60.7. With 1 torch thread
(a spare core): dense 90.8, inline 96.5, background 93.0. Hence the policy.
Staleness is an upper bound, so running inline (staleness 0) is always allowed.

Stores that mostly wait (a parameter server: the calls are network round trips
with the GIL released) are the exception: overlapping waits pays off without a
spare core, so their sparse work stays in the background.
"""

from __future__ import annotations

import os
from enum import Enum

import torch


class Placement(Enum):
    """Where sparse work runs (see module docstring)."""

    INLINE = "inline"
    BACKGROUND = "background"


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def choose_placement(
    mode: str,
    *,
    cpu_bound: bool = True,
    torch_threads: int | None = None,
    cores: int | None = None,
) -> Placement:
    """``INLINE`` for sync mode, or for CPU-bound sparse work when torch's
    intra-op threads leave no core free; else ``BACKGROUND``.

    Args:
        mode: ``train.mode`` (``sync``, ``hybrid`` or ``async``).
        cpu_bound: the sparse work computes in this process (in-process tables),
            rather than waiting on another one (a parameter server).
        torch_threads: torch's intra-op threads (default: ``torch.get_num_threads()``).
        cores: usable cores (default: ``usable_cores()``).
    """
    if mode == "sync":
        return Placement.INLINE
    if not cpu_bound:
        return Placement.BACKGROUND
    threads = torch.get_num_threads() if torch_threads is None else torch_threads
    spare = (usable_cores() if cores is None else cores) - threads
    return Placement.BACKGROUND if spare >= 1 else Placement.INLINE
