"""The feature job: lake events of a time window → training rows, entity tables and a new feature state.

Outputs under ``$RECLOOP_HOME/features/`` (one parquet file per *period with events*, named after the
period's first hour, replaced whole when rerun)::

    training/2026-01-01T05.parquet    one row per event: label, d_* floats, c_* indices, m_* lists
    user_stats/2026-01-01T05.parquet  user state rows (Feast source of the ``user_stats`` view)
    item_stats/2026-01-01T05.parquet  item state rows (Feast source of the ``item_stats`` view)
    state/v000001/                    vocabularies, stored statistics, latest state per entity
    schema.json                       which training columns are dense, categorical (with table sizes),
                                      multi-hot, and the state version they were built with
    partition.json                    the period of the files (1 h, 24 h or 168 h): chosen once per home

The period is an hour for dense logs; for a sparse one (a rating log over years) a day or a week, chosen
at the first run from the events' density (``choose_period_hours``), so the cost follows the events, not
the calendar: only periods with events are written. Windows are whole periods. A window holding more than
``max_window_rows`` events is built as consecutive smaller windows (each one's state carries to the next).
The job reads events from 24 h before the newest state version at or before the window start (so windowed
counts are complete), carries totals over from that version, and writes a new version when the window
moves past the latest one. Rerunning a window gives the same files.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.features import ops
from recloop.features.backend import FrameBackend, get_backend
from recloop.features.config import CategoricalFeature, FeatureConfig
from recloop.features.state import FeatureState, StateStore
from recloop.features.vocab import Vocabulary, count_values
from recloop.formats import TRAINING_PARQUET, id_dtype
from recloop.hours import hour_of_us
from recloop.ingest import lake
from recloop.schema import DatasetSpec
from recloop.settings import Settings

US = ops.US  # recloop.hours.US
HOUR_US = 3600 * US
DAY_US = 24 * HOUR_US
ENTITY_PREFIXES = {"user_key": "user", "item_key": "item"}


@dataclass(frozen=True)
class FeatureLayout:
    """Where the feature job's outputs live under ``$RECLOOP_HOME/features``."""

    root: Path

    @classmethod
    def for_settings(cls, settings: Settings) -> FeatureLayout:
        return cls(settings.home.resolve() / "features")

    @property
    def training(self) -> Path:
        return self.root / "training"

    def entity_table(self, prefix: str) -> Path:
        return self.root / f"{prefix}_stats"

    @property
    def state(self) -> Path:
        return self.root / "state"

    @property
    def schema(self) -> Path:
        return self.root / "schema.json"

    @property
    def partition(self) -> Path:
        return self.root / "partition.json"

    @property
    def lake_files(self) -> Path:
        """The committed lake files the job has read (``build_features``: late events come in new ones)."""
        return self.root / "lake_files.json"

    def period_hours(self) -> int | None:
        """The period of this home's feature files (None before the first run)."""
        if not self.partition.is_file():
            return None
        return int(json.loads(self.partition.read_text())["period_hours"])


@dataclass
class FeatureRunSummary:
    start: str
    end: str
    backend: str
    rows: int = 0
    entity_rows: dict[str, int] = field(default_factory=dict)
    hours_written: int = 0
    state_version: int = 0
    vocabulary_sizes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    message: str = ""
    windows: int = 1  # a long window is built as several (see MAX_WINDOW_ROWS)
    late_from: str | None = None  # rebuilt from this period's start: it holds an event that landed late
    period_hours: int = 1  # the feature files' period
    feast_applied: bool = False  # set by the pipeline when it publishes the window through Feast
    materialized: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _iso(t_us: int) -> str:
    return datetime.fromtimestamp(t_us / US, tz=UTC).isoformat()


PERIOD_HOURS = (1, 24, 168)
MAX_PERIODS = 2_000  # nor more files than this for the first window (a sparse log over decades: weeks)
MIN_ROWS_PER_PERIOD = 10  # the period is the shortest whose average period with events holds this many
MAX_WINDOW_ROWS = 2_000_000


def _period_file(folder: Path, period_us: int) -> Path:
    return folder / f"{hour_of_us(period_us)}.parquet"


def _period_start(t_us, period_us: int):
    """The start of the period holding ``t_us`` (an int or an array); weeks start on Monday 00:00 UTC."""
    offset = 4 * DAY_US if period_us == 7 * DAY_US else 0  # 1970-01-01 was a Thursday
    return (t_us - offset) // period_us * period_us + offset


