"""Feature ops against brute-force references on small random data (pandas backend)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from recloop.features import ops
from recloop.features.backend import BackendUnavailable, get_backend
from recloop.features.definition import _map_lists
from recloop.features.vocab import FIRST_INDEX, NULL_INDEX, OOV_INDEX, Vocabulary

PANDAS = get_backend("pandas")
US = ops.US


def random_events(seed: int, n: int = 400, keys: int = 12, hours: float = 60.0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    ts = np.sort(rng.integers(0, int(hours * 3600 * US), n))
    ts[5] = ts[4]  # ties at the same microsecond
    # Power-law keys: a few entities take most of the events.
    key = np.minimum(rng.zipf(1.6, n) - 1, keys - 1)
    return pd.DataFrame({"k": key, "_ts_us": ts + 1_700_000_000 * US, "y": (rng.random(n) < 0.3).astype(int)})


def brute_force_state(events: pd.DataFrame, key, t: int, since: int | None) -> dict[str, float]:
    """The entity's statistics after all of its events at or before ``t``."""
    mine = events[(events["k"] == key) & (events["_ts_us"] <= t)]
    day = mine[mine["_ts_us"] > t - 86400 * US]
    hour = mine[mine["_ts_us"] > t - 3600 * US]
    counted = mine if since is None else mine[mine["_ts_us"] >= since]
    return {"events_1h": len(hour), "events_24h": len(day), "clicks_24h": int(day["y"].sum()),
            "events_total": len(counted), "clicks_total": int(counted["y"].sum()), "last_seen": t / US}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_entity_states_match_brute_force(seed: int):
    events = random_events(seed)
    states = ops.entity_states(PANDAS, events, key="k", ts="_ts_us", label="y", prefix="u", since_us=None, base=None)
    frame = states.frame
    # One state row per (key, time) with events, and nothing else.
    assert len(frame) == len(events.drop_duplicates(["k", "_ts_us"]))
    for row in frame.itertuples(index=False):
        expected = brute_force_state(events, row.key, row.ts, None)
        got = {name: getattr(row, f"u_{name}") for name in expected}
        assert got == pytest.approx(expected), (row.key, row.ts)


def test_states_carry_over_from_a_base_snapshot():
    events = random_events(3)
    split = int(events["_ts_us"].iloc[250])
    whole = ops.entity_states(PANDAS, events, key="k", ts="_ts_us", label="y", prefix="u", since_us=None, base=None)
    first = ops.entity_states(PANDAS, events[events["_ts_us"] < split], key="k", ts="_ts_us", label="y", prefix="u",
                              since_us=None, base=None)
    base = first.frame.sort_values("ts").drop_duplicates("key", keep="last").drop(columns="ts")
    later = events[events["_ts_us"] >= split - 86400 * US]  # 24 h of look-back for the windowed counts
    second = ops.entity_states(PANDAS, later, key="k", ts="_ts_us", label="y", prefix="u", since_us=split, base=base)
    expected = whole.frame[whole.frame["ts"] >= split].reset_index(drop=True)
    pd.testing.assert_frame_equal(second.frame.reset_index(drop=True), expected, check_dtype=False)


def test_states_before_is_strictly_earlier_and_respects_ttl():
    events = random_events(4)
    states = ops.entity_states(PANDAS, events, key="k", ts="_ts_us", label="y", prefix="u", since_us=None, base=None)
    before = ops.states_before(PANDAS, states, events["k"], events["_ts_us"], None, ttl_seconds=6 * 3600)
    for i, row in enumerate(events.itertuples(index=False)):
        earlier = events[(events["k"] == row.k) & (events["_ts_us"] < row._1)]
        if earlier.empty or row._1 - earlier["_ts_us"].max() > 6 * 3600 * US:
            assert np.isnan(before["u_events_total"].iloc[i])
            continue
        expected = brute_force_state(events, row.k, int(earlier["_ts_us"].max()), None)
        assert before["u_events_24h"].iloc[i] == expected["events_24h"]
        assert before["u_clicks_total"].iloc[i] == expected["clicks_total"]  # never its own label
        assert before["u_last_seen"].iloc[i] == pytest.approx(expected["last_seen"])


