"""The lake's "already interacted" history (``recloop.features.seen``): its bounds as a pure function, the
file the feature job publishes (built whole or merged with the events since, the same either way), and
serving's reader, which reloads a replaced file and says when there is none."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.seen import (
    SeenConfig,
    SeenHistory,
    build_seen,
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
