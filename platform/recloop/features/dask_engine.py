"""The feature job on Dask: the same window computed by many worker processes, with the same result.

``RECLOOP_FEATURES_ENGINE=dask`` switches ``features.job.build_features`` to this engine: on the cluster at
``RECLOOP_DASK_SCHEDULER`` (whose workers see the same ``RECLOOP_HOME``), or on a local cluster of
``RECLOOP_DASK_WORKERS`` processes. Each task runs the frame backend of its worker (pandas on a CPU, cuDF
where a GPU and cuDF are there, ``RECLOOP_FRAME_BACKEND``). The job is two shuffles::

    lake files ──read (one task per file)──▶ window rows, vocabulary counts, events split by hash(key)
        │                                          │ counts merged on the driver → vocabularies (append-only)
        ▼                                          ▼
    per entity kind, per hash partition: entity states + each window row's state before it (by _order)
        │ states → driver (entity tables, snapshot)     │ befores split by lake file
        ▼                                               ▼
    per lake file: its window rows + their befores ──▶ training rows (lake order) → driver writes the hours

Why it is the same as one process: an entity's state depends only on its own events (``entity_stage``),
so a partition holding every event of some keys computes exactly their part; a vocabulary's new indices
depend only on the total counts (``Vocabulary.add_counts``), which merge by summing; and training rows are
row-wise given the befores, reassembled in lake order by ``_order`` (file index, row within the file).
What stays on the driver: reading the state store, merging counts, and writing the hour files (the outputs
of a window pass through its memory, as in the single-process job).

Example::

    settings = Settings(features_engine="dask", dask_workers=2)
    build_features(settings, spec, config)          # same files as with features_engine="local"
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recloop.features import definition, ops, window
from recloop.features.backend import get_backend
from recloop.features.vocab import count_values, merge_counts
from recloop.ingest import lake

if TYPE_CHECKING:
    from distributed import Client

    from recloop.features.config import FeatureConfig
    from recloop.features.vocab import Vocabulary
    from recloop.schema import DatasetSpec
    from recloop.settings import Settings

ORDER = "_order"  # file index << 32 | row within the file: sorts rows back into lake order
IN_WINDOW = "_in_window"


@dataclass(frozen=True)
class Bounds:
    """The plan's times, all a worker needs of it (the state itself stays on the driver)."""

    start_us: int
    end_us: int
    since_us: int | None
    read_from_us: int | None
    absorb_from_us: int | None
    new_state: bool
    first_state: bool

    @classmethod
    def of(cls, plan: window.WindowPlan) -> Bounds:
        return cls(plan.start_us, plan.end_us, plan.since_us, plan.read_from_us, plan.absorb_from_us,
                   plan.new_state, plan.latest is None)


@dataclass(frozen=True)
class FilePart:
    """What one lake file contributes: its window rows, the vocabulary sightings and (first state only)
    the numeric columns of its rows that update the state, and its events split by hash partition."""

    window_rows: int
    window: pa.Table | None
    counts: dict[str, pa.Table]
    moments: pa.Table | None
    buckets: dict[str, list[pa.Table]]


@dataclass(frozen=True)
class BucketPart:
    """One hash partition of one entity kind: its state rows, and its befores split by lake file."""

    states: pa.Table | None
    befores: list[pa.Table | None]


@dataclass(frozen=True)
class RowInputs:
    vocabularies: dict[str, Vocabulary]
    stats: dict


def partition_of(keys: pa.Array | pa.ChunkedArray, partitions: int) -> np.ndarray:
    """The hash partition of each entity key (the same for a key wherever it is seen)."""
    values = keys.to_numpy(zero_copy_only=False) if isinstance(keys, pa.Array) else \
        keys.combine_chunks().to_numpy(zero_copy_only=False)
    return (pd.util.hash_array(np.asarray(values)) % np.uint64(partitions)).astype(np.int64)


def _split(table: pa.Table, parts: np.ndarray, partitions: int) -> list[pa.Table]:
    return [table.filter(pa.array(parts == p)) for p in range(partitions)]


# --- tasks (run on the workers) ------------------------------------------------------------------------------


def read_part(settings: Settings, spec: DatasetSpec, config: FeatureConfig, bounds: Bounds, index: int, path: str,
              partitions: int) -> FilePart:
    """Read one lake file's share of the window and prepare it for both shuffles."""
    events = lake.read_window_file(settings, spec, path, bounds.read_from_us, bounds.end_us)
    if events.num_rows == 0:
        return FilePart(0, None, {}, None, {})
    events = definition.with_event_time(events, spec)
    events = events.append_column(ORDER, pa.array((index << 32) + np.arange(events.num_rows, dtype=np.int64)))
    in_window = pc.greater_equal(events["_ts_us"], bounds.start_us)
    events = events.append_column(IN_WINDOW, in_window)
    window = events.filter(in_window).drop_columns([IN_WINDOW])
    counts, moments = {}, None
    if bounds.new_state:
        new = events if bounds.absorb_from_us is None else events.filter(
            pc.greater_equal(events["_ts_us"], bounds.absorb_from_us))
        counts = {f.column: count_values(definition.vocabulary_values(new, f.column)) for f in definition.vocabulary_features(config)}
        if bounds.first_state:
            moments = new.select([*(f.column for f in config.numeric), spec.label])
    buckets = {}
    for role, prefix in definition.ENTITY_PREFIXES.items():
        key = getattr(spec, role)
        if key is not None:
            slim = events.select([key, spec.label, "_ts_us", ORDER, IN_WINDOW])
            buckets[prefix] = _split(slim, partition_of(slim[key], partitions), partitions)
    return FilePart(window.num_rows, window if window.num_rows else None, counts, moments, buckets)


