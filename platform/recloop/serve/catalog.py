"""The catalog's unavailable items: a JSON list of item ids that ``/recommend`` never returns (withdrawn,
out of stock), written by whoever owns the catalog and re-read by every serving process when it changes.

Example::

    write_unavailable(settings.unavailable_items_path, [17, 23])
    UnavailableItems(settings.unavailable_items_path).ids()   # frozenset({17, 23})
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

log = logging.getLogger("recloop.serve")


class UnavailableItems:
    """The catalog's unavailable items, re-read when the file changes (checked at most once a second).

    The file is a JSON list of item ids; a missing file means every item is available. A file that does
    not parse keeps the previous list (and says so in the log) rather than returning withdrawn items.
    """

    def __init__(self, path: Path, check_seconds: float = 1.0):
        self.path, self.check_seconds = Path(path), check_seconds
        self._ids: frozenset[int] = frozenset()
        self._mtime: float | None = None
        self._checked = 0.0
        self._lock = threading.Lock()

    def ids(self) -> frozenset[int]:
        now = time.monotonic()
        if now - self._checked < self.check_seconds:
            return self._ids
        with self._lock:
            self._checked = now
            try:
                mtime = self.path.stat().st_mtime
            except FileNotFoundError:
                self._ids, self._mtime = frozenset(), None
                return self._ids
            if mtime != self._mtime:
                try:
                    raw = json.loads(self.path.read_text())
                    self._ids = frozenset(int(i) for i in raw)
                    self._mtime = mtime
                except (ValueError, TypeError, OSError) as err:
                    log.error(
                        "%s is not a JSON list of item ids (%s): keeping the previous list", self.path, err
                    )
        return self._ids


def write_unavailable(path: Path, item_ids: list[int]) -> None:
    """Replace the catalog's unavailable items (written aside and renamed: a reader sees all or nothing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(sorted({int(i) for i in item_ids})) + "\n")
    tmp.replace(path)
