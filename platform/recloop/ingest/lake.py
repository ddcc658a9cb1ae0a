"""The event lake on disk: partitioned parquet, written so that no reader ever sees half a file.

Layout under ``$RECLOOP_HOME``::

    lake/events/date=2026-01-01/part-<token>.parquet   landed rows of one source file, for one date
    lake/_ledger.sqlite                                 which source files are in (see ledger.py)
    quarantine/date=<ingest date>/<sha16>.parquet       rejected rows, original values as text + reason

The whole of ``lake/events`` reads as one dataset:
``pyarrow.dataset.dataset(lake/events, partitioning="hive")``.

How one source file is committed (``StagedParquet`` → ledger ``begin_commit`` → ``publish`` →
``finish_commit``):

1. every output is written, batch by batch, under a hidden temporary name (``.part-….parquet.<token>.tmp``)
   beside its final place and flushed to disk; dataset readers skip names that start with a dot;
2. the ledger records the outputs and the file's event ids in one transaction: this is the commit point;
3. each temporary file is renamed to its final name (atomic within a file system);
4. the ledger marks the file done.

A crash before step 2 leaves only hidden temporaries, removed by the next run, which ingests the file
again. A crash after it is finished by the next run's ``recover``, which completes the renames.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from recloop.hours import US
from recloop.ingest.ledger import Ledger

if TYPE_CHECKING:
    from recloop.schema import DatasetSpec
    from recloop.settings import Settings

TEMP_SUFFIX = ".tmp"


def partition_dir(events_dir: Path, date: str) -> Path:
    return events_dir / f"date={date}"


class StagedParquet:
    """One output parquet file, written batch by batch under a hidden temporary name beside ``final``.

    ``close()`` flushes it to disk and returns the pair to publish; ``discard()`` deletes it (the source
    file was rejected halfway). A batch is written as it comes, so memory does not grow with the file.
    """

    def __init__(self, final: Path, token: str):
        self.final = final
        self.tmp = final.with_name(f".{final.name}.{token}{TEMP_SUFFIX}")
        self._writer: pq.ParquetWriter | None = None

    def write(self, table: pa.Table) -> None:
        if self._writer is None:
            self.final.parent.mkdir(parents=True, exist_ok=True)
            self._writer = pq.ParquetWriter(self.tmp, table.schema, compression="zstd")
        self._writer.write_table(table)

    def close(self) -> dict[str, str]:
        if self._writer is None:
            raise ValueError(f"nothing was written to {self.final}")
        self._writer.close()
        with open(self.tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        return {"tmp": str(self.tmp), "final": str(self.final)}

    def discard(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self.tmp.unlink(missing_ok=True)


def relative_to_home(output: dict[str, str], home: Path) -> dict[str, str]:
    """An output pair with paths relative to ``home``, as the ledger stores them (a lake can move)."""
    root = home.resolve()
    return {k: str(Path(v).resolve().relative_to(root)) for k, v in output.items()}


def publish(outputs: Iterable[dict[str, str]], home: Path) -> None:
    """Rename staged outputs (paths relative to ``home``) into place. Safe to repeat."""
    folders = set()
    for output in outputs:
        tmp, final = home / output["tmp"], home / output["final"]
        if tmp.exists():
            os.replace(tmp, final)
        elif not final.exists():
            raise FileNotFoundError(f"staged output {tmp} is gone and {final} was never published")
        folders.add(final.parent)
    for folder in folders:
        _fsync_dir(folder)


def recover(ledger: Ledger, home: Path, roots: Iterable[Path]) -> list[str]:
    """Finish commits that a killed run left half done; delete temporaries no ledger row claims.

    Returns:
        The source paths whose commits were completed.
    """
    finished = []
    claimed = set()
    for entry in ledger.entries(status="committing"):
        publish(entry.outputs, home)
        ledger.finish_commit(entry.sha256)
        finished.append(entry.path)
        claimed.update(str(home / o["tmp"]) for o in entry.outputs)
    for root in roots:
        if root.exists():
            for stray in root.rglob(f".*{TEMP_SUFFIX}"):
                if str(stray) not in claimed:
                    stray.unlink()
    return finished


def committed_event_files(ledger: Ledger, home: Path, events_dir: Path) -> list[str]:
    """Lake files that the ledger says are fully committed (a reader that trusts nothing else)."""
    events = events_dir.resolve()
    files = []
    for entry in ledger.entries(status="done"):
        for output in entry.outputs:
            final = (home / output["final"]).resolve()
            if final.is_relative_to(events):
                files.append(str(final))
    return sorted(files)


def read_events(ledger: Ledger, home: Path, events_dir: Path, columns: list[str] | None = None,
                filter=None) -> pa.Table:
    """Read the committed events (optionally some columns, and a pyarrow dataset filter expression)."""
    files = committed_event_files(ledger, home, events_dir)
    if not files:
        return pa.table({})
    dataset = ds.dataset(files, format="parquet", partitioning=ds.partitioning(flavor="hive"),
                         partition_base_dir=str(events_dir))
    return dataset.to_table(columns=columns, filter=filter)


def to_us(value: datetime) -> int:
    """A datetime (naive means UTC) as UTC microseconds, the lake's time unit."""
    value = value if value.tzinfo else value.replace(tzinfo=UTC)
    return int(round(value.timestamp() * US))