def choose_period_hours(ts_us: np.ndarray) -> int:
    """The shortest period (hour, day, week) whose periods with events hold ``MIN_ROWS_PER_PERIOD`` events on
    average and number at most ``MAX_PERIODS``: a dense log keeps hourly files, a sparse or long one (ratings
    over years) gets fewer, fuller files."""
    for hours in PERIOD_HOURS:
        occupied = len(np.unique(_period_start(ts_us, hours * HOUR_US)))
        if occupied and len(ts_us) / occupied >= MIN_ROWS_PER_PERIOD and occupied <= MAX_PERIODS:
            return hours
    return PERIOD_HOURS[-1]


def _split_points(ts_us: np.ndarray, start_us: int, end_us: int, period_us: int, max_rows: int) -> list[int]:
    """Window boundaries (period-aligned) so that each window holds at most about ``max_rows`` events."""
    if len(ts_us) <= max_rows:
        return [start_us, end_us]
    ordered = np.sort(ts_us)
    points = [start_us]
    for index in range(max_rows, len(ordered), max_rows):
        cut = _period_start(int(ordered[index]), period_us)
        if cut > points[-1]:
            points.append(cut)
    return [*points, end_us] if end_us > points[-1] else points


@dataclass(frozen=True)
class WindowPlan:
    """What one run of the job computes, decided before any event is read.

    Args:
        start_us, end_us: the window (whole hours); training rows and entity rows are written for it.
        since_us: where the base state's totals end (None: no base, the events hold all history).
        read_from_us: events are read from here (24 h before ``since_us``, so windowed counts are complete).
        absorb_from_us: events at or after this update the vocabularies (None: all events read).
        new_state: whether the run moves time past the latest state (then it updates the vocabularies and
            saves a new state version).
        latest, base: the newest state, and the newest at or before the window start.
    """

    start_us: int
    end_us: int
    since_us: int | None
    read_from_us: int | None
    absorb_from_us: int | None
    new_state: bool
    latest: FeatureState | None
    base: FeatureState | None


@dataclass(frozen=True)
class WindowFeatures:
    """What either engine computes for a window: the training rows (lake order), the entity states (sorted
    by key then time), and the vocabularies and statistics the rows were built with."""

    training: pa.Table
    states: dict[str, ops.EntityStates]
    vocabularies: dict[str, Vocabulary]
    stats: dict


