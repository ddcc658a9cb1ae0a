"""The serving journal in PostgreSQL: one journal for every serving replica (``RECLOOP_JOURNAL=postgres``).

The tables are those of the SQLite journal, in the schema ``recloop_journal`` of the database at
``RECLOOP_POSTGRES_DSN`` (created on first use, under an advisory lock so replicas starting together do
not race). What sharing needs, and how it is had:

- **the canary judges all traffic**: every replica writes its requests and evaluations here, so
  ``stats`` (the controller's and the monitor's figures) covers the union of what the replicas served;
- **feedback accepted by any replica, exactly once**: the event id is the primary key and new events are
  inserted with ``ON CONFLICT DO NOTHING RETURNING``, so of two replicas receiving the same feedback at
  once, exactly one reports each event as accepted. Feedback that reaches a replica before the serving
  replica's write queue (flushed every ~50 ms) has stored the request waits for it (``request_wait_seconds``):
  each write of requests sends ``NOTIFY recloop_journal_requests`` with their ids in its transaction, and a
  listening connection per replica wakes the waiters whose request was written (LISTEN/NOTIFY), with a poll
  every ``fallback_poll_seconds`` only in case a notification is lost, and every 20 ms while the listening
  connection is down;
- **each event lands once**: a replica landing feedback claims unlanded rows with ``FOR UPDATE SKIP
  LOCKED``, writes the file, marks the rows and commits; another replica skips the claimed rows. A crash
  between writing and committing leaves the rows unlanded (written again later; ingestion drops the
  duplicate ids), as with SQLite.

Example::

    journal = PostgresJournal("postgresql://recloop@postgres:5432/recloop", spec)
"""

from __future__ import annotations

import logging
import select
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from recloop.journal.base import Journal
from recloop.schema import DatasetSpec

SCHEMA_NAME = "recloop_journal"
CHANNEL = "recloop_journal_requests"  # NOTIFY payload: the written request ids, comma-separated ("" = any)
_PAYLOAD_BYTES = 7900  # PostgreSQL's limit is 8000 bytes; a longer batch notifies "" (every waiter looks)
_REMEMBERED = 100_000  # written ids kept for waiters that start looking after the notification came

log = logging.getLogger(__name__)
_SCHEMA_LOCK = 0x7265636C  # pg_advisory_xact_lock key ("recl"): one replica creates the tables at a time

TABLES = """
CREATE TABLE IF NOT EXISTS requests (
    request_id TEXT PRIMARY KEY, at DOUBLE PRECISION NOT NULL, ts_us BIGINT NOT NULL, user_id BIGINT NOT NULL,
    variant TEXT NOT NULL, served_version TEXT NOT NULL, latency_ms DOUBLE PRECISION NOT NULL,
    payload TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS requests_by_time ON requests (at);
CREATE INDEX IF NOT EXISTS requests_by_event_time ON requests (ts_us);
CREATE INDEX IF NOT EXISTS requests_by_user ON requests (user_id, ts_us);
CREATE TABLE IF NOT EXISTS evaluations (
    request_id TEXT NOT NULL, version TEXT NOT NULL, role TEXT NOT NULL, status TEXT NOT NULL,
    latency_ms DOUBLE PRECISION NOT NULL, at DOUBLE PRECISION NOT NULL);
CREATE INDEX IF NOT EXISTS evaluations_by_version ON evaluations (version, at);
CREATE INDEX IF NOT EXISTS evaluations_by_request ON evaluations (request_id);
CREATE TABLE IF NOT EXISTS feedback (
    event_id TEXT PRIMARY KEY, request_id TEXT NOT NULL, item_id BIGINT NOT NULL, label INTEGER NOT NULL,
    at DOUBLE PRECISION NOT NULL, served_version TEXT NOT NULL, scores TEXT NOT NULL, landed_file TEXT);
CREATE INDEX IF NOT EXISTS feedback_by_time ON feedback (at);
CREATE INDEX IF NOT EXISTS feedback_by_request ON feedback (request_id);
CREATE INDEX IF NOT EXISTS feedback_unlanded ON feedback (landed_file) WHERE landed_file IS NULL;
"""


