"""Feature operations: pure functions over arrays and frames, identical on pandas/numpy and cuDF/cupy.

Entity statistics follow one rule that makes training and serving agree:

- An entity's **state row** at time t holds its statistics *after* all of its events at or before t:
  events and clicks in the last hour and day, all-time totals, and when it was last seen.
- A **training row** for an event at time t sees the entity's state strictly *before* t (its latest
  state row with timestamp < t): never its own label, never the future.
- **Serving** reads the latest state row from the online store, which is the same rule applied "now".

So a Feast point-in-time lookup at ``t - 1µs`` returns exactly what the training rows hold.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from recloop.features.backend import FrameBackend
from recloop.hours import US

_MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# --- hashing ---------------------------------------------------------------------------------------------


def splitmix64(xp: Any, values: Any) -> Any:
    """A well-mixed 64-bit hash of integers, the same on numpy and cupy (wrapping uint64 arithmetic)."""
    z = values.astype(xp.uint64) + xp.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> xp.uint64(30))) * xp.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> xp.uint64(27))) * xp.uint64(0x94D049BB133111EB)
    return z ^ (z >> xp.uint64(31))


def hash_bucket(xp: Any, values: Any, buckets: int, null_mask: Any = None) -> Any:
    """Integer ids hashed into ``2 .. buckets+1`` (0 = null, as in vocabularies)."""
    with np.errstate(over="ignore"):
        out = (splitmix64(xp, values) % xp.uint64(buckets)).astype(xp.int64) + 2
    if null_mask is not None:
        out = xp.where(null_mask, 0, out)
    return out


def hashed_cross(xp: Any, left: Any, right: Any, buckets: int) -> Any:
    """Two index columns (vocabulary indices) crossed into ``2 .. buckets+1``."""
    with np.errstate(over="ignore"):
        combined = splitmix64(xp, left) ^ (splitmix64(xp, right) * xp.uint64(0x9E3779B97F4A7C15))
        return (splitmix64(xp, combined) % xp.uint64(buckets)).astype(xp.int64) + 2


# --- event-level transforms ------------------------------------------------------------------------------


def cyclic_time(xp: Any, ts_us: Any) -> dict[str, Any]:
    """Hour of day and day of week (Monday = 0) as points on circles, from UTC microseconds."""
    seconds = ts_us // US
    hour = (seconds % 86400) / 3600.0
    weekday = ((seconds // 86400) + 3) % 7  # 1970-01-01 was a Thursday
    return {
        "hour_sin": xp.sin(2 * np.pi * hour / 24), "hour_cos": xp.cos(2 * np.pi * hour / 24),
        "dow_sin": xp.sin(2 * np.pi * weekday / 7), "dow_cos": xp.cos(2 * np.pi * weekday / 7),
    }


def numeric_transform(xp: Any, values: Any, *, clip_min=None, clip_max=None, log1p=False) -> Any:
    """Clip then log1p (NaN stays NaN). The log is signed, sign(x) · log1p(|x|) (log1p itself on values at or
    above zero): a count with a few sentinel -1s keeps them apart from 0 and from the positives."""
    out = values.astype(xp.float64)
    if clip_min is not None or clip_max is not None:
        out = xp.clip(out, clip_min if clip_min is not None else -xp.inf, clip_max if clip_max is not None else xp.inf)
    return xp.sign(out) * xp.log1p(xp.abs(out)) if log1p else out


def standardize(xp: Any, values: Any, mean: float, std: float) -> Any:
    """(x - mean) / std with stored statistics; a missing value becomes the mean (0)."""
    out = (values - mean) / (std if std > 0 else 1.0)
    return xp.where(xp.isnan(out), 0.0, out)


# --- entity state ----------------------------------------------------------------------------------------

STAT_NAMES = ("events_1h", "events_24h", "clicks_24h", "events_total", "clicks_total", "last_seen")


@dataclass(frozen=True)
class EntityStates:
    """State rows of one entity kind, plus the sorted keys used to look states up.

    ``frame`` has columns ``key``, ``ts`` (µs), then ``<prefix>_<stat>`` for each of ``STAT_NAMES``;
    one row per (key, timestamp) that had events, sorted by key then time.
    """

    prefix: str
    frame: Any


def _group_codes(xp: Any, sorted_keys: Any) -> Any:
    """0, 0, 1, 1, 1, 2, …: a run number per distinct key in an already sorted key column."""
    change = xp.concatenate([xp.zeros(1, dtype=bool), sorted_keys[1:] != sorted_keys[:-1]])
    return xp.cumsum(change)


def entity_states(
    backend: FrameBackend, events: Any, *, key: str, ts: str, label: str, prefix: str,
    since_us: int | None, base: Any | None,
) -> EntityStates:
    """State rows for every (entity, timestamp) with events at or after ``since_us``.

    Args:
        events: frame with the entity ``key``, ``ts`` (int64 µs) and 0/1 ``label``; it must hold every
            event from 24 hours before ``since_us`` on, so windowed counts are complete.
        since_us: where the carried-over totals in ``base`` end (None: ``events`` hold all history).
        base: the latest state row per entity before ``since_us`` (columns ``key`` and the stats), whose
            totals are added to the ones counted here. None for none.
    """
    xp = backend.arrays
    frame = events[[key, ts, label]].sort_values([key, ts]).reset_index(drop=True)
    keys_sorted = backend.values(frame[key])
    times = backend.values(frame[ts]).astype(xp.int64)
    labels = backend.values(frame[label]).astype(xp.int64)
    n = len(times)
    if n == 0:
        empty = backend.frames.DataFrame({"key": frame[key], "ts": frame[ts]})
        for stat in STAT_NAMES:
            empty[f"{prefix}_{stat}"] = backend.frames.Series([], dtype="float64" if stat == "last_seen" else "int64")
        return EntityStates(prefix, empty)
    codes = _group_codes(xp, keys_sorted).astype(xp.int64)
    t_min = int(times.min())
    since = t_min if since_us is None else max(since_us, t_min)
    # Binary search on (entity, time) as one sorted int64: time enters as its rank among every instant
    # compared (event times, their window starts, ``since``), never as microseconds, so the key is below
    # entities × 4·events whatever the span (a µs key overflowed on 10k items × 22 years).
    instants = xp.unique(xp.concatenate([times, times - 3600 * US, times - 86400 * US,
                                         xp.full(1, since, dtype=xp.int64)]))
    width = int(len(instants))

    def key_at(moments: Any) -> Any:
        return codes * width + xp.searchsorted(instants, moments, side="left").astype(xp.int64)

    composite = key_at(times)
    upper = xp.searchsorted(composite, composite, side="right")  # includes ties at the same time
    cum_labels = xp.concatenate([xp.zeros(1, dtype=xp.int64), xp.cumsum(labels)])

    def window(seconds: int) -> tuple[Any, Any]:
        lower = xp.searchsorted(composite, key_at(times - seconds * US), side="right")
        return upper - lower, cum_labels[upper] - cum_labels[lower]

    events_1h, _ = window(3600)
    events_24h, clicks_24h = window(86400)
    first = xp.searchsorted(composite, key_at(xp.full(n, since, dtype=xp.int64)), side="left")
    events_total = upper - first
    clicks_total = cum_labels[upper] - cum_labels[first]

    # One state row per (key, time): the last row of each run of ties, at or after ``since``.
    last_of_run = xp.concatenate([composite[1:] != composite[:-1], xp.ones(1, dtype=bool)])
    keep = last_of_run & (times >= since)
    states = frame[[key]][keep].rename(columns={key: "key"}).reset_index(drop=True)
    states["ts"] = times[keep]
    states[f"{prefix}_events_1h"] = events_1h[keep]
    states[f"{prefix}_events_24h"] = events_24h[keep]
    states[f"{prefix}_clicks_24h"] = clicks_24h[keep]
    states[f"{prefix}_events_total"] = events_total[keep]
    states[f"{prefix}_clicks_total"] = clicks_total[keep]
    states[f"{prefix}_last_seen"] = times[keep].astype(xp.float64) / US
    if base is not None and len(base):
        carried = base[["key", f"{prefix}_events_total", f"{prefix}_clicks_total"]].rename(
            columns={f"{prefix}_events_total": "_events", f"{prefix}_clicks_total": "_clicks"})
        states = states.merge(carried, on="key", how="left")
        states[f"{prefix}_events_total"] += states["_events"].fillna(0).astype("int64")
        states[f"{prefix}_clicks_total"] += states["_clicks"].fillna(0).astype("int64")
        states = states.drop(columns=["_events", "_clicks"])
    states = states.sort_values(["key", "ts"]).reset_index(drop=True)
    return EntityStates(prefix, states)


def states_before(
    backend: FrameBackend, states: EntityStates, keys: Any, times_us: Any, base: Any | None, ttl_seconds: int
) -> Any:
    """For each (key, time), the entity's latest state strictly before that time, or nulls if none.

    Looks in ``states`` first, then in ``base`` (the carried-over latest state per entity). A state
    older than ``ttl_seconds`` counts as missing (the same rule as the Feast views' TTL).

    Returns:
        A frame aligned with ``keys`` with the stat columns (floats, NaN where missing).
    """
    frames = backend.frames
    prefix = states.prefix
    stat_columns = [f"{prefix}_{s}" for s in STAT_NAMES]
    query = frames.DataFrame({"key": keys, "ts": times_us})
    query["_row"] = np.arange(len(query)) if backend.name == "pandas" else backend.arrays.arange(len(query))
    candidates = states.frame[["key", "ts", *stat_columns]]
    if base is not None and len(base):
        carried = base[["key", *stat_columns]].copy()
        carried["ts"] = (carried[f"{prefix}_last_seen"] * US).round().astype("int64")
        candidates = frames.concat([carried[["key", "ts", *stat_columns]], candidates], ignore_index=True)
    # As-of join by binary search on (key rank, time): rank keys over both sides consistently.
    all_keys = frames.concat([candidates["key"], query["key"]], ignore_index=True)
    ranks = all_keys.rank(method="dense").astype("int64")
    xp = backend.arrays
    cand_rank = backend.values(ranks.iloc[: len(candidates)]).astype(xp.int64)
    query_rank = backend.values(ranks.iloc[len(candidates):]).astype(xp.int64)
    cand_ts = backend.values(candidates["ts"]).astype(xp.int64)
    query_ts = backend.values(query["ts"]).astype(xp.int64)
    # Times as their rank among all instants on both sides (not µs): the key cannot overflow at any span.
    instants = xp.unique(xp.concatenate([cand_ts, query_ts]))
    width = int(len(instants)) + 1
    cand_key = cand_rank * width + xp.searchsorted(instants, cand_ts).astype(xp.int64)
    order = xp.argsort(cand_key, kind="stable")
    cand_key_sorted = cand_key[order]
    query_key = query_rank * width + xp.searchsorted(instants, query_ts).astype(xp.int64)
    pos = xp.searchsorted(cand_key_sorted, query_key, side="left") - 1  # strictly earlier
    found = pos >= 0
    pos_clipped = xp.where(found, pos, 0)
    source = order[pos_clipped] if len(order) else pos_clipped
    if len(order):
        found = found & (cand_rank[source] == query_rank)
        found = found & ((query_ts - cand_ts[source]) <= ttl_seconds * US)
    out = frames.DataFrame({"_row": query["_row"]})
    for column in stat_columns:
        values = backend.values(candidates[column]).astype(xp.float64) if len(order) else xp.zeros(len(query))
        picked = values[source] if len(order) else values
        out[column] = xp.where(found, picked, xp.nan)
    return out.drop(columns=["_row"])


def entity_dense(xp: Any, stats: dict[str, Any], prefix: str, event_ts_us: Any, *, prior: float, smoothing: float,
                 recency_cap_seconds: float) -> dict[str, Any]:
    """Model inputs from an entity's raw state (NaN = unknown entity): the same code for training and serving.

    Returns float arrays: recency (log seconds since last seen), log counts over 1 h / 24 h / all time,
    smoothed CTR over 24 h, and the smoothed all-time CTR (target encoding).
    """
    def filled(name: str) -> Any:
        values = stats[f"{prefix}_{name}"]
        return xp.where(xp.isnan(values), 0.0, values)

    last_seen = stats[f"{prefix}_last_seen"]
    since = event_ts_us / US - last_seen
    since = xp.where(xp.isnan(since), recency_cap_seconds, xp.clip(since, 0.0, recency_cap_seconds))
    events_24h, events_total = filled("events_24h"), filled("events_total")
    return {
        f"{prefix}_recency": xp.log1p(since),
        f"{prefix}_events_1h": xp.log1p(filled("events_1h")),
        f"{prefix}_events_24h": xp.log1p(events_24h),
        f"{prefix}_events_total": xp.log1p(events_total),
        f"{prefix}_ctr_24h": (filled("clicks_24h") + smoothing * prior) / (events_24h + smoothing),
        f"{prefix}_ctr": (filled("clicks_total") + smoothing * prior) / (events_total + smoothing),
    }
