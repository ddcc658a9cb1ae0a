"""Model inputs for a ranking request, built by the training job's own row builder.

A request names a user, the candidate items and a context (the spec's categorical, numeric and list
columns, each one value for every candidate or a list with one value per candidate). The user's and the
items' state comes from the Feast online store in one batched read of ``ranking_v1``; the request then
goes through ``features.definition.training_rows`` exactly as a training event would, with the online state in
place of the point-in-time state. One code path for both sides is what keeps training and serving
consistent (``tests/test_serve.py`` checks served rows against the training rows of the same events).

An entity the online store does not know gets the training job's "never seen" values (zero counts,
the prior CTR, the capped recency), and is counted as a fallback.

Example::

    builder = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), FeastOnline(settings))
    rows, fallbacks = builder.rows(user_id=7, item_ids=[3, 9], context={"device": "ios"}, ts_us=now_us)
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Any, Protocol

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recloop.features import ops
from recloop.features.backend import get_backend
from recloop.features.config import FeatureConfig
from recloop.features.definition import ENTITY_PREFIXES, FeatureLayout, training_rows
from recloop.features.feast_import import import_feast
from recloop.features.seen import SeenHistory, history_of
from recloop.features.state import FeatureState, StateStore
from recloop.formats import ARROW_TYPES
from recloop.schema import ColumnSpec, DatasetSpec, compile_pattern
from recloop.settings import Settings

CONTEXT_ROLES = ("categorical", "numeric", "multi_hot")
PROBE_ENTITY = 2**62  # an id no real user or item has: the probe reads the store but finds nothing
DEFAULT_POSITION = 1  # rank as if every candidate were shown first: the model's position effect is a constant


class RequestError(ValueError):
    """A request the features cannot be built for (unknown context column, wrong type or length)."""


class OnlineReader(Protocol):
    def read(self, user_id: int, item_ids: list[int]) -> dict[str, np.ndarray]:
        """Raw entity state: ``user_<stat>`` (length 1) and ``item_<stat>`` (one per item); NaN = unknown;
        and each entity row's time (``stamp_name``), which the TTL is judged on."""