def build_features(
    settings: Settings, spec: DatasetSpec, config: FeatureConfig, *, start: datetime | None = None,
    end: datetime | None = None, backend: FrameBackend | None = None, max_window_rows: int = MAX_WINDOW_ROWS,
) -> FeatureRunSummary:
    """Build features for ``[start, end)`` (default: from the latest state to the newest event, and from
    the period of the earliest late event: one landed since the last run with a time before its state).

    The engine is ``settings.features_engine``: ``local`` (this process) or ``dask`` (partitions by hash of
    entity key on a Dask cluster, ``recloop.features.dask_engine``); both give the same files.
    Returns a summary; an empty window is not an error (``rows == 0`` and a message).

    Late events: the periods from the earliest one's to the latest state are built again with them (their
    training rows, entity tables and corrected states, whose totals then count them), with the latest
    vocabularies and the late sightings counted in them (ids keep their indices; one that reaches
    ``min_count`` with them gets the next).
    """
    began = time.perf_counter()
    backend = backend or get_backend(settings.frame_backend)
    layout = FeatureLayout.for_settings(settings)
    store = StateStore(layout.state)
    latest = store.latest()
    lake_files = lake.window_files(settings)  # what this run can read: recorded as read at its end

    bounds = lake.time_bounds(settings, spec)
    if bounds is None:
        return FeatureRunSummary("", "", backend.name, message="the lake has no events yet: run `recloop ingest`")
    lake_first, lake_last = bounds
    late_us, late_vocabularies = _late_events(settings, spec, config, layout, lake_files, latest) \
        if start is None and latest else (None, None)
    start_us = lake.to_us(start) if start else (latest.as_of_us if latest else lake_first)
    if late_us is not None:
        start_us = min(start_us, late_us)
    end_us = lake.to_us(end) if end else lake_last + 1
    engine = settings.features_engine
    name = backend.name if engine == "local" else f"dask/{settings.frame_backend}"
    if start_us >= end_us:
        return FeatureRunSummary(_iso(start_us), _iso(end_us), name, message="empty window: nothing to build")
    timestamps = lake.read_window(settings, spec, start_us, end_us, columns=[spec.timestamp])
    ts_us = (timestamps[spec.timestamp].cast(pa.int64()).to_numpy() if timestamps.num_columns
             else np.empty(0, np.int64))
    period_hours = layout.period_hours()
    if period_hours is None:  # a home built before periods existed has hourly files
        period_hours = choose_period_hours(ts_us) if len(ts_us) and latest is None else 1
        layout.root.mkdir(parents=True, exist_ok=True)
        layout.partition.write_text(json.dumps({"period_hours": period_hours}) + "\n")
    period_us = period_hours * HOUR_US
    start_us = _period_start(start_us, period_us)
    end_us = _period_start(end_us - 1, period_us) + period_us
    points = _split_points(ts_us, start_us, end_us, period_us, max_window_rows)
    rebuild = None
    if late_us is not None and latest is not None:  # the rebuilt periods end where the latest state is
        rebuild = {"from_us": start_us, "until_us": latest.as_of_us, "first_version": store.next_version(),
                   "vocabularies": late_vocabularies}
        points = sorted({*points, latest.as_of_us} if start_us < latest.as_of_us < end_us else set(points))
    total = FeatureRunSummary(_iso(start_us), _iso(end_us), name,
                              late_from=_iso(start_us) if late_us is not None else None)
    for part_start, part_end in zip(points[:-1], points[1:], strict=True):
        part = _build_window(settings, spec, config, backend, layout, store, part_start, part_end, period_us,
                             rebuild)
        total.rows += part.rows
        total.hours_written += part.hours_written
        for prefix, count in part.entity_rows.items():
            total.entity_rows[prefix] = total.entity_rows.get(prefix, 0) + count
        total.state_version = part.state_version or total.state_version
        total.vocabulary_sizes = part.vocabulary_sizes or total.vocabulary_sizes
        total.message = part.message if not total.rows else ""
    total.windows = len(points) - 1
    total.period_hours = period_hours
    # Every late event among these files is in now, unless an explicit start skipped some or an explicit end
    # stopped the rebuild before the latest state (the states after it would stay uncorrected): then the next
    # run finds them late again and rebuilds up to the latest state.
    if start is None and (rebuild is None or end_us >= rebuild["until_us"]):
        _record_lake_files(layout, settings, lake_files)
    elif rebuild is not None:
        total.message = (f"late events rebuilt up to {_iso(end_us)} only: the states up to {_iso(rebuild['until_us'])} "
                         "are corrected by the next run without an end")
    total.seconds = round(time.perf_counter() - began, 3)
    return total


def _keys_admitted_so_far(settings: Settings, spec: DatasetSpec, config: FeatureConfig, training: pa.Table,
                          base: FeatureState | None, start_us: int) -> pa.Table:
    """``training`` with each user and item id out of vocabulary (``OOV_INDEX``) in the rows before it had
    been seen ``min_count`` times: a row's features are what was known before its event.

    The vocabularies admit the ids a window saw often enough at its end, so the window's rows used to take
    an id's index from its first event on: with ``min_count`` 2, an indexed user in a row said "this user
    comes back later in the window" (and one window gave other indices than the same events split in two).
    Counted here: the base state's sightings, the events between it and the window, and the window's own
    events before the row (time order; lake order within equal times). Keys only: their raw values are in
    the rows; the other vocabularies admit at one sighting (``min_count`` 1) by default."""
    from recloop.features.vocab import OOV_INDEX

    keys = [f for f in config.categorical if not f.hash_buckets and f.min_count > 1 and f"c_{f.column}" in
            training.column_names and f.column in training.column_names and f.column in (spec.user_key, spec.item_key)]
    if not keys or not training.num_rows:
        return training
    since = base.as_of_us if base else None
    between = lake.read_window(settings, spec, since, start_us, columns=[f.column for f in keys]) \
        if since is None or since < start_us else pa.table({})
    order = np.lexsort((np.arange(training.num_rows), training["_ts_us"].to_numpy()))
    for feature in keys:
        name, values = f"c_{feature.column}", training[feature.column].to_numpy(zero_copy_only=False)
        ordered = values[order]
        unique, inverse = np.unique(ordered, return_inverse=True)
        prior = np.zeros(len(unique), dtype=np.int64)  # sightings before the window, per distinct id
        counted = base.vocabularies[feature.column].table if base and feature.column in base.vocabularies else None
        if counted is not None and counted.num_rows:
            found = pc.index_in(pa.array(unique).cast(counted["value"].type), value_set=counted["value"])
            prior += pc.take(counted["count"], found).fill_null(0).to_numpy()
        earlier, counts = np.unique(between[feature.column].drop_null().to_numpy(), return_counts=True) \
            if between.num_rows else (np.empty(0), np.empty(0, np.int64))
        if len(earlier):
            at = np.searchsorted(earlier, unique).clip(max=len(earlier) - 1)
            prior += np.where(earlier[at] == unique, counts[at], 0)
        before = prior[inverse]
        seen = np.empty(len(values), dtype=np.int64)  # sightings before each row
        seen[order] = before + _earlier_in_group(inverse)
        index = training[name].to_numpy()
        masked = np.where((index > OOV_INDEX) & (seen < feature.min_count), OOV_INDEX, index).astype(index.dtype)
        training = training.set_column(training.column_names.index(name), name, pa.array(masked))
    return training


