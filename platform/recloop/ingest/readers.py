"""Read one landing file, batch by batch, into Arrow tables of its original values, or reject it whole.

A reader does no validation beyond what it takes to split a file into rows and columns: it yields the
values as they were written (strings for text formats, the file's own types for parquet), each row's
position in the source, and the rows that could not even be split into fields (a Criteo line with the
wrong number of tabs, a CSV line with the wrong number of commas) with their raw text. Memory stays
bounded whatever the file's size: parquet is read a row group at a time in batches of at most
``batch_rows`` rows, CSV in blocks of about ``batch_rows`` lines, Criteo TSV ``batch_rows`` lines at a time.

A file that cannot be read raises ``FileRejected`` with the reason, before or during the batches:

- ``permanent=True``: the bytes themselves are bad (truncated, not the format it claims, wrong
  encoding, empty). The ledger remembers them, so the same bytes are not tried again.
- ``permanent=False``: the file could not be read this time (it vanished, it is not readable, it changed
  while being read). Nothing is remembered; the next run tries again.

Files are opened without following a symbolic link and without blocking (a FIFO named ``x.csv`` must not
hang the run), and the digest and the rows come from the same open handle: a file replaced or deleted
after it was found is either read as it was or refused, never mixed.

Row numbers (``source_row``) count data rows from 0 in file order: parquet rows, CSV lines after the
header, Criteo lines.

Text files are UTF-8; a byte order mark at the start (Excel's "CSV UTF-8" writes one) is dropped.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import os
import re
import stat
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recloop.schema import DatasetSpec

PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".csv.gz")
DEFAULT_BATCH_ROWS = 65_536
_READ_ERRORS = (pa.ArrowException, OSError, EOFError, zlib.error, ValueError)


class FileRejected(Exception):
    """The file cannot be ingested; ``permanent`` says whether its bytes are to blame (see module doc)."""

    def __init__(self, reason: str, permanent: bool = True):
        super().__init__(reason)
        self.permanent = permanent


@dataclass
class SourceBatch:
    """A batch of rows of one file.

    Attributes:
        table: one row per readable row, columns as named in the file, original values.
        source_row: (len(table),) int64, each row's position in the file.
        unsplittable: rows that could not be split into fields: ``source_row``, ``raw_line``, ``reason``.
        text: whether the values are text still to be parsed (CSV, TSV) rather than typed (parquet).
    """

    table: pa.Table
    source_row: np.ndarray
    unsplittable: list[tuple[int, str, str]] = field(default_factory=list)
    text: bool = False
    notes: list[str] = field(default_factory=list)  # about the file as a whole (read by content, not name)

    @property
    def rows_in(self) -> int:
        return self.table.num_rows + len(self.unsplittable)


def open_landing_file(path: Path, identity: tuple[int, int] | None = None, follow: bool = False) -> BinaryIO:
    """Open a landing file for reading, refusing links, special files and a file swapped since it was found.

    Args:
        identity: ``(st_dev, st_ino)`` seen when the file was found; the opened file must be that one.
        follow: follow a symbolic link (only for a file the user named explicitly).
    """
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except FileNotFoundError as err:
        raise FileRejected("vanished before it could be read", permanent=False) from err
    except OSError as err:
        if err.errno == 40:  # ELOOP: the last component became a symbolic link
            raise FileRejected("symbolic link (not followed)", permanent=False) from err
        raise FileRejected(f"cannot open: {err.strerror}", permanent=False) from err
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise FileRejected("not a regular file", permanent=False)
    if identity is not None and (info.st_dev, info.st_ino) != identity:
        os.close(fd)
        raise FileRejected("replaced by another file after it was found", permanent=False)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def file_digest(handle: BinaryIO) -> tuple[str, int]:
    """SHA-256 of the file's bytes (its identity in the ledger) and its size; leaves the handle at 0."""
    digest, size = hashlib.sha256(), 0
    try:
        handle.seek(0)
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
        handle.seek(0)
    except OSError as err:
        raise FileRejected(f"cannot read: {err.strerror or err}", permanent=False) from err
    return digest.hexdigest(), size


def check_unchanged(handle: BinaryIO, size: int) -> None:
    """Refuse a file that grew or shrank while it was read (someone is still writing it in place)."""
    now = os.fstat(handle.fileno()).st_size
    if now != size:
        raise FileRejected(f"changed while being read ({size} → {now} bytes)", permanent=False)


