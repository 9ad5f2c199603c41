"""Bad-row accounting: count, keep the first few with ``file:line: reason``, and
decide when there are too many.

A row is bad when it has the wrong number of fields, a label that is not 0/1, a
dense value that is not a finite number, or a value a column transform rejects.
Bad rows are skipped; good rows around them are kept.

When the run fails (``BadDataError``): bad rows > ``max_bad_row_ratio`` x rows
read (rows read = good + bad data rows; headers and blank lines do not count),
checked

- at the end of every file and therefore at the end of the run, on the totals
  so far, so a small file is judged on all its rows, never on its first bad one;
- early, after each parsed block (~2 MB of text), but only once at least
  ``EARLY_CHECK_MIN_ROWS`` rows have been read, so a file of garbage fails in
  seconds instead of after hours of parsing.

A ``data.dataset`` run judges the job's totals, exactly once over restarts
(``totals``, from ``Progress.bad_totals``), as an uninterrupted run judges its
own: a resume that starts in a bad hour is judged with the hours before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from estuary.data.errors import BadDataError

__all__ = ["EARLY_CHECK_MIN_ROWS", "BadRow", "BadRowReport", "BadRowTracker"]

EARLY_CHECK_MIN_ROWS: Final = 1000


class BadRow(NamedTuple):
    """One reported bad row.

    Args:
        file: the file as shown to the user (relative to the job folder if inside it).
        line: 1-based physical line in the decompressed file, header included.
        reason: what is wrong, naming the field (``field I5: 'abc' is not a number``).
    """

    file: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.reason}"


@dataclass(frozen=True)
class BadRowReport:
    """Bad rows seen while reading.

    Args:
        count: bad rows skipped.
        rows_read: data rows read, good + bad.
        examples: the first bad rows in read order (at most ``report_bad_rows``).
    """

    count: int = 0
    rows_read: int = 0
    examples: list[BadRow] = field(default_factory=list)

    @property
    def ratio(self) -> float:
        """count / rows_read (0 when nothing was read)."""
        return self.count / self.rows_read if self.rows_read else 0.0

    def __str__(self) -> str:
        head = f"{self.count} bad rows of {self.rows_read} rows read ({self.ratio:.2%})"
        return "\n  ".join([head, *map(str, self.examples)])


class BadRowTracker:
    """Running totals of one read, and the policy above.

    Args:
        max_ratio: ``DataSpec.max_bad_row_ratio``.
        max_examples: ``DataSpec.report_bad_rows``.
        totals: ``(bad rows, rows read)`` to judge instead of this read's own
            (a job's totals over restarts); ``count`` and ``rows_read`` stay
            this read's.
    """

    def __init__(
        self,
        max_ratio: float,
        max_examples: int,
        totals: Callable[[], tuple[int, int]] | None = None,
    ) -> None:
        self.max_ratio = max_ratio
        self.max_examples = max_examples
        self.totals = totals
        self.count = 0
        self.rows_read = 0
        self.examples: list[BadRow] = []

    @property
    def examples_wanted(self) -> int:
        """How many more examples to collect."""
        return self.max_examples - len(self.examples)

    def add(self, rows_read: int, bad_count: int, examples: list[BadRow]) -> None:
        """Add one block's counts; ``examples`` must be its first bad rows in order."""
        self.rows_read += rows_read
        self.count += bad_count
        self.examples.extend(examples[: self.examples_wanted])

    def judged(self) -> tuple[int, int]:
        """The ``(bad rows, rows read)`` the ratio is checked on."""
        return self.totals() if self.totals is not None else (self.count, self.rows_read)

    def too_many(self) -> bool:
        bad, read = self.judged()
        return bad > self.max_ratio * read

    def check_early(self, where: str) -> None:
        """After a block: fail if over the ratio and enough rows were read."""
        if self.judged()[1] >= EARLY_CHECK_MIN_ROWS and self.too_many():
            raise self._error(f"after a block of {where}")

    def check_file_end(self, where: str) -> None:
        """At the end of a file: fail if over the ratio."""
        if self.too_many():
            raise self._error(f"at the end of {where}")

    def report(self) -> BadRowReport:
        return BadRowReport(self.count, self.rows_read, list(self.examples))

    def _error(self, when: str) -> BadDataError:
        report = BadRowReport(*self.judged(), list(self.examples))
        if self.totals is not None and self.count == 0:  # a resumed job's earlier runs
            first = " No bad row was read in this run: the earlier runs of the job read them."
        elif report.examples:
            first = " First bad rows:\n  " + "\n  ".join(map(str, report.examples))
        else:  # data.report_bad_rows: 0
            first = ""
        counted = "" if self.totals is None else f"; this run read {self.count} of {self.rows_read}"
        return BadDataError(
            f"too many bad rows: {report.count} of {report.rows_read} rows read "
            f"({report.ratio:.2%}{counted}) exceed "
            f"data.max_bad_row_ratio={self.max_ratio:g} (checked {when}).{first}"
        )
