"""The event lake on disk: partitioned parquet, written so that no reader ever sees half a file.

Layout under ``$RECLOOP_HOME``::

    lake/events/date=2026-01-01/part-<sha16>.parquet    landed rows of one source file, for one date
    lake/_ledger.sqlite                                 which source files are in (see ledger.py)
    quarantine/date=<ingest date>/<sha16>.parquet       rejected rows, original values as text + reason

The whole of ``lake/events`` reads as one dataset:
``pyarrow.dataset.dataset(lake/events, partitioning="hive")``.

How one source file is committed (``stage`` → ledger ``begin_commit`` → ``publish`` → ``finish_commit``):

1. every output is written under a hidden temporary name (``.part-….parquet.<token>.tmp``) beside its
   final place and flushed to disk; dataset readers skip names that start with a dot;
2. the ledger records the outputs: this is the commit point;
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

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from recloop.ingest.ledger import Ledger

if TYPE_CHECKING:
    from recloop.schema import DatasetSpec
    from recloop.settings import Settings

TEMP_SUFFIX = ".tmp"
US = 1_000_000


def partition_dir(events_dir: Path, date: str) -> Path:
    return events_dir / f"date={date}"


def stage(table: pa.Table, final: Path, token: str) -> dict[str, str]:
    """Write ``table`` under a hidden temporary name beside ``final``; return the pair to publish."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{token}{TEMP_SUFFIX}")
    pq.write_table(table, tmp, compression="zstd")
    with open(tmp, "rb+") as handle:
        os.fsync(handle.fileno())
    return {"tmp": str(tmp), "final": str(final)}


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


class IdSet:
    """Exact set membership for many string ids, cheap to extend and to query.

    Ids are kept as 64-bit hashes in sorted runs (with the ids beside them); a query is a binary search
    per run, and every hash hit is confirmed by comparing the ids themselves, so a hash collision can
    never make a new event look like a duplicate. Runs merge like a binary counter, so adding n ids
    costs O(n log n) overall, however many files they come in.
    """

    def __init__(self) -> None:
        self._runs: list[tuple[np.ndarray, np.ndarray]] = []  # (sorted hashes, ids in the same order)

    def __len__(self) -> int:
        return sum(len(h) for h, _ in self._runs)

    def add(self, ids: np.ndarray) -> None:
        if len(ids) == 0:
            return
        ids = np.asarray(ids, dtype=object)
        hashes = pd.util.hash_array(ids)
        order = np.argsort(hashes, kind="stable")
        self._runs.append((hashes[order], ids[order]))
        while len(self._runs) > 1 and 2 * len(self._runs[-1][0]) >= len(self._runs[-2][0]):
            (h2, i2), (h1, i1) = self._runs.pop(), self._runs.pop()
            hashes, ids = np.concatenate([h1, h2]), np.concatenate([i1, i2])
            order = np.argsort(hashes, kind="stable")
            self._runs.append((hashes[order], ids[order]))

    def contains(self, ids: np.ndarray) -> np.ndarray:
        """(len(ids),) bool: which ids are in the set."""
        ids = np.asarray(ids, dtype=object)
        found = np.zeros(len(ids), dtype=bool)
        if len(ids) == 0:
            return found
        hashes = pd.util.hash_array(ids)
        for run_hashes, run_ids in self._runs:
            pos = np.minimum(np.searchsorted(run_hashes, hashes), len(run_hashes) - 1)
            for i in np.flatnonzero(run_hashes[pos] == hashes):
                j = pos[i]
                while j < len(run_hashes) and run_hashes[j] == hashes[i] and not found[i]:
                    found[i] = run_ids[j] == ids[i]
                    j += 1
        return found


class LandedIds:
    """Event ids already in the lake, per date partition, for duplicate detection during one run.

    Ids are checked within the dates an incoming file covers: a replayed event carries its original
    timestamp, so it falls in the same partition. A partition's ids are read from disk (one column)
    the first time it is needed, then kept up to date in memory as the run lands more files.
    """

    def __init__(self, events_dir: Path, event_id: str):
        self._events_dir = events_dir
        self._event_id = event_id
        self._by_date: dict[str, IdSet] = {}
        self._pending: dict[str, list[pa.Array]] = {}  # landed this run, folded in when next queried

    def _load(self, date: str) -> IdSet:
        if date not in self._by_date:
            ids = IdSet()
            folder = partition_dir(self._events_dir, date)
            for f in sorted(folder.glob("part-*.parquet")) if folder.exists() else []:
                ids.add(pq.read_table(f, columns=[self._event_id])[self._event_id].to_numpy())
            self._by_date[date] = ids
            self._pending.pop(date, None)  # already on disk, so already read
        for pending in self._pending.pop(date, []):
            self._by_date[date].add(pending.to_numpy(zero_copy_only=False))
        return self._by_date[date]

    def contains(self, ids: pa.Array, dates: Iterable[str]) -> np.ndarray:
        """A boolean mask: which of ``ids`` are already landed in any of ``dates``."""
        values = ids.to_numpy(zero_copy_only=False)
        found = np.zeros(len(values), dtype=bool)
        for date in sorted(set(dates)):
            found |= self._load(date).contains(values)
        return found

    def add(self, date: str, ids: pa.Array) -> None:
        """Record ids just landed in ``date`` (call after they are published)."""
        if date in self._by_date:
            self._pending.setdefault(date, []).append(ids)


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
