"""Time as the loop names it: microseconds since the epoch in events, ``YYYY-MM-DDTHH`` (UTC) for hours.

Every file of training rows is named after the first hour of its period (``2026-01-01T10.parquet``);
checkpoints, training windows, the gate's held-out window and the monitor's windows are lists of such
stems. One definition here, so that a stem written by the feature job is read the same way by every stage.

Example::

    hour_stem(datetime(2026, 1, 1, 10, 30, tzinfo=UTC))   # "2026-01-01T10"
    hour_after("2026-01-01T23")                            # "2026-01-02T00"
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

US = 1_000_000  # microseconds a second: event timestamps are int64 microseconds since the epoch (UTC)
HOUR_FORMAT = "%Y-%m-%dT%H"


def hour_stem(when: datetime) -> str:
    """The hour ``when`` falls in, as ``YYYY-MM-DDTHH`` (an aware time is taken in UTC first)."""
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    return when.strftime(HOUR_FORMAT)


def parse_hour(stem: str) -> datetime:
    """The start of the hour ``YYYY-MM-DDTHH``, in UTC."""
    return datetime.strptime(stem, HOUR_FORMAT).replace(tzinfo=UTC)


def hour_after(stem: str) -> str:
    """The hour after ``YYYY-MM-DDTHH`` (the first hour a checkpoint or a run has not seen)."""
    return hour_stem(parse_hour(stem) + timedelta(hours=1))


def hour_of_us(t_us: int) -> str:
    """The hour of a timestamp in microseconds since the epoch."""
    return hour_stem(datetime.fromtimestamp(t_us / US, tz=UTC))


def file_hour(path) -> datetime:
    """When a file of training rows starts: its name is its period's first hour (``2026-01-01T10.parquet``)."""
    return parse_hour(path.stem)
