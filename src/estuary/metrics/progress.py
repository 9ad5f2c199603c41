"""Progress bars: training (rows/s and a running loss) and evaluation (rows/s)."""

from __future__ import annotations

import sys

from tqdm import tqdm


class ProgressBar:
    """A tqdm bar counted in rows, showing rows/s and, while training, an
    exponentially smoothed loss. Disabled bars cost nothing.

    Args:
        total: rows expected (0 or ``None``: unknown; the bar counts up).
        enabled: draw the bar (writes to stderr).
        smoothing: weight of the newest loss in the running average.
        desc: the bar's label (e.g. ``eval``).
    """

    def __init__(
        self, total: int | None, *, enabled: bool, smoothing: float = 0.05, desc: str | None = None
    ) -> None:
        self.enabled = enabled
        self.smoothing = smoothing
        self.running_loss: float | None = None
        self._bar = (
            tqdm(
                total=total or None,
                desc=desc,
                unit="rows",
                unit_scale=True,
                dynamic_ncols=True,
                file=sys.stderr,
            )
            if enabled
            else None
        )

    def update(self, rows: int, loss: float, epoch: int) -> None:
        """A training step of ``rows`` rows (over all trainers)."""
        if self.running_loss is None:
            self.running_loss = loss
        else:
            self.running_loss += self.smoothing * (loss - self.running_loss)
        if self._bar is not None:
            self._bar.update(rows)
            self._bar.set_postfix(epoch=epoch, loss=f"{self.running_loss:.4f}", refresh=False)

    def count(self, rows: int) -> None:
        """``rows`` more rows done (evaluation: no loss)."""
        if self._bar is not None:
            self._bar.update(rows)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