def read_batches(handle: BinaryIO, name: str, spec: DatasetSpec, digest: str,
                 batch_rows: int = DEFAULT_BATCH_ROWS, settled_only: bool = False) -> Iterator[SourceBatch]:
    """Batches of the open file ``handle`` (called ``name``) as the spec's format says.

    Raises ``FileRejected`` (before the first batch or between two) if the file cannot be read, or, with
    ``settled_only`` (a file found in the landing zone), if it is text that may still be being written
    (``_check_settled``).
    """
    info = os.fstat(handle.fileno())
    if info.st_size == 0:
        raise FileRejected("empty file (0 bytes)")
    lowered = name.lower()
    found = sniff(handle, spec)
    by_suffix = ("parquet" if lowered.endswith(PARQUET_SUFFIXES) else "csv" if lowered.endswith(CSV_SUFFIXES)
                 else "tsv" if lowered.endswith((".tsv", ".tsv.gz")) else None)
    if found.kind == "parquet":
        content = "parquet"
    elif found.header is not None:
        content = "csv" if found.delimiter == "," else "tsv"
    else:
        content = "headerless TSV" if spec.format == "criteo_tsv" else None
    note = None
    expected = by_suffix or ("headerless TSV" if spec.format == "criteo_tsv" else None)
    if spec.format == "criteo_tsv" and by_suffix == "tsv" and content == "headerless TSV":
        expected = content  # a Criteo log named .tsv: what its name says
    if content is not None and content != expected:
        shown = {"csv": "CSV with a header", "tsv": "tab-separated text with a header"}.get(content, content)
        note = (f"{name}: read as {shown} by its content (its name says "
                f"{by_suffix or 'nothing of its format'}); name it {_suffix_for(content)} to say so")
    if settled_only and found.kind == "text" and not found.compressed and (
            spec.format == "criteo_tsv" or content in ("csv", "tsv") or by_suffix == "csv"):
        _check_settled(handle, info)
    if spec.format == "criteo_tsv":
        if content in ("parquet", "csv", "tsv"):
            batches = _criteo_table_file(handle, name, spec, batch_rows, content, found)
        else:
            batches = _read_criteo(handle, name, spec, digest, batch_rows, found.compressed)
    elif content == "parquet" or (content is None and by_suffix == "parquet"):
        batches = _read_parquet(handle, batch_rows)
    elif content in ("csv", "tsv") or by_suffix == "csv":
        batches = _read_csv(handle, found.compressed, batch_rows, found.delimiter)
    else:
        suffix = Path(name).suffix or "(no suffix)"
        raise FileRejected(
            f"unsupported file type {suffix!r} for spec {spec.name!r}: expected {PARQUET_SUFFIXES + CSV_SUFFIXES}, "
            "or text whose first line names the spec's columns"
        )
    return _noted(batches, note) if note else batches


# A text file whose last line has no line end and that changed this recently may still be being written:
# it waits for the next run. (Read at once, a line cut at "0." of "0.75" landed as 0.0, and the finished
# line was refused later as a duplicate id: the wrong value stayed.) An older one is read as it is.
UNSETTLED_SECONDS = 60.0


def _check_settled(handle: BinaryIO, info: os.stat_result) -> None:
    """Refuse for now a file whose last byte is not a line end and whose last change is recent: the file's
    time against the wall clock (not the ingest's own ``now``, which judges the events' timestamps)."""
    handle.seek(info.st_size - 1)
    last = handle.read(1)
    handle.seek(0)
    age = time.time() - info.st_mtime
    if last != b"\n" and age < UNSETTLED_SECONDS:
        raise FileRejected(f"its last line has no line end and it changed {max(age, 0):.0f} s ago: it may still be "
                           f"being written (read once it has not changed for {UNSETTLED_SECONDS:.0f} s)",
                           permanent=False)


@dataclass(frozen=True)
class Sniffed:
    """What a file's first bytes say it is: ``parquet`` or ``text`` (maybe gzip-compressed), and for text its
    delimiter and whether the first line is a header (its fields, when it names the spec's columns)."""

    kind: str
    compressed: bool = False
    delimiter: str = ","
    header: tuple[str, ...] | None = None


