"""Shared machinery of the line-based formats: delimited text (criteo_tsv, csv,
tsv) here; ``jsonl`` reuses the decompression, blocks and parse pool
(``text_blocks``, ``parse_blocks``).

Pipeline for one file::

    file -> decompress (pyarrow stream, C++) -> blocks of whole lines (~2 MB)
         -> per block, blocks on a thread pool: the numba tokenizer
            (``tokenize``, unquoted blocks: field spans, no copies) or
            pyarrow.csv.read_csv (quoted values), serial inside the block
         -> RawChunk (binary columns + physical line numbers)

Why blocks of our own instead of one ``read_csv`` call: pyarrow's
``invalid_row_handler`` only reports a row's line number when parsing is
single-threaded. Cutting the text ourselves at newlines gives every block a known
first line (the newlines before it) and lets blocks parse in parallel.

Line numbers are physical lines of the decompressed text, 1-based, header
included. pyarrow skips blank lines (``""`` or ``"\\r"``) and numbers invalid rows
among the non-blank ones; when a block has blank lines we locate them with one
numpy pass over the block, otherwise the mapping is the identity. A value with a
quoted newline (or bare ``\\r`` line endings) would make a row span lines; it is
rejected with ``DataFileError`` rather than given wrong line numbers.
"""

from __future__ import annotations

import csv
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

from estuary.config.errors import ConfigError
from estuary.data.badrows import BadRow
from estuary.data.errors import DataFileError
from estuary.data.formats.tokenize import count_newlines, split_block
from estuary.data.formats.types import RawChunk, ReadRequest
from estuary.data.formats.values import one_array

__all__ = [
    "COMPRESSION_BY_SUFFIX",
    "Dialect",
    "block_parser",
    "compression_for",
    "count_lines",
    "parse_blocks",
    "read_delimited",
    "text_blocks",
]

COMPRESSION_BY_SUFFIX: dict[str, str] = {
    ".gz": "gzip",
    ".gzip": "gzip",
    ".zst": "zstd",
    ".zstd": "zstd",
    ".bz2": "bz2",
}
"""``compression: auto`` picks the codec from the file's last suffix; else none."""

_NEWLINE = ord("\n")
_CR = ord("\r")


@dataclass(frozen=True)
class Dialect:
    """How a delimited-text format splits fields.

    Args:
        delimiter: one character.
        quote_char: the quoting character, or ``False`` for none (faster).
        header: the first line holds the column names.
    """

    delimiter: str
    quote_char: str | Literal[False]
    header: bool


def compression_for(path: Path, setting: str) -> str | None:
    """The pyarrow codec name for ``path`` (``None`` = plain text)."""
    if setting == "auto":
        return COMPRESSION_BY_SUFFIX.get(path.suffix.lower())
    return None if setting == "none" else setting


def _open(request: ReadRequest) -> pa.NativeFile:
    codec = compression_for(request.path, request.source.compression)
    try:
        return pa.input_stream(str(request.path), compression=codec)
    except FileNotFoundError:
        raise DataFileError(f"{request.display}: file not found") from None
    except (OSError, pa.ArrowException) as e:
        raise DataFileError(f"{request.display}: cannot open ({codec or 'plain'}): {e}") from e


def text_blocks(request: ReadRequest) -> Iterator[bytes]:
    """The decompressed text in blocks that end at a newline (the last may not)."""
    codec = compression_for(request.path, request.source.compression) or "plain"
    carry: list[bytes] = []  # text after the last newline so far (a line's start)
    with _open(request) as stream:
        while True:
            try:
                data = stream.read(request.block_size_bytes)
            except (OSError, pa.ArrowException) as e:
                # pyarrow says "Truncated compressed stream" for a cut-off gzip.
                raise DataFileError(
                    f"{request.display}: truncated or corrupt {codec} stream: {e}"
                ) from e
            if not data:
                break
            cut = data.rfind(b"\n")
            if cut < 0:  # one line longer than a block: keep reading
                carry.append(data)
                continue
            end = cut + 1
            if carry:  # one copy: the carried start + this read up to its last newline
                yield b"".join([*carry, memoryview(data)[:end]])
            else:
                yield data if end == len(data) else data[:end]
            carry = [data[end:]] if end < len(data) else []
    if carry:
        yield b"".join(carry)


def _split_header(request: ReadRequest, dialect: Dialect, first: bytes) -> tuple[list[str], bytes]:
    """(column names, the rest of the block) from the first block of a header file."""
    end = first.find(b"\n")
    line, rest = (first, b"") if end < 0 else (first[:end], first[end + 1 :])
    line = line.removeprefix(b"\xef\xbb\xbf").rstrip(b"\r")  # UTF-8 BOM, CRLF
    try:
        header = pacsv.read_csv(
            pa.py_buffer(line + b"\n"),
            read_options=pacsv.ReadOptions(use_threads=False),
            parse_options=pacsv.ParseOptions(
                delimiter=dialect.delimiter, quote_char=dialect.quote_char
            ),
        )
    except pa.ArrowException as e:
        raise DataFileError(f"{request.display}:1: cannot parse the header row: {e}") from e
    names = list(header.column_names)
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise DataFileError(f"{request.display}:1: duplicate column names {duplicates}")
    return names, rest


