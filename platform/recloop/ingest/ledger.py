"""The ingestion ledger: which files have been ingested, with their counts, and commits in flight.

A file is known by the SHA-256 of its bytes, so the same content under another name (or the same name
touched again) is not ingested twice, while a file rewritten with new content is new. The ledger is a
SQLite database in the lake folder (``_ledger.sqlite``: the leading underscore keeps dataset readers
away from it).

A row's status moves ``committing`` → ``done``; ``rejected`` records a file that could not be read.
``committing`` rows name the temporary and final paths of their outputs, so a run that was killed while
renaming them into place can be finished by the next one (see ``recloop.ingest.lake``).
"""

from __future__ import annotations

import fcntl
import json
import sqlite3
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

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

    def begin_commit(
        self, *, sha256: str, path: str, size: int, spec: str, rows_in: int, rows_landed: int,
        rows_quarantined: int, outputs: list[dict[str, str]],
    ) -> None:
        """Record the decision to publish these outputs: from here on, the file counts as ingested."""
        self._db.execute(
            "INSERT OR REPLACE INTO files (sha256, path, size, spec, status, rows_in, rows_landed,"
            " rows_quarantined, outputs, error, recorded_at) VALUES (?, ?, ?, ?, 'committing', ?, ?, ?, ?, NULL, ?)",
            (sha256, path, size, spec, rows_in, rows_landed, rows_quarantined, json.dumps(outputs), _now()),
        )

    def finish_commit(self, sha256: str) -> None:
        self._db.execute(
            "UPDATE files SET status = 'done', recorded_at = ? WHERE sha256 = ?", (_now(), sha256)
        )

    def record_rejected(self, *, sha256: str, path: str, size: int, spec: str, error: str) -> None:
        self._db.execute(
            "INSERT OR REPLACE INTO files (sha256, path, size, spec, status, error, recorded_at)"
            " VALUES (?, ?, ?, ?, 'rejected', ?, ?)",
            (sha256, path, size, spec, error, _now()),
        )


@contextmanager
def exclusive_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock on ``path`` for the block: one ingest run at a time per lake."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def _entry(row: tuple) -> LedgerEntry:
    (sha, path, size, spec, status, rows_in, landed, quarantined, outputs, error, recorded) = row
    return LedgerEntry(sha, path, size, spec, status, rows_in, landed, quarantined, json.loads(outputs), error,
                       recorded)


def _now() -> str:
    return datetime.now(UTC).isoformat()
