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
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.features import dask_engine
from recloop.features.backend import FrameBackend, get_backend
from recloop.features.config import FeatureConfig
from recloop.features.definition import (
    FeatureLayout,
    admission_counted,
    one_hot_tables,
    role_of,
    update_vocabularies,
    vocabulary_features,
    vocabulary_values,
)
from recloop.features.outputs import (
    DAY_US,
    HOUR_US,
    entity_table,
    snapshot_of,
    write_periods,
)
from recloop.features.outputs import period_start as _period_start
from recloop.features.seen import SeenConfig, build_seen, with_history
from recloop.features.state import FeatureState, StateStore
from recloop.features.vocab import Vocabulary, count_values, out_of_vocabulary_until, sightings_before
from recloop.features.window import WindowPlan, compute_window
from recloop.formats import TRAINING_PARQUET
from recloop.hours import US
from recloop.ingest import lake
from recloop.schema import DatasetSpec
from recloop.settings import Settings

__all__ = ["DAY_US", "HOUR_US", "FeatureRunSummary", "build_features", "choose_period_hours"]


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
    seen_users: int | None = None  # users in the published seen history (features.seen); None: none written

    def to_dict(self) -> dict:
        return asdict(self)


def _iso(t_us: int) -> str:
    return datetime.fromtimestamp(t_us / US, tz=UTC).isoformat()


PERIOD_HOURS = (1, 24, 168)
MAX_PERIODS = 2_000  # nor more files than this for the first window (a sparse log over decades: weeks)
MIN_PERIODS = 4  # a longer period must leave at least this many periods with events (``choose_period_hours``)
MIN_ROWS_PER_PERIOD = 10  # the period is the shortest whose average period with events holds this many
MAX_WINDOW_ROWS = 2_000_000


def choose_period_hours(ts_us: np.ndarray) -> int:
    """The shortest period (hour, day, week) whose periods with events hold ``MIN_ROWS_PER_PERIOD`` events on
    average and number at most ``MAX_PERIODS``: a dense log keeps hourly files, a sparse or long one (ratings
    over years) gets fewer, fuller files. A period longer than one that is not full enough is taken only if it
    leaves ``MIN_PERIODS`` periods with events: Criteo's published 200-row sample (one day) got a single daily
    file, and training, which holds the newest files out for validation, had nothing left to train on."""
    occupied = [len(np.unique(_period_start(ts_us, hours * HOUR_US))) for hours in PERIOD_HOURS]
    for index, hours in enumerate(PERIOD_HOURS):
        longer = occupied[index + 1] if index + 1 < len(PERIOD_HOURS) else 0
        full = occupied[index] and len(ts_us) / occupied[index] >= MIN_ROWS_PER_PERIOD
        if occupied[index] and occupied[index] <= MAX_PERIODS and (full or longer < MIN_PERIODS):
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
        return FeatureRunSummary(_iso(start_us), _iso(end_us), name, message="empty window: nothing to build",
                                 seen_users=_publish_seen(settings, spec, layout, store, rebuild=False))
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
    total.seen_users = _publish_seen(settings, spec, layout, store, rebuild=late_us is not None)
    total.seconds = round(time.perf_counter() - began, 3)
    return total


def _publish_seen(settings: Settings, spec: DatasetSpec, layout: FeatureLayout, store: StateStore,
                  rebuild: bool) -> int | None:
    """The users' seen history as of the newest state (``features.seen``), beside the state serving reloads;
    its users (None: the rule is off, the spec has no keys, or there is no state yet)."""
    latest_version = store.latest_version()
    if latest_version is None:
        return None
    as_of_us = store.as_of_us(latest_version)
    written = build_seen(settings, spec, layout.seen, as_of_us, SeenConfig.published(settings, spec), rebuild=rebuild)
    return None if written is None else len(pc.unique(written.table[written.user_key]))


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
    keys = [f for f in admission_counted(config, spec) if f.column in training.column_names]
    if not keys or not training.num_rows:
        return training
    since = base.as_of_us if base else None
    between = lake.read_window(settings, spec, since, start_us, columns=[f.column for f in keys]) \
        if since is None or since < start_us else pa.table({})
    order = np.lexsort((np.arange(training.num_rows), training["_ts_us"].to_numpy()))
    for feature in keys:
        name, values = f"c_{feature.column}", training[feature.column].to_numpy(zero_copy_only=False)
        counted = base.vocabularies[feature.column].table if base and feature.column in base.vocabularies else None
        earlier = between[feature.column].drop_null() if between.num_rows else None
        seen = sightings_before(values, order, lambda unique, c=counted, e=earlier: _prior_sightings(unique, c, e))
        masked = out_of_vocabulary_until(training[name].to_numpy(), seen, feature.min_count)
        training = training.set_column(training.column_names.index(name), name, pa.array(masked))
    return training