def _time_condition(spec: DatasetSpec, start_us: int | None, end_us: int | None):
    ts = ds.field(spec.timestamp)
    condition = None
    if start_us is not None:
        condition = ts >= pa.scalar(start_us, pa.timestamp("us", tz="UTC"))
    if end_us is not None:
        upper = ts < pa.scalar(end_us, pa.timestamp("us", tz="UTC"))
        condition = upper if condition is None else condition & upper
    return condition


def read_window(settings: Settings, spec: DatasetSpec, start_us: int | None, end_us: int | None,
                columns: list[str] | None = None) -> pa.Table:
    """Committed lake events with ``start <= timestamp < end`` (either bound may be None): the one way
    every stage reads the lake."""
    if not settings.ledger_path.exists():
        return pa.table({})
    with Ledger.open(settings.ledger_path) as ledger:
        return read_events(ledger, settings.home, settings.lake_events_dir, columns=columns,
                           filter=_time_condition(spec, start_us, end_us))


def window_files(settings: Settings) -> list[str]:
    """The committed lake files, in the order ``read_window`` reads them: a distributed reader gives each
    worker some of them (``read_window_file``), and their rows in this order are ``read_window``'s rows."""
    if not settings.ledger_path.exists():
        return []
    with Ledger.open(settings.ledger_path) as ledger:
        return committed_event_files(ledger, settings.home, settings.lake_events_dir)


def read_window_file(settings: Settings, spec: DatasetSpec, path: str, start_us: int | None, end_us: int | None,
                     columns: list[str] | None = None) -> pa.Table:
    """One file of ``window_files`` read as ``read_window`` reads it (same columns, same filter)."""
    dataset = ds.dataset([path], format="parquet", partitioning=ds.partitioning(flavor="hive"),
                         partition_base_dir=str(settings.lake_events_dir))
    return dataset.to_table(columns=columns, filter=_time_condition(spec, start_us, end_us))


def time_bounds(settings: Settings, spec: DatasetSpec) -> tuple[int, int] | None:
    """First and last event time in the committed lake (UTC microseconds), or None if it is empty."""
    import pyarrow.compute as pc

    table = read_window(settings, spec, None, None, columns=[spec.timestamp])
    if table.num_rows == 0:
        return None
    stamps = table[spec.timestamp].cast(pa.int64())
    return pc.min(stamps).as_py(), pc.max(stamps).as_py()


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