def sniff(handle: BinaryIO, spec: DatasetSpec) -> Sniffed:
    """The file's format by its content, not its name (a CSV with a header named ``train.txt``); leaves the
    handle at 0. A header is a first line of which at least half the fields are names of the spec's
    columns; the delimiter is a tab or a comma, whichever the first line has more of."""
    try:
        head = handle.read(4)
        handle.seek(0)
        if head == b"PAR1":
            return Sniffed("parquet")
        compressed = head[:2] == b"\x1f\x8b"
        line = _text_stream(handle, compressed).readline(1 << 20)
        handle.seek(0)
    except _READ_ERRORS:
        handle.seek(0)
        return Sniffed("text")
    text = line.decode("utf-8-sig", errors="replace").rstrip("\r\n")
    delimiter = "\t" if text.count("\t") > text.count(",") else ","
    fields = tuple(f.strip() for f in next(csv.reader([text], delimiter=delimiter), []))
    known = set(spec.file_fields) | {c.name for c in spec.columns}
    named = sum(f in known for f in fields)
    header = fields if fields and named >= max(1, len(fields) // 2) else None
    return Sniffed("text", compressed, delimiter, header)


def _suffix_for(content: str) -> str:
    return {"parquet": ".parquet", "csv": ".csv", "tsv": ".tsv"}.get(content, "without .csv/.parquet")


def _noted(batches: Iterator[SourceBatch], note: str) -> Iterator[SourceBatch]:
    """The batches, the first carrying ``note`` (the run's summary prints it as a hint)."""
    first = True
    for batch in batches:
        if first:
            batch.notes.append(note)
            first = False
        yield batch


def _guarded(batches: Iterator[SourceBatch], what: str) -> Iterator[SourceBatch]:
    """Turn a read error in the middle of a file into ``FileRejected`` (the file's bytes are bad)."""
    try:
        yield from batches
    except FileRejected:
        raise
    except _READ_ERRORS as err:
        raise FileRejected(f"not a readable {what} file: {_utf8_hint(err)}") from err


def _utf8_hint(err: Exception) -> str:
    text = str(err)
    return f"not UTF-8 text ({text})" if "UTF8" in text or "utf-8" in text.lower() else text


# --- parquet -----------------------------------------------------------------------------------------------


def _read_parquet(handle: BinaryIO, batch_rows: int) -> Iterator[SourceBatch]:
    try:
        source = pq.ParquetFile(handle, buffer_size=1 << 20, pre_buffer=False)
    except _READ_ERRORS as err:
        raise FileRejected(f"not a readable parquet file: {err}") from err

    def batches() -> Iterator[SourceBatch]:
        start = 0
        for batch in source.iter_batches(batch_size=batch_rows, use_threads=False):
            table = pa.Table.from_batches([batch])
            yield SourceBatch(table=table, source_row=np.arange(start, start + table.num_rows, dtype=np.int64))
            start += table.num_rows
        if start == 0:  # no rows at all: still one (empty) batch, so the file's columns are checked
            yield SourceBatch(table=source.schema_arrow.empty_table(), source_row=np.empty(0, np.int64))

    return _guarded(batches(), "parquet")


# --- CSV ---------------------------------------------------------------------------------------------------


def _header_only(handle: BinaryIO, compressed: bool) -> bool:
    """Whether nothing but blank space follows the first line; leaves the handle at 0."""
    try:
        stream = _text_stream(handle, compressed)
        stream.readline()
        blank = True
        while blank and (block := stream.read(1 << 16)):
            blank = not block.strip()
        handle.seek(0)
    except _READ_ERRORS as err:
        raise FileRejected(f"cannot decompress: {err}") from err
    return blank


def _text_stream(handle: BinaryIO, compressed: bool) -> BinaryIO:
    return gzip.GzipFile(fileobj=handle, mode="rb") if compressed else handle  # type: ignore[return-value]


def _read_csv(handle: BinaryIO, compressed: bool, batch_rows: int, delimiter: str = ",") -> Iterator[SourceBatch]:
    """CSV (or ``delimiter``-separated text) with a header line; every column read as text, empty fields as null."""
    try:
        header_line = _text_stream(handle, compressed).readline().rstrip(b"\r\n")
        handle.seek(0)
    except _READ_ERRORS as err:
        raise FileRejected(f"cannot decompress: {err}") from err
    if not header_line.strip():
        raise FileRejected("no header line")
    header_only = _header_only(handle, compressed)
    try:
        # utf-8-sig: Excel's "CSV UTF-8" starts with a byte order mark, not part of the first column's name.
        names = [n.strip() if delimiter == "\t" else n
                 for n in next(csv.reader([header_line.decode("utf-8-sig")], delimiter=delimiter))]
    except UnicodeDecodeError as err:
        raise FileRejected(f"not UTF-8 text (header byte {err.start})") from err
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise FileRejected(f"header names columns more than once: {duplicated}")

    if header_only:  # no rows (Arrow refuses to skip a header line with no line end after it)
        return iter([SourceBatch(table=pa.table({n: pa.array([], pa.string()) for n in names}),
                                 source_row=np.empty(0, np.int64), text=True)])

    invalid: list[tuple[int, str, str]] = []

    def on_invalid_row(row: pacsv.InvalidRow) -> str:
        # row.number is the 1-based physical line (header = line 1) when reading single-threaded.
        invalid.append(
            (int(row.number) - 2, row.text, f"wrong_field_count:{row.actual_columns}/{row.expected_columns}")
        )
        return "skip"

    try:
        reader = pacsv.open_csv(
            _text_stream(handle, compressed),
            read_options=pacsv.ReadOptions(use_threads=False, block_size=max(1 << 16, batch_rows * 256),
                                           column_names=names, skip_rows=1),
            parse_options=pacsv.ParseOptions(delimiter=delimiter, invalid_row_handler=on_invalid_row),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=True, null_values=[""]
            ),
        )
    except _READ_ERRORS as err:
        raise FileRejected(f"not a readable CSV file: {_utf8_hint(err)}") from err

    def batches() -> Iterator[SourceBatch]:
        rows = _RowNumbers()
        for batch in reader:
            table = pa.Table.from_batches([batch])
            skipped, invalid[:] = list(invalid), []
            yield SourceBatch(table=table, source_row=rows.take(table.num_rows, skipped), unsplittable=skipped,
                              text=True)
        if invalid or rows.next == 0:  # bad lines after the last good one; or no rows (columns still checked)
            empty = pa.table({n: pa.array([], pa.string()) for n in names})
            yield SourceBatch(table=empty, source_row=rows.take(0, list(invalid)), unsplittable=list(invalid),
                              text=True)

    return _guarded(batches(), "CSV")