def _check_columns(request: ReadRequest, names: list[str], origin: str) -> None:
    missing = [c for c in request.columns if c not in names]
    if missing:
        raise ConfigError(
            "data.schema",
            f"column {missing[0]!r} is not in {request.display} ({origin}: {', '.join(names)})",
        )


def _nonblank_lines(block: bytes) -> np.ndarray:
    """0-based indices (int64) of the block's lines that pyarrow does not skip."""
    buf = np.frombuffer(block, dtype=np.uint8)
    newlines = np.flatnonzero(buf == _NEWLINE)
    starts = np.concatenate(([0], newlines + 1))
    ends = np.concatenate((newlines, [buf.shape[0]]))
    if block.endswith(b"\n"):  # the text after the final newline is not a line
        starts, ends = starts[:-1], ends[:-1]
    length = ends - starts
    first = buf[np.minimum(starts, buf.shape[0] - 1)]
    blank = (length == 0) | ((length == 1) & (first == _CR))
    return np.flatnonzero(~blank).astype(np.int64)


class _BlockParser:
    """Parses one block of whole lines into a RawChunk (thread-safe, stateless)."""

    def __init__(self, request: ReadRequest, dialect: Dialect, names: list[str]) -> None:
        self.request = request
        self.names = names
        self.parse_options = dict(delimiter=dialect.delimiter, quote_char=dialect.quote_char)
        # The numba tokenizer (``tokenize``) reads blocks without quoting: always
        # for an unquoted dialect, else blocks that hold no quote character.
        self.quote = dialect.quote_char.encode() if dialect.quote_char else None
        self.delimiter = dialect.delimiter
        self.fast = (
            len(dialect.delimiter) == 1
            and dialect.delimiter.isascii()
            and dialect.delimiter not in "\r\n"
        )
        slot = {c: k for k, c in enumerate(request.columns)}
        self.slots = np.array([slot.get(name, -1) for name in names], dtype=np.int64)
        # Binary, not string: no UTF-8 validation cost, and invalid UTF-8 in a
        # categorical is hashed as bytes instead of failing the whole block.
        self.convert = pacsv.ConvertOptions(
            column_types={c: pa.binary() for c in request.columns},
            include_columns=list(request.columns),
        )

    def __call__(self, block: bytes, first_line: int, lines: int) -> RawChunk:
        """Parse ``block`` (``lines`` physical lines, the first being ``first_line``)."""
        if self.fast and (self.quote is None or self.quote not in block):
            chunk = self._split(block, first_line, lines)
            if chunk is not None:
                return chunk
        return self._parse(block, first_line, lines)

    def _split(self, block: bytes, first_line: int, lines: int) -> RawChunk | None:
        """The numba tokenizer's reading of an unquoted block; ``None``: use pyarrow."""
        split = split_block(block, self.delimiter, self.slots, list(self.request.columns), lines)
        if split is None:
            return None
        expected = len(self.names)
        invalid = [
            BadRow(
                self.request.display, first_line + line, f"expected {expected} fields, found {n}"
            )
            for line, n in zip(split.bad_lines.tolist(), split.bad_fields.tolist(), strict=True)
        ]
        return RawChunk(
            file=self.request.display,
            columns=split.columns,
            line_numbers=split.good_lines + first_line,
            invalid=invalid,
        )

    def _parse(self, block: bytes, first_line: int, lines: int) -> RawChunk:
        """pyarrow's reading of a block (quoted values, and the tokenizer's fallbacks)."""
        rejected: list[tuple[int, int]] = []  # (number among non-blank lines, fields)

        def on_invalid(row: pacsv.InvalidRow) -> str:
            # Called in line order: parsing inside one block is single-threaded.
            rejected.append((row.number, row.actual_columns))
            return "skip"

        if not block.isascii():
            # pyarrow decodes an invalid row's text as UTF-8 before calling the
            # handler; when that fails the row is not skipped and the whole block
            # fails. Such rows (wrong field count and invalid UTF-8) get their bad
            # bytes replaced first (same fields, same lines: still a bad row).
            block = self._clean_invalid_utf8(block) or block
        try:
            table = self._read(block, on_invalid)
        except pa.ArrowInvalid as e:  # e.g. an unterminated quote
            raise self._parse_error(first_line, lines, e) from e
        nonblank = table.num_rows + len(rejected)
        physical: np.ndarray | None = None
        if lines != nonblank:
            physical = _nonblank_lines(block)
            if physical.shape[0] != nonblank:
                raise DataFileError(
                    f"{self.request.display}: a row spans several lines between lines "
                    f"{first_line} and {first_line + lines - 1} (a quoted newline, or bare "
                    "CR line endings); every row must be one line"
                )
        keep = np.ones(nonblank, dtype=bool)
        bad_index = np.array([number - 1 for number, _ in rejected], dtype=np.int64)
        keep[bad_index] = False
        good_index = np.flatnonzero(keep)
        if physical is not None:
            good_index, bad_index = physical[good_index], physical[bad_index]
        expected = len(self.names)
        invalid = [
            BadRow(
                self.request.display,
                first_line + int(index),
                f"expected {expected} fields, found {fields}",
            )
            for index, (_, fields) in zip(bad_index, rejected, strict=True)
        ]
        columns = {c: one_array(table.column(c)) for c in self.request.columns}
        return RawChunk(
            file=self.request.display,
            columns=columns,
            line_numbers=good_index.astype(np.int64) + first_line,
            invalid=invalid,
        )

    def _read(self, block: bytes, on_invalid: Callable[[pacsv.InvalidRow], str]) -> pa.Table:
        return pacsv.read_csv(
            pa.py_buffer(block),
            read_options=pacsv.ReadOptions(
                column_names=self.names,
                use_threads=False,
                block_size=max(len(block) + 1, 1 << 20),
            ),
            parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid, **self.parse_options),
            convert_options=self.convert,
        )

    def _parse_error(self, first_line: int, lines: int, error: Exception) -> DataFileError:
        return DataFileError(
            f"{self.request.display}: cannot parse lines {first_line}-"
            f"{first_line + lines - 1}: {error}"
        )

    def _clean_invalid_utf8(self, block: bytes) -> bytes | None:
        """``block`` with each line that is not UTF-8 and has the wrong field count
        made UTF-8 (bad bytes -> U+FFFD); ``None`` when there is no such line."""
        try:
            block.decode("utf-8")
            return None
        except UnicodeDecodeError:
            pass
        delimiter = str(self.parse_options["delimiter"])
        quote = self.parse_options["quote_char"]
        fmt: dict[str, Any] = (
            {"quotechar": quote} if isinstance(quote, str) else {"quoting": csv.QUOTE_NONE}
        )
        lines = block.split(b"\n")
        changed = False
        for i, line in enumerate(lines):
            try:
                line.decode("utf-8")
                continue
            except UnicodeDecodeError:
                pass
            # latin-1 keeps every byte; delimiters and quotes are ASCII.
            fields = next(
                csv.reader([line.decode("latin-1").rstrip("\r")], delimiter=delimiter, **fmt), []
            )
            if len(fields) != len(self.names):
                lines[i] = line.decode("utf-8", "replace").encode("utf-8")
                changed = True
        return b"\n".join(lines) if changed else None


