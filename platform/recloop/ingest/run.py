"""Ingest a file or a folder of files: read, check, de-duplicate, land good rows, quarantine the rest.

Every file found is accounted for in the summary, and every row of every file read:

- ``ingested``: ``rows_in == rows_landed + rows_quarantined``;
- ``skipped``: its bytes were ingested (or rejected) before;
- ``rejected``: it could not be read, with the reason: bad bytes (remembered by the ledger), or a file
  that vanished, changed while being read, is unreadable, a symbolic link or not a regular file (not
  remembered: the next run looks again). The run goes on with the next file;
- ``ignored``: a hidden (``.``) or metadata (``_``) name, by convention a file still being written or
  not an event file, with the reason.

One ingest run at a time per lake (a file lock); each file is read and landed batch by batch (memory
bounded whatever its size) and committed atomically (see ``lake.py``); an event id already anywhere in
the lake is a duplicate (see the id set in ``ledger.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.ingest import lake
from recloop.ingest.ledger import Ledger
from recloop.ingest.readers import (
    DEFAULT_BATCH_ROWS,
    FileRejected,
    SourceBatch,
    check_unchanged,
    file_digest,
    open_landing_file,
    read_batches,
)
from recloop.ingest.validate import RowProblems, check_rows
from recloop.locks import exclusive_lock
from recloop.schema import DatasetSpec
from recloop.settings import Settings


@dataclass
class FileResult:
    """What happened to one file found under the source (``error``: the reason, when not ingested)."""

    path: str
    status: Literal["ingested", "skipped", "rejected", "ignored"]
    sha256: str | None
    rows_in: int = 0
    rows_landed: int = 0
    rows_quarantined: int = 0
    reasons: dict[str, int] = field(default_factory=dict)
    partitions: list[str] = field(default_factory=list)
    error: str | None = None
    ledger_key: str | None = None  # the file's record in the ledger: its content and the spec's version
    hints: list[str] = field(default_factory=list)  # what the spec could say to accept quarantined rows


@dataclass
class IngestSummary:
    """The outcome of one ``ingest`` call; ``to_dict()`` is the CLI's ``--json`` output.

    ``files`` counts everything found (ingested + skipped + rejected + ignored: ignored names were left out of
    it, so the count did not match the folder); ``results`` has one entry for each, every one not ingested
    with its reason (``error``).
    """

    source: str
    spec: str
    files: int = 0
    files_ingested: int = 0
    files_skipped: int = 0
    files_rejected: int = 0
    files_ignored: int = 0
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
        self.files_ignored += result.status == "ignored"
        self.rows_in += result.rows_in
        self.rows_landed += result.rows_landed
        self.rows_quarantined += result.rows_quarantined

    def to_dict(self) -> dict:
        out = asdict(self)
        out["files_detail"] = out.pop("results")
        return out


@dataclass(frozen=True)
class Candidate:
    """A file found under the source, and what ingestion will do with it.

    Attributes:
        action: ``read``, ``ignore`` (hidden or metadata name) or ``refuse`` (never read), with ``reason``.
        identity: ``(st_dev, st_ino)`` when found: the file opened later must be this one.
        follow: a symbolic link is followed (only for a file named explicitly as the source).
    """

    path: Path
    action: Literal["read", "ignore", "refuse"]
    reason: str | None = None
    identity: tuple[int, int] | None = None
    follow: bool = False


def discover(source: Path) -> list[Candidate]:
    """Everything under ``source`` in path order, each with its action; links are never followed.

    A file named explicitly is read (through a link, if it is one: the user chose it); inside a folder,
    a symbolic link (which could lead anywhere: ``/etc/passwd``, another lake) and anything but a regular
    file or folder are refused, and names starting with ``.`` or ``_`` are ignored (a folder with such a
    name counts once, unsearched).
    """
    if not source.exists() and not source.is_symlink():
        raise FileNotFoundError(f"nothing to ingest: {source} does not exist")
    if not source.is_dir():
        info = source.stat() if source.exists() else None
        if info is None or not stat.S_ISREG(info.st_mode):
            return [Candidate(source, "refuse", "not a regular file")]
        return [Candidate(source, "read", identity=(info.st_dev, info.st_ino), follow=True)]
    found: list[Candidate] = []
    _walk(source, found)
    return sorted(found, key=lambda c: str(c.path))


def _walk(folder: Path, found: list[Candidate]) -> None:
    try:
        entries = list(os.scandir(folder))
    except OSError as err:
        found.append(Candidate(folder, "refuse", f"folder cannot be listed: {err.strerror}"))
        return
    for entry in entries:
        path = Path(entry.path)
        is_dir = entry.is_dir(follow_symlinks=False)
        if entry.name.startswith((".", "_")):
            kind = "hidden" if entry.name.startswith(".") else "metadata"
            what = "folder, not searched" if is_dir else "file"
            found.append(Candidate(path, "ignore", f"{kind} name ({entry.name[0]!r}): {what}"))
        elif entry.is_symlink():
            found.append(Candidate(path, "refuse", "symbolic link (not followed: it may lead outside the folder)"))
        elif is_dir:
            _walk(path, found)
        elif entry.is_file(follow_symlinks=False):
            info = entry.stat(follow_symlinks=False)
            found.append(Candidate(path, "read", identity=(info.st_dev, info.st_ino)))
        else:
            found.append(Candidate(path, "refuse", "not a regular file (a pipe, socket or device)"))


def ingest(
    source: Path,
    spec: DatasetSpec,
    settings: Settings,
    *,
    now: datetime | None = None,
    on_file: Callable[[FileResult], None] | None = None,
    batch_rows: int = DEFAULT_BATCH_ROWS,
    reingest: bool = False,
    wait_for_writers: bool = True,
) -> IngestSummary:
    """Ingest ``source`` (a file or a folder) into the lake under ``settings.home``.

    Args:
        source: a file, or a folder searched recursively.
        spec: the dataset spec every row is checked against.
        settings: where the lake, quarantine and ledger live.
        now: the ingest clock (timestamps beyond ``now + spec.max_future_seconds`` are quarantined).
        on_file: called after each file, e.g. to advance a progress bar.
        batch_rows: rows read, checked and written at a time: what bounds the memory a file takes.
        reingest: read the files again even if the ledger has them under this spec (``--reingest``): rows
            already in the lake come back as ``duplicate_event_id``, the others land.
        wait_for_writers: a text file found in a folder whose last line has no line end and that changed
            within ``readers.UNSETTLED_SECONDS`` waits for the next run (it may still be being written); False
            (a finished log, as ``recloop replay`` reads one) reads it now. A file named as the source is
            always read now: the user chose it.

    Example::

        summary = ingest(Path("landing/"), load_spec("synthetic"), Settings())
        assert summary.rows_in == summary.rows_landed + summary.rows_quarantined
    """
    started = time.perf_counter()
    now = now or datetime.now(UTC)
    candidates = discover(Path(source))
    summary = IngestSummary(source=str(source), spec=spec.name)
    with exclusive_lock(settings.lake_dir / "_ingest.lock"), Ledger.open(settings.ledger_path) as ledger:
        summary.recovered = lake.recover(ledger, settings.home, [settings.lake_events_dir, settings.quarantine_dir])
        ledger.ensure_ids(lambda: _lake_ids(ledger, settings, spec))
        for candidate in candidates:
            result = _ingest_candidate(candidate, spec, settings, ledger, now, batch_rows, reingest,
                                       settled_only=wait_for_writers and not candidate.follow)
            summary.add(result)
            if on_file:
                on_file(result)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _lake_ids(ledger: Ledger, settings: Settings, spec: DatasetSpec) -> Iterator[list[str]]:
    """The event ids of every committed lake file, batch by batch (to fill an older ledger's id set)."""
    for path in lake.committed_event_files(ledger, settings.home, settings.lake_events_dir):
        for batch in pq.ParquetFile(path).iter_batches(columns=[spec.event_id]):
            yield batch.column(0).to_pylist()


def ledger_key(digest: str, spec: DatasetSpec) -> str:
    """A file's key in the ledger: its content and the spec's version (a fixed spec reads it again)."""
    return hashlib.sha256(f"{digest}:{spec.name}:{spec.version}".encode()).hexdigest()


def _token(key: str, again: bool) -> str:
    """The name of a source's outputs: its ledger key; a source read again (``--reingest``, a quarantine
    replay) gets its own, so its outputs never replace the rows an earlier read landed."""
    return hashlib.sha256(f"{key}:{time.time_ns()}".encode()).hexdigest()[:16] if again else key[:16]


def _ingest_candidate(candidate: Candidate, spec: DatasetSpec, settings: Settings, ledger: Ledger, now: datetime,
                      batch_rows: int, reingest: bool = False, settled_only: bool = False) -> FileResult:
    path = str(candidate.path)
    if candidate.action == "ignore":
        return FileResult(path, "ignored", None, error=candidate.reason)
    if candidate.action == "refuse":
        return FileResult(path, "rejected", None, error=candidate.reason)
    try:
        handle = open_landing_file(candidate.path, candidate.identity, candidate.follow)
    except FileRejected as err:
        return FileResult(path, "rejected", None, error=str(err))
    with handle:
        try:
            digest, size = file_digest(handle)
        except FileRejected as err:
            return FileResult(path, "rejected", None, error=str(err))
        key = ledger_key(digest, spec)
        if reingest:
            ledger.forget(key)
        known = ledger.get(key)
        if known is not None:
            done = "ingested" if known.status == "done" else known.status
            note = (f"already {done} under this version of spec {spec.name!r}"
                    + (f" as {known.path}" if known.path != path else "")
                    + ("" if known.status == "done" else f" ({known.error})" if known.error else "")
                    + ": `recloop ingest FILE --reingest` reads it again")
            return FileResult(path, "skipped", digest, error=note, ledger_key=key)
        staging = _Staging(settings, _token(key, reingest), now)
        ledger.begin_file()
        try:
            batches = read_batches(handle, candidate.path.name, spec, digest, batch_rows, settled_only=settled_only)
            result = _land(batches, candidate.path, key, spec, settings, ledger, staging, now,
                           lambda: check_unchanged(handle, size), size)
            result.sha256 = digest
            return result
        except FileRejected as err:
            staging.discard()
            ledger.abandon_file()
            if err.permanent:
                ledger.record_rejected(sha256=key, path=path, size=size, spec=spec.name, error=str(err))
            return FileResult(path, "rejected", digest, error=str(err), ledger_key=key)
        except BaseException:  # a write failed, or the run was interrupted: nothing of this file stays
            staging.discard()
            ledger.abandon_file()
            raise


class _Staging:
    """The outputs of one source file while it is read: one per event date, plus its quarantine file."""

    def __init__(self, settings: Settings, token: str, now: datetime):
        self.settings, self.token = settings, token
        self.partitions: dict[str, lake.StagedParquet] = {}
        folder = settings.quarantine_dir / f"date={now.strftime('%Y-%m-%d')}"
        self.quarantine = lake.StagedParquet(folder / f"{token}.parquet", token)
        self.quarantined = 0

    def land(self, date: str, table: pa.Table) -> None:
        if date not in self.partitions:
            final = lake.partition_dir(self.settings.lake_events_dir, date) / f"part-{self.token}.parquet"
            self.partitions[date] = lake.StagedParquet(final, self.token)
        self.partitions[date].write(table)

    def quarantine_rows(self, table: pa.Table) -> None:
        self.quarantine.write(table)
        self.quarantined += table.num_rows

    def close(self) -> list[dict[str, str]]:
        staged = list(self.partitions.values()) + ([self.quarantine] if self.quarantined else [])
        return [lake.relative_to_home(output.close(), self.settings.home) for output in staged]

    def discard(self) -> None:
        for output in [*self.partitions.values(), self.quarantine]:
            output.discard()


def _land(batches: Iterable[SourceBatch], path: Path, key: str, spec: DatasetSpec, settings: Settings,
          ledger: Ledger, staging: _Staging, now: datetime, check_source: Callable[[], None], size: int
          ) -> FileResult:
    """Check and stage a source's batches, then commit it (ledger, under ``key``) and publish its outputs."""
    result = FileResult(str(path), "ingested", key, ledger_key=key)
    reasons: Counter[str] = Counter()
    for batch in batches:
        typed, problems = _checked(batch, spec, now)
        result.hints += [h for h in (*batch.notes, *problems.hints) if h not in result.hints]
        if typed is not None:
            _flag_duplicates(typed, spec, problems, ledger)
        bad = problems.bad_mask()
        if typed is not None and (~bad).any():
            landed = typed.filter(pa.array(~bad))
            dates = _utc_dates(landed[spec.timestamp])
            for date in sorted(pc.unique(dates).to_pylist()):
                staging.land(date.isoformat(), landed.filter(pc.equal(dates, pa.scalar(date, pa.date32()))))
            result.rows_landed += landed.num_rows
        quarantined = _quarantine_table(batch, np.flatnonzero(bad), problems.reasons(), path, now)
        if quarantined.num_rows:
            staging.quarantine_rows(quarantined)
            reasons.update(code for reason in quarantined["_reason"].to_pylist() for code in reason.split("; "))
        result.rows_in += batch.rows_in
    check_source()
    result.rows_quarantined = staging.quarantined
    result.partitions = sorted(staging.partitions)
    result.reasons = dict(sorted(reasons.items()))
    if result.rows_in != result.rows_landed + result.rows_quarantined:  # the contract; never expected to fire
        raise RuntimeError(f"row accounting broken for {path}: {result}")
    outputs = staging.close()
    ledger.begin_commit(sha256=key, path=str(path), size=size, spec=spec.name, rows_in=result.rows_in,
                        rows_landed=result.rows_landed, rows_quarantined=result.rows_quarantined, outputs=outputs)
    lake.publish(outputs, settings.home)
    ledger.finish_commit(key)
    return result


def _checked(batch: SourceBatch, spec: DatasetSpec, now: datetime) -> tuple[pa.Table | None, RowProblems]:
    """``check_rows``; a value that breaks the checks themselves rejects the file, not the run."""
    try:
        return check_rows(batch.table, spec, now)
    except Exception as err:  # noqa: BLE001 - one file's odd contents must not stop ingestion of the rest
        raise FileRejected(f"could not be checked ({type(err).__name__}: {err})", permanent=False) from err


def _flag_duplicates(typed: pa.Table, spec: DatasetSpec, problems: RowProblems, ledger: Ledger) -> None:
    """Among rows still good (the last check: these rows land unless flagged here): a repeated id within
    the file (first one wins), or an id anywhere in the lake. Their ids join the ledger's id set."""
    good = np.flatnonzero(~problems.bad_mask())
    if len(good) == 0:
        return
    ids = typed[spec.event_id].take(pa.array(good)).to_pylist()
    within = pd.Series(ids, dtype=object).duplicated(keep="first").to_numpy()
    already = ledger.claim_ids(ids)
    problems.add(good[within | already], "duplicate_event_id")


def _utc_dates(timestamps: pa.ChunkedArray) -> pa.Array:
    """The UTC calendar date of each timestamp (the lake's partition key)."""
    return timestamps.combine_chunks().cast(pa.date32())


_FROM_BOOL = {b"recloop.source_type": b"bool"}  # a quarantined column's field metadata: see _quarantine_table


def _quarantine_table(
    batch: SourceBatch, bad_rows: np.ndarray, reasons: np.ndarray, path: Path, now: datetime
) -> pa.Table:
    """Rejected rows with their original values (as text), the reason, the source file and row number."""
    split = batch.table.take(pa.array(bad_rows, pa.int64()))
    count = split.num_rows + len(batch.unsplittable)
    columns: dict[str, pa.Array] = {
        "_source_file": pa.array([str(path)] * count, pa.string()),
        "_source_row": pa.array(
            np.concatenate([batch.source_row[bad_rows], np.array([r for r, _, _ in batch.unsplittable], np.int64)]),
            pa.int64(),
        ),
        "_reason": pa.array(list(reasons[bad_rows]) + [reason for _, _, reason in batch.unsplittable], pa.string()),
        "_raw_line": pa.array([None] * split.num_rows + [line for _, line, _ in batch.unsplittable], pa.string()),
        "_ingested_at": pa.array([now] * count, pa.timestamp("us", tz="UTC")),
    }
    padding = pa.nulls(len(batch.unsplittable), pa.string())
    for name in split.column_names:
        columns[name] = pa.concat_arrays([_as_text(split[name].combine_chunks()), padding])
    table = pa.table(columns)
    # A bool keeps its text ("true", as a person reading the quarantine expects) and a mark, so a replay
    # reads it back as the bool it was: the integer parsers rightly refuse the text "true" (a CSV cell),
    # and without the mark a label=True quarantined for another reason could never land. 1/0 would land,
    # but as "1" where a string column took the bool as "true".
    bools = {f.name for f in split.schema if pa.types.is_boolean(f.type)}
    schema = pa.schema([f.with_metadata(_FROM_BOOL) if f.name in bools else f for f in table.schema])
    return pa.Table.from_arrays(table.columns, schema=schema)


def _as_text(values: pa.Array) -> pa.Array:
    """Original values as strings (lists and other nested values as JSON)."""
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    try:
        return values.cast(pa.string())
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid):
        return pa.array([None if v is None else json.dumps(v, default=str) for v in values.to_pylist()], pa.string())