def _earlier_in_group(groups: np.ndarray) -> np.ndarray:
    """For each element, how many elements before it belong to its group (pandas' ``cumcount``)."""
    by_group = np.argsort(groups, kind="stable")
    sorted_groups = groups[by_group]
    starts = np.flatnonzero(np.r_[True, sorted_groups[1:] != sorted_groups[:-1]])
    run_start = np.repeat(starts, np.diff(np.r_[starts, len(groups)]))
    out = np.empty(len(groups), dtype=np.int64)
    out[by_group] = np.arange(len(groups)) - run_start
    return out


def _late_events(settings: Settings, spec: DatasetSpec, config: FeatureConfig, layout: FeatureLayout,
                 lake_files: list[str], latest: FeatureState) -> tuple[int | None, dict | None]:
    """Events landed since the job last ran (in lake files it had not read) with times before the latest
    state: the earliest one's time, and the latest vocabularies with their sightings counted (ids that reach
    ``min_count`` with them get the next indices). ``(None, None)`` without any, or for a home without the
    record of files read (built before it existed)."""
    if not layout.lake_files.is_file():
        return None, None
    read = set(json.loads(layout.lake_files.read_text())["files"])
    features = vocabulary_features(config)
    late = [lake.read_window_file(settings, spec, path, None, latest.as_of_us,
                                  columns=[spec.timestamp, *dict.fromkeys(f.column for f in features)])
            for path in lake_files if _relative(path, settings) not in read]
    late = [t for t in late if t.num_rows]
    if not late:
        return None, None
    events = pa.concat_tables(late)
    earliest = pc.min(events[spec.timestamp].cast(pa.int64())).as_py()
    vocabularies = update_vocabularies(config, spec, latest, {
        f.column: count_values(vocabulary_values(events, f.column)) for f in features})
    return earliest, vocabularies


def _relative(path: str, settings: Settings) -> str:
    return str(Path(path).resolve().relative_to(settings.home.resolve()))


def _record_lake_files(layout: FeatureLayout, settings: Settings, lake_files: list[str]) -> None:
    layout.root.mkdir(parents=True, exist_ok=True)
    tmp = layout.lake_files.with_suffix(".json.tmp")
    tmp.write_text(json.dumps({"files": sorted(_relative(f, settings) for f in lake_files)}) + "\n")
    os.replace(tmp, layout.lake_files)


