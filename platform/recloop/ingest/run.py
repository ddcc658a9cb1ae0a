"""Ingest a file or a folder of files: read, check, de-duplicate, land good rows, quarantine the rest.

Every row is accounted for: for each file, ``rows_in == rows_landed + rows_quarantined``; a file that
cannot be read at all is ``rejected`` (recorded with its error, and the run goes on); a file whose bytes
were ingested before is ``skipped``. One ingest run at a time per lake (a file lock), and each file is
committed atomically (see ``lake.py``).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recloop.ingest import lake
from recloop.ingest.ledger import Ledger, exclusive_lock
from recloop.ingest.readers import FileRejected, SourceRows, file_digest, read_source
from recloop.ingest.validate import RowProblems, check_rows
from recloop.schema import DatasetSpec
from recloop.settings import Settings


@dataclass
class FileResult:
    """What happened to one source file."""

    path: str
    status: Literal["ingested", "skipped", "rejected"]
    sha256: str
    rows_in: int = 0
    rows_landed: int = 0
    rows_quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    partitions: list[str] = field(default_factory=list)
    error: str | None = None


@dataclass
class IngestSummary:
    """The outcome of one ``ingest`` call; ``to_dict()`` is the CLI's ``--json`` output."""

    source: str
    spec: str
    files: int = 0
    files_ingested: int = 0
    files_skipped: int = 0
    files_rejected: int = 0
    rows_in: int = 0
    rows_landed: int = 0
    rows_quarantined: int = 0
    recovered: list[str] = field(default_factory=list)
    seconds: float = 0.0
    results: list[FileResult] = field(default_factory=list)

    def add(self, result: FileResult) -> None:
        self.results.append(result)
        self.files += 1
        self.files_ingested += result.status == "ingested"
        self.files_skipped += result.status == "skipped"
        self.files_rejected += result.status == "rejected"
        self.rows_in += result.rows_in
        self.rows_landed += result.rows_landed
        self.rows_quarantined += result.rows_quarantined

    def to_dict(self) -> dict:
        out = asdict(self)
        out["files_detail"] = out.pop("results")
        return out


def discover(source: Path) -> list[Path]:
    """The files to ingest under ``source`` in path order, skipping hidden (``.``) and ``_`` names."""
    if not source.exists():
        raise FileNotFoundError(f"nothing to ingest: {source} does not exist")
    if source.is_file():
        return [source]
    return sorted(
        p
        for p in source.rglob("*")
        if p.is_file() and not any(part.startswith((".", "_")) for part in p.relative_to(source).parts)
    )


def ingest(
    source: Path,
    spec: DatasetSpec,
    settings: Settings,
    *,
    now: datetime | None = None,
    on_file: Callable[[FileResult], None] | None = None,
) -> IngestSummary:
    """Ingest ``source`` (a file or a folder) into the lake under ``settings.home``.

    Args:
        source: a file, or a folder searched recursively.
        spec: the dataset spec every row is checked against.
        settings: where the lake, quarantine and ledger live.
        now: the ingest clock (timestamps beyond ``now + spec.max_future_seconds`` are quarantined).
        on_file: called after each file, e.g. to advance a progress bar.

    Example::

        summary = ingest(Path("landing/"), load_spec("synthetic"), Settings())
        assert summary.rows_in == summary.rows_landed + summary.rows_quarantined
    """
    started = time.perf_counter()
    now = now or datetime.now(UTC)
    files = discover(Path(source))
    summary = IngestSummary(source=str(source), spec=spec.name)
    with exclusive_lock(settings.lake_dir / "_ingest.lock"), Ledger.open(settings.ledger_path) as ledger:
        summary.recovered = lake.recover(ledger, settings.home, [settings.lake_events_dir, settings.quarantine_dir])
        landed_ids = lake.LandedIds(settings.lake_events_dir, spec.event_id)
        for path in files:
            result = _ingest_file(path, spec, settings, ledger, landed_ids, now)
            summary.add(result)
            if on_file:
                on_file(result)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _ingest_file(
    path: Path, spec: DatasetSpec, settings: Settings, ledger: Ledger, landed_ids: lake.LandedIds, now: datetime
) -> FileResult:
    digest = file_digest(path)
    size = path.stat().st_size
    known = ledger.get(digest)
    if known is not None:
        note = f"already {known.status} as {known.path}" if known.path != str(path) else f"already {known.status}"
        return FileResult(str(path), "skipped", digest, error=None if known.status == "done" else note)
    try:
        rows = read_source(path, spec, digest)
    except FileRejected as err:
        ledger.record_rejected(sha256=digest, path=str(path), size=size, spec=spec.name, error=str(err))
        return FileResult(str(path), "rejected", digest, error=str(err))

    typed, problems = check_rows(rows.table, spec, now)
    if typed is not None:
        _flag_duplicates(typed, spec, problems, landed_ids)
    bad = problems.bad_mask()
    reasons = problems.reasons()

    token = digest[:16]
    outputs, partitions, staged_ids = [], [], []
    if typed is not None and (~bad).any():
        landed = typed.filter(pa.array(~bad))
        dates = _utc_dates(landed[spec.timestamp])
        for date in sorted(pc.unique(dates).to_pylist()):
            part = landed.filter(pc.equal(dates, pa.scalar(date, pa.date32())))
            final = lake.partition_dir(settings.lake_events_dir, date.isoformat()) / f"part-{token}.parquet"
            outputs.append(lake.relative_to_home(lake.stage(part, final, token), settings.home))
            partitions.append(date.isoformat())
            staged_ids.append((date.isoformat(), part[spec.event_id].combine_chunks()))
    quarantined = _quarantine_table(rows, np.flatnonzero(bad), reasons, path, now)
    if quarantined.num_rows:
        folder = settings.quarantine_dir / f"date={now.strftime('%Y-%m-%d')}"
        outputs.append(lake.relative_to_home(lake.stage(quarantined, folder / f"{token}.parquet", token),
                                             settings.home))

    rows_landed = int((~bad).sum()) if typed is not None else 0
    result = FileResult(
        str(path), "ingested", digest, rows_in=rows.rows_in, rows_landed=rows_landed,
        rows_quarantined=quarantined.num_rows, partitions=partitions,
        reasons=_count_reasons(quarantined["_reason"].to_pylist()) if quarantined.num_rows else {},
    )
    if result.rows_in != result.rows_landed + result.rows_quarantined:  # the contract; never expected to fire
        raise RuntimeError(f"row accounting broken for {path}: {result}")
    ledger.begin_commit(sha256=digest, path=str(path), size=size, spec=spec.name, rows_in=result.rows_in,
                        rows_landed=rows_landed, rows_quarantined=result.rows_quarantined, outputs=outputs)
    lake.publish(outputs, settings.home)
    ledger.finish_commit(digest)
    for date, ids in staged_ids:
        landed_ids.add(date, ids)
    return result


