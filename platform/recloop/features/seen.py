"""What each user already interacted with in the lake: the items ``/recommend`` never offers them again.

The journal knows what serving showed and recorded within the last day; the lake knows everything the log
holds (a rating from last month, a click from an ingested export). The feature job turns it into one small
file, serving reads it, and the replay computes the same sets at any point in time with the same function::

    lake events (user, item, label, time)
      │ keep      time in [before - lookback_days, before); label 1 only, unless every_interaction
      │ collapse  one row per (user, item): its newest time
      │ bound     each user's newest max_items items (ties: smaller item id first)
      ▼
    $RECLOOP_HOME/features/seen.parquet    columns <user key>, <item key>, last_us; sorted by user, newest
                                           first; the metadata names the time it is as of and its bounds

**Why positives only by default.** A label-1 row is a click, a purchase or a high rating: the user has the
item, and offering it again wastes a slot. A label-0 row in a click log is an impression the user passed
over; banning every impression for months would empty a heavy user's catalog, and the journal's rule
already keeps shown items out for ``recommend_seen_hours``. In a log where every row means the user
consumed the item (ratings, where label 0 is a low rating of a film they watched), every row counts: the
default for a spec with ``events: chosen`` (``RECLOOP_RECOMMEND_SEEN_HISTORY_ALL`` overrides either way).

The file is as of the newest feature state (``before`` = its ``as_of``), written aside and renamed, so a
reader sees all of it or the one before. A run after that one merges the previous file with the events
since (exact: a pair the bound left out is older than the ``max_items`` pairs it kept, whose times only
grow); late events, another bound or other key names rebuild it from the lake.

Example::

    seen = seen_items(events, spec, before_us=period_start_us)     # the replay: {user: items, newest first}
    history = SeenHistory(FeatureLayout.for_settings(settings).seen)
    history.items(17)                                              # serving: user 17's items (None: no file)
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.hours import US
from recloop.ingest import lake
from recloop.schema import DatasetSpec
from recloop.settings import Settings

log = logging.getLogger("recloop.features")

LAST = "last_us"  # the pair's newest interaction time (UTC microseconds)
METADATA_KEY = b"recloop.seen"
DAY_US = 24 * 3600 * US


@dataclass(frozen=True)
class SeenConfig:
    """Which interactions count as "already seen", and how many are kept.

    Args:
        max_items: each user's newest items kept (0: no history; the rule is off).
        lookback_days: only interactions this recent (before the file's time) count.
        every_interaction: every row counts, not only label 1 (see the module docstring).
    """

    max_items: int = 500
    lookback_days: float = 365.0
    every_interaction: bool = False

    def __post_init__(self) -> None:
        if self.max_items < 0 or self.lookback_days <= 0:
            raise ValueError("max_items must be at least 0 and lookback_days above 0")

    @classmethod
    def for_settings(cls, settings: Settings, spec: DatasetSpec | None = None) -> SeenConfig:
        """The settings' bounds; ``recommend_seen_history_all`` unset: every row of a spec whose rows are items
        users ``chosen`` (a rating means they have the item, liked or not), label-1 rows otherwise."""
        every = settings.recommend_seen_history_all
        if every is None:
            every = spec is not None and spec.events == "chosen"
        return cls(settings.recommend_seen_history_items, settings.recommend_seen_history_days, every)

    @property
    def enabled(self) -> bool:
        return self.max_items > 0

    @classmethod
    def published(cls, settings: Settings, spec: DatasetSpec) -> SeenConfig:
        """What the feature job publishes: the filter's bounds, holding at least the spec's derived history
        (``DatasetSpec.history``: serving reads it from the same file, so the file keeps that many items even
        with the filter off)."""
        config = cls.for_settings(settings, spec)
        if spec.history is None:
            return config
        return cls(max(config.max_items, spec.history.items), config.lookback_days, config.every_interaction)


def _keys(spec: DatasetSpec) -> tuple[str, str]:
    if not (spec.user_key and spec.item_key):
        raise ValueError(f"spec {spec.name!r} names no user key or no item key: there is no history per user")
    return spec.user_key, spec.item_key


def interactions(events: pa.Table, spec: DatasetSpec, config: SeenConfig) -> pa.Table:
    """The events that count as seen, as (user, item, ``last_us``) rows (one per event, not collapsed)."""
    user, item = _keys(spec)
    times = events[spec.timestamp].cast(pa.int64())
    table = pa.table({user: events[user], item: events[item], LAST: times})
    if not config.every_interaction:
        table = table.filter(pc.equal(events[spec.label].cast(pa.int8()), 1))
    return table


def bounded(pairs: pa.Table, spec: DatasetSpec, before_us: int, config: SeenConfig) -> pa.Table:
    """``pairs`` (user, item, ``last_us``; several rows per pair allowed) cut to ``config``'s bounds as of
    ``before_us``: one row per pair with its newest time, each user's newest ``max_items``, sorted by user
    and newest first."""
    user, item = _keys(spec)
    since = before_us - int(round(config.lookback_days * DAY_US))
    recent = pairs.filter(pc.and_(pc.greater_equal(pairs[LAST], since), pc.less(pairs[LAST], before_us)))
    if not recent.num_rows or not config.enabled:
        return recent.slice(0, 0)
    grouped = recent.group_by([user, item]).aggregate([(LAST, "max")])  # one row per pair: its newest time
    newest = pa.table({user: grouped[user], item: grouped[item], LAST: grouped[f"{LAST}_max"]})
    ordered = newest.sort_by([(user, "ascending"), (LAST, "descending"), (item, "ascending")])
    index, _ = _grouped(ordered, user, item)
    ends = np.r_[index.starts[1:], ordered.num_rows]
    rank = np.arange(ordered.num_rows) - np.repeat(index.starts, ends - index.starts)  # 0: the user's newest
    return ordered.filter(pa.array(rank < config.max_items))


def seen_table(events: pa.Table, spec: DatasetSpec, before_us: int, config: SeenConfig = SeenConfig()
               ) -> pa.Table:
    """Each user's seen items as of ``before_us`` (events at or after it do not count): the rows of the file
    the feature job writes (user key, item key, ``last_us``; sorted by user, newest first)."""
    return bounded(interactions(events, spec, config), spec, before_us, config)


def seen_items(events: pa.Table, spec: DatasetSpec, before_us: int, config: SeenConfig = SeenConfig()
               ) -> dict:
    """Each user's seen items as of ``before_us``, as serving would filter them with the file built then.

    For the replay and offline evaluation: the same rule as ``/recommend``'s ``seen_history`` filter.

    Args:
        events: lake events with the spec's timestamp, label, user and item key columns (more are ignored).
        spec: names those columns.
        before_us: the point in time (UTC microseconds); only events strictly before it count.
        config: the bounds (``SeenConfig.for_settings(settings, spec)`` for serving's own).

    Returns:
        user id → (n,) item ids, newest first; users without any are left out.

    Example::

        seen = seen_items(lake.read_window(settings, spec, None, t_us), spec, t_us,
                          SeenConfig.for_settings(settings, spec))
        candidates = candidates[~np.isin(candidates, seen.get(user, []))]
    """
    user, item = _keys(spec)
    table = seen_table(events, spec, before_us, config)
    if table.num_rows == 0:  # nothing before that time (else the ends below would name one user too many)
        return {}
    index, items = _grouped(table, user, item)
    ends = [*index.starts[1:].tolist(), len(items)]
    return {u: items[start:end] for u, start, end in zip(index.users.tolist(), index.starts.tolist(), ends,
                                                        strict=True)}


# --- the derived history: each event's user's newest items before it (``DatasetSpec.history``) ---------------


def history_lists(pairs: pa.Table, spec: DatasetSpec, users: np.ndarray, times_us: np.ndarray, items: int,
                  lookback_days: float) -> pa.ListArray:
    """For each (user, time), the user's newest ``items`` distinct items among ``pairs`` strictly before that
    time and within ``lookback_days`` of it, **oldest first** (the newest last, as a history list is written):
    exactly ``seen_items`` at that time, cut to ``items`` and reversed (ties in time: the smaller item id
    counts as the newer, as there).

    Args:
        pairs: (user, item, ``last_us``) rows that count (``interactions``), any order.
        users, times_us: the rows to describe (any order; a row's own event is not before it).
    """
    user, item = _keys(spec)
    pair_users = pairs[user].to_numpy(zero_copy_only=False).astype(np.int64)
    pair_items = pairs[item].to_numpy(zero_copy_only=False).astype(np.int64)
    pair_times = pairs[LAST].to_numpy(zero_copy_only=False).astype(np.int64)
    order = np.lexsort((-pair_items, pair_times, pair_users))  # per user, oldest first; ties: larger item first
    pair_users, pair_items, pair_times = pair_users[order], pair_items[order], pair_times[order]
    users, times_us = np.asarray(users, dtype=np.int64), np.asarray(times_us, dtype=np.int64)
    lookback = int(round(lookback_days * DAY_US))
    lists: list[list[int] | None] = [None] * len(users)
    current, recent = None, {}  # the user walked, their items by newest time (insertion order: oldest first)
    at = end = 0
    for row in np.lexsort((times_us, users)).tolist():
        who, when = int(users[row]), int(times_us[row])
        if who != current:
            current, recent = who, {}
            at = int(np.searchsorted(pair_users, who, "left"))
            end = int(np.searchsorted(pair_users, who, "right"))
        while at < end and pair_times[at] < when:
            key = int(pair_items[at])
            recent.pop(key, None)  # met again: it moves to the newest end
            recent[key] = int(pair_times[at])
            if len(recent) > items:  # an item pushed out can only come back by being met again
                del recent[next(iter(recent))]
            at += 1
        while recent and next(iter(recent.values())) < when - lookback:
            del recent[next(iter(recent))]
        lists[row] = list(recent)
    return pa.array(lists, pa.list_(pa.int64()))


def with_history(settings: Settings, spec: DatasetSpec, events: pa.Table) -> pa.Table:
    """``events`` with the spec's derived history column (``DatasetSpec.history``), from the lake's events
    before each one (read here, so any subset of events, a window or a partition, gets the same lists);
    ``events`` unchanged for a spec without one."""
    if spec.history is None or events.num_rows == 0:
        return events
    if spec.history.name in events.column_names:
        events = events.drop_columns([spec.history.name])
    config = SeenConfig.for_settings(settings, spec)
    times = events[spec.timestamp].cast(pa.int64()).to_numpy()
    users = events[spec.user_key].to_numpy(zero_copy_only=False)
    since = int(times.min()) - int(round(config.lookback_days * DAY_US))
    lake_events = lake.read_window(settings, spec, since, int(times.max()),
                                   columns=[spec.timestamp, spec.label, spec.user_key, spec.item_key])
    if lake_events.num_rows:
        lake_events = lake_events.filter(pc.is_in(lake_events[spec.user_key], pa.array(np.unique(users))))
        pairs = interactions(lake_events, spec, config)
    else:
        pairs = _no_pairs(spec)
    lists = history_lists(pairs, spec, users, times, spec.history.items, config.lookback_days)
    return events.append_column(spec.history.name, lists)


def _no_pairs(spec: DatasetSpec) -> pa.Table:
    """An empty (user, item, ``last_us``) table: no interaction counts."""
    return pa.table({spec.user_key: pa.array([], pa.int64()), spec.item_key: pa.array([], pa.int64()),
                     LAST: pa.array([], pa.int64())})


def history_of(items_newest_first: np.ndarray | None, count: int) -> list[int]:
    """Serving's derived history from the published file's items (``SeenHistory.items``): the newest
    ``count``, oldest first as the feature job writes it (None, no file yet: an empty history)."""
    if items_newest_first is None:
        return []
    return [int(i) for i in items_newest_first[:count][::-1]]


@dataclass(frozen=True)
class _UserIndex:
    users: np.ndarray  # (U,) sorted distinct user ids
    starts: np.ndarray  # (U,) each one's first row


def _grouped(table: pa.Table, user: str, item: str) -> tuple[_UserIndex, np.ndarray]:
    """A table sorted by user as distinct users, their first rows, and the items (numpy)."""
    users = table[user].to_numpy(zero_copy_only=False)
    starts = np.flatnonzero(np.r_[True, users[1:] != users[:-1]]) if len(users) else np.zeros(0, np.int64)
    return _UserIndex(users[starts], starts), table[item].to_numpy(zero_copy_only=False)


# --- the file -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SeenFile:
    """The published history: its rows and what they are (as of when, which keys, which bounds)."""

    table: pa.Table
    as_of_us: int
    user_key: str
    item_key: str
    config: SeenConfig


def write_seen(path: Path, table: pa.Table, spec: DatasetSpec, as_of_us: int, config: SeenConfig) -> None:
    """Write the history (aside, then renamed over the previous one: a reader sees one whole file)."""
    user, item = _keys(spec)
    meta = {"as_of_us": as_of_us, "user_key": user, "item_key": item, "config": asdict(config)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table.replace_schema_metadata({METADATA_KEY: json.dumps(meta).encode()}), tmp)
    os.replace(tmp, path)


def read_seen(path: Path) -> SeenFile:
    """The history file; ``FileNotFoundError`` when there is none, ``ValueError`` when it is not one."""
    table = pq.read_table(path)
    raw = (table.schema.metadata or {}).get(METADATA_KEY)
    if raw is None:
        raise ValueError(f"{path} has no {METADATA_KEY.decode()} metadata: not a seen-history file")
    meta = json.loads(raw)
    return SeenFile(table, int(meta["as_of_us"]), meta["user_key"], meta["item_key"], SeenConfig(**meta["config"]))


def build_seen(settings: Settings, spec: DatasetSpec, path: Path, as_of_us: int, config: SeenConfig,
               rebuild: bool = False) -> SeenFile | None:
    """The feature job's step: the history as of ``as_of_us`` (the newest feature state's time), written to
    ``path``; None when the rule is off or the spec has no user or item key (no file is written).

    From the previous file and the events since it when it holds the same keys and bounds and is not
    newer; from the lake's whole look-back otherwise, or when ``rebuild`` (late events landed before it).
    """
    if not config.enabled or not (spec.user_key and spec.item_key):
        return None
    try:
        previous = read_seen(path)
    except (FileNotFoundError, ValueError, OSError, pa.ArrowException):
        previous = None
    same = previous is not None and (previous.user_key, previous.item_key, previous.config) == \
        (spec.user_key, spec.item_key, config) and previous.as_of_us <= as_of_us
    if same and previous.as_of_us == as_of_us and not rebuild:
        return previous
    columns = [spec.timestamp, spec.label, spec.user_key, spec.item_key]
    if same and not rebuild:
        events = lake.read_window(settings, spec, previous.as_of_us, as_of_us, columns=columns)
        pairs = [previous.table.select([spec.user_key, spec.item_key, LAST])]
    else:
        since = as_of_us - int(round(config.lookback_days * DAY_US))
        events = lake.read_window(settings, spec, since, as_of_us, columns=columns)
        pairs = []
    if events.num_rows:
        pairs.append(interactions(events, spec, config))
    merged = pa.concat_tables(pairs, promote_options="permissive") if pairs else _no_pairs(spec)
    table = bounded(merged, spec, as_of_us, config)
    write_seen(path, table, spec, as_of_us, config)
    return SeenFile(table, as_of_us, spec.user_key, spec.item_key, config)


# --- serving's reader ---------------------------------------------------------------------------------------


class SeenHistory:
    """The published history as serving reads it: re-read when the feature job replaces the file (one
    ``stat`` per request; one request pays the load, the others keep the current history meanwhile).

    ``items(user)`` is None while there is no usable file (``missing`` says why): the caller answers without
    the rule and says so. A file that stops parsing keeps the history read before it (and logs why).
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._stamp: tuple[int, int] | None = None
        self._loaded: tuple[_UserIndex, np.ndarray, int] | None = None  # users, items, as_of_us
        self._loading = threading.Lock()
        self.missing = "no history of the lake yet (the feature job writes it)"
        self.reloads = 0
        self.refresh_if_changed()

    @property
    def as_of_us(self) -> int | None:
        loaded = self._loaded
        return loaded[2] if loaded else None

    def refresh_if_changed(self) -> bool:
        """Load the file if it changed since the last look; returns whether a new history was loaded."""
        try:
            found = os.stat(self.path)
            stamp = (found.st_mtime_ns, found.st_ino)
        except FileNotFoundError:
            stamp = None
        if stamp == self._stamp or not self._loading.acquire(blocking=False):
            return False
        try:
            if stamp is None:
                self._stamp, self._loaded = None, None
                self.missing = "no history of the lake yet (the feature job writes it)"
                return False
            try:
                published = read_seen(self.path)
                users = published.table[published.user_key]
                if not pa.types.is_integer(users.type) or not pa.types.is_integer(published.table[published.item_key].type):
                    raise ValueError("its keys are not integers (serving's ids are)")
                index, items = _grouped(published.table, published.user_key, published.item_key)
            except (OSError, ValueError, KeyError, pa.ArrowException) as err:
                log.error("seen history %s could not be read (%s): keeping the previous one", self.path, err)
                self._stamp = stamp
                if self._loaded is None:
                    self.missing = f"the history file could not be read ({type(err).__name__})"
                return False
            self._loaded = (_UserIndex(index.users.astype(np.int64), index.starts), items.astype(np.int64),
                            published.as_of_us)
            self._stamp = stamp
            self.reloads += 1
            return True
        finally:
            self._loading.release()

    def items(self, user_id: int) -> np.ndarray | None:
        """(n,) item ids the user interacted with (newest first; empty: none); None: no usable history."""
        self.refresh_if_changed()
        loaded = self._loaded
        if loaded is None:
            return None
        index, items, _ = loaded
        at = int(np.searchsorted(index.users, user_id))
        if at == len(index.users) or index.users[at] != user_id:
            return items[:0]
        end = int(index.starts[at + 1]) if at + 1 < len(index.starts) else len(items)
        return items[int(index.starts[at]):end]