def bucket_stage(backend_name: str, spec: DatasetSpec, config: FeatureConfig, prefix: str,
                 pieces: list[pa.Table | None], base: pa.Table | None, since_us: int | None, files: int) -> BucketPart:
    """Entity states and befores of one hash partition (``definition.entity_stage`` on its keys only)."""
    pieces = [p for p in pieces if p is not None and p.num_rows]
    table = pa.concat_tables(pieces) if pieces else None
    if table is None:
        return BucketPart(None, [None] * files)
    backend = get_backend(backend_name)
    window = table.filter(table[IN_WINDOW])
    states, before = definition.entity_stage(backend, config, spec, prefix, backend.from_arrow(table.drop_columns(
        [ORDER, IN_WINDOW])), backend.from_arrow(window.drop_columns([ORDER, IN_WINDOW])), base, since_us)
    befores = backend.to_arrow(before).append_column(ORDER, window[ORDER])
    by_file = (befores[ORDER].to_numpy() >> 32) if befores.num_rows else np.empty(0, np.int64)
    return BucketPart(backend.to_arrow(states.frame),
                      [befores.filter(pa.array(by_file == f)) if (by_file == f).any() else None
                       for f in range(files)])


def file_rows(backend_name: str, spec: DatasetSpec, config: FeatureConfig, window: pa.Table,
              befores: dict[str, list[pa.Table | None]], inputs: RowInputs) -> pa.Table:
    """The training rows of one lake file's window rows, in its order (``definition.training_rows``)."""
    backend = get_backend(backend_name)
    aligned = {}
    for prefix, pieces in befores.items():
        table = pa.concat_tables([p for p in pieces if p is not None]).sort_by(ORDER)
        if not pc.all(pc.equal(table[ORDER], window[ORDER])).as_py() or table.num_rows != window.num_rows:
            raise RuntimeError(f"the {prefix} states do not line up with the window rows of a lake file")
        aligned[prefix] = backend.from_arrow(table.drop_columns([ORDER]))
    return definition.training_rows(backend, config, spec, window.drop_columns([ORDER]), inputs.vocabularies,
                             inputs.stats, aligned)


def _field(result, name: str):
    return getattr(result, name)


def _bucket_piece(part: FilePart, prefix: str, bucket: int) -> pa.Table | None:
    return part.buckets[prefix][bucket] if prefix in part.buckets else None  # a file with no events read


def _file_piece(part: BucketPart, index: int) -> pa.Table | None:
    return part.befores[index]


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


def compute_window(settings: Settings, spec: DatasetSpec, config: FeatureConfig, plan: window.WindowPlan,
                   client: Client | None = None) -> window.WindowFeatures | None:
    """``window.compute_window`` on a Dask cluster (``client``, or the one ``settings`` name)."""
    if client is None:
        with dask_client(settings) as own:
            return compute_window(settings, spec, config, plan, own)
    settings = settings.model_copy(update={"home": settings.home.resolve()})  # workers resolve nothing
    files = lake.window_files(settings)
    if not files:
        return None
    partitions = settings.dask_partitions or 2 * max(1, len(client.scheduler_info()["workers"]))
    bounds = Bounds.of(plan)
    backend = settings.frame_backend
    parts = [client.submit(read_part, settings, spec, config, bounds, i, path, partitions, pure=False)
             for i, path in enumerate(files)]
    window_rows = client.gather([client.submit(_field, p, "window_rows") for p in parts])
    if sum(window_rows) == 0:
        return None

    buckets: dict[str, list] = {}
    for role, prefix in definition.ENTITY_PREFIXES.items():
        if getattr(spec, role) is None:
            continue
        base = plan.base.snapshots.get(prefix) if plan.base else None
        base_parts = _split(base, partition_of(base["key"], partitions), partitions) if base is not None \
            else [None] * partitions
        buckets[prefix] = [client.submit(bucket_stage, backend, spec, config, prefix,
                                         [client.submit(_bucket_piece, p, prefix, b) for p in parts],
                                         base_parts[b], plan.since_us, len(files), pure=False)
                           for b in range(partitions)]

    if plan.new_state:
        counts = client.gather([client.submit(_field, p, "counts") for p in parts])
        merged = {f.column: merge_counts([c[f.column] for c in counts if c])
                  for f in definition.vocabulary_features(config)}
        vocabularies = definition.update_vocabularies(config, spec, plan.latest, merged)
        if plan.latest is None:
            moments = [m for m in client.gather([client.submit(_field, p, "moments") for p in parts])
                       if m is not None]
            stats = definition.initial_stats(config, spec, pa.concat_tables(moments))
        else:
            stats = plan.latest.stats
    else:
        vocabularies, stats = plan.latest.vocabularies, plan.latest.stats
    inputs = client.scatter(RowInputs(vocabularies, stats), broadcast=True)

    rows = [client.submit(file_rows, backend, spec, config, client.submit(_field, part, "window"),
                          {prefix: [client.submit(_file_piece, b, f) for b in futures]
                           for prefix, futures in buckets.items()}, inputs, pure=False)
            for f, (part, count) in enumerate(zip(parts, window_rows, strict=True)) if count]
    training = pa.concat_tables(client.gather(rows))
    frame_backend = get_backend(backend)
    states = {}
    for prefix, futures in buckets.items():
        tables = [t for t in client.gather([client.submit(_field, b, "states") for b in futures]) if t is not None]
        frame = frame_backend.from_arrow(pa.concat_tables(tables)).sort_values(["key", "ts"]).reset_index(drop=True)
        states[prefix] = ops.EntityStates(prefix, frame)
    return window.WindowFeatures(training, states, vocabularies, stats)