def _build_window(settings: Settings, spec: DatasetSpec, config: FeatureConfig, backend: FrameBackend,
                  layout: FeatureLayout, store: StateStore, start_us: int, end_us: int, period_us: int,
                  rebuild: dict | None = None) -> FeatureRunSummary:
    """One window ``[start_us, end_us)`` (period-aligned) of ``build_features``; a window of a ``rebuild``
    (late events: ``from_us``, ``until_us``, the ``vocabularies`` with their sightings) maps its ids with
    those vocabularies and saves a corrected state at its end, for the windows after it."""
    latest = store.latest()
    if rebuild is not None and latest is not None and latest.as_of_us <= rebuild["until_us"]:
        latest = replace(latest, vocabularies=rebuild["vocabularies"])
    engine = settings.features_engine
    summary = FeatureRunSummary(_iso(start_us), _iso(end_us), backend.name if engine == "local" else
                                f"dask/{settings.frame_backend}")
    base = store.at_or_before(start_us)
    since_us = base.as_of_us if base else None
    new_state = latest is None or end_us > latest.as_of_us
    plan = WindowPlan(start_us, end_us, since_us, since_us - DAY_US if since_us else None,
                      (latest.as_of_us if latest else None) if new_state else None, new_state, latest, base)
    if engine == "dask":
        from recloop.features import dask_engine

        computed = dask_engine.compute_window(settings, spec, config, plan)
    else:
        computed = compute_window(backend, spec, config, plan, lake.read_window(settings, spec, plan.read_from_us,
                                                                                 end_us))
    if computed is None:
        summary.message = f"no events between {summary.start} and {summary.end}"
        return summary

    summary.rows = computed.training.num_rows
    training = _keys_admitted_so_far(settings, spec, config, computed.training,
                                     store.at_or_before(start_us, counted=True), start_us)
    written = _write_periods(layout.training, training, "_ts_us", start_us, end_us, period_us, TRAINING_PARQUET)
    for prefix, entity_states in computed.states.items():
        table = entity_table(backend, entity_states, getattr(spec, _role(prefix)), start_us, end_us)
        summary.entity_rows[prefix] = table.num_rows
        _write_periods(layout.entity_table(prefix), table, "_ts_us", start_us, end_us, period_us)
    summary.hours_written = written

    correcting = not new_state and rebuild is not None and end_us <= rebuild["until_us"]
    if new_state or correcting:  # a corrected state keeps the latest vocabularies and statistics
        snapshots = {prefix: _snapshot(backend, s, base.snapshots.get(prefix) if base else None)
                     for prefix, s in computed.states.items()}
        marker = {k: rebuild[k] for k in ("from_us", "until_us", "first_version")} if correcting else None
        saved = store.save(FeatureState(end_us, computed.vocabularies, computed.stats, snapshots),
                           publish=new_state or end_us == rebuild["until_us"], rebuild=marker)
    else:
        saved = latest
    summary.state_version = saved.version
    summary.vocabulary_sizes = {c: v.size for c, v in computed.vocabularies.items()}
    _write_schema(layout, config, spec, computed.vocabularies, saved.version)
    return summary


def with_event_time(events: pa.Table, spec: DatasetSpec) -> pa.Table:
    """``events`` with ``_ts_us``: the event time as int64 microseconds, the job's time column."""
    return events.append_column("_ts_us", events[spec.timestamp].cast(pa.int64()))


def compute_window(backend: FrameBackend, spec: DatasetSpec, config: FeatureConfig, plan: WindowPlan,
                   events: pa.Table) -> WindowFeatures | None:
    """The single-process engine: everything from the events read for ``plan`` (None: none in the window)."""
    if events.num_rows == 0:
        return None
    events = with_event_time(events, spec)
    window = events.filter(pc.greater_equal(events["_ts_us"], plan.start_us))
    if window.num_rows == 0:
        return None
    latest = plan.latest
    if plan.new_state:
        new = events if plan.absorb_from_us is None else events.filter(
            pc.greater_equal(events["_ts_us"], plan.absorb_from_us))
        vocabularies = update_vocabularies(config, spec, latest, {
            f.column: count_values(vocabulary_values(new, f.column)) for f in vocabulary_features(config)})
        stats = latest.stats if latest else initial_stats(config, spec, new)
    else:
        vocabularies, stats = latest.vocabularies, latest.stats

    frame = backend.from_arrow(events.select(_state_columns(spec)))
    window_frame = backend.from_arrow(window.select(_state_columns(spec)))
    states, befores = {}, {}
    for role, prefix in ENTITY_PREFIXES.items():
        key = getattr(spec, role)
        if key is None:
            continue
        base = plan.base.snapshots[prefix] if plan.base and prefix in plan.base.snapshots else None
        states[prefix], befores[prefix] = entity_stage(backend, config, spec, prefix, frame, window_frame, base,
                                                       plan.since_us)
    training = training_rows(backend, config, spec, window, vocabularies, stats, befores)
    return WindowFeatures(training, states, vocabularies, stats)


