"""The feature job on Dask: ``dask.dataframe`` partitions on many worker processes, which write the window's
files themselves; the driver handles metadata only (file names, row counts, vocabulary counts, exact sums).

``RECLOOP_FEATURES_ENGINE=dask`` switches ``features.job.build_features`` to this engine: on the cluster at
``RECLOOP_DASK_SCHEDULER`` (whose workers see the same ``RECLOOP_HOME``), or on a local cluster of
``RECLOOP_DASK_WORKERS`` processes. Partitions are pandas frames of Arrow-typed columns (``pd.ArrowDtype``:
every type survives the shuffles exactly), or cuDF frames with ``RECLOOP_FRAME_BACKEND=cudf`` (dask-cudf on
GPU workers; the driver resolves the backend for the frames' types)::

    lake files ─dd.from_map─▶ events (a partition per file)
      │ 1. per partition: vocabulary counts, exact moments ──▶ driver: vocabularies, statistics (metadata)
      │ 2. per entity kind: (key, label, time, order) ─set_index(hash of key, P)─▶ key partitions
      │       + the base snapshot's rows and the key's earlier sightings, partitioned alike
      │    per key partition: states, each window row's state before it ─▶ snapshot part (written there)
      │        │ befores ─set_index(period)─┐       entity rows ─set_index(period)─▶ entity files (written)
      ▼        ▼                            ▼
    window rows ─set_index(period, Q)─▶ per period partition: training rows ─▶ training files (written)

Why it is the same as one process: an entity's state depends only on its own events (``entity_stage``), so
a partition holding every event of some keys (and their base rows) computes exactly their part; vocabulary
indices depend only on total counts (``Vocabulary.add_counts``), which merge by summing; statistics are
exact sums (``recloop.features.moments``); training rows are row-wise given the befores, put back in lake
order within a period by ``_order`` (file index, row within the file); a key's sightings before a row
(``vocab.sightings_before``) are counted in its key partition. Every period (of training rows, of entity
rows) is in one partition, so its file is written whole by one worker.

Example::

    settings = Settings(features_engine="dask", dask_workers=2)
    build_features(settings, spec, config)          # same files as with features_engine="local"
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq

from recloop.features import definition, outputs
from recloop.features.backend import get_backend
from recloop.features.moments import Moments
from recloop.features.ops import STAT_NAMES
from recloop.features.seen import with_history
from recloop.features.state import read_snapshot_part, write_snapshot_part
from recloop.features.vocab import count_values, merge_counts, out_of_vocabulary_until, sightings_before
from recloop.formats import TRAINING_PARQUET
from recloop.ingest import lake

if TYPE_CHECKING:
    from distributed import Client

    from recloop.features.config import FeatureConfig
    from recloop.features.definition import FeatureLayout
    from recloop.features.state import FeatureState
    from recloop.features.vocab import Vocabulary
    from recloop.features.window import WindowPlan
    from recloop.schema import DatasetSpec
    from recloop.settings import Settings

ORDER = "_order"  # file index << 32 | row within the file: sorts rows back into lake order
IN_WINDOW = "_in_window"
PART = "_part"  # the hash partition of an entity key
PERIOD = "_period"  # the partition of a period (periods in time order, Q partitions of consecutive periods)
SEEN = "_seen"  # sightings of the row's key before it (admission of a key vocabulary with min_count > 1)
WRITTEN = pa.schema([("file", pa.string()), ("rows", pa.int64())])
SNAPSHOT_PARTS = pa.schema([("file", pa.string()), ("rows", pa.int64()), ("sha256", pa.string())])


@dataclass(frozen=True)
class Job:
    """What every task needs to know of the window (small: it travels with each task)."""

    settings: Settings
    spec: DatasetSpec
    config: FeatureConfig
    backend: str
    columns: tuple[str, ...]  # the lake columns a window row keeps
    start_us: int
    end_us: int
    since_us: int | None
    read_from_us: int | None
    absorb_from_us: int | None
    first_state: bool
    period_us: int
    key_parts: int
    period_parts: int
    training: Path
    entity_folders: dict[str, Path]

    def period_of(self, ts_us: np.ndarray) -> np.ndarray:
        """Each time's period partition: consecutive periods share one, so a period is never split."""
        periods = (self.end_us - self.start_us) // self.period_us
        index = (outputs.period_start(ts_us, self.period_us) - self.start_us) // self.period_us
        return (index * self.period_parts // periods).astype(np.int64)


@dataclass(frozen=True)
class WrittenWindow:
    """What the driver learns of a window the workers wrote: counts, names, and the state's metadata."""

    rows: int
    periods: int
    entity_rows: dict[str, int]
    vocabularies: dict[str, Vocabulary]
    stats: dict
    snapshots: dict[str, list[dict]]  # per entity kind, the parts written into the staged state version


def partition_of(keys: pa.Array | pa.ChunkedArray, partitions: int) -> np.ndarray:
    """The hash partition of each entity key (the same for a key wherever it is seen)."""
    values = keys.to_numpy(zero_copy_only=False) if isinstance(keys, pa.Array) else \
        keys.combine_chunks().to_numpy(zero_copy_only=False)
    return (pd.util.hash_array(np.asarray(values)) % np.uint64(partitions)).astype(np.int64)


def _frame(table: pa.Table, backend: str) -> Any:
    """A partition: cuDF, or pandas with Arrow-typed columns (a round trip gives back the same types)."""
    if backend == "cudf":
        import cudf

        return cudf.DataFrame.from_arrow(table)
    return table.to_pandas(types_mapper=pd.ArrowDtype)


def _arrow(frame: Any) -> pa.Table:
    if isinstance(frame, pd.DataFrame):
        return pa.Table.from_pandas(frame, preserve_index=False).replace_schema_metadata(None)
    return frame.to_arrow(preserve_index=False)


def _written(names: list[str], rows: list[int], backend: str) -> Any:
    return _frame(pa.table({"file": pa.array(names, pa.string()), "rows": pa.array(rows, pa.int64())}), backend)


# --- tasks (run on the workers) ------------------------------------------------------------------------------


def read_events(items: list[tuple[int, str]], job: Job) -> Any:
    """Some lake files' events read for the window, with their time, lake order and whether in the window."""
    tables = []
    for index, path in items:
        table = lake.read_window_file(job.settings, job.spec, path, job.read_from_us, job.end_us,
                                      columns=list(job.columns))
        table = definition.with_event_time(table, job.spec)
        table = table.append_column(ORDER, pa.array((index << 32) + np.arange(table.num_rows, dtype=np.int64)))
        tables.append(table.append_column(IN_WINDOW, pc.greater_equal(table["_ts_us"], job.start_us)))
    return _frame(pa.concat_tables(tables), job.backend)


def summarize(frame: Any, job: Job, vocabulary_columns: list[str]) -> tuple[dict[str, pa.Table], dict | None]:
    """One partition's vocabulary sightings and (first state only) exact moments: metadata for the driver."""
    events = _arrow(frame)
    new = events if job.absorb_from_us is None else events.filter(
        pc.greater_equal(events["_ts_us"], job.absorb_from_us))
    counts = {c: count_values(definition.vocabulary_values(new, c)) for c in vocabulary_columns}
    return counts, definition.stats_moments(job.config, job.spec, new) if job.first_state else None


def key_rows(frame: Any, job: Job, key: str) -> Any:
    """What the entity stage needs of each event, with its key's hash partition."""
    table = _arrow(frame).select([key, job.spec.label, "_ts_us", ORDER, IN_WINDOW])
    return _frame(table.append_column(PART, pa.array(partition_of(table[key], job.key_parts))), job.backend)


def read_base(item: tuple[str, str], job: Job) -> Any:
    """One file of the base state's snapshot (checked), with each key's hash partition."""
    table = read_snapshot_part(*item)
    return _frame(table.append_column(PART, pa.array(partition_of(table["key"], job.key_parts))), job.backend)


def read_between(items: list[tuple[int, str]], job: Job, key: str, since_us: int | None,
                 key_type: pa.DataType) -> Any:
    """Some lake files' sightings of ``key`` between the counted state and the window (``value``, ``count``)."""
    tables = [lake.read_window_file(job.settings, job.spec, path, since_us, job.start_us, columns=[key])
              for _, path in items]
    return _frame(_key_counts(pa.concat_tables(tables)[key], job, key_type), job.backend)


def between_in_events(frame: Any, job: Job, key: str, since_us: int | None, key_type: pa.DataType) -> Any:
    """The same sightings from events already read (when the window's read reaches back to the counted state)."""
    table = _arrow(frame)
    keep = pc.less(table["_ts_us"], job.start_us)
    if since_us is not None:
        keep = pc.and_(keep, pc.greater_equal(table["_ts_us"], since_us))
    return _frame(_key_counts(table.filter(keep)[key], job, key_type), job.backend)


def _key_counts(values: pa.ChunkedArray, job: Job, key_type: pa.DataType) -> pa.Table:
    counts = count_values(values if len(values) else pa.chunked_array([], key_type), key_type)
    return counts.append_column(PART, pa.array(partition_of(counts["value"], job.key_parts)))


def key_stage(events: Any, base: Any | None, prior: Any | None, job: Job, prefix: str, number: int,
              staging: Path | None) -> dict:
    """One key partition of one entity kind: its befores (by period partition), its entity rows in the
    window (by period partition), and its snapshot part, written into ``staging`` (a new state only)."""
    spec, config = job.spec, job.config
    key = getattr(spec, definition.role_of(prefix))
    backend = get_backend(job.backend)
    table = _arrow(events)
    base_table = _arrow(base) if base is not None else None  # the partition (PART) is the index: dropped
    window = table.filter(table[IN_WINDOW]).sort_by(ORDER)
    columns = [key, spec.label, "_ts_us"]
    states, before = definition.entity_stage(backend, config, spec, prefix, backend.from_arrow(table.select(columns)),
                                             backend.from_arrow(window.select(columns)), base_table, job.since_us)
    befores = backend.to_arrow(before).append_column(ORDER, window[ORDER]).append_column(
        PERIOD, pa.array(job.period_of(window["_ts_us"].to_numpy())))
    if prior is not None:
        befores = befores.append_column(SEEN, pa.array(_seen(window, key, _arrow(prior))))
    rows = outputs.entity_table(backend, states, key, job.start_us, job.end_us)
    rows = rows.append_column(PERIOD, pa.array(job.period_of(rows["_ts_us"].to_numpy())))
    snapshot = SNAPSHOT_PARTS.empty_table()
    if staging is not None:
        part = outputs.snapshot_of(backend, states, base_table)
        if part.num_rows:
            snapshot = pa.Table.from_pylist([write_snapshot_part(part, staging, prefix, number)], SNAPSHOT_PARTS)
    return {"befores": _frame(befores, job.backend), "entity": _frame(rows, job.backend),
            "snapshot": _frame(snapshot, job.backend)}


def _seen(window: pa.Table, key: str, prior: pa.Table) -> np.ndarray:
    """Sightings of each window row's key before it: counted before the window (``prior``), then earlier
    rows in time order (lake order within a time), as ``job._keys_admitted_so_far`` counts them."""
    # pandas, not Acero: the shuffled buffers arrive unaligned, which Acero warns about on every call
    totals = prior.to_pandas().groupby("value", sort=False)["count"].sum() if prior.num_rows else None

    def before(unique: np.ndarray) -> np.ndarray:
        if totals is None:
            return np.zeros(len(unique), dtype=np.int64)
        return totals.reindex(unique).fillna(0).astype(np.int64).to_numpy()

    order = np.lexsort((window[ORDER].to_numpy(), window["_ts_us"].to_numpy()))
    return sightings_before(window[key].to_numpy(zero_copy_only=False), order, before)


def window_rows(frame: Any, job: Job) -> Any:
    table = _arrow(frame)
    table = table.filter(table[IN_WINDOW]).drop_columns([IN_WINDOW])
    return _frame(table.append_column(PERIOD, pa.array(job.period_of(table["_ts_us"].to_numpy()))), job.backend)


def write_training(window: Any, *rest: Any, job: Job, prefixes: tuple[str, ...]) -> Any:
    """One period partition's training rows (``definition.training_rows``), written as its period files."""
    befores, inputs = rest[:-1], rest[-1]
    vocabularies, stats = inputs
    backend = get_backend(job.backend)
    rows = _arrow(window).sort_by(ORDER)
    if not rows.num_rows:
        return _written([], [], job.backend)
    aligned, seen = {}, {}
    for prefix, frame in zip(prefixes, befores, strict=True):
        table = _arrow(frame).sort_by(ORDER)
        if table.num_rows != rows.num_rows or not table[ORDER].equals(rows[ORDER]):
            raise RuntimeError(f"the {prefix} states do not line up with the window rows of a period partition")
        if SEEN in table.column_names:
            seen[getattr(job.spec, definition.role_of(prefix))] = table[SEEN].to_numpy()
        aligned[prefix] = backend.from_arrow(table.select([f"{prefix}_{s}" for s in STAT_NAMES]))
    rows = with_history(job.settings, job.spec, rows)  # the derived history, if the spec has one
    training = definition.training_rows(backend, job.config, job.spec, rows.drop_columns([ORDER]),
                                        vocabularies, stats, aligned)
    for feature in definition.admission_counted(job.config, job.spec):
        name = f"c_{feature.column}"
        masked = out_of_vocabulary_until(training[name].to_numpy(), seen[feature.column], feature.min_count)
        training = training.set_column(training.column_names.index(name), name, pa.array(masked))
    names = outputs.write_period_files(job.training, training, "_ts_us", job.period_us, TRAINING_PARQUET)
    return _written(names, _rows_per_period(training["_ts_us"].to_numpy(), job.period_us), job.backend)


def write_entities(frame: Any, job: Job, prefix: str) -> Any:
    """One period partition's entity rows (sorted by key and time, as one process has them), as period files."""
    table = _arrow(frame)  # the period partition is the index: dropped
    if not table.num_rows:
        return _written([], [], job.backend)
    key = table.column_names[0]
    table = table.sort_by([(key, "ascending"), ("_ts_us", "ascending")])
    names = outputs.write_period_files(job.entity_folders[prefix], table, "_ts_us", job.period_us)
    return _written(names, _rows_per_period(table["_ts_us"].to_numpy(), job.period_us), job.backend)


def _rows_per_period(ts_us: np.ndarray, period_us: int) -> list[int]:
    return np.unique(outputs.period_start(ts_us, period_us), return_counts=True)[1].tolist()


# --- the driver ----------------------------------------------------------------------------------------------


@contextmanager
def dask_client(settings: Settings) -> Iterator[Client]:
    """A client of the configured scheduler, or of a local cluster that lives as long as the block."""
    from distributed import Client, LocalCluster

    if settings.dask_scheduler:
        with Client(settings.dask_scheduler) as client:
            yield client
        return
    with LocalCluster(n_workers=settings.dask_workers, threads_per_worker=1, processes=True,
                      dashboard_address=None) as cluster, Client(cluster) as client:
        yield client


def _empty(schema: pa.Schema, backend: str) -> Any:
    return _frame(schema.empty_table(), backend)


def _by(frame: Any, column: str, parts: int) -> Any:
    """``frame`` partitioned on an integer column with values ``0 .. parts-1``: partition ``i`` holds value
    ``i`` (known divisions, so frames partitioned alike line up partition by partition)."""
    return frame.set_index(column, divisions=list(range(parts + 1)), shuffle_method="tasks")


def build_window(settings: Settings, spec: DatasetSpec, config: FeatureConfig, plan: WindowPlan,
                 layout: FeatureLayout, period_us: int, counted: FeatureState | None, staging: Path | None,
                 client: Client | None = None) -> WrittenWindow | None:
    """The window of ``plan`` computed and written by the workers of a Dask cluster (``client``, or the one
    ``settings`` name); ``staging``: the next state version's folder, for the snapshot parts (a new state).
    The driver then removes stale period files and saves the state. None: no events in the window."""
    if client is None:
        with dask_client(settings) as own:
            return build_window(settings, spec, config, plan, layout, period_us, counted, staging, own)
    import dask

    # the partitions' Arrow types are the ones wanted: dask's conversion of strings would only cost a pass
    with dask.config.set({"dataframe.convert-string": False}):
        return _build_window(settings, spec, config, plan, layout, period_us, counted, staging, client)


def _build_window(settings: Settings, spec: DatasetSpec, config: FeatureConfig, plan: WindowPlan,
                  layout: FeatureLayout, period_us: int, counted: FeatureState | None, staging: Path | None,
                  client: Client) -> WrittenWindow | None:
    import dask
    import dask.dataframe as dd

    settings = settings.model_copy(update={"home": settings.home.resolve()})  # workers resolve nothing
    files = lake.window_files(settings)
    if not files:
        return None
    backend = get_backend(settings.frame_backend).name
    if backend == "cudf":
        import dask_cudf  # noqa: F401 - registers cuDF partitions with dask.dataframe

    schema = ds.dataset(files[0], format="parquet", partitioning=ds.partitioning(flavor="hive"),
                        partition_base_dir=str(settings.lake_events_dir)).schema
    names = tuple(c.name for c in spec.columns if c.name in schema.names)
    key_parts = settings.dask_partitions or 2 * max(1, len(client.scheduler_info()["workers"]))
    periods = (plan.end_us - plan.start_us) // period_us
    entity_folders = {prefix: layout.entity_table(prefix) for role, prefix in definition.ENTITY_PREFIXES.items()
                      if getattr(spec, role)}
    job = Job(settings, spec, config, backend, names, plan.start_us, plan.end_us, plan.since_us, plan.read_from_us,
              plan.absorb_from_us, plan.new_state and plan.latest is None, period_us, key_parts,
              min(periods, key_parts), layout.training, entity_folders)
    event_schema = pa.schema([*(schema.field(n) for n in names), ("_ts_us", pa.int64()), (ORDER, pa.int64()),
                              (IN_WINDOW, pa.bool_())])
    groups = _groups(list(enumerate(files)), 4 * max(1, len(client.scheduler_info()["workers"])))
    # read once, held in the workers' memory (never the driver's) while both steps use them
    events = dd.from_map(read_events, groups, job=job, meta=_empty(event_schema, backend),
                         enforce_metadata=False).persist()

    # 1. vocabularies and statistics: per partition counts and exact sums, merged on the driver
    if plan.new_state:
        columns = [f.column for f in definition.vocabulary_features(config)]
        parts = dask.compute(*[dask.delayed(summarize)(p, job, columns) for p in events.to_delayed()])
        merged = {c: merge_counts([counts[c] for counts, _ in parts]) for c in columns}
        vocabularies = definition.update_vocabularies(config, spec, plan.latest, merged)
        if job.first_state:
            moments = {}
            for _, part in parts:
                moments = {name: moments.get(name, Moments()) + m for name, m in part.items()}
            stats = definition.stats_from_moments(config, moments)
        else:
            stats = plan.latest.stats
    else:
        vocabularies, stats = plan.latest.vocabularies, plan.latest.stats

    # 2. per entity kind, by key partition: befores, entity rows, snapshot parts
    admission = {f.column for f in definition.admission_counted(config, spec)}
    base_files = _snapshot_files(settings, plan.base) if plan.base else {}
    befores, entities, snapshots = {}, {}, {}
    for role, prefix in definition.ENTITY_PREFIXES.items():
        key = getattr(spec, role)
        if key is None:
            continue
        rows = _by(events.map_partitions(key_rows, job, key, meta=_empty(pa.schema(
            [schema.field(key), schema.field(spec.label), ("_ts_us", pa.int64()), (ORDER, pa.int64()),
             (IN_WINDOW, pa.bool_()), (PART, pa.int64())]), backend)), PART, key_parts).to_delayed()
        base = [None] * key_parts
        if prefix in base_files:
            base_schema = pq.read_schema(base_files[prefix][0][0]).remove_metadata().append(pa.field(PART, pa.int64()))
            base = _by(dd.from_map(read_base, base_files[prefix], job=job, meta=_empty(base_schema, backend),
                                   enforce_metadata=False), PART, key_parts).to_delayed()
        prior = [None] * key_parts
        if key in admission:
            prior = _by(_prior(dd, job, events, groups, key, schema.field(key).type, counted), PART,
                        key_parts).to_delayed()
        stages = [dask.delayed(key_stage)(e, b, p, job, prefix, number, staging)
                  for number, (e, b, p) in enumerate(zip(rows, base, prior, strict=True))]
        stat_fields = [(f"{prefix}_{s}", pa.float64()) for s in STAT_NAMES]
        befores_schema = pa.schema([*stat_fields, (ORDER, pa.int64()), (PERIOD, pa.int64()),
                                    *([(SEEN, pa.int64())] if key in admission else [])])
        befores[prefix] = _by(dd.from_delayed([dask.delayed(operator.getitem)(s, "befores") for s in stages],
                                              meta=_empty(befores_schema, backend), verify_meta=False),
                              PERIOD, job.period_parts)
        entity_schema = pa.schema([(key, _round_trip_type(schema.field(key).type)),
                                   ("event_timestamp", pa.timestamp("us", tz="UTC")), ("_ts_us", pa.int64()),
                                   *((f"{prefix}_{s}", pa.float64() if s == "last_seen" else pa.int64())
                                     for s in STAT_NAMES), (PERIOD, pa.int64())])
        entity = dd.from_delayed([dask.delayed(operator.getitem)(s, "entity") for s in stages],
                                 meta=_empty(entity_schema, backend), verify_meta=False)
        entities[prefix] = _by(entity, PERIOD, job.period_parts).map_partitions(
            write_entities, job, prefix, meta=_empty(WRITTEN, backend))
        snapshots[prefix] = dd.from_delayed([dask.delayed(operator.getitem)(s, "snapshot") for s in stages],
                                            meta=_empty(SNAPSHOT_PARTS, backend), verify_meta=False)

    # 3. by period partition: training rows, written where they are computed
    window = _by(events.map_partitions(window_rows, job, meta=_empty(pa.schema(
        [*(f for f in event_schema if f.name != IN_WINDOW), (PERIOD, pa.int64())]), backend)), PERIOD,
        job.period_parts)
    inputs = dask.delayed((vocabularies, stats), pure=True)
    prefixes = tuple(befores)
    training = dd.map_partitions(write_training, window, *befores.values(), inputs, job=job, prefixes=prefixes,
                                 meta=_empty(WRITTEN, backend), align_dataframes=False)
    for folder in (layout.training, *entity_folders.values()):
        outputs.staging_folder(folder).mkdir(parents=True, exist_ok=True)
    written, written_entities, parts = dask.compute(training, entities, snapshots)
    written = _arrow(written)
    if not written.num_rows:
        return None
    outputs.remove_stale(layout.training, plan.start_us, plan.end_us, period_us, written["file"].to_pylist())
    entity_rows = {}
    for prefix, frame in written_entities.items():
        table = _arrow(frame)
        outputs.remove_stale(entity_folders[prefix], plan.start_us, plan.end_us, period_us, table["file"].to_pylist())
        entity_rows[prefix] = int(pc.sum(table["rows"]).as_py() or 0)
    return WrittenWindow(int(pc.sum(written["rows"]).as_py()), written.num_rows, entity_rows, vocabularies, stats,
                         {prefix: _arrow(found).to_pylist() for prefix, found in parts.items()})


def _prior(dd: Any, job: Job, events: Any, groups: list, key: str, key_type: pa.DataType,
           counted: FeatureState | None):
    """Sightings of ``key`` before the window: the counted state's vocabulary counts and the lake's events
    between that state and the window (``job._keys_admitted_so_far``), as (value, count) rows by key partition:
    taken from the events read when they reach back that far, else read from the lake."""
    since = counted.as_of_us if counted else None
    meta = _empty(pa.schema([("value", key_type), ("count", pa.int64()), (PART, pa.int64())]), job.backend)
    frames = []
    if counted is not None and key in counted.vocabularies:
        table = counted.vocabularies[key].table.select(["value", "count"])
        table = pa.table({"value": table["value"].cast(key_type), "count": table["count"]})
        table = table.append_column(PART, pa.array(partition_of(table["value"], job.key_parts)))
        frames.append(dd.from_pandas(_frame(table, job.backend), npartitions=1))
    if since is None or since < job.start_us:
        read = job.read_from_us is None or (since is not None and since >= job.read_from_us)
        frames.append(events.map_partitions(between_in_events, job, key, since, key_type, meta=meta) if read else
                      dd.from_map(read_between, groups, job=job, key=key, since_us=since, key_type=key_type,
                                  meta=meta, enforce_metadata=False))
    return dd.concat(frames) if frames else dd.from_pandas(meta, npartitions=1)


def _groups(items: list, parts: int) -> list[list]:
    """``items`` in at most ``parts`` consecutive groups of near-equal size (a partition reads a group)."""
    size = -(-len(items) // max(1, min(parts, len(items))))
    return [items[i:i + size] for i in range(0, len(items), size)]


def _snapshot_files(settings: Settings, base: FeatureState) -> dict[str, list[tuple[str, str]]]:
    from recloop.features.definition import FeatureLayout
    from recloop.features.state import StateStore

    return StateStore(FeatureLayout.for_settings(settings).state).snapshot_files(base.version)


def _round_trip_type(arrow_type: pa.DataType) -> pa.DataType:
    """A key's type in the entity tables: what the frame backend's round trip makes of the lake's type."""
    frame = get_backend("pandas").from_arrow(pa.table({"key": pa.array([], arrow_type)}))
    return pa.Table.from_pandas(frame, preserve_index=False)["key"].type

