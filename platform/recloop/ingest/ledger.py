"""The ingestion ledger: which files have been ingested, with their counts, and commits in flight.

A file is known by the SHA-256 of its bytes, so the same content under another name (or the same name
touched again) is not ingested twice, while a file rewritten with new content is new. The ledger is a
SQLite database in the lake folder (``_ledger.sqlite``: the leading underscore keeps dataset readers
away from it).

A row's status moves ``committing`` → ``done``; ``rejected`` records a file whose bytes cannot be read.
``committing`` rows name the temporary and final paths of their outputs, so a run that was killed while
renaming them into place can be finished by the next one (see ``recloop.ingest.lake``).

The ledger also holds the **id set**: every event id in the lake, whatever its date. A file's new ids are
added in the same transaction as its ``committing`` row (``begin_file`` … ``begin_commit``), so they count
as landed exactly when the file does, and an event replayed with another timestamp is still a duplicate.
A ledger written before the id set existed is filled from the lake once (``ensure_ids``).
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    sha256           TEXT PRIMARY KEY,
    path             TEXT NOT NULL,
    size             INTEGER NOT NULL,
    spec             TEXT NOT NULL,
    status           TEXT NOT NULL CHECK (status IN ('committing', 'done', 'rejected')),
    rows_in          INTEGER NOT NULL DEFAULT 0,
    rows_landed      INTEGER NOT NULL DEFAULT 0,
    rows_quarantined INTEGER NOT NULL DEFAULT 0,
    outputs          TEXT NOT NULL DEFAULT '[]',
    error            TEXT,
    recorded_at      TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS event_ids (id TEXT PRIMARY KEY) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
"""


@dataclass(frozen=True)
class LedgerEntry:
    sha256: str
    path: str
    size: int
    spec: str
    status: str
    rows_in: int
    rows_landed: int
    rows_quarantined: int
    outputs: list[dict[str, str]]
    error: str | None
    recorded_at: str


