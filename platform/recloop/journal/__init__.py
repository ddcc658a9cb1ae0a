"""The serving journal: every request, every model evaluation, every feedback event.

It is what closes the loop and what the canary controller judges on:

- ``requests``: who asked, what was served by which version (the payload keeps candidates, context,
  scores and the ranked list, so feedback can be turned into full events later);
- ``evaluations``: one row per model that scored a request (the served one, and the challenger in
  shadow mode), with its latency and status (``ok``, ``error``, ``nan``);
- ``feedback``: one row per impression, keyed by its event id (``<request_id>-<item_id>``): a repeated
  feedback call is ignored, so every event exists once. ``landed_file`` is set once the event was
  written to the landing zone; events written but not marked (a crash in between) are written again
  and ingestion drops the duplicate ids, so nothing is lost and nothing lands twice.

Request rows are written by a background thread in batches (a request never waits on the database);
feedback is written synchronously, because its answer says what was accepted.

Two stores behind one interface (``Journal``, ``recloop.journal.base``), chosen by ``RECLOOP_JOURNAL``
(``open_journal``): serving writes it; the gate, the canary controller and the monitor read it.

- ``SqliteJournal`` (default): a WAL file under ``$RECLOOP_HOME/serving``, for the processes of one host;
- ``PostgresJournal`` (``recloop.journal.postgres``, at ``RECLOOP_POSTGRES_DSN``): shared by every
  serving replica, so the canary controller judges the union of their traffic, and feedback for a
  request is accepted by whichever replica receives it, exactly once (the event id is the primary key).

Example::

    journal = open_journal(settings, spec)          # what the serving API, controller and monitor open
    journal.record(request_row, evaluation_rows)
    journal.add_feedback(request_id, impressions=[3, 9], clicks=[9])
    journal.stats("7", since=canary_started)        # VariantStats over every replica's traffic
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from recloop import endpoints
from recloop.journal.base import (
    FeedbackError,
    Journal,
    JournalBusy,
    JournalUnavailable,
    UnknownRequest,
    retriever_key,
)
from recloop.journal.sqlite import SqliteJournal, journal_path
from recloop.schema import DatasetSpec

if TYPE_CHECKING:
    from recloop.settings import Settings

__all__ = ["FeedbackError", "Journal", "JournalBusy", "JournalUnavailable", "SqliteJournal", "UnknownRequest", "journal_path",
           "open_journal", "retriever_key"]


def open_journal(settings: Settings, spec: DatasetSpec | None = None, *, create: bool = True,
                 connect_later: bool = False) -> Journal | None:
    """The journal ``settings`` name (``RECLOOP_JOURNAL``): SQLite under ``home``, or PostgreSQL at
    ``RECLOOP_POSTGRES_DSN``. With ``create=False``, None where a SQLite journal does not exist yet (a
    reader that must not create one).

    Args:
        connect_later: serving's journal: a PostgreSQL that does not answer yet is not a failure. The journal
            opens without it (``degraded`` says so), keeps the requests served meanwhile in memory, refuses
            feedback with ``JournalUnavailable`` and connects on a later write. Readers (the canary controller,
            the monitor) fail at once instead: they have nothing to do without it.
    """
    if settings.journal == "postgres":
        from recloop.journal.postgres import PostgresJournal

        limits = endpoints.limits_for(settings)
        if not connect_later:
            endpoints.require_postgres(settings.postgres_dsn, limits)  # a dead database: one line, in seconds
        return PostgresJournal(endpoints.with_connect_timeout(settings.postgres_dsn, limits), spec,
                               connect_later=connect_later, shown_as=_shown(settings.postgres_dsn))
    path = journal_path(settings)
    if not create and not path.exists():
        return None
    return SqliteJournal(path, spec)


def _shown(dsn: str) -> str:
    """The DSN as messages and ``/healthz`` may show it: no password, in a URL or a libpq ``key=value`` string."""
    import re

    return endpoints.redact(dsn) if "://" in dsn else re.sub(r"password\s*=\s*('[^']*'|\S+)", "password=***", dsn)