def entity_stage(backend: FrameBackend, config: FeatureConfig, spec: DatasetSpec, prefix: str, frame: Any,
                 window_frame: Any, base: pa.Table | None, since_us: int | None) -> tuple[ops.EntityStates, Any]:
    """One entity kind's state rows from ``frame`` (every event read, of some or all entities) and, for each
    row of ``window_frame`` (the window's events of the same entities), the state strictly before it.

    Per entity, nothing depends on other entities: a partition holding all events of some entities
    computes exactly their part of the single-process result.
    """
    key = getattr(spec, _role(prefix))
    base_snapshot = backend.from_arrow(base) if base is not None else None
    states = ops.entity_states(backend, frame, key=key, ts="_ts_us", label=spec.label, prefix=prefix,
                               since_us=since_us, base=base_snapshot)
    before = ops.states_before(backend, states, window_frame[key], window_frame["_ts_us"], base_snapshot,
                               config.ttl_seconds)
    return states, before


def _role(prefix: str) -> str:
    return {v: k for k, v in ENTITY_PREFIXES.items()}[prefix]


def _state_columns(spec: DatasetSpec) -> list[str]:
    return [k for k in (spec.user_key, spec.item_key) if k] + [spec.label, "_ts_us"]


def vocabulary_features(config: FeatureConfig) -> list:
    """The features that keep a vocabulary: categoricals (but the hashed ones) and multi-hot lists with their
    own vocabulary (the ids inside the lists are counted)."""
    own = [CategoricalFeature(m.column) for m in config.multi_hot if m.vocabulary == m.column]
    return [f for f in config.categorical if not f.hash_buckets] + own


def vocabulary_values(events: pa.Table, column: str) -> pa.ChunkedArray | pa.Array:
    """The ids a vocabulary counts in ``column``: its values, or the elements of its lists."""
    values = events[column]
    return pc.list_flatten(values) if pa.types.is_list(values.type) else values


def update_vocabularies(config: FeatureConfig, spec: DatasetSpec, latest: FeatureState | None,
                        counts: dict[str, pa.Table]) -> dict[str, Vocabulary]:
    """The latest vocabularies with new sightings (``count_values`` per column, possibly merged from
    partitions) added: append-only, so the same counts give the same indices however they were counted."""
    from recloop.formats import ARROW_TYPES

    vocabularies = {}
    for feature in vocabulary_features(config):
        current = latest.vocabularies.get(feature.column) if latest else None
        if current is None:
            value_type = ARROW_TYPES[spec.column(feature.column).dtype]
            value_type = value_type.value_type if pa.types.is_list(value_type) else value_type
            current = Vocabulary.empty(feature.column, feature.min_count, value_type)
        vocabularies[feature.column] = current.add_counts(counts[feature.column])
    return vocabularies


def _numeric_values(np_module: Any, feature, column: pa.ChunkedArray) -> np.ndarray:
    values = column.cast(pa.float64()).to_numpy()
    return ops.numeric_transform(np_module, values, clip_min=feature.clip_min, clip_max=feature.clip_max,
                                 log1p=feature.log1p)


def initial_stats(config: FeatureConfig, spec: DatasetSpec, events: pa.Table) -> dict:
    """Statistics stored once, with the first state, so the model's inputs keep one scale afterwards."""
    numeric = {}
    for feature in config.numeric:
        values = _numeric_values(np, feature, events[feature.column])
        finite = values[np.isfinite(values)]
        numeric[feature.column] = {"mean": float(finite.mean()) if len(finite) else 0.0,
                                   "std": float(finite.std()) if len(finite) > 1 else 1.0}
    labels = events[spec.label].cast(pa.float64()).to_numpy()
    return {"prior_ctr": float(labels.mean()) if len(labels) else 0.0, "numeric": numeric}