def test_windows_of_any_span_and_entity_count_do_not_overflow():
    """10k entities over 22 years (a real ratings log): a packed (entity, µs) int64 key overflows there; the
    states and the as-of lookup must still match brute force, including the 1 h / 24 h windows."""
    rng = np.random.default_rng(7)
    keys = 10_000
    years = 22 * 365 * 86400 * US
    start = 800_000_000 * US
    key = np.concatenate([np.arange(keys), rng.integers(0, keys, 2000), np.full(4, 17)])
    ts = np.concatenate([start + rng.integers(0, years, keys), start + rng.integers(0, years, 2000),
                         start + years + np.array([0, 10, 3600 * US, 3600 * US + 1])])
    events = pd.DataFrame({"k": key, "_ts_us": ts, "y": (rng.random(len(key)) < 0.4).astype(int)})
    states = ops.entity_states(PANDAS, events, key="k", ts="_ts_us", label="y", prefix="u", since_us=None,
                               base=None)
    frame = states.frame
    assert len(frame) == len(events.drop_duplicates(["k", "_ts_us"]))
    for row in frame[frame["key"].isin([17, 5, 9_999])].itertuples(index=False):
        expected = brute_force_state(events, row.key, row.ts, None)
        assert {name: getattr(row, f"u_{name}") for name in expected} == pytest.approx(expected), (row.key, row.ts)
    # The as-of lookup over the same span: entity 17's state just after its last events.
    query_keys = pd.Series([17, 17, 9_999])
    query_ts = np.array([start + years + 3600 * US + 2, start + years + 5, start + years + 2 * years])
    found = ops.states_before(PANDAS, states, query_keys, query_ts, None, ttl_seconds=30 * 365 * 86400)
    assert found["u_events_total"].iloc[0] == (events["k"] == 17).sum()
    assert found["u_events_total"].iloc[1] == ((events["k"] == 17) & (events["_ts_us"] < query_ts[1])).sum()
    assert np.isnan(found["u_events_total"].iloc[2])  # beyond the TTL


def test_entity_dense_defaults_for_unknown_entities():
    nan = np.array([np.nan])
    stats = {f"u_{name}": nan for name in ops.STAT_NAMES}
    dense = ops.entity_dense(np, stats, "u", np.array([0]), prior=0.1, smoothing=20, recency_cap_seconds=100.0)
    assert dense["u_ctr"][0] == pytest.approx(0.1) and dense["u_ctr_24h"][0] == pytest.approx(0.1)
    assert dense["u_recency"][0] == pytest.approx(np.log1p(100.0)) and dense["u_events_total"][0] == 0


def test_hashing_is_deterministic_in_range_and_spreads():
    values = np.arange(100_000, dtype=np.int64)
    buckets = ops.hash_bucket(np, values, 1000)
    assert buckets.min() >= 2 and buckets.max() < 1002
    assert np.array_equal(buckets, ops.hash_bucket(np, values.copy(), 1000))
    counts = np.bincount(buckets - 2, minlength=1000)
    assert counts.min() > 50 and counts.max() < 160  # ~100 per bucket
    assert ops.hash_bucket(np, np.array([5]), 10, null_mask=np.array([True]))[0] == 0
    crossed = ops.hashed_cross(np, np.array([2, 2, 3]), np.array([7, 8, 7]), 1 << 14)
    assert len(set(crossed.tolist())) == 3 and (crossed >= 2).all()


def test_cyclic_time():
    monday_6am = 1_767_600_000 * US  # 2026-01-05 08:00 UTC is a Monday
    features = ops.cyclic_time(np, np.array([monday_6am]))
    hour = 8.0
    assert features["hour_sin"][0] == pytest.approx(np.sin(2 * np.pi * hour / 24))
    assert features["dow_sin"][0] == pytest.approx(0.0) and features["dow_cos"][0] == pytest.approx(1.0)


def test_vocabulary_is_append_only_with_a_frequency_threshold():
    vocab = Vocabulary.empty("item", min_count=2, value_type=pa.int64())
    first = vocab.update(pa.array([10, 10, 11, 12, 12, None]))
    assert first.admitted().to_pydict() == {"value": [10, 12], "index": [2, 3]}
    second = first.update(pa.array([11, 13, 13, 9, 9]))  # 11 reaches 2 across windows
    assert second.admitted().to_pydict() == {"value": [10, 12, 9, 11, 13], "index": [2, 3, 4, 5, 6]}
    lookup = second.lookup_arrow(pa.array([12, 10, 14, None, 11])).to_pylist()
    assert lookup == [3, 2, OOV_INDEX, NULL_INDEX, 5]
    assert second.size == 7 and first.lookup_arrow(pa.array([11])).to_pylist() == [OOV_INDEX]


