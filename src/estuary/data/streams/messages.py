"""Stream messages -> the ``RawChunk`` the file readers produce.

Each message payload is one row in a line format (``criteo_tsv``, ``csv`` /
``tsv`` without a header, ``jsonl``). M messages become one block of M lines,
parsed by the same block parsers as files (``formats.text`` / ``formats.jsonl``)::

    messages (M) -> screen: empty, a line break inside, no payload -> bad rows
                 -> b"\\n".join(the rest) -> block parser -> RawChunk
                 -> line numbers mapped back to message numbers (1..M)

A row's "line" is its message number in the read (1-based); ``StreamChunk``
maps it to the stream offset, so bad rows read
``source 'clicks' offset 1234: field I5: 'x' is not a number``. Every message is
exactly one good row or one bad row (``raw.rows_read == M``): when a block
cannot be parsed as a whole (an unterminated CSV quote), its messages are parsed
one by one, so a bad message never takes good ones down with it.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from estuary.config.errors import ConfigError
from estuary.config.spec import SourceSpec
from estuary.data.badrows import BadRow
from estuary.data.errors import DataFileError
from estuary.data.formats import jsonl, text
from estuary.data.formats.criteo_tsv import CRITEO_COLUMNS, CriteoTsvReader
from estuary.data.formats.types import RawChunk, ReadRequest
from estuary.data.formats.values import to_text
from estuary.data.streams.types import Offset, StreamBadRow, StreamMessage
from estuary.data.types import Int64Array

__all__ = ["MESSAGE_FORMATS", "MessageFormat", "MessageParser", "StreamChunk"]

BlockParse = Callable[[bytes, int, int], RawChunk]
"""``parse(block, first_line, lines) -> RawChunk`` (see ``formats.text.parse_blocks``)."""

_LINE_BREAKS = re.compile(rb"[\r\n]")
_BLANK = b" \t\r\n"
_WHERE_PREFIX = re.compile(r"^cannot parse lines \d+-\d+: ")


@dataclass(frozen=True)
class MessageFormat:
    """How one payload is one row.

    Args:
        name: the format's name (``StreamSourceSpec.format``).
        dialect: delimiter and quoting for delimited text; ``None`` for ``jsonl``.
        default_columns: field names when the spec gives none (``criteo_tsv``).
    """

    name: str
    dialect: text.Dialect | None
    default_columns: tuple[str, ...] | None = None

    def block_parser(self, request: ReadRequest, names: list[str] | None) -> BlockParse:
        if self.dialect is None:
            return jsonl.block_parser(request)
        assert names is not None
        return text.block_parser(request, self.dialect, names)


MESSAGE_FORMATS: dict[str, MessageFormat] = {
    "criteo_tsv": MessageFormat(
        "criteo_tsv", CriteoTsvReader.dialect, default_columns=tuple(CRITEO_COLUMNS)
    ),
    "csv": MessageFormat("csv", text.Dialect(delimiter=",", quote_char='"', header=False)),
    "tsv": MessageFormat("tsv", text.Dialect(delimiter="\t", quote_char='"', header=False)),
    "jsonl": MessageFormat("jsonl", None),
}
"""Message formats by name; add one here (and to ``StreamFormatName``)."""


@dataclass(frozen=True)
class StreamChunk:
    """The rows of one read: a ``RawChunk`` plus where each message sits.

    Args:
        raw: the good-so-far rows; ``raw.file`` is the source name and
            ``raw.line_numbers`` int64 (R,) each row's message number (1-based
            index into ``offsets``); ``raw.invalid`` the rejected messages.
        offsets: (M,) the offsets of the M messages read, in stream order
            (M = ``raw.rows_read``).
        timestamps_ms: int64 (M,) broker time of each message (Unix ms; -1 unknown).
        position: the offset to checkpoint once these rows are trained (the last
            message's offset; the reader's position when M = 0).
    """

    raw: RawChunk
    offsets: list[Offset]
    timestamps_ms: Int64Array
    position: Offset

    @property
    def num_messages(self) -> int:
        """M, messages read (good + bad rows)."""
        return len(self.offsets)

    @property
    def num_rows(self) -> int:
        """R, rows that parsed (the decoder may still reject some)."""
        return self.raw.num_rows

    def offset_of(self, number: int) -> Offset:
        """The offset of message ``number`` (a ``line`` of ``raw``, 1-based)."""
        return self.offsets[number - 1]

    def row_offsets(self) -> list[Offset]:
        """(R,) the offset of each row of ``raw``, in order."""
        return [self.offsets[int(n) - 1] for n in self.raw.line_numbers]

    def bad_rows(self, rows: Iterable[BadRow]) -> list[StreamBadRow]:
        """Bad rows of this chunk (``raw.invalid`` or a decoder's ``bad_examples``)
        as ``source 'clicks' offset 1234: reason``."""
        return [
            StreamBadRow(
                f"source {row.file!r} offset {self.offset_of(row.line)}", row.line, row.reason
            )
            for row in rows
        ]


class MessageParser:
    """Parses lists of messages of one source into ``StreamChunk``s (thread-safe).

    Args:
        format: a ``MESSAGE_FORMATS`` name.
        columns: columns to return, in order (the decoder's ``columns``).
        names: the message's field names for delimited formats (default: the
            format's, e.g. Criteo's 40); must be ``None`` for ``jsonl``.
        source: the source's name in bad-row reports.
        where: config path of the source, for errors.

    Raises:
        ConfigError: unknown format, or a column that a delimited message lacks.
    """

    def __init__(
        self,
        format: str,
        columns: Sequence[str],
        names: Sequence[str] | None = None,
        *,
        source: str,
        where: str = "stream",
    ) -> None:
        kind = MESSAGE_FORMATS.get(format)
        if kind is None:
            known = ", ".join(sorted(MESSAGE_FORMATS))
            raise ConfigError(f"{where}.format", f"format {format!r} is unknown (known: {known})")
        field_names = list(names) if names is not None else None
        if field_names is None and kind.default_columns is not None:
            field_names = list(kind.default_columns)
        if kind.dialect is not None:
            if field_names is None:
                raise ConfigError(f"{where}.columns", f"format {format!r} needs column names")
            missing = [c for c in columns if c not in field_names]
            if missing:
                raise ConfigError(
                    f"{where}.columns",
                    f"column {missing[0]!r} is not in the messages of {source!r} "
                    f"(columns: {', '.join(field_names)})",
                )
        self.format = kind
        self.field_count = len(field_names or ()) if kind.dialect is not None else 0
        self.columns = list(dict.fromkeys(columns))  # a column may serve several roles
        self.source = source
        request = ReadRequest(
            path=Path(source),
            display=source,
            source=SourceSpec(path=source, format=format, columns=field_names),
            where=where,
            columns=self.columns,
            threads=1,
        )
        self._parse = kind.block_parser(request, field_names)

    def parse(self, messages: Sequence[StreamMessage], position: Offset) -> StreamChunk:
        """The rows of ``messages`` (M), in order; ``position`` is the reader's
        position, used as ``StreamChunk.position`` when M = 0."""
        lines: list[bytes] = []
        numbers: list[int] = []  # message number (1-based) of each line of the block
        invalid: list[BadRow] = []
        for number, message in enumerate(messages, start=1):
            payload = message.payload.removesuffix(b"\n").removesuffix(b"\r")
            reason = message.problem or _screen(payload)
            if reason is None and self.field_count and not _is_utf8(payload):
                reason = self._field_count_problem(payload)
            if reason is not None:
                invalid.append(BadRow(self.source, number, reason))
                continue
            lines.append(payload)
            numbers.append(number)
        raw = self._parse_lines(lines, np.asarray(numbers, dtype=np.int64), invalid)
        offsets = [m.offset for m in messages]
        stamps = [-1 if m.timestamp_ms is None else m.timestamp_ms for m in messages]
        return StreamChunk(
            raw=raw,
            offsets=offsets,
            timestamps_ms=np.asarray(stamps, dtype=np.int64),
            position=offsets[-1] if offsets else position,
        )

    def _parse_lines(
        self, lines: list[bytes], numbers: Int64Array, screened: list[BadRow]
    ) -> RawChunk:
        """Parse the block of ``lines``; map its line numbers to message ``numbers``."""
        chunk: RawChunk | None = None
        if lines:
            try:
                chunk = self._parse(b"\n".join(lines) + b"\n", 1, len(lines))
            except DataFileError:
                chunk = None  # e.g. an unterminated quote: parse message by message
            if chunk is not None and chunk.rows_read != len(lines):
                chunk = None  # defensive: every line must be exactly one row or one bad row
            if chunk is None:
                chunk = self._one_by_one(lines)
        if chunk is None:  # no line to parse: every message was screened out
            columns = {c: pa.nulls(0, pa.binary()) for c in self.columns}
            return RawChunk(self.source, columns, np.zeros(0, np.int64), screened)
        invalid = [BadRow(self.source, int(numbers[b.line - 1]), b.reason) for b in chunk.invalid]
        if screened:
            invalid = sorted([*screened, *invalid], key=lambda b: b.line)
        return RawChunk(
            file=self.source,
            columns=chunk.columns,
            line_numbers=numbers[chunk.line_numbers - 1],
            invalid=invalid,
        )

    def _field_count_problem(self, payload: bytes) -> str | None:
        """Fields of a non-UTF-8 delimited row, counted here: pyarrow cannot report
        such a row as invalid (its handler decodes the text) and fails the block."""
        dialect = self.format.dialect
        assert dialect is not None
        text = payload.decode("utf-8", "surrogateescape")
        if dialect.quote_char is False:
            found = text.count(dialect.delimiter) + 1
        else:
            try:
                found = len(next(csv.reader([text], delimiter=dialect.delimiter, strict=True)))
            except csv.Error as e:
                return f"cannot parse: {e}"
        if found != self.field_count:
            return f"expected {self.field_count} fields, found {found}"
        return None

    def _one_by_one(self, lines: list[bytes]) -> RawChunk:
        """Each line parsed alone; a line that fails is a bad row (slow path)."""
        parts: list[RawChunk] = []
        invalid: list[BadRow] = []
        for number, line in enumerate(lines, start=1):
            try:
                part = self._parse(line + b"\n", number, 1)
            except DataFileError as e:
                invalid.append(BadRow(self.source, number, _reason(e, self.source)))
                continue
            if part.rows_read != 1:
                invalid.append(BadRow(self.source, number, "not exactly one row"))
                continue
            parts.append(part)
            invalid.extend(part.invalid)
        columns = {}
        for c in self.columns:
            arrays = [part.columns[c] for part in parts]
            if len({a.type for a in arrays}) > 1:  # e.g. int64 next to binary: all as text
                arrays = [to_text(a) for a in arrays]
            columns[c] = pa.concat_arrays(arrays) if arrays else pa.nulls(0, pa.binary())
        numbers = [part.line_numbers for part in parts]
        return RawChunk(
            file=self.source,
            columns=columns,
            line_numbers=np.concatenate(numbers) if numbers else np.zeros(0, np.int64),
            invalid=invalid,
        )


def _screen(payload: bytes) -> str | None:
    """Why a payload cannot be one line of a block, or None."""
    if not payload.strip(_BLANK):
        return "empty message"
    if _LINE_BREAKS.search(payload) is not None:
        return "a line break inside the message (one message must be one row on one line)"
    return None


def _is_utf8(payload: bytes) -> bool:
    try:
        payload.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _reason(error: DataFileError, source: str) -> str:
    """A parser's error as a bad-row reason (without the file and line prefix)."""
    message = str(error).removeprefix(f"{source}: ")
    return _WHERE_PREFIX.sub("cannot parse: ", message)
