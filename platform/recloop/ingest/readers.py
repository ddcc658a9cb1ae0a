"""Read one landing file into an Arrow table of its original values, or reject it whole.

A reader does no validation beyond what it takes to split a file into rows and columns: it returns the
values as they were written (strings for text formats, the file's own types for parquet), each row's
position in the source, and the rows that could not even be split into fields (a Criteo line with the
wrong number of tabs, a CSV line with the wrong number of commas) with their raw text. A file that cannot
be read at all raises ``FileRejected`` with the reason.

Row numbers (``source_row``) count data rows from 0 in file order: parquet rows, CSV lines after the
header, Criteo lines.
"""

from __future__ import annotations

import csv
import gzip
import hashlib
import io
import re
import zlib
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from recloop.schema import DatasetSpec

PARQUET_SUFFIXES = (".parquet", ".pq")
CSV_SUFFIXES = (".csv", ".csv.gz")


class FileRejected(Exception):
    """The file as a whole cannot be read (truncated, not the format it claims, wrong encoding, empty)."""


@dataclass
class SourceRows:
    """What a reader got out of one file.

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

    @property
    def rows_in(self) -> int:
        return self.table.num_rows + len(self.unsplittable)


def file_digest(path: Path) -> str:
    """SHA-256 of the file's bytes: the file's identity in the ledger."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_source(path: Path, spec: DatasetSpec, digest: str) -> SourceRows:
    """Read ``path`` as the spec's format says. Raises ``FileRejected`` if it cannot be read at all."""
    if path.stat().st_size == 0:
        raise FileRejected("empty file (0 bytes)")
    name = path.name.lower()
    if spec.format == "criteo_tsv":
        return _read_criteo(path, spec, digest)
    if name.endswith(PARQUET_SUFFIXES):
        return _read_parquet(path)
    if name.endswith(CSV_SUFFIXES):
        return _read_csv(path)
    raise FileRejected(
        f"unsupported file type {path.suffix or '(no suffix)'!r} for spec {spec.name!r}: "
        f"expected {PARQUET_SUFFIXES + CSV_SUFFIXES}"
    )


def _read_parquet(path: Path) -> SourceRows:
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as err:
        raise FileRejected(f"not a readable parquet file: {err}") from err
    return SourceRows(table=table, source_row=np.arange(table.num_rows, dtype=np.int64))


def _read_bytes(path: Path) -> bytes:
    try:
        data = path.read_bytes()
        return gzip.decompress(data) if path.name.lower().endswith(".gz") else data
    except (OSError, EOFError, zlib.error) as err:
        raise FileRejected(f"cannot decompress: {err}") from err


def _decode_utf8(data: bytes) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise FileRejected(f"not UTF-8 text (byte {err.start}: {data[err.start:err.start + 1]!r})") from err


def _read_csv(path: Path) -> SourceRows:
    """CSV with a header line; every column read as text, empty fields as null."""
    data = _read_bytes(path)
    _decode_utf8(data)  # reject the whole file on a bad encoding rather than mangling values
    header_line = data.split(b"\n", 1)[0].rstrip(b"\r")
    if not header_line.strip():
        raise FileRejected("no header line")
    names = next(csv.reader([header_line.decode("utf-8")]))
    duplicated = sorted({n for n in names if names.count(n) > 1})
    if duplicated:
        raise FileRejected(f"header names columns more than once: {duplicated}")

    invalid: list[tuple[int, str, str]] = []

    def on_invalid_row(row: pacsv.InvalidRow) -> str:
        # row.number is the 1-based line number (header = line 1) when reading single-threaded.
        invalid.append(
            (int(row.number) - 2, row.text, f"wrong_field_count:{row.actual_columns}/{row.expected_columns}")
        )
        return "skip"

    try:
        table = pacsv.read_csv(
            io.BytesIO(data),
            read_options=pacsv.ReadOptions(use_threads=False, block_size=64 << 20),
            parse_options=pacsv.ParseOptions(invalid_row_handler=on_invalid_row),
            convert_options=pacsv.ConvertOptions(
                column_types={n: pa.string() for n in names}, strings_can_be_null=True, null_values=[""]
            ),
        )
    except pa.ArrowException as err:
        raise FileRejected(f"not a readable CSV file: {err}") from err
    source_row = _rows_not_skipped(table.num_rows, [r for r, _, _ in invalid])
    return SourceRows(table=table, source_row=source_row, unsplittable=invalid, text=True)


def _rows_not_skipped(kept: int, skipped: list[int]) -> np.ndarray:
    """Positions 0..kept+len(skipped)-1 without the skipped ones, in order."""
    total = kept + len(skipped)
    mask = np.ones(total, dtype=bool)
    mask[np.asarray(skipped, dtype=np.int64)] = False
    return np.flatnonzero(mask).astype(np.int64)


def _read_criteo(path: Path, spec: DatasetSpec, digest: str) -> SourceRows:
    """Criteo TSV: no header, fields = the spec's file fields; id and timestamp derived (see CriteoOptions)."""
    assert spec.criteo is not None  # validated by the spec
    text = _decode_utf8(_read_bytes(path))
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()  # the newline that ends the last line
    fields = spec.file_fields
    tabs = len(fields) - 1
    good, bad = [], []
    for number, line in enumerate(lines):
        line = line.rstrip("\r")
        count = line.count("\t")
        if count == tabs:
            good.append(number)
        else:
            bad.append((number, line, f"wrong_field_count:{count + 1}/{len(fields)}"))
    body = "\n".join(lines[i].rstrip("\r") for i in good)
    if good:
        try:
            table = pacsv.read_csv(
                io.BytesIO(body.encode("utf-8") + b"\n"),
                read_options=pacsv.ReadOptions(column_names=fields, block_size=64 << 20),
                parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False),
                convert_options=pacsv.ConvertOptions(
                    column_types={n: pa.string() for n in fields}, strings_can_be_null=True, null_values=[""]
                ),
            )
        except pa.ArrowException as err:
            raise FileRejected(f"not a readable Criteo TSV file: {err}") from err
    else:
        table = pa.table({n: pa.array([], pa.string()) for n in fields})

    # Derived columns: rows spread evenly over the file's day; ids from content hash + line number.
    match = re.search(spec.criteo.day_pattern, path.name)
    day_start = spec.criteo.start + timedelta(days=int(match.group(1)) if match else 0)
    source_row = np.asarray(good, dtype=np.int64)
    step_us = 86_400_000_000 // max(len(lines), 1)
    ts_us = int(day_start.timestamp() * 1_000_000) + source_row * step_us
    ids = pa.array([f"criteo-{digest[:16]}-{i}" for i in good], pa.string())
    table = table.append_column(spec.event_id, ids).append_column(
        spec.timestamp, pa.array(ts_us, pa.timestamp("us", tz="UTC"))
    )
    return SourceRows(table=table, source_row=source_row, unsplittable=bad, text=True)