class FeastOnline:
    """The ``ranking_v1`` feature service of the Feast online store (SQLite or Redis per settings)."""

    def __init__(self, settings: Settings):
        from recloop.features.store import FEATURE_SERVICE, feature_store, join_keys

        self.store = feature_store(settings)
        self.service = self.store.get_feature_service(FEATURE_SERVICE)
        self.keys = join_keys(settings)  # the spec's key names (user_id/item_id, customer/product, ...)

    def read(self, user_id: int, item_ids: list[int]) -> dict[str, np.ndarray]:
        entities = {self.keys["user"]: [user_id] * len(item_ids), self.keys["item"]: list(item_ids)}
        response = self.store.get_online_features(features=self.service, entity_rows=entities).proto
        vectors = dict(zip(response.metadata.feature_names.val, response.results, strict=True))
        out = {}
        for prefix in ENTITY_PREFIXES.values():
            for stat in ops.STAT_NAMES:
                values = vectors[f"{prefix}_{stat}"].values
                out[f"{prefix}_{stat}"] = _floats(values[:1] if prefix == "user" else values)
            stamps = vectors[f"{prefix}_events_total"].event_timestamps
            stamps = np.array([t.seconds * 1_000_000 + t.nanos // 1000 for t in stamps], dtype=np.float64)
            stamps = stamps[:1] if prefix == "user" else stamps
            out[stamp_name(prefix)] = np.where(np.isnan(out[f"{prefix}_events_total"]), np.nan, stamps)
        return out


def stamp_name(prefix: str) -> str:
    """The key of a reader's answer holding the entity rows' times (µs; NaN: no row): what the TTL is
    judged on, as the feature job judges it on the entity table's ``event_timestamp``."""
    return f"{prefix}:event_timestamp_us"


class RedisOnline:
    """``ranking_v1`` read straight from Feast's Redis layout: one pipelined round trip per request.

    The keys and hash fields are Feast's (``features/online_keys.py`` lays them out, ``features/online_writer.py`` writes them and a test checks
    them byte for byte); reading them without Feast's SDK skips its per-value Python conversions, a
    few milliseconds per request. ``tests/test_serve.py`` checks the answers against Feast's own read.

    Items' state is kept in memory (``ItemStates``, up to ``cached_items`` items) for as long as the
    store's generation key holds the value read before it: the item statistics change only when the
    features flow materializes, and the writer gives that key a new value after every write. Each read
    gets the key's value in the same pipeline, ahead of the state it reads, and uses remembered state
    only when that value is still the one the state was read under. The user's state is read from Redis
    on every request; a store without the key (written by Feast's own ``materialize``) is read whole
    every time.
    """

    def __init__(self, settings: Settings, cached_items: int | None = None):
        from recloop.endpoints import limits_for, redis_client
        from recloop.features.online_keys import entity_key_head, field_key, generation_key
        from recloop.features.store import feature_store

        store = feature_store(settings)
        self.project = store.project
        self.client = redis_client(settings.redis_url, limits_for(settings))
        self.generation_key = generation_key(self.project)
        self.cached_items = settings.serve_item_cache_items if cached_items is None else cached_items
        self.items = ItemStates(None)
        self.views = {}
        views = service_views(store)
        for view, join_key, features in views:
            fields = [field_key(view.name, f) for f in features] + [f"_ts:{view.name}".encode()]  # its time last
            self.views[join_key] = (entity_key_head(join_key), fields, features)
        self.user_key, self.item_key = entity_join_keys(views)

    def _key(self, join_key: str, entity: int) -> bytes:
        return self.views[join_key][0] + int(entity).to_bytes(8, "little", signed=True) + self.project.encode()

    def read(self, user_id: int, item_ids: list[int]) -> dict[str, np.ndarray]:
        items = list(dict.fromkeys(int(i) for i in item_ids))
        user, found = None, {}
        # The generation moved since the remembered state was read: that state is read again.
        for attempt in range(3):
            remembered = self.items
            wanted = [i for i in items if i not in found]
            cached = remembered.get(wanted) if attempt < 2 and self.cached_items else {}
            missing = [i for i in wanted if i not in cached]
            pipe = self.client.pipeline(transaction=False)
            pipe.get(self.generation_key)  # first: the state read after it is at least this generation's
            if user is None:
                pipe.hmget(self._key(self.user_key, user_id), self.views[self.user_key][1])
            for item in missing:
                pipe.hmget(self._key(self.item_key, item), self.views[self.item_key][1])
            generation, *answers = pipe.execute()
            if user is None:
                user, answers = _decode(answers[:1], len(self.views[self.user_key][1])), answers[1:]
            fetched = dict(zip(missing, _decode(answers, len(self.views[self.item_key][1])), strict=True))
            found.update(fetched)
            current = generation is not None and generation == remembered.generation
            if current:
                found.update(cached)
            else:  # another generation (or none: a store our writer did not write): forget what was kept
                self.items = remembered = ItemStates(generation)
            if generation is not None and self.cached_items:
                remembered.add(fetched, self.cached_items)
            if current or not cached:
                break
        out = {name: user[:, f] for f, name in enumerate(self.views[self.user_key][2])}
        out[stamp_name("user")] = user[:, -1]
        values = np.stack([found[int(i)] for i in item_ids]) if len(item_ids) else \
            np.zeros((0, len(self.views[self.item_key][1])))
        out.update({name: values[:, f] for f, name in enumerate(self.views[self.item_key][2])})
        out[stamp_name("item")] = values[:, -1]
        return out


class SqliteOnline:
    """``ranking_v1`` read straight from Feast's SQLite online store (the embedded default): one query a view
    per request.

    The tables and rows are Feast's (``SqliteOnlineStore``: a row per entity key and feature, the value a
    serialized ``ValueProto``, the row's time in ``event_ts`` as Feast's adapter wrote it); the entity keys are
    Feast's serialization (``online_keys.entity_key_head``). Reading them without Feast's SDK skips its
    per-request resolution and response building: 26 of the demo's 94 serving-thread seconds a simulated day
    went to ``get_online_features``. ``tests/test_serve.py`` checks the answers against Feast's own read. The
    connection is read-only, shared by serving's threads under a lock, and opened again when the file is
    replaced.

    Items' state is kept in memory (``ItemStates``, up to ``cached_items`` items) for as long as nothing was
    committed to the store (SQLite's ``data_version``, and the same file): item statistics change only when
    the features flow materializes. The user's row is read on every request.
    """

    def __init__(self, settings: Settings, cached_items: int | None = None):
        import_feast()
        from feast.infra.online_stores.sqlite import SqliteOnlineStore, _table_id

        from recloop.features.online_keys import entity_key_head
        from recloop.features.store import feature_store

        store = feature_store(settings)
        config = store.config
        if config.entity_key_serialization_version != 3:
            raise OnlineUnavailable("the SQLite reader knows entity key serialization 3 only")
        self.path = SqliteOnlineStore._get_db_path(config)
        self._lock = threading.Lock()
        self._conn, self._file = None, None
        self.cached_items = settings.serve_item_cache_items if cached_items is None else cached_items
        self.items = ItemStates(None)
        self.views: dict[str, tuple[bytes, str, list[str]]] = {}
        versioned = bool(getattr(config.registry, "enable_online_feature_view_versioning", False))
        views = service_views(store)
        for view, join_key, features in views:
            self.views[join_key] = (entity_key_head(join_key), _table_id(config.project, view, versioned), features)
        self.user_key, self.item_key = entity_join_keys(views)
        self._connection()

    def _connection(self):
        import os
        import sqlite3
        from pathlib import Path

        stat = os.stat(self.path)
        if self._conn is None or self._file != (stat.st_dev, stat.st_ino):
            if self._conn is not None:
                self._conn.close()
            self._conn = sqlite3.connect(f"{Path(self.path).resolve().as_uri()}?mode=ro", uri=True,
                                         check_same_thread=False)  # as a URI: a home with spaces or "?" too
            self._file = (stat.st_dev, stat.st_ino)
        return self._conn

    def _view(self, join_key: str, ids: list[int]) -> np.ndarray:
        """(len(ids), features + 1) float64: each feature, then the row's time (µs); NaN: no value."""
        import_feast()
        from feast.protos.feast.types.Value_pb2 import Value

        head, table, features = self.views[join_key]
        keys = [head + int(i).to_bytes(8, "little", signed=True) for i in ids]
        with self._lock:
            rows = self._connection().execute(
                f'SELECT entity_key, feature_name, value, event_ts FROM "{table}" '  # noqa: S608 - Feast's own name
                f"WHERE entity_key IN ({','.join('?' * len(keys))})", keys).fetchall() if keys else []
        where = {key: i for i, key in enumerate(keys)}
        column = {name: f for f, name in enumerate(features)}
        out = np.full((len(keys), len(features) + 1), np.nan)
        for key, name, raw, stamp in rows:
            f = column.get(name)
            if f is None or key not in where:
                continue
            out[where[key], f] = _number(Value.FromString(raw))
            out[where[key], -1] = _feast_sqlite_time(stamp)
        return out

    def generation(self) -> tuple:
        """What changes when the store is written: the file's identity and SQLite's ``data_version`` on this
        connection (it moves whenever another connection commits to the database)."""
        with self._lock:
            conn = self._connection()
            return self._file, conn.execute("PRAGMA data_version").fetchone()[0]

    def read(self, user_id: int, item_ids: list[int]) -> dict[str, np.ndarray]:
        generation = self.generation()  # before the reads: state read after it is at least this generation's
        user = self._view(self.user_key, [user_id])
        unique = list(dict.fromkeys(int(i) for i in item_ids))
        remembered = self.items
        if remembered.generation != generation:
            self.items = remembered = ItemStates(generation)
        cached = remembered.get(unique) if self.cached_items else {}
        missing = [i for i in unique if i not in cached]
        fetched = dict(zip(missing, self._view(self.item_key, missing), strict=True))
        if self.cached_items and self.generation() == generation:  # not written meanwhile: safe to keep
            remembered.add(fetched, self.cached_items)
        found = {**cached, **fetched}
        items = np.stack([found[int(i)] for i in item_ids]) if item_ids else \
            np.zeros((0, len(self.views[self.item_key][2]) + 1))
        out: dict[str, np.ndarray] = {}
        for prefix, values, join_key in (("user", user, self.user_key), ("item", items, self.item_key)):
            for f, name in enumerate(self.views[join_key][2]):
                out[name] = values[:, f]
            # as Feast's answer reads: a row's time only where the row holds the entity's statistics
            out[stamp_name(prefix)] = np.where(np.isnan(out[f"{prefix}_events_total"]), np.nan, values[:, -1])
        return out


def _feast_sqlite_time(stamp) -> float:
    """``event_ts`` as Feast's SQLite store reads it back, in µs: its adapter wrote ``int(datetime.timestamp())``
    of a naive UTC time, and its reader takes ``datetime.fromtimestamp`` of that as UTC."""
    from datetime import UTC, datetime

    if isinstance(stamp, int | float):
        moment = datetime.fromtimestamp(int(stamp))
    elif isinstance(stamp, str | bytes):
        moment = datetime.fromisoformat(stamp.decode() if isinstance(stamp, bytes) else stamp)
    else:
        return float("nan")
    moment = moment.replace(tzinfo=UTC) if moment.tzinfo is None else moment.astimezone(UTC)
    return float(int(moment.timestamp()) * 1_000_000 + moment.microsecond)


class ItemStates:
    """Items' decoded online state (a float64 row each, NaN where unknown) as of one value of the store's
    generation key (see ``RedisOnline``). Unknown items are remembered too: unknown until the next write."""

    def __init__(self, generation: bytes | None):
        self.generation = generation
        self.rows: dict[int, np.ndarray] = {}

    def get(self, items: list[int]) -> dict[int, np.ndarray]:
        rows = self.rows
        return {i: rows[i] for i in items if i in rows}

    def add(self, rows: dict[int, np.ndarray], limit: int) -> None:
        if len(self.rows) + len(rows) > limit:  # a bound on memory: start over rather than track use
            self.rows = {}
        self.rows.update(list(rows.items())[:limit])


def _decode(rows: list[list[bytes | None]], width: int) -> np.ndarray:
    """HMGET answers (Feast's serialized ``ValueProto`` fields, then the row's serialized ``Timestamp``) as
    (rows, width) float64, the time in µs; NaN: missing."""
    import_feast()
    from feast.protos.feast.types.Value_pb2 import Value
    from google.protobuf.timestamp_pb2 import Timestamp

    values = np.full((len(rows), width), np.nan)
    for r, row in enumerate(rows):
        for f, raw in enumerate(row):
            if raw and f == width - 1:
                stamp = Timestamp.FromString(raw)
                values[r, f] = stamp.seconds * 1_000_000 + stamp.nanos // 1000
            elif raw:
                values[r, f] = _number(Value.FromString(raw))
    return values


def online_reader(settings: Settings) -> OnlineReader:
    """The reader for the configured online store, connected on first use (see ``DeferredOnline``)."""
    return DeferredOnline(lambda: RedisOnline(settings) if settings.feast_online_store == "redis"
                          else SqliteOnline(settings))


class OnlineUnavailable(RuntimeError):
    """The online store cannot be read (not set up yet, or its service is down)."""


class DeferredOnline:
    """An online reader built on first use, and built again on later reads until that works.

    A serving process starts (and says why it is not ready) even when Feast was never applied or Redis
    is down; the first request after the store is there connects.
    """

    def __init__(self, build: Callable[[], OnlineReader]):
        self._build = build
        self._reader: OnlineReader | None = None
        self._lock = threading.Lock()

    def read(self, user_id: int, item_ids: list[int]) -> dict[str, np.ndarray]:
        reader = self._reader
        if reader is None:
            with self._lock:
                if self._reader is None:
                    try:
                        self._reader = self._build()
                    except Exception as err:  # noqa: BLE001 - any failure to connect is the store's
                        raise OnlineUnavailable(f"the online store cannot be opened: {type(err).__name__}: {err}"
                                                ) from err
                reader = self._reader
        return reader.read(user_id, item_ids)


def _floats(values) -> np.ndarray:
    """Feast value protos as float64, NaN where the store had nothing (faster than Feast's ``to_dict``)."""
    return np.array([_number(value) for value in values], dtype=np.float64)


def _number(value) -> float:
    """A Feast ``ValueProto``'s number; NaN where the store had nothing (unset or null)."""
    kind = value.WhichOneof("val")
    return float(getattr(value, kind)) if kind is not None and kind != "null_val" else float("nan")


def service_views(store) -> list[tuple]:
    """``(feature view, its join key, the service's features of it)`` for each view of ``ranking_v1``."""
    from recloop.features.store import FEATURE_SERVICE

    out = []
    for projection in store.get_feature_service(FEATURE_SERVICE).feature_view_projections:
        view = store.get_feature_view(projection.name)
        [join_key] = [column.name for column in view.entity_columns]
        out.append((view, join_key, [f.name for f in projection.features]))
    return out


def entity_join_keys(views: list[tuple]) -> tuple[str, str]:
    """The join keys of the user and item statistics views of ``service_views`` (the spec's key names)."""
    keys = {view.name: join_key for view, join_key, _ in views}
    return keys["user_stats"], keys["item_stats"]


@dataclass(frozen=True)
class Fallbacks:
    """Entities of one request that the online store did not know."""

    user: int
    items: int


class RequestFeatures:
    """Builds model input rows for requests; reloads vocabularies and statistics as soon as the feature job
    publishes a new state (its version marker is checked per request), not on a timer."""

    def __init__(self, settings: Settings, spec: DatasetSpec, config: FeatureConfig, online: OnlineReader):
        self.spec, self.config, self.online = spec, config, online
        self.backend = get_backend("pandas")  # a request is 1-1000 rows: the host is faster than a launch
        self._states = StateStore(FeatureLayout.for_settings(settings).state)
        self._state: FeatureState | None = None
        self._lock = threading.Lock()
        self._loading = threading.Lock()
        self._stamp: tuple[int, int] | None = None
        self.reloads = 0
        self._cuts: dict[frozenset[str], FeatureConfig] = {}
        self.refresh()
        self._context_columns = {c.name: c for role in CONTEXT_ROLES for c in spec.by_role(role)}
        # the published history of the lake (``features.seen``): the derived history column's source, and
        # /recommend's seen filter reads the same object
        self.seen = SeenHistory(FeatureLayout.for_settings(settings).seen)

    def per_candidate(self, context: dict[str, Any]) -> dict[str, bool]:
        """For each context column of a (valid) request, whether it was given per candidate."""
        return {name: per_candidate(value, ARROW_TYPES[self._context_columns[name].dtype])
                for name, value in context.items()}

    @property
    def state_version(self) -> int | None:
        return self._state.version if self._state else None

    def state_age(self, now: datetime) -> dict | None:
        """When the published state ends and whether ``now`` is past its TTL: then every user and item is served
        as never seen (a stopped feature job, or a home whose events are older than the clock: the demo's
        simulated January). None before a state is loaded."""
        if self._state is None:
            return None
        age = (now - self._state.as_of).total_seconds()
        return {"as_of": self._state.as_of.isoformat(), "age_days": round(age / 86400, 1),
                "past_ttl": age > self.config.ttl_seconds}

    def refresh(self) -> bool:
        """Load the newest feature state if the feature job wrote one since; returns whether it did."""
        stamp = self._states.marker_stamp()
        newest = self._states.latest_version()
        if newest is None or (self._state and self._state.version == newest):
            self._stamp = stamp
            return False
        state = self._states.load(newest)
        with self._lock:
            self._state = state
            self._stamp = stamp
            self.reloads += 1
        return True

    def refresh_if_published(self) -> bool:
        """Per request: one ``stat`` of the state's version marker; when the features flow published a new
        version since, load it (one request pays; the others keep the current state meanwhile)."""
        if self._states.marker_stamp() == self._stamp or not self._loading.acquire(blocking=False):
            return False
        try:
            return self.refresh()
        finally:
            self._loading.release()

    def rows(self, user_id: int, item_ids: list[int], context: dict[str, Any], ts_us: int,
             whole_row: bool = True) -> tuple[pa.Table, Fallbacks]:
        """One row per candidate, with the training rows' ``d_*``, ``c_*`` and ``m_*`` columns. The context
        must hold every column the spec allows no null in (``whole_row``: a ``/rank`` request, which lands as
        events); False: what is left out or null is unknown to the model (``_window``)."""
        state = self._current_state()
        window = self._window(user_id, item_ids, context, ts_us, whole_row=whole_row)
        raw = self.online.read(user_id, item_ids)
        ttl_us = self.config.ttl_seconds * 1_000_000
        for prefix in ENTITY_PREFIXES.values():  # older than the TTL: unknown, as the training rows have it
            stale = (ts_us - raw.pop(stamp_name(prefix))) > ttl_us  # (NaN: no row, already unknown)
            for stat in ops.STAT_NAMES:
                raw[f"{prefix}_{stat}"] = np.where(stale, np.nan, raw[f"{prefix}_{stat}"])
        n = len(item_ids)
        befores = {}
        for prefix in ENTITY_PREFIXES.values():
            columns = {f"{prefix}_{s}": raw[f"{prefix}_{s}"] for s in ops.STAT_NAMES}
            if prefix == "user":
                columns = {k: np.repeat(v, n) for k, v in columns.items()}
            befores[prefix] = self.backend.frames.DataFrame(columns)
        fallbacks = Fallbacks(user=int(np.isnan(raw["user_events_total"]).all()),
                              items=int(np.isnan(raw["item_events_total"]).sum()))
        return training_rows(self.backend, self.config, self.spec, window, state.vocabularies, state.stats,
                             befores), fallbacks

    def request_rows(self, user_id: int, context: dict[str, Any], ts_us: int, columns: Collection[str]
                     ) -> pa.Table:
        """One row of the request's own ``c_*`` and ``m_*`` columns named in ``columns``: nothing is read
        from the online store, and nothing is computed that they do not need.

        For a consumer of the request alone (the retriever's user tower: the user id, the context, the
        click history). The row comes from ``training_rows`` like every other, with the feature
        configuration cut to those columns; the whole context is checked as ``rows`` checks it.
        """
        state = self._current_state()
        # never landed: a column left out is not refused (an item attribute such as a category or a release
        # year, required on /rank, is the catalog's business on /recommend, which the request may not give:
        # checked as required here, every /recommend on a ratings log with a year was refused)
        window = self._window(user_id, [PROBE_ENTITY], context, ts_us, whole_row=False)
        return training_rows(self.backend, self._cut(columns), self.spec, window, state.vocabularies,
                             state.stats, befores={})

    def _cut(self, columns: Collection[str]) -> FeatureConfig:
        """The feature configuration cut to what makes ``columns`` (kept per set of columns)."""
        wanted = frozenset(columns)
        config = self._cuts.get(wanted)
        if config is not None:
            return config
        full = self.config
        crosses = tuple(c for c in full.crosses if f"c_{c.name}" in wanted)
        multi_hot = tuple(m for m in full.multi_hot if f"m_{m.column}" in wanted)
        needed = {f"c_{c}" for cross in crosses for c in cross.columns} | {f"c_{m.vocabulary}" for m in multi_hot}
        categorical = tuple(c for c in full.categorical if f"c_{c.column}" in wanted | needed)
        made = {f"c_{c.column}" for c in categorical} | {f"c_{c.name}" for c in crosses} | \
            {f"m_{m.column}" for m in multi_hot}
        if wanted - made:
            raise KeyError(f"no categorical or multi-hot feature makes {sorted(wanted - made)}")
        config = replace(full, categorical=categorical, crosses=crosses, numeric=(), multi_hot=multi_hot,
                         cyclic_time=False)
        self._cuts[wanted] = config
        return config

    def _current_state(self) -> FeatureState:
        """The feature state as the features flow last published it (vocabularies and statistics)."""
        self.refresh_if_published()
        state = self._state
        if state is None:
            raise RuntimeError("no feature state yet: run `recloop features` before serving")
        return state

    def _window(self, user_id: int, item_ids: list[int], context: dict[str, Any], ts_us: int,
                whole_row: bool = True) -> pa.Table:
        """The request as a table of events, in the spec's columns (what ingestion would have landed). A
        column the spec allows no null in and the context leaves out is refused (a served row without it
        lands, with its feedback, in quarantine). ``whole_row`` False (the readiness probe, the gate's
        re-scoring of logged requests, ``/recommend`` whose catalog may lack a value, the retriever's user
        tower): left out or null, a value is unknown to the model instead."""
        spec, n = self.spec, len(item_ids)
        unknown = sorted(set(context) - set(self._context_columns))
        if spec.history is not None and spec.history.name in unknown:
            raise RequestError(f"context {spec.history.name!r}: the user's history is derived from the lake "
                               "(the spec's history), not given by the request")
        if unknown:
            raise RequestError(f"unknown context columns {unknown}; allowed: {sorted(self._context_columns)}")
        _check_timestamp(spec, ts_us)
        columns: dict[str, pa.Array] = {
            spec.event_id: pa.array([""] * n, pa.string()),
            spec.timestamp: pa.array(np.full(n, ts_us), pa.timestamp("us", tz="UTC")),
            spec.label: pa.array(np.zeros(n, np.int8)),
        }
        if spec.user_key:
            columns[spec.user_key] = pa.array(np.full(n, user_id, dtype=np.int64))
        if spec.item_key:
            columns[spec.item_key] = pa.array(np.asarray(item_ids, dtype=np.int64))
        required = []
        for name, column in self._context_columns.items():
            value = context.get(name, DEFAULT_POSITION if name == "position" else None)
            columns[name] = _broadcast(name, value, n, ARROW_TYPES[column.dtype])
            if name not in context and value is None:
                # left out: unknown to the model (its OOV row, a missing number); but a served row lands as an
                # event, and one without a column the spec allows no null in went to quarantine with its feedback
                if not column.nullable and whole_row:
                    required.append(name)
                continue
            if column.role in _CHECKS:  # whole_row False: a null (a catalog item without it) is unknown too
                _CHECKS[column.role](column, columns[name], nulls_allowed=column.nullable or not whole_row)
        if required:
            raise RequestError(f"context {required} required: the spec allows no null in them, and a served row "
                               "lands as an event (with one left out, its feedback could not be learned from)")
        for oracle in spec.by_role("oracle"):
            columns[oracle.name] = pa.nulls(n, ARROW_TYPES[oracle.dtype])
        if spec.history is not None:  # as of the feature job's last run (the training rows': as of the event)
            derived = history_of(self.seen.items(user_id), spec.history.items)
            columns[spec.history.name] = pa.array([derived] * n, pa.list_(pa.int64()))
        columns["_ts_us"] = pa.array(np.full(n, ts_us, dtype=np.int64))
        return pa.table(columns)


def per_candidate(value: Any, arrow_type: pa.DataType) -> bool:
    """Whether a context value gives one value per candidate (a list; for a list column, a list of lists)."""
    if not isinstance(value, list):
        return False
    if pa.types.is_list(arrow_type):  # lists (or nulls) only, one at least: [null, 1] is one list with a null in it
        return all(isinstance(v, list | None) for v in value) and any(isinstance(v, list) for v in value)
    return True


def _check_numeric(column: ColumnSpec, values: pa.Array, nulls_allowed: bool = False) -> None:
    """Refuse what ingestion would have quarantined: a null where the spec allows none, a number that is
    not finite or outside the spec's bounds (the model never saw such a value in training)."""
    if not (column.nullable or nulls_allowed) and values.null_count:
        raise RequestError(f"context {column.name!r} cannot be null")
    numbers = values.cast(pa.float64()).to_numpy(zero_copy_only=False)
    present = ~np.asarray(values.is_null())
    with np.errstate(invalid="ignore"):
        bad = present & ~(np.isfinite(numbers) & (numbers >= float(column.min)) & (numbers <= float(column.max)))
    if bad.any():
        low, high = (f"{float(b):.15g}" for b in (column.min, column.max))
        raise RequestError(f"context {column.name!r}: {numbers[bad][0]:.15g} is outside the spec's range "
                           f"[{low}, {high}]")


def _broadcast(name: str, value: Any, n: int, arrow_type: pa.DataType) -> pa.Array:
    """A context value as a column of ``n``: one value for every candidate, or one per candidate. Numbers
    convert only exactly: Arrow would cut 1.5 to an integer 1 and read true as 1.0."""
    values = value if per_candidate(value, arrow_type) else [value] * n
    if len(values) != n:
        raise RequestError(f"context {name!r} has {len(values)} values for {n} candidates "
                           "(give one value, or one per candidate)")
    element = arrow_type.value_type if pa.types.is_list(arrow_type) else arrow_type
    if pa.types.is_integer(element) or pa.types.is_floating(element):
        for scalar in _scalars(values):
            if isinstance(scalar, bool) or (pa.types.is_integer(element) and isinstance(scalar, float)
                                            and not scalar.is_integer()):
                kind = "an integer" if pa.types.is_integer(element) else "a number"
                raise RequestError(f"context {name!r}: {scalar!r} is not {kind}")
    try:
        return pa.array(values, arrow_type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, UnicodeEncodeError) as err:
        raise RequestError(f"context {name!r}: {err}") from err


def _scalars(values: list) -> Any:
    """The scalars of a context value's list (its lists' elements too)."""
    for value in values:
        if isinstance(value, list):
            yield from _scalars(value)
        else:
            yield value


def _check_categorical(column: ColumnSpec, values: pa.Array, nulls_allowed: bool = False) -> None:
    """Refuse a value the request gives that ingestion would have quarantined: a null where the spec allows
    none, a value outside ``allowed`` or the bounds, text that does not match the spec's pattern."""
    if not (column.nullable or nulls_allowed) and values.null_count:
        raise RequestError(f"context {column.name!r} cannot be null")
    present = [v for v in values.to_pylist() if v is not None]
    if column.allowed is not None:
        refused = [v for v in present if v not in column.allowed]
        if refused:
            raise RequestError(f"context {column.name!r}: {refused[0]!r} is not one of {column.allowed}")
    if column.pattern is not None:
        pattern = compile_pattern(column.pattern)
        refused = [v for v in present if not pattern.fullmatch(v)]
        if refused:
            raise RequestError(f"context {column.name!r}: {refused[0]!r} does not match {column.pattern!r}")
    if column.dtype != "string":
        low = -np.inf if column.min is None else column.min
        high = np.inf if column.max is None else column.max
        refused = [v for v in present if not low <= v <= high]
        if refused:
            raise RequestError(f"context {column.name!r}: {refused[0]!r} is outside the spec's range "
                               f"[{column.min}, {column.max}]")


def _check_multi_hot(column: ColumnSpec, values: pa.ListArray, nulls_allowed: bool = False) -> None:
    """Refuse a list ingestion would have quarantined: a null list where the spec allows none, an element
    outside the spec's bounds (``ingest.validate`` checks the same)."""
    if not (column.nullable or nulls_allowed) and values.null_count:
        raise RequestError(f"context {column.name!r} cannot be null")
    elements = pc.list_flatten(values).drop_null().to_numpy(zero_copy_only=False)
    low = -np.inf if column.min is None else float(column.min)
    high = np.inf if column.max is None else float(column.max)
    refused = elements[(elements < low) | (elements > high)]
    if len(refused):
        raise RequestError(f"context {column.name!r}: {int(refused[0])} is outside the spec's range "
                           f"[{column.min}, {column.max}]")


_CHECKS = {"numeric": _check_numeric, "categorical": _check_categorical, "multi_hot": _check_multi_hot}


def _check_timestamp(spec: DatasetSpec, ts_us: int) -> None:
    """Refuse an event time ingestion would have quarantined: before the spec's minimum, after its maximum,
    or further in the future than ``max_future_seconds``."""
    low, high = spec.column(spec.timestamp).timestamp_bounds()
    if low is not None and ts_us < low.timestamp() * 1e6:
        raise RequestError(f"ts is before the spec's minimum {low.isoformat()}")
    if high is not None and ts_us > high.timestamp() * 1e6:
        raise RequestError(f"ts is after the spec's maximum {high.isoformat()}")
    if ts_us > (time.time() + spec.max_future_seconds) * 1e6:
        raise RequestError(f"ts is more than {spec.max_future_seconds} s in the future")
