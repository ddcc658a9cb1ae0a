"""The journal in one SQLite file (WAL): the default, for the serving processes of one host."""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from recloop.journal.base import Journal
from recloop.schema import DatasetSpec

if TYPE_CHECKING:
    from recloop.settings import Settings

SCHEMA = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, at REAL NOT NULL, ts_us INTEGER NOT NULL, user_id INTEGER NOT NULL,
    variant TEXT NOT NULL, served_version TEXT NOT NULL, latency_ms REAL NOT NULL, payload TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (at);
CREATE INDEX IF NOT EXISTS requests_by_event_time ON requests (ts_us);
CREATE INDEX IF NOT EXISTS requests_by_user ON requests (user_id, ts_us);
CREATE TABLE IF NOT EXISTS evaluations (
    request_id TEXT NOT NULL, version TEXT NOT NULL, role TEXT NOT NULL, status TEXT NOT NULL,
    latency_ms REAL NOT NULL, at REAL NOT NULL);
CREATE INDEX IF NOT EXISTS evaluations_by_version ON evaluations (version, at);
CREATE INDEX IF NOT EXISTS evaluations_by_request ON evaluations (request_id);
CREATE TABLE IF NOT EXISTS feedback (
    event_id TEXT PRIMARY KEY, request_id TEXT NOT NULL, item_id INTEGER NOT NULL, label INTEGER NOT NULL,
    at REAL NOT NULL, served_version TEXT NOT NULL, scores TEXT NOT NULL, landed_file TEXT);
CREATE INDEX IF NOT EXISTS feedback_by_time ON feedback (at);
CREATE INDEX IF NOT EXISTS feedback_by_request ON feedback (request_id);
CREATE INDEX IF NOT EXISTS feedback_unlanded ON feedback (landed_file) WHERE landed_file IS NULL;
"""


class SqliteJournal(Journal):
    """The journal in one SQLite file (WAL): the default, for the serving processes of one host."""

    def __init__(self, path: Path, spec: DatasetSpec | None = None, request_wait_seconds: float = 0.0):
        super().__init__(spec, request_wait_seconds)
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=30)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(SCHEMA)
        self._lock = threading.Lock()
        self._start_writer()

    @contextmanager
    def _transaction(self, begin: str = "BEGIN") -> Iterator[None]:
        """One transaction, rolled back when anything in it fails: a failed statement (a busy store, a full
        disk) left the connection inside its transaction, and every later BEGIN then failed ("cannot start a
        transaction within a transaction") until a restart."""
        self._db.execute(begin)
        try:
            yield
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def _write_requests(self, requests: list[tuple], evaluations: list[tuple]) -> None:
        with self._lock, self._transaction():
            self._db.executemany("INSERT OR IGNORE INTO requests VALUES (?,?,?,?,?,?,?,?)", requests)
            self._db.executemany("INSERT INTO evaluations VALUES (?,?,?,?,?,?)", evaluations)

    def _request(self, request_id: str) -> tuple[str, str] | None:
        with self._lock:
            return self._db.execute("SELECT payload, served_version FROM requests WHERE request_id = ?",
                                    (request_id,)).fetchone()

    def _insert_new_feedback(self, rows: list[tuple]) -> list[tuple]:
        with self._lock, self._transaction("BEGIN IMMEDIATE"):
            ids = [r[0] for r in rows]
            seen = {r[0] for r in self._db.execute(
                f"SELECT event_id FROM feedback WHERE event_id IN ({','.join('?' * len(ids))})", ids)}
            new = [r for r in rows if r[0] not in seen]
            self._db.executemany("INSERT INTO feedback VALUES (?,?,?,?,?,?,?,?)", new)
        return new

    @contextmanager
    def _unlanded(self, limit: int) -> Iterator[tuple[list[tuple], object]]:
        with self._lock:
            rows = self._db.execute(
                "SELECT f.event_id, f.item_id, f.label, r.ts_us, r.user_id, r.payload FROM feedback f "
                "JOIN requests r USING (request_id) WHERE f.landed_file IS NULL LIMIT ?", (limit,)).fetchall()

        def mark(name: str) -> None:
            with self._lock, self._transaction():
                self._db.executemany("UPDATE feedback SET landed_file = ? WHERE event_id = ?",
                                     [(name, r[0]) for r in rows])

        yield rows, mark

    def _query(self, sql: str, params: list) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, params).fetchall()

    def _close_store(self) -> None:
        self._db.close()


def journal_path(settings: Settings) -> Path:
    return settings.serving_dir / "journal.db"