def training_rows(backend: FrameBackend, config: FeatureConfig, spec: DatasetSpec, window: pa.Table,
                  vocabularies: dict[str, Vocabulary], stats: dict, befores: dict[str, Any]) -> pa.Table:
    """One training row per event of the window (in lake order)."""
    xp = backend.arrays
    host = backend.to_numpy
    columns: dict[str, Any] = {
        spec.event_id: window[spec.event_id], spec.timestamp: window[spec.timestamp],
        "_ts_us": window["_ts_us"], "label": window[spec.label].cast(pa.float32()),
    }
    for key in (spec.user_key, spec.item_key):
        if key:
            columns[key] = window[key]
    for oracle in spec.by_role("oracle"):
        columns[oracle.name] = window[oracle.name]

    ts_us = xp.asarray(window["_ts_us"].to_numpy())
    dense: dict[str, Any] = {}
    for feature in config.numeric:
        values = _numeric_values(xp, feature, window[feature.column])
        moments = stats["numeric"].get(feature.column, {"mean": 0.0, "std": 1.0})
        dense[feature.column] = ops.standardize(xp, values, moments["mean"], moments["std"]) if feature.standardize \
            else xp.where(xp.isnan(values), 0.0, values)
    if config.cyclic_time:
        dense.update(ops.cyclic_time(xp, ts_us))
    for prefix, before in befores.items():
        raw = {c: backend.values(before[c]) for c in before.columns}
        dense.update(ops.entity_dense(xp, raw, prefix, ts_us, prior=stats["prior_ctr"], smoothing=config.smoothing,
                                      recency_cap_seconds=config.recency_cap_seconds))
        columns[f"{prefix}_is_new"] = pa.array(host(xp.isnan(raw[f"{prefix}_last_seen"])))
    for name, values in dense.items():
        columns[f"d_{name}"] = pa.array(host(values).astype(np.float32))

    indices: dict[str, Any] = {}
    for feature in config.categorical:
        column = window[feature.column]
        if feature.hash_buckets:
            if not pa.types.is_integer(column.type):
                raise ValueError(f"hash_buckets needs an integer column; {feature.column!r} is {column.type}")
            values = xp.asarray(column.fill_null(0).to_numpy())
            nulls = xp.asarray(column.is_null().to_numpy(zero_copy_only=False))
            indices[feature.column] = ops.hash_bucket(xp, values, feature.hash_buckets, nulls)
        else:
            indices[feature.column] = xp.asarray(vocabularies[feature.column].lookup_arrow(column).to_numpy())
    for cross in config.crosses:
        indices[cross.name] = ops.hashed_cross(xp, indices[cross.columns[0]], indices[cross.columns[1]], cross.buckets)
    sizes = one_hot_tables(config, vocabularies)  # each table's size sets its ids' type on disk (formats.id_dtype)
    for name, values in indices.items():
        columns[f"c_{name}"] = pa.array(host(values).astype(id_dtype(sizes[name][0])))

    for feature in config.multi_hot:
        columns[f"m_{feature.column}"] = _map_lists(window[feature.column], vocabularies[feature.vocabulary],
                                                    feature.max_length)
    return pa.table(columns)


def one_hot_tables(config: FeatureConfig, vocabularies: dict[str, Vocabulary]) -> dict[str, tuple[int, bool]]:
    """Each one-hot id column's table (named as the feature, ``c_`` left off): its rows and whether they are
    hash buckets (a hashed column or a cross: another bucket count renumbers every id, where a vocabulary
    only grows). Index 0 is null and 1 out of vocabulary, so buckets take two rows more."""
    tables = {f.column: (f.hash_buckets + 2, True) if f.hash_buckets else (vocabularies[f.column].size, False)
              for f in config.categorical}
    return {**tables, **{cross.name: (cross.buckets + 2, True) for cross in config.crosses}}