REPLAYED_DIR = "replayed"


def replay_quarantine(settings: Settings, spec: DatasetSpec, *, now: datetime | None = None,
                      on_file: Callable[[FileResult], None] | None = None) -> IngestSummary:
    """Quarantined rows through ``spec`` again (``recloop quarantine replay``), after the spec was fixed.

    Each quarantine file is one source: its rows that pass now land (an id already in the lake is still a
    duplicate), the others go to a new quarantine file with their new reasons, and the file itself moves to
    ``quarantine/replayed/`` once its replay is committed. The ledger records the replay under the file's
    content and the spec's version, so an interrupted replay is finished, never landed twice. Rows that
    could not even be split into fields are carried over as they were.
    """
    started = time.perf_counter()
    now = now or datetime.now(UTC)
    root = settings.quarantine_dir
    files = sorted(p for p in root.glob("date=*/*.parquet") if not p.name.startswith((".", "_")))
    summary = IngestSummary(source=str(root), spec=spec.name)
    with exclusive_lock(settings.lake_dir / "_ingest.lock"), Ledger.open(settings.ledger_path) as ledger:
        summary.recovered = lake.recover(ledger, settings.home, [settings.lake_events_dir, settings.quarantine_dir])
        ledger.ensure_ids(lambda: _lake_ids(ledger, settings, spec))
        for path in files:
            result = _replay_file(path, spec, settings, ledger, now)
            summary.add(result)
            if result.status in ("ingested", "skipped"):
                target = root / REPLAYED_DIR / path.parent.name / path.name
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            if on_file:
                on_file(result)
    summary.seconds = round(time.perf_counter() - started, 3)
    return summary