def _prior_sightings(unique: np.ndarray, counted: pa.Table | None, earlier: pa.ChunkedArray | None) -> np.ndarray:
    """Sightings of each of ``unique`` (sorted distinct ids) before a window: a state's vocabulary counts
    (``counted``) plus the ids of the events between that state and the window (``earlier``)."""
    prior = np.zeros(len(unique), dtype=np.int64)
    if counted is not None and counted.num_rows:
        found = pc.index_in(pa.array(unique).cast(counted["value"].type), value_set=counted["value"])
        prior += pc.take(counted["count"], found).fill_null(0).to_numpy()
    if earlier is not None and len(earlier):
        values, counts = np.unique(earlier.to_numpy(), return_counts=True)
        at = np.searchsorted(values, unique).clip(max=len(values) - 1)
        prior += np.where(values[at] == unique, counts[at], 0)
    return prior


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
    engine = settings.features_engine
    local = engine == "local"  # the Dask engine's workers read the snapshots themselves: the driver never does
    latest = store.latest(snapshots=local)
    if rebuild is not None and latest is not None and latest.as_of_us <= rebuild["until_us"]:
        latest = replace(latest, vocabularies=rebuild["vocabularies"])
    summary = FeatureRunSummary(_iso(start_us), _iso(end_us), backend.name if local else
                                f"dask/{settings.frame_backend}")
    base = store.at_or_before(start_us, snapshots=local)
    since_us = base.as_of_us if base else None
    new_state = latest is None or end_us > latest.as_of_us
    plan = WindowPlan(start_us, end_us, since_us, since_us - DAY_US if since_us else None,
                      (latest.as_of_us if latest else None) if new_state else None, new_state, latest, base)
    correcting = not new_state and rebuild is not None and end_us <= rebuild["until_us"]
    counted = store.at_or_before(start_us, counted=True, snapshots=False)
    if local:
        events = with_history(settings, spec, lake.read_window(settings, spec, plan.read_from_us, end_us))
        computed = compute_window(backend, spec, config, plan, events)
        if computed is None:
            summary.message = f"no events between {summary.start} and {summary.end}"
            return summary
        summary.rows = computed.training.num_rows
        training = _keys_admitted_so_far(settings, spec, config, computed.training, counted, start_us)
        summary.hours_written = write_periods(layout.training, training, "_ts_us", start_us, end_us, period_us,
                                              TRAINING_PARQUET)
        for prefix, entity_states in computed.states.items():
            table = entity_table(backend, entity_states, getattr(spec, role_of(prefix)), start_us, end_us)
            summary.entity_rows[prefix] = table.num_rows
            write_periods(layout.entity_table(prefix), table, "_ts_us", start_us, end_us, period_us)
        vocabularies, stats, staged, parts = computed.vocabularies, computed.stats, None, None
        snapshots = {prefix: snapshot_of(backend, s, base.snapshots.get(prefix) if base else None)
                     for prefix, s in computed.states.items()} if new_state or correcting else {}
    else:
        staged = store.stage() if new_state or correcting else None
        written = dask_engine.build_window(settings, spec, config, plan, layout, period_us, counted, staged)
        if written is None:
            store.unstage(staged)
            summary.message = f"no events between {summary.start} and {summary.end}"
            return summary
        summary.rows, summary.hours_written = written.rows, written.periods
        summary.entity_rows = written.entity_rows
        vocabularies, stats, parts, snapshots = written.vocabularies, written.stats, written.snapshots, {}

    if new_state or correcting:  # a corrected state keeps the latest vocabularies and statistics
        marker = {k: rebuild[k] for k in ("from_us", "until_us", "first_version")} if correcting else None
        saved = store.save(FeatureState(end_us, vocabularies, stats, snapshots),
                           publish=new_state or end_us == rebuild["until_us"], rebuild=marker, staged=staged,
                           snapshot_parts=parts)
    else:
        saved = latest
    summary.state_version = saved.version
    summary.vocabulary_sizes = {c: v.size for c, v in vocabularies.items()}
    _write_schema(layout, config, spec, vocabularies, saved.version)
    return summary


def _write_schema(layout: FeatureLayout, config: FeatureConfig, spec: DatasetSpec,
                  vocabularies: dict[str, Vocabulary], version: int) -> None:
    """What the trainer needs to know about the training rows, next to them."""
    sources = {**{f.column: f.column for f in config.categorical}, **{c.name: list(c.columns) for c in config.crosses}}
    budgets = {f.column: f.max_rows for f in config.categorical if f.max_rows}
    categorical = {f"c_{name}": {"num_embeddings": size, "source": sources[name], **({"hashed": True} if hashed else {}),
                                 **({"max_rows": budgets[name]} if name in budgets else {})}
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
