"""Callbacks: what the fit loop does around each step besides training.

The loop (``estuary.train.loop``) calls, in order::

    on_fit_start(state)
    per epoch:  on_epoch_start(state)
      per step: before_step(state) -> engine step -> after_step(state, rows, loss)
    on_fit_end(state)          (also when the fit fails or stops)

``state`` is the run's ``LoopState`` (steps done, epoch, rank, stop signal).
Built-in callbacks: ``ProgressCallback``, ``RunObserver`` (``train/observe.py``),
``AdmissionSwitch``, ``CheckpointCadence``, ``EpochWindow`` (where a timed window
of epochs begins: the calibration's) and, for tests, ``FaultInjection``
(runs a function before a step: crash, kill, hold or stop a run at a known step).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from estuary.metrics.progress import ProgressBar
from estuary.train.stop import LocalStop, StopSignal

__all__ = [
    "AdmissionSwitch",
    "Callback",
    "CheckpointCadence",
    "EpochWindow",
    "FaultInjection",
    "LoopState",
    "ProgressCallback",
]


@dataclass
class LoopState:
    """Where a run is; checkpoints save it, a resume restores it.

    Args:
        step: global steps done.
        epoch: the epoch in progress (``data.sources`` jobs; 0 otherwise).
        epoch_step: steps done in ``epoch`` (a mid-epoch checkpoint resumes there).
        rank: this trainer's rank.
        world_size: trainers in the run (W).
        stop: the run's stop signal.
        restarts: times the run was resumed from its own checkpoints (saved
            with them; a resume adds one).
    """

    step: int = 0
    epoch: int = 0
    epoch_step: int = 0
    rank: int = 0
    world_size: int = 1
    stop: StopSignal = field(default_factory=LocalStop)
    restarts: int = 0

    @property
    def chief(self) -> bool:
        """Rank 0: the one trainer that evaluates and writes checkpoints."""
        return self.rank == 0


class Callback:
    """Base class: every hook does nothing; override the ones you need."""

    def on_fit_start(self, state: LoopState) -> None:
        """Before the first step."""

    def on_epoch_start(self, state: LoopState) -> None:
        """Before the first step of ``state.epoch``."""

    def before_step(self, state: LoopState) -> None:
        """Before step ``state.step + 1`` (its batch is already looked up)."""

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        """After step ``state.step``, which trained ``rows`` rows over all ranks."""

    def on_fit_end(self, state: LoopState) -> None:
        """After the last step, or when the fit stops or fails."""


class Callbacks(Callback):
    """Several callbacks called in order."""

    def __init__(self, callbacks: Iterable[Callback]) -> None:
        self.callbacks = list(callbacks)

    def on_fit_start(self, state: LoopState) -> None:
        for c in self.callbacks:
            c.on_fit_start(state)

    def on_epoch_start(self, state: LoopState) -> None:
        for c in self.callbacks:
            c.on_epoch_start(state)

    def before_step(self, state: LoopState) -> None:
        for c in self.callbacks:
            c.before_step(state)

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        for c in self.callbacks:
            c.after_step(state, rows, loss)

    def on_fit_end(self, state: LoopState) -> None:
        for c in self.callbacks:
            c.on_fit_end(state)


class FaultInjection(Callback):
    """Runs ``fn(state)`` before a step: every step, or only before step
    ``at_step`` (1-based). For tests: raise, kill the process, hold it, or
    ``state.stop.request(...)`` at a known step.

    Args:
        fn: called with the run's state; ``state.step`` steps are done.
        at_step: the step it runs before (``None``: before every step).
    """

    def __init__(self, fn: Callable[[LoopState], Any], at_step: int | None = None) -> None:
        self.fn, self.at_step = fn, at_step

    def before_step(self, state: LoopState) -> None:
        if self.at_step is None or state.step + 1 == self.at_step:
            self.fn(state)


class ProgressCallback(Callback):
    """The progress bar: rows, loss and epoch after each step."""

    def __init__(self, total_rows: int, enabled: bool) -> None:
        self.total_rows, self.enabled = total_rows, enabled
        self.bar: ProgressBar | None = None

    def on_fit_start(self, state: LoopState) -> None:
        self.bar = ProgressBar(total=self.total_rows, enabled=self.enabled)

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        if self.bar is not None:
            self.bar.update(rows, loss, state.epoch)

    def on_fit_end(self, state: LoopState) -> None:
        if self.bar is not None:
            self.bar.close()


class AdmissionSwitch(Callback):
    """Admission counts only the first epoch: later epochs re-read rows already
    counted (tables on a parameter server too: every rank may switch it,
    idempotently)."""

    def __init__(self, tables: Iterable[Any]) -> None:
        self.tables = list(tables)

    def on_epoch_start(self, state: LoopState) -> None:
        for table in self.tables:
            switch = getattr(table, "set_admission_counting", None)
            if switch is not None:  # EmbeddingTable, RemoteTable
                switch(state.epoch == 0)


class EpochWindow(Callback):
    """Marks a timed window of epochs: when epoch ``first`` starts, keeps the
    wall clock, the process's CPU clock and ``times.as_dict()`` (the engine's
    ``StageTimes``, set once the engine exists) as ``start``; when the fit's
    steps end (``on_fit_end``, before the fit evaluates the eval split), the
    same as ``end``. ``end`` minus ``start`` covers epochs ``first`` on only.

    Args:
        first: the first timed epoch (0-based; earlier epochs are a warm-up).
    """

    def __init__(self, first: int) -> None:
        self.first = first
        self.times: Any = None
        self.start: tuple[float, float, dict[str, float]] | None = None
        self.end: tuple[float, float, dict[str, float]] | None = None

    def _mark(self) -> tuple[float, float, dict[str, float]]:
        return time.perf_counter(), time.process_time(), self.times.as_dict()

    def on_epoch_start(self, state: LoopState) -> None:
        if state.epoch == self.first and self.times is not None:
            self.start = self._mark()

    def on_fit_end(self, state: LoopState) -> None:
        if self.start is not None:
            self.end = self._mark()


class CheckpointCadence(Callback):
    """A checkpoint every ``every`` steps (rank 0; ``output.checkpoint_every_steps``).

    Args:
        every: steps between checkpoints (``None``: none in the middle).
        save: writes a consistent checkpoint of the current step.
        saved_step: the step the last checkpoint holds (a resume's step).
    """

    def __init__(
        self, every: int | None, save: Callable[[], Path], saved_step: int | None = None
    ) -> None:
        self.every, self.save, self.saved_step = every, save, saved_step
        self.last: Path | None = None  # the newest checkpoint written

    def after_step(self, state: LoopState, rows: int, loss: float) -> None:
        if self.every is not None and state.step % self.every == 0:
            self.write(state)

    def write(self, state: LoopState) -> Path:
        self.last = self.save()
        self.saved_step = state.step
        return self.last