class PostgresJournal(Journal):
    """The journal in PostgreSQL, shared by serving replicas (see the module docstring).

    Args:
        dsn: a libpq connection string or ``postgresql://`` URL.
        spec: the dataset feedback lands as.
        request_wait_seconds: how long feedback waits for a request another replica has not written yet.
        pool_size: connections kept open (the request writer, feedback calls, the feedback flusher, queries);
            a caller finding them all busy waits for one.
        statement_seconds: the longest a statement may run (a database that hangs holds no serving thread
            longer than this).
        fallback_poll_seconds: how often a waiter looks anyway while notifications arrive (one lost is
            found this late).
    """

    def __init__(self, dsn: str, spec: DatasetSpec | None = None, request_wait_seconds: float = 2.0,
                 pool_size: int = 8, statement_seconds: float = 30.0, fallback_poll_seconds: float = 1.0):
        import psycopg2.pool

        super().__init__(spec, request_wait_seconds)
        self.fallback_poll_seconds = fallback_poll_seconds
        self._dsn = dsn
        self._written = threading.Condition()
        self._written_ids: set[str] = set()
        self._written_order: deque[str] = deque()
        self._any_written = 0  # counts notifications that named no ids
        self._listening = threading.Event()
        self._listener_stop = threading.Event()
        # minconn = maxconn: psycopg2 closes every returned connection past minconn, so a pool of one kept
        # opening and closing the others under concurrent calls; and it raises at maxconn instead of waiting
        self._pool = psycopg2.pool.ThreadedConnectionPool(
            pool_size, pool_size, dsn,
            options=f"-c search_path={SCHEMA_NAME} -c statement_timeout={int(statement_seconds * 1000)}")
        self._slots = threading.BoundedSemaphore(pool_size)
        with self._connection() as connection, connection.cursor() as cursor:
            cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
            cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA_NAME}")
            cursor.execute(TABLES)
        self._listener = threading.Thread(target=self._listen_loop, name="recloop-journal-listen", daemon=True)
        self._listener.start()
        self._start_writer()

    @contextmanager
    def _connection(self) -> Iterator:
        """A pooled connection (waiting for a free one); its transaction commits when the block ends (rolls
        back on an error)."""
        with self._slots:
            connection = self._pool.getconn()
            try:
                with connection:
                    yield connection
            finally:
                self._pool.putconn(connection)

    def _write_requests(self, requests: list[tuple], evaluations: list[tuple]) -> None:
        from psycopg2.extras import execute_values

        with self._connection() as connection, connection.cursor() as cursor:
            execute_values(cursor, "INSERT INTO requests VALUES %s ON CONFLICT (request_id) DO NOTHING", requests)
            if evaluations:
                execute_values(cursor, "INSERT INTO evaluations VALUES %s", evaluations)
            ids = ",".join(r[0] for r in requests)
            # delivered when the transaction commits: a woken replica finds the rows
            cursor.execute("SELECT pg_notify(%s, %s)", (CHANNEL, ids if len(ids) <= _PAYLOAD_BYTES else ""))

    def _listen_loop(self) -> None:
        """Keep a connection listening on ``CHANNEL`` and wake the waiters (reconnecting after a failure;
        meanwhile waiters poll)."""
        import psycopg2

        while not self._listener_stop.is_set():
            connection = None
            try:
                connection = psycopg2.connect(self._dsn)
                connection.autocommit = True
                connection.cursor().execute(f"LISTEN {CHANNEL}")
                self._listening.set()
                while not self._listener_stop.is_set():
                    if select.select([connection], [], [], 0.5)[0]:
                        connection.poll()
                        self._heard([n.payload for n in connection.notifies])
                        connection.notifies.clear()
            except Exception as err:  # noqa: BLE001 - waiters fall back to polling; try again shortly
                log.warning("journal: listening for written requests failed (polling meanwhile): %s", err)
            finally:
                self._listening.clear()
                if connection is not None:
                    connection.close()
            self._listener_stop.wait(1.0)

    def _heard(self, payloads: list[str]) -> None:
        with self._written:
            for payload in payloads:
                if not payload:
                    self._any_written += 1
                for request_id in filter(None, payload.split(",")):
                    if request_id not in self._written_ids:
                        self._written_ids.add(request_id)
                        self._written_order.append(request_id)
                while len(self._written_order) > _REMEMBERED:
                    self._written_ids.discard(self._written_order.popleft())
            self._written.notify_all()

    def _wait_for_request(self, request_id: str, seconds: float) -> None:
        """Until a notification names ``request_id`` (or names none), at most ``seconds`` and at most
        ``fallback_poll_seconds``; a 20 ms poll while no connection listens."""
        if not self._listening.is_set():
            super()._wait_for_request(request_id, seconds)
            return
        with self._written:
            before = self._any_written
            self._written.wait_for(lambda: request_id in self._written_ids or self._any_written != before
                                   or not self._listening.is_set(),
                                   timeout=max(0.0, min(seconds, self.fallback_poll_seconds)))

    def _request(self, request_id: str) -> tuple[str, str] | None:
        with self._connection() as connection, connection.cursor() as cursor:
            cursor.execute("SELECT payload, served_version FROM requests WHERE request_id = %s", (request_id,))
            return cursor.fetchone()

    def _insert_new_feedback(self, rows: list[tuple]) -> list[tuple]:
        from psycopg2.extras import execute_values

        with self._connection() as connection, connection.cursor() as cursor:
            inserted = execute_values(cursor, "INSERT INTO feedback VALUES %s ON CONFLICT (event_id) DO NOTHING "
                                      "RETURNING event_id", rows, fetch=True)
        new = {event_id for (event_id,) in inserted}
        return [r for r in rows if r[0] in new]

    @contextmanager
    def _unlanded(self, limit: int) -> Iterator[tuple[list[tuple], object]]:
        with self._connection() as connection, connection.cursor() as cursor:
            cursor.execute(
                "SELECT f.event_id, f.item_id, f.label, r.ts_us, r.user_id, r.payload FROM feedback f "
                "JOIN requests r USING (request_id) WHERE f.landed_file IS NULL LIMIT %s FOR UPDATE OF f SKIP LOCKED",
                (limit,))
            rows = cursor.fetchall()

            def mark(name: str) -> None:
                cursor.execute("UPDATE feedback SET landed_file = %s WHERE event_id = ANY(%s)",
                               (name, [r[0] for r in rows]))

            yield rows, mark

    def _query(self, sql: str, params: list) -> list[tuple]:
        with self._connection() as connection, connection.cursor() as cursor:
            cursor.execute(sql.replace("?", "%s"), params)
            return cursor.fetchall()

    def _close_store(self) -> None:
        self._listener_stop.set()
        self._listener.join(timeout=5)
        self._pool.closeall()