def _map_lists(lists: pa.ChunkedArray, vocab: Vocabulary, max_length: int) -> pa.Array:
    """Each list's ids through the vocabulary, keeping the last ``max_length`` (the most recent)."""
    lists = lists.combine_chunks().fill_null(pa.scalar([], lists.type))
    lengths = pc.list_value_length(lists).to_numpy()
    mapped = vocab.lookup_arrow(pc.list_flatten(lists)).to_numpy()
    starts = np.concatenate([[0], np.cumsum(lengths)])[:-1]
    keep_from = starts + np.maximum(lengths - max_length, 0)
    kept_lengths = np.minimum(lengths, max_length)
    position = np.arange(len(mapped)) - np.repeat(starts, lengths)
    keep = position >= np.repeat(keep_from - starts, lengths)
    offsets = np.concatenate([[0], np.cumsum(kept_lengths)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(mapped[keep].astype(id_dtype(vocab.size))))


def entity_table(backend: FrameBackend, states: ops.EntityStates, key: str, start_us: int, end_us: int) -> pa.Table:
    """State rows with ``start <= ts < end``, as the Feast source: ``<key>, event_timestamp, <stats>``."""
    table = backend.to_arrow(states.frame)
    table = table.filter(pc.and_(pc.greater_equal(table["ts"], start_us), pc.less(table["ts"], end_us)))
    stat_columns = [c for c in table.column_names if c.startswith(f"{states.prefix}_")]
    return pa.table({
        key: table["key"], "event_timestamp": table["ts"].cast(pa.timestamp("us", tz="UTC")), "_ts_us": table["ts"],
        **{c: table[c].cast(pa.float64() if c.endswith("last_seen") else pa.int64()) for c in stat_columns},
    })


def _snapshot(backend: FrameBackend, states: ops.EntityStates, previous: pa.Table | None) -> pa.Table:
    """The latest state row per entity: new state rows win over the carried-over snapshot."""
    table = backend.to_arrow(states.frame)
    stat_columns = [c for c in table.column_names if c.startswith(f"{states.prefix}_")]
    table = table.select(["key", *stat_columns])
    if previous is not None and previous.num_rows:
        table = pa.concat_tables([previous.select(table.column_names).cast(table.schema), table])
    frame = table.to_pandas()
    frame = frame.drop_duplicates("key", keep="last").sort_values("key")
    return pa.Table.from_pandas(frame, preserve_index=False)


def _write_periods(folder: Path, table: pa.Table, ts_column: str, start_us: int, end_us: int,
                   period_us: int, parquet: dict | None = None) -> int:
    """One file per period of the window that has rows, staged beside the folder and renamed in; the window's
    other files (periods now empty) removed. Work follows the rows: empty periods cost nothing."""
    folder.mkdir(parents=True, exist_ok=True)
    staging = folder.parent / f".staging-{folder.name}"
    staging.mkdir(exist_ok=True)
    ts = table[ts_column].to_numpy() if table.num_rows else np.empty(0, dtype=np.int64)
    periods = _period_start(ts, period_us)
    first, last = _period_file(folder, start_us).stem, _period_file(folder, end_us).stem
    stale = {p for p in folder.glob("*.parquet") if first <= p.stem < last}
    order = np.argsort(periods, kind="stable")
    bounds = np.flatnonzero(np.diff(periods[order])) + 1
    written = 0
    for rows in np.split(order, bounds) if len(order) else []:
        path = _period_file(folder, int(periods[rows[0]]))
        part = table.take(pa.array(np.sort(rows))).drop_columns([ts_column])
        tmp = staging / path.name
        pq.write_table(part, tmp, **(parquet or {}))
        os.replace(tmp, path)
        stale.discard(path)
        written += 1
    for path in stale:
        path.unlink(missing_ok=True)
    shutil.rmtree(staging, ignore_errors=True)
    return written


def _write_schema(layout: FeatureLayout, config: FeatureConfig, spec: DatasetSpec,
                  vocabularies: dict[str, Vocabulary], version: int) -> None:
    """What the trainer needs to know about the training rows, next to them."""
    sources = {**{f.column: f.column for f in config.categorical}, **{c.name: list(c.columns) for c in config.crosses}}
    categorical = {f"c_{name}": {"num_embeddings": size, "source": sources[name], **({"hashed": True} if hashed else {})}
                   for name, (size, hashed) in one_hot_tables(config, vocabularies).items()}
    multi_hot = {f"m_{m.column}": {"num_embeddings": vocabularies[m.vocabulary].size, "vocabulary": m.vocabulary,
                                   "max_length": m.max_length} for m in config.multi_hot}
    sample = sorted(layout.training.glob("*.parquet"))
    dense = [n for n in pq.read_schema(sample[-1]).names if n.startswith("d_")] if sample else []
    schema = {"label": "label", "event_id": spec.event_id, "timestamp": spec.timestamp, "dense": dense,
              "categorical": categorical, "multi_hot": multi_hot, "state_version": version, "dataset": spec.name,
              "user_key": spec.user_key, "item_key": spec.item_key}
    tmp = layout.schema.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(schema, indent=2) + "\n")
    os.replace(tmp, layout.schema)