def block_parser(
    request: ReadRequest, dialect: Dialect, names: list[str]
) -> Callable[[bytes, int, int], RawChunk]:
    """The parser of one block of whole lines, ``parse(block, first_line, lines)``,
    for text that is not a file (stream messages); thread-safe."""
    return _BlockParser(request, dialect, names)


def read_delimited(
    request: ReadRequest, dialect: Dialect, names: list[str] | None = None
) -> Iterator[RawChunk]:
    """Read one delimited-text file as RawChunks, in file order.

    Args:
        request: file, wanted columns, block size, threads.
        dialect: delimiter, quoting, header.
        names: the file's column names when it has no header row.
    """
    blocks = text_blocks(request)
    first_line = 1
    if dialect.header:
        first = next(blocks, None)
        if first is None:
            return  # an empty file has no header: 0 rows, the caller warns
        names, rest = _split_header(request, dialect, first)
        _check_columns(request, names, "header")
        first_line = 2
        blocks = _chain_first(rest, blocks)
    else:
        assert names is not None, "header-less formats need column names"
        _check_columns(request, names, "columns")
    yield from parse_blocks(request, blocks, _BlockParser(request, dialect, names), first_line)


def parse_blocks(
    request: ReadRequest,
    blocks: Iterator[bytes],
    parse: Callable[[bytes, int, int], RawChunk],
    first_line: int = 1,
) -> Iterator[RawChunk]:
    """``parse(block, first_line, lines)`` over blocks of whole lines, yielded in order.

    With ``request.threads > 1`` blocks parse on a pool, at most 2 per thread in
    flight; decompression stays on this thread (pyarrow releases the GIL while
    inflating). ``parse`` must be thread-safe.
    """
    if request.threads <= 1:
        for block in blocks:
            lines = count_lines(block)
            yield parse(block, first_line, lines)
            first_line += lines
        return
    pool = ThreadPoolExecutor(request.threads, thread_name_prefix="estuary-parse")
    pending: deque[Future[RawChunk]] = deque()
    try:
        for block in blocks:
            lines = count_lines(block)
            pending.append(pool.submit(parse, block, first_line, lines))
            first_line += lines
            if len(pending) >= 2 * request.threads:
                yield pending.popleft().result()  # blocks until the oldest is parsed
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def count_lines(block: bytes) -> int:
    """Physical lines in a block; only the file's last block may lack the final newline.

    Runs on the reading thread for every block, so it counts without the GIL."""
    return count_newlines(block) + (0 if block.endswith(b"\n") else 1)


def _chain_first(first: bytes, rest: Iterator[bytes]) -> Iterator[bytes]:
    if first:
        yield first
    yield from rest