class Ledger:
    """SQLite-backed record of ingested files. One instance per ingest run; not shared across threads.

    Example::

        with Ledger.open(settings.ledger_path) as ledger:
            if ledger.get(digest) is None:
                ...
    """

    def __init__(self, connection: sqlite3.Connection):
        self._db = connection

    @classmethod
    @contextmanager
    def open(cls, path: Path) -> Iterator[Ledger]:
        path.parent.mkdir(parents=True, exist_ok=True)
        db = sqlite3.connect(path, isolation_level=None, timeout=60)
        try:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=FULL")
            db.executescript(_SCHEMA)
            yield cls(db)
        finally:
            db.close()

    def get(self, sha256: str) -> LedgerEntry | None:
        row = self._db.execute("SELECT * FROM files WHERE sha256 = ?", (sha256,)).fetchone()
        return _entry(row) if row else None

    def entries(self, status: str | None = None) -> list[LedgerEntry]:
        if status is None:
            rows = self._db.execute("SELECT * FROM files ORDER BY recorded_at, path").fetchall()
        else:
            rows = self._db.execute(
                "SELECT * FROM files WHERE status = ? ORDER BY recorded_at, path", (status,)
            ).fetchall()
        return [_entry(r) for r in rows]

    # --- the id set ------------------------------------------------------------------------------------

    def ensure_ids(self, lake_ids: Callable[[], Iterable[Iterable[str]]]) -> int:
        """Fill the id set from the lake if this ledger predates it; returns how many ids were added.

        Args:
            lake_ids: yields the event ids of every committed lake file (batch by batch).
        """
        row = self._db.execute("SELECT value FROM meta WHERE key = 'event_ids'").fetchone()
        if row is not None:
            return 0
        added = 0
        self._db.execute("BEGIN IMMEDIATE")
        try:
            if self._db.execute("SELECT 1 FROM files WHERE status != 'rejected' LIMIT 1").fetchone():
                for batch in lake_ids():
                    added += self._db.executemany("INSERT OR IGNORE INTO event_ids VALUES (?)",
                                                  ((i,) for i in batch)).rowcount
            self._db.execute("INSERT INTO meta VALUES ('event_ids', 'complete')")
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return added

    def begin_file(self) -> None:
        """Open the transaction that ``begin_commit`` closes: ids added meanwhile land with the file."""
        self._db.execute("BEGIN IMMEDIATE")

    def claim_ids(self, ids: list[str]) -> np.ndarray:
        """Add ``ids`` to the id set (inside the file's transaction); returns (len(ids),) bool: which were
        there already, in the lake or earlier in this file. One statement per call: SQLite inserts what
        is new and returns it (``INSERT OR IGNORE … RETURNING``, SQLite ≥ 3.35)."""
        inserted = {row[0] for row in self._db.execute(
            "INSERT OR IGNORE INTO event_ids SELECT value FROM json_each(?) RETURNING id", (json.dumps(ids),))}
        if len(inserted) == len(ids):
            return np.zeros(len(ids), dtype=bool)
        return np.fromiter((i not in inserted for i in ids), dtype=bool, count=len(ids))

    def add_ids(self, ids: Iterable[str]) -> None:
        self._db.executemany("INSERT OR IGNORE INTO event_ids VALUES (?)", ((i,) for i in ids))

    def abandon_file(self) -> None:
        """Forget everything since ``begin_file`` (the file was rejected halfway, or the run failed)."""
        if self._db.in_transaction:
            self._db.execute("ROLLBACK")

    def event_id_count(self) -> int:
        return self._db.execute("SELECT count(*) FROM event_ids").fetchone()[0]

    # --- commits -----------------------------------------------------------------------------------------

    def begin_commit(
        self, *, sha256: str, path: str, size: int, spec: str, rows_in: int, rows_landed: int,
        rows_quarantined: int, outputs: list[dict[str, str]],
    ) -> None:
        """Record the decision to publish these outputs: from here on, the file counts as ingested.

        Commits the transaction ``begin_file`` opened, with the ids added since: the commit point.
        """
        self._db.execute(
            "INSERT OR REPLACE INTO files (sha256, path, size, spec, status, rows_in, rows_landed,"
            " rows_quarantined, outputs, error, recorded_at) VALUES (?, ?, ?, ?, 'committing', ?, ?, ?, ?, NULL, ?)",
            (sha256, path, size, spec, rows_in, rows_landed, rows_quarantined, json.dumps(outputs), _now()),
        )
        if self._db.in_transaction:
            self._db.execute("COMMIT")

    def finish_commit(self, sha256: str) -> None:
        self._db.execute(
            "UPDATE files SET status = 'done', recorded_at = ? WHERE sha256 = ?", (_now(), sha256)
        )

    def forget(self, sha256: str) -> bool:
        """Let the next run read a file again (``recloop ingest --reingest``). A rejected file's record goes;
        a finished one's is kept under another key, because its outputs are the lake's committed files (deleted,
        the rows it landed left every reader of the lake while its ids still made the new read's rows
        duplicates: lost for good). Its rows and ids stay, so they come back as duplicates."""
        moved = self._db.execute("UPDATE files SET sha256 = ? WHERE sha256 = ? AND status = 'done'",
                                 (f"{sha256}:read-again-{time.time_ns()}", sha256))
        removed = self._db.execute("DELETE FROM files WHERE sha256 = ? AND status = 'rejected'", (sha256,))
        return moved.rowcount + removed.rowcount > 0

    def record_rejected(self, *, sha256: str, path: str, size: int, spec: str, error: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO files (sha256, path, size, spec, status, error, recorded_at)"
            " VALUES (?, ?, ?, ?, 'rejected', ?, ?)",
            (sha256, path, size, spec, error, _now()),
        )


def _entry(row: tuple) -> LedgerEntry:
    (sha, path, size, spec, status, rows_in, landed, quarantined, outputs, error, recorded) = row
    return LedgerEntry(sha, path, size, spec, status, rows_in, landed, quarantined, json.loads(outputs), error,
                       recorded)


def _now() -> str:
    return datetime.now(UTC).isoformat()