@pytest.mark.parametrize("kind", ["int64", "int32 ids into an int64 vocabulary", "string", "large string batch"])
def test_every_lookup_path_gives_the_index_arrows_index_in_gives(kind):
    """Integer ids by binary search, a request's strings through a dict, long string batches through Arrow:
    the same indices (admitted, out of vocabulary, not yet admitted, null) as ``index_in`` over the admitted."""
    import pyarrow.compute as pc

    rng = np.random.default_rng(3)
    ids = rng.integers(-50, 5000, 3000)
    strings = kind.endswith("string") or kind.endswith("batch")
    to_values = (lambda a: pa.array([None if v % 97 == 0 else f"{v:08x}" for v in a])) if strings else \
        (lambda a: pa.array([None if v % 97 == 0 else int(v) for v in a], pa.int64()))
    vocab = Vocabulary.empty("c", min_count=2, value_type=pa.string() if strings else pa.int64())
    vocab = vocab.update(to_values(ids))
    asked = to_values(np.append(rng.integers(-60, 5200, 5000 if kind == "large string batch" else 60), 97))  # a null
    if kind.startswith("int32"):
        asked = asked.cast(pa.int32())
    admitted = vocab.admitted()
    position = pc.index_in(asked.cast(admitted["value"].type), value_set=admitted["value"].combine_chunks())
    expected = pc.if_else(pc.is_null(asked), NULL_INDEX,
                          pc.fill_null(pc.take(admitted["index"].combine_chunks(), position), OOV_INDEX))
    got = vocab.lookup_arrow(asked)
    assert got.type == pa.int64() and got.to_pylist() == expected.to_pylist()
    assert {NULL_INDEX, OOV_INDEX} <= set(got.to_pylist()) and max(got.to_pylist()) >= FIRST_INDEX
    empty = Vocabulary.empty("c", value_type=vocab.table.schema.field("value").type)
    assert set(empty.lookup_arrow(asked).to_pylist()) == {NULL_INDEX, OOV_INDEX}


def test_multi_hot_lists_map_through_the_vocabulary_and_keep_the_most_recent():
    vocab = Vocabulary.empty("item", value_type=pa.int64()).update(pa.array([5, 6, 7]))
    lists = pa.chunked_array([pa.array([[5, 6, 99], [], None, [7, 7, 6, 5, 6]], pa.list_(pa.int64()))])
    mapped = _map_lists(lists, vocab, max_length=3).to_pylist()
    assert mapped == [[2, 3, OOV_INDEX], [], [], [3, 2, 3]]


def test_backend_auto_never_fails_and_cudf_says_why():
    assert get_backend("auto").name in ("pandas", "cudf")
    try:
        import cupy  # noqa: F401
    except ImportError:
        with pytest.raises(BackendUnavailable, match="needs a CUDA GPU"):
            get_backend("cudf")


def test_moments_are_exact_sums_so_any_split_gives_the_same_floats():
    """The first state's scale from one process (all values) and from a Dask cluster (per-file sums merged)."""
    import numpy as np

    from recloop.features.moments import Moments

    rng = np.random.default_rng(7)
    values = np.r_[rng.lognormal(0, 4, 20_001) * np.sign(rng.normal(size=20_001)), np.nan, np.inf, 1e-300, -3.5]
    whole = Moments.of(values)
    for pieces in (2, 7, 64):
        parts = sum((Moments.of(p) for p in np.array_split(values, pieces)), Moments())
        assert parts == whole and parts.mean() == whole.mean() and parts.std() == whole.std()
    finite = values[np.isfinite(values)]
    assert whole.count == len(finite)
    assert abs(whole.mean() - finite.mean()) <= 1e-12 * abs(finite).max()
    assert abs(whole.std() - finite.std()) <= 1e-9 * finite.std()


def test_counts_on_a_log_scale_keep_their_sign_and_the_shipped_criteo_spec_asks_for_it():
    from recloop.features.config import FeatureConfig
    from recloop.schema import load_spec

    counts = np.array([-3.0, -1.0, 0.0, 1.0, 9.0, 50_000.0, np.nan])
    signed = ops.numeric_transform(np, counts, log1p=True)
    assert np.allclose(signed[:6], [-np.log(4), -np.log(2), 0.0, np.log(2), np.log(10), np.log(50_001)])
    assert np.isnan(signed[6])
    # a column bounded at zero keeps its clip and plain log1p
    assert np.allclose(ops.numeric_transform(np, np.array([-1.0, 3.0]), clip_min=0.0, log1p=True), [0.0, np.log(4)])
    # Criteo's I1-I13 may hold -1 (their spec bounds them by 32 bits), so "auto" would leave them linear: one
    # count of 50,000 then sits ~60 standard deviations out. The shipped spec says scale: log.
    numeric = FeatureConfig.for_spec(load_spec("criteo")).numeric
    assert len(numeric) == 13 and all(f.log1p and f.clip_min is None for f in numeric)


def test_scale_is_a_numeric_column_setting():
    from pydantic import ValidationError

    from recloop.schema import ColumnSpec

    column = ColumnSpec(name="delta", role="numeric", dtype="int64", min=-10, max=10)
    assert not column.log_scale and ColumnSpec(name="n", role="numeric", dtype="int64", min=0, max=9).log_scale
    assert ColumnSpec(name="delta", role="numeric", dtype="int64", min=-10, max=10, scale="log").log_scale
    assert not ColumnSpec(name="n", role="numeric", dtype="int64", min=0, max=9, scale="linear").log_scale
    with pytest.raises(ValidationError, match="scale only applies to numeric columns"):
        ColumnSpec(name="c", role="categorical", dtype="string", scale="log")