class _RowNumbers:
    """Hands out source row numbers to parsed rows in order, passing over the lines the parser skipped."""

    def __init__(self) -> None:
        self.next = 0
        self._skipped: set[int] = set()

    def take(self, count: int, skipped: list[tuple[int, str, str]]) -> np.ndarray:
        self._skipped.update(r for r, _, _ in skipped)
        ahead = np.array(sorted(r for r in self._skipped if r >= self.next), dtype=np.int64)
        span = np.arange(self.next, self.next + count + len(ahead), dtype=np.int64)
        numbers = span[~np.isin(span, ahead)][:count]
        if count:
            self.next = int(numbers[-1]) + 1
            self._skipped = {r for r in self._skipped if r >= self.next}
        return numbers


# --- Criteo TSV ----------------------------------------------------------------------------------------------


def criteo_event_ids(rows: list[str]) -> pa.Array:
    """Criteo event ids from each row's content (its fields joined by tabs): the same row gives the same id
    whichever file, name or position it arrives in, so a file sent again lands nothing twice."""
    return pa.array([f"criteo-{hashlib.sha256(r.encode()).hexdigest()[:24]}" for r in rows], pa.string())


def _criteo_day(name: str, spec: DatasetSpec, total_rows: int) -> tuple[int, int]:
    """(first timestamp, step) in microseconds: a file's rows spread evenly over its day."""
    assert spec.criteo is not None  # validated by the spec
    match = re.search(spec.criteo.day_pattern, name)
    day_start = spec.criteo.start + timedelta(days=int(match.group(1)) if match else 0)
    return int(day_start.timestamp() * 1_000_000), 86_400_000_000 // max(total_rows, 1)


