"""What the feature job writes for a window, shared by both engines: period files, entity tables, snapshots.

A window's outputs are one parquet file per *period with rows* (``period_file``); ``write_period_files``
writes the periods of some rows (the single-process job: all of them; a Dask worker: the periods its
partition holds), each staged beside the folder and renamed in, and ``remove_stale`` then drops the
window's files of periods now empty (the driver, from the names written). ``entity_table`` is the Feast
source of an entity kind's state rows; ``snapshot_of`` the latest state row per entity.

Example::

    names = write_period_files(layout.training, rows, "_ts_us", period_us, TRAINING_PARQUET)
    remove_stale(layout.training, start_us, end_us, period_us, names)
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.features import ops
from recloop.features.backend import FrameBackend
from recloop.hours import US, hour_of_us

HOUR_US = 3600 * US
DAY_US = 24 * HOUR_US


def period_file(folder: Path, period_us: int) -> Path:
    return folder / f"{hour_of_us(period_us)}.parquet"


def period_start(t_us, period_us: int):
    """The start of the period holding ``t_us`` (an int or an array); weeks start on Monday 00:00 UTC."""
    offset = 4 * DAY_US if period_us == 7 * DAY_US else 0  # 1970-01-01 was a Thursday
    return (t_us - offset) // period_us * period_us + offset


def staging_folder(folder: Path) -> Path:
    return folder.parent / f".staging-{folder.name}"


def write_period_files(folder: Path, table: pa.Table, ts_column: str, period_us: int,
                       parquet: dict | None = None) -> list[str]:
    """One file per period that ``table`` has rows in (its rows in table order, ``ts_column`` dropped),
    staged in ``staging_folder`` and renamed in; returns the names written. Work follows the rows."""
    folder.mkdir(parents=True, exist_ok=True)
    staging = staging_folder(folder)
    staging.mkdir(exist_ok=True)
    ts = table[ts_column].to_numpy() if table.num_rows else np.empty(0, dtype=np.int64)
    periods = period_start(ts, period_us)
    order = np.argsort(periods, kind="stable")
    bounds = np.flatnonzero(np.diff(periods[order])) + 1
    written = []
    for rows in np.split(order, bounds) if len(order) else []:
        path = period_file(folder, int(periods[rows[0]]))
        part = table.take(pa.array(np.sort(rows))).drop_columns([ts_column])
        tmp = staging / path.name
        pq.write_table(part, tmp, **(parquet or {}))
        os.replace(tmp, path)
        written.append(path.name)
    return written


def remove_stale(folder: Path, start_us: int, end_us: int, period_us: int, written: list[str]) -> None:
    """The window's files other than ``written`` (periods with no rows now) removed, and the staging folder."""
    first, last = period_file(folder, start_us).stem, period_file(folder, end_us).stem
    keep = set(written)
    for path in folder.glob("*.parquet"):
        if first <= path.stem < last and path.name not in keep:
            path.unlink(missing_ok=True)
    shutil.rmtree(staging_folder(folder), ignore_errors=True)


def write_periods(folder: Path, table: pa.Table, ts_column: str, start_us: int, end_us: int, period_us: int,
                  parquet: dict | None = None) -> int:
    """The window's files of ``table`` written and its stale ones removed; returns how many were written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = write_period_files(folder, table, ts_column, period_us, parquet)
    remove_stale(folder, start_us, end_us, period_us, written)
    return len(written)


def entity_table(backend: FrameBackend, states: ops.EntityStates, key: str, start_us: int, end_us: int) -> pa.Table:
    """State rows with ``start <= ts < end``, as the Feast source: ``<key>, event_timestamp, <stats>``."""
    table = backend.to_arrow(states.frame)
    table = table.filter(pc.and_(pc.greater_equal(table["ts"], start_us), pc.less(table["ts"], end_us)))
    stat_columns = [c for c in table.column_names if c.startswith(f"{states.prefix}_")]
    return pa.table({
        key: table["key"], "event_timestamp": table["ts"].cast(pa.timestamp("us", tz="UTC")), "_ts_us": table["ts"],
        **{c: table[c].cast(pa.float64() if c.endswith("last_seen") else pa.int64()) for c in stat_columns},
    })


def snapshot_of(backend: FrameBackend, states: ops.EntityStates, previous: pa.Table | None) -> pa.Table:
    """The latest state row per entity, sorted by key: new state rows win over the carried-over snapshot
    (``previous``: all of it, or on a Dask worker its rows of the partition's keys)."""
    table = backend.to_arrow(states.frame)
    stat_columns = [c for c in table.column_names if c.startswith(f"{states.prefix}_")]
    table = table.select(["key", *stat_columns])
    if previous is not None and previous.num_rows:
        table = pa.concat_tables([previous.select(table.column_names).cast(table.schema), table])
    frame = table.to_pandas()
    frame = frame.drop_duplicates("key", keep="last").sort_values("key")
    return pa.Table.from_pandas(frame, preserve_index=False)