def _replay_file(path: Path, spec: DatasetSpec, settings: Settings, ledger: Ledger, now: datetime) -> FileResult:
    data = path.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    key = ledger_key(digest, spec)
    if ledger.get(key) is not None:
        return FileResult(str(path), "skipped", digest, error="already replayed (the ledger has its bytes)",
                          ledger_key=key)
    table = pq.read_table(path)
    split = ~np.asarray(table["_raw_line"].is_valid())
    values = table.select([c for c in table.column_names if not c.startswith("_")])
    for column in values.schema:
        if column.metadata == _FROM_BOOL:  # the bools of a typed file: read as bools again
            values = values.set_column(values.column_names.index(column.name), column.name,
                                       values[column.name].cast(pa.bool_()))
    for column in spec.by_role("multi_hot"):  # lists from a typed file were kept as JSON text
        if column.name in values.column_names:
            values = values.set_column(values.column_names.index(column.name), column.name,
                                       pa.array([_list_text(v, column.separator) for v in
                                                 values[column.name].to_pylist()], pa.string()))
    rows = table["_source_row"].to_numpy()
    unsplittable = [(int(r), line, reason) for r, line, reason, ok in zip(
        rows, table["_raw_line"].to_pylist(), table["_reason"].to_pylist(), split, strict=True) if not ok]
    batch = SourceBatch(table=values.filter(pa.array(split)), source_row=rows[split], unsplittable=unsplittable,
                        text=True)
    staging = _Staging(settings, _token(key, True), now)
    ledger.begin_file()
    try:
        result = _land([batch], path, key, spec, settings, ledger, staging, now, lambda: None, len(data))
    except BaseException:
        staging.discard()
        ledger.abandon_file()
        raise
    result.sha256 = digest
    return result


def _list_text(value: str | None, separator: str) -> str | None:
    if value is None or not value.startswith("["):
        return value
    try:
        return separator.join(str(v) for v in json.loads(value))
    except (ValueError, TypeError):
        return value
