"""The one definition of the model's features, shared by the feature job, the online writer and serving.

Training rows and request rows are built by the same functions here, so a model sees at serving exactly
what it was trained on: ``training_rows`` turns events (a window of the lake, or one request's
candidates) plus each entity's state strictly before the event into the model's columns::

    label | d_<numeric>, d_<entity stats>, d_<cyclic time> | c_<categorical> (vocabulary or hash) | m_<list>
          float32 inputs                                     table indices (0 null, 1 OOV)          index lists

Entity states (``user_*`` and ``item_*`` counts, CTR, recency) come from ``entity_stage``; vocabularies
are append-only (``update_vocabularies``); the numeric scale is fixed with the first state
(``initial_stats``). ``FeatureLayout`` says where the job's outputs live; ``ENTITY_PREFIXES`` names the
entity kinds. The online store's key layout is ``recloop.features.online_keys``.

Example::

    layout = FeatureLayout.for_settings(settings)           # features/training/*.parquet, state/, ...
    rows = training_rows(backend, config, spec, events, vocabularies, stats, befores)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from recloop.features import ops
from recloop.features.backend import FrameBackend
from recloop.features.config import CategoricalFeature, FeatureConfig
from recloop.features.moments import Moments
from recloop.features.state import FeatureState
from recloop.features.vocab import Vocabulary
from recloop.formats import ARROW_TYPES, id_dtype
from recloop.schema import DatasetSpec
from recloop.settings import Settings

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
    def seen(self) -> Path:
        """Each user's items already interacted with in the lake (``recloop.features.seen``)."""
        return self.root / "seen.parquet"

    @property
    def lake_files(self) -> Path:
        """The committed lake files the job has read (``build_features``: late events come in new ones)."""
        return self.root / "lake_files.json"

    def period_hours(self) -> int | None:
        """The period of this home's feature files (None before the first run)."""
        if not self.partition.is_file():
            return None
        return int(json.loads(self.partition.read_text())["period_hours"])


def with_event_time(events: pa.Table, spec: DatasetSpec) -> pa.Table:
    """``events`` with ``_ts_us``: the event time as int64 microseconds, the job's time column."""
    return events.append_column("_ts_us", events[spec.timestamp].cast(pa.int64()))


def entity_stage(backend: FrameBackend, config: FeatureConfig, spec: DatasetSpec, prefix: str, frame: Any,
                 window_frame: Any, base: pa.Table | None, since_us: int | None) -> tuple[ops.EntityStates, Any]:
    """One entity kind's state rows from ``frame`` (every event read, of some or all entities) and, for each
    row of ``window_frame`` (the window's events of the same entities), the state strictly before it.

    Per entity, nothing depends on other entities: a partition holding all events of some entities
    computes exactly their part of the single-process result.
    """
    key = getattr(spec, role_of(prefix))
    base_snapshot = backend.from_arrow(base) if base is not None else None
    states = ops.entity_states(backend, frame, key=key, ts="_ts_us", label=spec.label, prefix=prefix,
                               since_us=since_us, base=base_snapshot)
    before = ops.states_before(backend, states, window_frame[key], window_frame["_ts_us"], base_snapshot,
                               config.ttl_seconds)
    return states, before


def role_of(prefix: str) -> str:
    return {v: k for k, v in ENTITY_PREFIXES.items()}[prefix]


def state_columns(spec: DatasetSpec) -> list[str]:
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


LABEL_MOMENTS = "_label"  # the labels' entry among ``stats_moments``' (a feature column never starts with _)


def stats_moments(config: FeatureConfig, spec: DatasetSpec, events: pa.Table) -> dict[str, Moments]:
    """What the first state's statistics are computed from, mergeable across partitions of ``events``
    (exact sums: one process and a Dask cluster get the same floats, see ``recloop.features.moments``)."""
    moments = {f.column: Moments.of(_numeric_values(np, f, events[f.column])) for f in config.numeric}
    moments[LABEL_MOMENTS] = Moments.of(events[spec.label].cast(pa.float64()).to_numpy())
    return moments


def stats_from_moments(config: FeatureConfig, moments: dict[str, Moments]) -> dict:
    """Statistics stored once, with the first state, so the model's inputs keep one scale afterwards."""
    numeric = {f.column: {"mean": moments[f.column].mean(), "std": moments[f.column].std()} for f in config.numeric}
    return {"prior_ctr": moments[LABEL_MOMENTS].mean(), "numeric": numeric}


def initial_stats(config: FeatureConfig, spec: DatasetSpec, events: pa.Table) -> dict:
    """``stats_from_moments`` of all ``events`` (the single-process job's)."""
    return stats_from_moments(config, stats_moments(config, spec, events))


def admission_counted(config: FeatureConfig, spec: DatasetSpec) -> list[CategoricalFeature]:
    """The entity-key vocabularies whose ids are out of vocabulary in a window's rows before their
    ``min_count``-th sighting (``recloop.features.job``): vocabulary (not hashed) keys with ``min_count > 1``."""
    return [f for f in config.categorical
            if not f.hash_buckets and f.min_count > 1 and f.column in (spec.user_key, spec.item_key)]


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
