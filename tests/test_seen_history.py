"""The lake's "already interacted" history (``recloop.features.seen``): its bounds as a pure function, the
file the feature job publishes (built whole or merged with the events since, the same either way), and
serving's reader, which reloads a replaced file and says when there is none."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.seen import (
    SeenConfig,
    SeenHistory,
    build_seen,
    history_lists,
    interactions,
    read_seen,
    seen_items,
    seen_table,
    write_seen,
)
from recloop.features.state import StateStore
from recloop.ingest import lake
from recloop.schema import load_spec
from recloop.simulate import WorldConfig

DAY_US = 86_400 * 1_000_000
T0 = int(datetime(2026, 1, 1, tzinfo=UTC).timestamp() * 1_000_000)


def events(rows: list[tuple[float, int, int, int]], user: str = "user_id", item: str = "item_id",
           ts: str = "ts", label: str = "label") -> pa.Table:
    """(day, user, item, label) rows as lake events under the given column names."""
    days, users, items, labels = zip(*rows, strict=True)
    return pa.table({
        ts: pa.array([T0 + int(d * DAY_US) for d in days], pa.timestamp("us", tz="UTC")),
        label: pa.array(labels, pa.int8()),
        user: pa.array(users, pa.int64()),
        item: pa.array(items, pa.int64()),
    })


@pytest.fixture(scope="module")
def synthetic():
    return load_spec("synthetic")


def as_lists(seen: dict) -> dict:
    return {user: items.tolist() for user, items in seen.items()}


def test_only_clicks_before_the_time_count_each_item_once_newest_first(synthetic):
    log = events([(0, 1, 10, 1), (1, 1, 11, 1), (2, 1, 12, 0), (3, 1, 10, 1), (3, 2, 10, 1),
                  (4, 1, 13, 1), (5, 3, 14, 1)])
    seen = seen_items(log, synthetic, T0 + 4 * DAY_US)
    # 10 twice (its newest time, day 3, puts it first); 12 was not clicked; day 4 and after are not history yet
    assert as_lists(seen) == {1: [10, 11], 2: [10]}


def test_every_interaction_counts_when_configured(synthetic):
    log = events([(0, 1, 10, 1), (1, 1, 12, 0)])
    assert as_lists(seen_items(log, synthetic, T0 + 2 * DAY_US, SeenConfig(every_interaction=True))) == \
        {1: [12, 10]}


def test_each_user_keeps_only_the_newest_items_within_the_look_back(synthetic):
    rng = np.random.default_rng(0)
    rows = [(float(d), int(u), int(i), 1) for d, u, i in zip(rng.uniform(0, 30, 2000), rng.zipf(1.5, 2000) % 20,
                                                            rng.zipf(1.3, 2000) % 300, strict=True)]
    before = T0 + 30 * DAY_US
    config = SeenConfig(max_items=7, lookback_days=10)
    seen = seen_items(events(rows), synthetic, before, config)
    newest: dict[int, dict[int, int]] = {}  # the rule written out: user → item → newest time in the look-back
    for day, user, item, _ in rows:
        t = T0 + int(day * DAY_US)
        if before - 10 * DAY_US <= t < before:
            newest.setdefault(user, {})[item] = max(t, newest.get(user, {}).get(item, t))
    expected = {user: [i for i, _ in sorted(items.items(), key=lambda p: (-p[1], p[0]))[:7]]
                for user, items in newest.items()}
    assert as_lists(seen) == expected
    assert max(len(items) for items in seen.values()) == 7  # the bound binds for the heavy users


def test_the_spec_names_the_keys(tmp_path: Path):
    from ratings_log import SPEC

    (tmp_path / "ratings.yaml").write_text(SPEC)
    spec = load_spec(tmp_path / "ratings.yaml")
    log = events([(0, 5, 50, 1), (1, 6, 51, 0)], user="customer", item="product", ts="rated_at", label="liked")
    assert as_lists(seen_items(log, spec, T0 + 2 * DAY_US)) == {5: [50]}
    assert seen_table(log, spec, T0 + 2 * DAY_US).column_names == ["customer", "product", "last_us"]


def test_bounds_are_checked():
    with pytest.raises(ValueError):
        SeenConfig(max_items=-1)
    with pytest.raises(ValueError):
        SeenConfig(lookback_days=0)


# --- the file and its reader ----------------------------------------------------------------------------------


def test_serving_reads_the_file_reloads_a_new_one_and_says_when_there_is_none(tmp_path: Path, synthetic):
    path = tmp_path / "seen.parquet"
    history = SeenHistory(path)
    assert history.items(1) is None and "no history" in history.missing
    log = events([(0, 1, 10, 1), (1, 1, 11, 1), (1, 4, 40, 1)])
    write_seen(path, seen_table(log, synthetic, T0 + 2 * DAY_US), synthetic, T0 + 2 * DAY_US, SeenConfig())
    assert history.items(1).tolist() == [11, 10] and history.items(4).tolist() == [40]
    assert history.items(2).tolist() == [] and history.items(10**12).tolist() == []
    write_seen(path, seen_table(log, synthetic, T0 + DAY_US), synthetic, T0 + DAY_US, SeenConfig())
    assert history.items(1).tolist() == [10] and history.items(4).tolist() == []  # the replaced file
    assert history.reloads == 2 and history.as_of_us == T0 + DAY_US
    path.write_bytes(b"not parquet")
    assert history.items(1).tolist() == [10]  # a broken file keeps the history read before it
    assert not list(tmp_path.glob(".*.tmp"))  # written aside and renamed


def test_the_feature_job_publishes_the_history_merged_runs_equal_one_whole_run(tmp_path_factory, lake_factory,
                                                                                 synthetic):
    world = WorldConfig(seed=3, days=3, events_per_day=1500)
    settings = lake_factory(tmp_path_factory.mktemp("seen"), world, features=False)
    config = FeatureConfig.for_spec(synthetic)
    layout = FeatureLayout.for_settings(settings)
    first = build_features(settings, synthetic, config, end=datetime(2026, 1, 2, tzinfo=UTC))
    assert first.seen_users and layout.seen.is_file()
    second = build_features(settings, synthetic, config)  # from the first file and the events since
    published = read_seen(layout.seen)
    store = StateStore(layout.state)
    as_of = store.as_of_us(store.latest_version())
    assert published.as_of_us == as_of > T0 + DAY_US and second.seen_users > first.seen_users
    whole = seen_table(lake.read_window(settings, synthetic, None, None), synthetic, as_of,
                       SeenConfig.for_settings(settings))
    assert published.table.replace_schema_metadata(None).equals(whole)
    rebuilt = build_seen(settings, synthetic, tmp_path_factory.mktemp("whole") / "seen.parquet", as_of,
                         SeenConfig.for_settings(settings))  # no previous file: the whole look-back
    assert rebuilt.table.equals(whole)


# --- the derived history (``DatasetSpec.history``) ---------------------------------------------------------


def test_each_rows_history_is_the_seen_rule_just_before_it_cut_and_oldest_first(synthetic):
    rng = np.random.default_rng(5)
    n = 400  # a few users, few items: repeats, ties in time (whole hours) and a look-back that drops some
    log = events([(float(d), int(u), int(i), int(lab)) for d, u, i, lab in zip(
        np.round(rng.uniform(0, 30, n) * 24) / 24, rng.integers(1, 6, n), rng.integers(100, 130, n),
        rng.random(n) < 0.6, strict=True)])
    config = SeenConfig(max_items=4, lookback_days=7.0)
    times = log["ts"].cast(pa.int64()).to_numpy()
    users = log["user_id"].to_numpy()
    lists = history_lists(interactions(log, synthetic, config), synthetic, users, times, 4, 7.0).to_pylist()
    lengths = set()
    for row in range(n):
        expected = seen_items(log, synthetic, int(times[row]), config).get(int(users[row]), np.zeros(0))
        assert lists[row] == expected.tolist()[::-1], row  # the seen rule at its time, oldest first
        lengths.add(len(lists[row]))
    assert lengths >= {0, 4} and len(lengths) > 2  # empty, cut at 4, and in between all occur


def test_a_derived_history_is_built_into_the_training_rows_and_served_the_same(tmp_path_factory, lake_factory,
                                                                              synthetic):
    """The feature job derives the spec's history from the lake (the newest items before each row, through
    the item vocabulary); serving derives it from the published file as of the job's run; a request may not
    give it."""
    from recloop.features.online import DeferredOnline, RequestError, RequestFeatures, online_reader
    from recloop.schema import DatasetSpec, HistorySpec

    world = WorldConfig(seed=6, days=2, events_per_day=1500)
    settings = lake_factory(tmp_path_factory.mktemp("derived"), world, features=False)
    spec = DatasetSpec.model_validate({**synthetic.model_dump(), "history": HistorySpec(name="liked", items=5)})
    assert spec.version != synthetic.version and load_spec("synthetic").version == synthetic.version
    config = FeatureConfig.for_spec(spec)
    build_features(settings, spec, config)
    layout = FeatureLayout.for_settings(settings)
    training = pa.concat_tables(pq.read_table(f) for f in sorted(layout.training.glob("*.parquet")))
    assert "m_liked" in training.column_names
    schema = json.loads(layout.schema.read_text())
    assert schema["multi_hot"]["m_liked"]["vocabulary"] == "item_id"
    state = StateStore(layout.state).latest()
    vocabulary = state.vocabularies["item_id"]
    whole = lake.read_window(settings, spec, None, None)
    seen_config = SeenConfig.for_settings(settings, spec)
    times = training["ts"].cast(pa.int64()).to_numpy()
    users = training["user_id"].to_numpy()
    checked = non_empty = 0
    for row in np.random.default_rng(0).choice(training.num_rows, 150, replace=False):
        raw = seen_items(whole, spec, int(times[row]), seen_config).get(int(users[row]), np.zeros(0, np.int64))
        expected = vocabulary.lookup_arrow(pa.array(np.asarray(raw[:5][::-1], dtype=np.int64))).to_pylist()
        assert training["m_liked"][int(row)].as_py() == expected, row
        checked, non_empty = checked + 1, non_empty + bool(expected)
    assert checked == 150 and non_empty > 50  # most rows' users had clicked before

    features = RequestFeatures(settings, spec, config, DeferredOnline(lambda: online_reader(settings)))
    as_of = StateStore(layout.state).as_of_us(StateStore(layout.state).latest_version())
    user = int(users[-1])
    row = features.request_rows(user, {"device": "ios"}, as_of, ["m_liked"])
    newest = seen_items(whole, spec, as_of, seen_config)[user][:5][::-1]
    assert row["m_liked"][0].as_py() == vocabulary.lookup_arrow(pa.array(np.asarray(newest, dtype=np.int64))).to_pylist()
    assert len(newest) == 5
    with pytest.raises(RequestError, match="derived from the lake"):
        features.request_rows(user, {"liked": [1, 2]}, as_of, ["m_liked"])


def test_a_derived_history_needs_both_keys_and_a_name_of_its_own(synthetic):
    from pydantic import ValidationError

    from recloop.schema import DatasetSpec

    raw = synthetic.model_dump()
    with pytest.raises(ValidationError, match="a name of its own"):
        DatasetSpec.model_validate({**raw, "history": {"name": "device"}})
    with pytest.raises(ValidationError, match="between 1 and 500"):
        DatasetSpec.model_validate({**raw, "history": {"items": 0}})
    keyless = [c for c in raw["columns"] if c["role"] != "user_key"]
    with pytest.raises(ValidationError, match="needs a user_key"):
        DatasetSpec.model_validate({**raw, "columns": keyless, "history": {}})
