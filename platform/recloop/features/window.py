"""One window's features computed in one process: the plan decided before any event is read
(``WindowPlan``), what an engine returns (``WindowFeatures``), and the single-process engine
(``compute_window``). ``recloop.features.dask_engine`` computes the same ``WindowFeatures`` on a cluster;
``recloop.features.job`` plans windows, picks the engine and writes what it returns."""

from __future__ import annotations

from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc

from recloop.features import ops
from recloop.features.backend import FrameBackend
from recloop.features.config import FeatureConfig
from recloop.features.definition import (
    ENTITY_PREFIXES,
    entity_stage,
    initial_stats,
    state_columns,
    training_rows,
    update_vocabularies,
    vocabulary_features,
    vocabulary_values,
    with_event_time,
)
from recloop.features.state import FeatureState
from recloop.features.vocab import Vocabulary, count_values
from recloop.schema import DatasetSpec


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

    frame = backend.from_arrow(events.select(state_columns(spec)))
    window_frame = backend.from_arrow(window.select(state_columns(spec)))
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