def _criteo_table_file(handle: BinaryIO, name: str, spec: DatasetSpec, batch_rows: int, content: str,
                       found: Sniffed) -> Iterator[SourceBatch]:
    """Criteo fields in text with a header (``content`` csv or tsv) or a parquet file (named columns: the spec's
    file fields); the event id and timestamp derived as for TSV, unless the file carries both already (rows
    written from a lake: ``recloop replay``'s landing files, an export), which are kept as they are."""
    try:
        if content == "parquet":
            total = pq.ParquetFile(handle).metadata.num_rows
        else:
            total = max(_count_lines(_text_stream(handle, found.compressed)) - 1, 0)
        handle.seek(0)
    except _READ_ERRORS as err:
        raise FileRejected(f"not a readable file: {err}") from err
    start_us, step_us = _criteo_day(name, spec, total)
    inner = (_read_parquet(handle, batch_rows) if content == "parquet"
             else _read_csv(handle, found.compressed, batch_rows, found.delimiter))
    fields = spec.file_fields

    def batches() -> Iterator[SourceBatch]:
        for batch in inner:
            table = batch.table
            if spec.event_id in table.column_names and spec.timestamp in table.column_names:
                yield batch  # already derived once (deriving again named each column twice)
                continue
            present = [f for f in fields if f in table.column_names]
            text = [pc.cast(table[f], pa.string()).fill_null("") for f in present] or [pa.array([""] * len(table))]
            joined = pc.binary_join_element_wise(*text, "\t").to_pylist() if table.num_rows else []
            table = table.append_column(spec.event_id, criteo_event_ids(joined)).append_column(
                spec.timestamp, pa.array(start_us + batch.source_row * step_us, pa.timestamp("us", tz="UTC")))
            yield SourceBatch(table=table, source_row=batch.source_row, unsplittable=batch.unsplittable,
                              text=batch.text)

    return batches()


def _read_criteo(handle: BinaryIO, name: str, spec: DatasetSpec, digest: str,
                 batch_rows: int, compressed: bool) -> Iterator[SourceBatch]:
    """Criteo TSV: no header, fields = the spec's file fields; id and timestamp derived (see CriteoOptions).

    Rows are spread evenly over the file's day, so the lines are counted first (one extra pass).
    """
    try:
        total_lines = _count_lines(_text_stream(handle, compressed))
        handle.seek(0)
    except _READ_ERRORS as err:
        raise FileRejected(f"cannot decompress: {err}") from err
    start_us, step_us = _criteo_day(name, spec, total_lines)
    fields = spec.file_fields

    def parse(first_line: int, raw_lines: list[bytes]) -> SourceBatch:
        good, bad, body = [], [], []
        for offset, raw in enumerate(raw_lines):
            number = first_line + offset
            try:
                # A byte order mark (some editors start UTF-8 text with one) is not part of the first field.
                line = raw.rstrip(b"\n").rstrip(b"\r").decode("utf-8-sig" if number == 0 else "utf-8")
            except UnicodeDecodeError as err:
                raise FileRejected(f"not UTF-8 text (line {number}, byte {err.start})") from err
            if not line.strip():  # a blank line (trailing ones are common) is no row, as the CSV reader has it
                continue
            count = line.count("\t")
            if count == len(fields) - 1:
                good.append(number)
                body.append(line)
            else:
                bad.append((number, line, f"wrong_field_count:{count + 1}/{len(fields)}"))
        if body:
            table = pacsv.read_csv(
                io.BytesIO(("\n".join(body) + "\n").encode("utf-8")),
                read_options=pacsv.ReadOptions(column_names=fields, block_size=64 << 20, use_threads=False),
                parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in fields}, strings_can_be_null=True, null_values=[""]
                ),
            )
        else:
            table = pa.table({n: pa.array([], pa.string()) for n in fields})
        # Derived columns: rows spread evenly over the file's day; ids from the row's content.
        source_row = np.asarray(good, dtype=np.int64)
        ids = criteo_event_ids(body)
        table = table.append_column(spec.event_id, ids).append_column(
            spec.timestamp, pa.array(start_us + source_row * step_us, pa.timestamp("us", tz="UTC"))
        )
        return SourceBatch(table=table, source_row=source_row, unsplittable=bad, text=True)

    def batches() -> Iterator[SourceBatch]:
        stream, first, chunk = _text_stream(handle, compressed), 0, []
        for raw in stream:
            chunk.append(raw)
            if len(chunk) == batch_rows:
                yield parse(first, chunk)
                first, chunk = first + len(chunk), []
        if chunk or first == 0:
            yield parse(first, chunk)

    return _guarded(batches(), "Criteo TSV")


def _count_lines(stream: BinaryIO) -> int:
    """Lines as the reader will see them: a last line without its newline counts too."""
    count, last = 0, b"\n"
    for block in iter(lambda: stream.read(1 << 20), b""):
        count += block.count(b"\n")
        last = block[-1:]
    return count + (last != b"\n")
