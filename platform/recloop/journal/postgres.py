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
  duplicate ids), as with SQLite;
- **a replica starts while the database is down** (``connect_later``, what serving opens): it serves, keeps
  the request rows in memory, refuses feedback with ``JournalUnavailable`` (a 503 the client retries) and
  tries the database again every ``retry_seconds``; the first write that reaches it creates the tables and
  writes every row kept meanwhile.

Example::

    journal = PostgresJournal("postgresql://recloop@postgres:5432/recloop", spec)
"""

from __future__ import annotations

import logging
import select
import threading
import time
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from recloop.journal.base import Journal, JournalUnavailable
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
        connect_later: a database that does not answer now is not an error: the journal opens without it
            (``degraded`` says why) and connects on a later call (see the module docstring).
        retry_seconds: while the database is unreachable, how often a call tries it again (the others are
            refused at once, so a dead database costs a request nothing).
        shown_as: how messages name the database (the DSN without its password).
    """

    def __init__(self, dsn: str, spec: DatasetSpec | None = None, request_wait_seconds: float = 2.0,
                 pool_size: int = 8, statement_seconds: float = 30.0, fallback_poll_seconds: float = 1.0,
                 *, connect_later: bool = False, retry_seconds: float = 5.0, shown_as: str = "its DSN"):
        super().__init__(spec, request_wait_seconds)
        self.fallback_poll_seconds = fallback_poll_seconds
        self._dsn = dsn
        self._written = threading.Condition()
        self._written_ids: set[str] = set()
        self._written_order: deque[str] = deque()
        self._any_written = 0  # counts notifications that named no ids
        self._listening = threading.Event()
        self._listener_stop = threading.Event()
        self._pool_size, self._statement_seconds = pool_size, statement_seconds
        self._retry_seconds, self._shown_as = retry_seconds, shown_as
        self._pool = None
        self._opening = threading.Lock()
        self._unreachable: str | None = None  # why the database could not be reached, until it is
        self._next_try = 0.0  # monotonic time of the next try while unreachable
        self._slots = threading.BoundedSemaphore(pool_size)
        try:
            self._open_store()
        except JournalUnavailable as err:
            if not connect_later:
                raise
            log.warning("journal: %s", err)
        self._listener = threading.Thread(target=self._listen_loop, name="recloop-journal-listen", daemon=True)
        self._listener.start()
        self._start_writer()

    @property
    def degraded(self) -> str | None:
        if self._unreachable is not None:
            return (f"PostgreSQL at {self._shown_as} unreachable since start-up: {self.unwritten_requests} request "
                    f"rows kept in memory, feedback refused until it answers ({self._unreachable})")
        return super().degraded

    def _open_store(self) -> None:
        """Connect the pool and create the schema (once); while the database is unreachable, at most one try per
        ``retry_seconds``, every other call refused at once with ``JournalUnavailable``."""
        import psycopg2.pool

        with self._opening:
            if self._pool is not None:
                return
            wait = self._next_try - time.monotonic()
            if wait > 0:
                raise JournalUnavailable(f"PostgreSQL at {self._shown_as} is unreachable ({self._unreachable}); "
                                         f"tried again in {wait:.0f} s", retry_after=max(1.0, wait))
            pool = None
            try:
                # minconn = maxconn: psycopg2 closes every returned connection past minconn, so a pool of one kept
                # opening and closing the others under concurrent calls; and it raises at maxconn instead of waiting
                pool = psycopg2.pool.ThreadedConnectionPool(
                    self._pool_size, self._pool_size, self._dsn,
                    options=f"-c search_path={SCHEMA_NAME} -c statement_timeout={int(self._statement_seconds * 1000)}")
                connection = pool.getconn()
                try:
                    with connection, connection.cursor() as cursor:
                        cursor.execute("SELECT pg_advisory_xact_lock(%s)", (_SCHEMA_LOCK,))
                        cursor.execute(f"CREATE SCHEMA IF NOT EXISTS {SCHEMA_NAME}")
                        cursor.execute(TABLES)
                finally:
                    pool.putconn(connection)
            except psycopg2.Error as err:
                if pool is not None:
                    pool.closeall()
                self._unreachable = " ".join(str(err).split()) or type(err).__name__
                self._next_try = time.monotonic() + self._retry_seconds
                raise JournalUnavailable(f"PostgreSQL at {self._shown_as} is unreachable: {self._unreachable}",
                                         retry_after=self._retry_seconds) from err
            if self._unreachable is not None:
                log.warning("journal: PostgreSQL at %s answers again", self._shown_as)
            self._pool, self._unreachable = pool, None

    @contextmanager
    def _connection(self) -> Iterator:
        """A pooled connection (waiting for a free one); its transaction commits when the block ends (rolls
        back on an error). Raises ``JournalUnavailable`` while the database cannot be reached."""
        if self._pool is None:
            self._open_store()
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

        failing = False
        while not self._listener_stop.is_set():
            connection = None
            try:
                connection = psycopg2.connect(self._dsn)
                connection.autocommit = True
                connection.cursor().execute(f"LISTEN {CHANNEL}")
                self._listening.set()
                failing = False
                while not self._listener_stop.is_set():
                    if select.select([connection], [], [], 0.5)[0]:
                        connection.poll()
                        self._heard([n.payload for n in connection.notifies])
                        connection.notifies.clear()
            except Exception as err:  # noqa: BLE001 - waiters fall back to polling; try again shortly
                # once per outage: a database down for an hour is one warning here, not one a second
                (log.debug if failing else log.warning)(
                    "journal: listening for written requests failed (polling meanwhile): %s", err)
                failing = True
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
        if self._pool is not None:
            self._pool.closeall()