def _flag_duplicates(typed: pa.Table, spec: DatasetSpec, problems: RowProblems, landed: lake.LandedIds) -> None:
    """Among rows still good: a repeated id within the file (first one wins), or an id already landed."""
    good = np.flatnonzero(~problems.bad_mask())
    if len(good) == 0:
        return
    ids = typed[spec.event_id].take(pa.array(good)).combine_chunks()
    within = pd.Series(ids, dtype=pd.ArrowDtype(pa.string())).duplicated(keep="first").to_numpy()
    dates = pc.unique(_utc_dates(typed[spec.timestamp].take(pa.array(good)))).to_pylist()
    already = landed.contains(ids, [d.isoformat() for d in dates])
    problems.add(good[within | already], "duplicate_event_id")


def _utc_dates(timestamps: pa.ChunkedArray) -> pa.Array:
    """The UTC calendar date of each timestamp (the lake's partition key)."""
    return timestamps.combine_chunks().cast(pa.date32())


def _quarantine_table(
    rows: SourceRows, bad_rows: np.ndarray, reasons: np.ndarray, path: Path, now: datetime
) -> pa.Table:
    """Rejected rows with their original values (as text), the reason, the source file and row number."""
    split = rows.table.take(pa.array(bad_rows, pa.int64()))
    count = split.num_rows + len(rows.unsplittable)
    columns: dict[str, pa.Array] = {
        "_source_file": pa.array([str(path)] * count, pa.string()),
        "_source_row": pa.array(
            np.concatenate([rows.source_row[bad_rows], np.array([r for r, _, _ in rows.unsplittable], np.int64)]),
            pa.int64(),
        ),
        "_reason": pa.array(list(reasons[bad_rows]) + [reason for _, _, reason in rows.unsplittable], pa.string()),
        "_raw_line": pa.array([None] * split.num_rows + [line for _, line, _ in rows.unsplittable], pa.string()),
        "_ingested_at": pa.array([now] * count, pa.timestamp("us", tz="UTC")),
    }
    padding = pa.nulls(len(rows.unsplittable), pa.string())
    for name in split.column_names:
        columns[name] = pa.concat_arrays([_as_text(split[name].combine_chunks()), padding])
    return pa.table(columns)


def _as_text(values: pa.Array) -> pa.Array:
    """Original values as strings (lists and other nested values as JSON)."""
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    try:
        return values.cast(pa.string())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in values.to_pylist()], pa.string())


def _count_reasons(joined: list[str]) -> dict[str, int]:
    counts = Counter(code for reason in joined for code in reason.split("; "))
    return dict(sorted(counts.items()))
