"""Cross-process locks: one holder at a time of a lock file, across processes and threads.

Every stage that must not run twice at once on one home takes one of these: an ingest run per lake, a
registration per MLflow store, the monitor's memory, the model slot of the flows. ``filelock`` does the
work; the operating system releases a lock with the process that held it, so a killed holder never
blocks the next one.

Example::

    with exclusive_lock(settings.lake_dir / "_ingest.lock"):
        ...  # one ingest run at a time per lake
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def exclusive_lock(path: Path, timeout_seconds: float | None = None) -> Iterator[None]:
    """Hold an exclusive lock on the lock file ``path`` for the block (``filelock``: one holder across
    processes and threads, released by the operating system with a process that dies), e.g. one ingest run
    at a time per lake. ``path`` is a file of its own: taking the lock may truncate it. Waits up to
    ``timeout_seconds`` (None: for ever), then raises ``TimeoutError`` (``filelock.Timeout``)."""
    from filelock import FileLock

    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path), timeout=-1 if timeout_seconds is None else timeout_seconds):
        yield
