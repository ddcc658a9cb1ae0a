"""The feature job over a real (small) lake: windows, state carry-over, leakage, bad input."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.state import FeatureStateError, StateStore
from recloop.features.vocab import OOV_INDEX
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig

SPEC = load_spec("synthetic")
CONFIG = FeatureConfig.for_spec(SPEC)
DAY2 = datetime(2026, 1, 2, tzinfo=UTC)
DAY3 = datetime(2026, 1, 3, tzinfo=UTC)


@pytest.fixture(scope="session")
def lake_home(tmp_path_factory, lake_factory) -> Path:
    """Three simulated days (sudden drift on the third: new item ids) ingested into a lake."""
    world = WorldConfig(seed=21, days=3, events_per_day=3000, drift="sudden", drift_day=2)
    return lake_factory(tmp_path_factory.mktemp("lake"), world, features=False).home


@pytest.fixture
def home(lake_home: Path, tmp_path: Path) -> Settings:
    shutil.copytree(lake_home, tmp_path / "home")
    return Settings(home=tmp_path / "home", frame_backend="pandas")


def read(settings: Settings, name: str) -> pa.Table:
    return ds.dataset(FeatureLayout.for_settings(settings).root / name, format="parquet").to_table()


def test_features_cover_every_event_once_with_the_schema(home: Settings):
    summary = build_features(home, SPEC, CONFIG)
    assert summary.rows == 9000 and summary.state_version == 1 and summary.hours_written == 72
    training = read(home, "training")
    assert training.num_rows == 9000 and len(set(training["event_id"].to_pylist())) == 9000
    schema = FeatureLayout.for_settings(home).schema.read_text()
    for column in ("d_user_ctr", "c_item_id", "m_history", "c_device_x_category"):
        assert column in training.column_names and column in schema
    dense = np.column_stack([training[c].to_numpy() for c in training.column_names if c.startswith("d_")])
    assert np.isfinite(dense).all()
    assert (read(home, "user_stats")["user_events_total"].to_numpy() >= 1).all()
    # training rows in the loader's encoding (TRAINING_PARQUET: LZ4, no dictionary pages)
    first = sorted((FeatureLayout.for_settings(home).root / "training").glob("*.parquet"))[0]
    chunks = [pq.ParquetFile(first).metadata.row_group(0).column(i)
              for i in range(pq.ParquetFile(first).metadata.num_columns)]
    # pyarrow names parquet's LZ4_RAW codec "LZ4" (Arrow's raw LZ4 block format)
    assert {c.compression for c in chunks} == {"LZ4"} and not any(c.has_dictionary_page for c in chunks)
    # ids as int32 (their tables fit: formats.id_dtype), one-hot and multi-hot alike
    written = pq.read_schema(first)
    assert all(written.field(c).type == pa.int32() for c in written.names if c.startswith("c_"))
    assert written.field("m_history").type.value_type == pa.int32()


def test_split_windows_give_the_same_entity_state_as_one_window(home: Settings, tmp_path: Path):
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    build_features(home, SPEC, CONFIG, end=DAY2)
    build_features(home, SPEC, CONFIG, end=datetime(2026, 1, 2, 7, tzinfo=UTC))
    build_features(home, SPEC, CONFIG)  # from the latest state to the end
    build_features(other, SPEC, CONFIG, end=DAY2)
    build_features(other, SPEC, CONFIG)
    for name, key in (("user_stats", "user_id"), ("item_stats", "item_id")):
        order = [(key, "ascending"), ("event_timestamp", "ascending")]
        assert read(home, name).sort_by(order).equals(read(other, name).sort_by(order)), name
    entity_dense = [c for c in read(home, "training").column_names if c.startswith(("d_user", "d_item"))]
    a = read(home, "training").sort_by("event_id")
    b = read(other, "training").sort_by("event_id")
    for column in entity_dense + ["d_price", "c_device", "c_country"]:
        np.testing.assert_allclose(a[column].to_numpy(), b[column].to_numpy(), rtol=1e-6, err_msg=column)
    assert len(StateStore(FeatureLayout.for_settings(home).state).versions()) == 3


def test_no_row_sees_its_own_label_or_the_future(home: Settings):
    build_features(home, SPEC, CONFIG)
    training = read(home, "training").to_pandas()
    events = ds.dataset(home.lake_events_dir, partitioning="hive").to_table().to_pandas()
    rng = np.random.default_rng(0)
    for i in rng.choice(len(training), 40, replace=False):
        row = training.iloc[i]
        past = events[(events["user_id"] == row["user_id"]) & (events["ts"] < row["ts"])]
        clicks, count = past["label"].sum(), len(past)
        prior, smoothing = StateStore(FeatureLayout.for_settings(home).state).latest().stats["prior_ctr"], 20.0
        assert row["d_user_ctr"] == pytest.approx((clicks + smoothing * prior) / (count + smoothing), rel=1e-5)
        assert row["d_user_events_total"] == pytest.approx(np.log1p(count), rel=1e-5)
        assert bool(row["user_is_new"]) == (count == 0)


def test_rerunning_a_window_changes_nothing(home: Settings):
    build_features(home, SPEC, CONFIG, end=DAY2)
    first = read(home, "training").sort_by("event_id")
    again = build_features(home, SPEC, CONFIG, start=datetime(2026, 1, 1, tzinfo=UTC), end=DAY2)
    assert again.state_version == 1  # no new version for a window already covered
    assert read(home, "training").sort_by("event_id").equals(first)


def test_new_ids_are_oov_until_admitted_and_tables_grow(home: Settings):
    first = build_features(home, SPEC, CONFIG, end=datetime(2026, 1, 2, 12, tzinfo=UTC))
    second = build_features(home, SPEC, CONFIG)
    assert second.vocabulary_sizes["item_id"] > first.vocabulary_sizes["item_id"]  # the new catalog wave
    store = StateStore(FeatureLayout.for_settings(home).state)
    old, new = store.load(1).vocabularies["item_id"], store.load(2).vocabularies["item_id"]
    kept = old.admitted()
    assert new.lookup_arrow(kept["value"]).to_pylist() == kept["index"].to_pylist()  # indices never move
    never_seen = pa.array([10**12], pa.int64())
    assert new.lookup_arrow(never_seen).to_pylist() == [OOV_INDEX]


def test_an_empty_window_is_a_message_not_an_error(home: Settings, tmp_path: Path):
    summary = build_features(home, SPEC, CONFIG, start=datetime(2027, 1, 1, tzinfo=UTC),
                             end=datetime(2027, 1, 2, tzinfo=UTC))
    assert summary.rows == 0 and "no events" in summary.message
    empty = build_features(Settings(home=tmp_path / "nothing", frame_backend="pandas"), SPEC, CONFIG)
    assert empty.rows == 0 and "no events yet" in empty.message


@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_a_damaged_vocabulary_file_is_an_error_that_names_it(home: Settings, damage: str):
    build_features(home, SPEC, CONFIG, end=DAY2)
    path = FeatureLayout.for_settings(home).state / "v000001" / "vocab-item_id.parquet"
    if damage == "missing":
        path.unlink()
    else:
        path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(FeatureStateError, match="vocab-item_id.parquet") as err:
        build_features(home, SPEC, CONFIG)
    assert damage in str(err.value)


def test_a_long_window_is_built_as_consecutive_smaller_ones(home: Settings, tmp_path: Path):
    other = Settings(home=tmp_path / "other", frame_backend="pandas")
    shutil.copytree(home.home, other.home)
    whole = build_features(home, SPEC, CONFIG)
    split = build_features(other, SPEC, CONFIG, max_window_rows=2500)  # 9000 events: four windows
    assert (whole.windows, split.windows) == (1, 4) and split.rows == whole.rows == 9000
    for name, key in (("user_stats", "user_id"), ("item_stats", "item_id")):
        order = [(key, "ascending"), ("event_timestamp", "ascending")]
        assert read(home, name).sort_by(order).equals(read(other, name).sort_by(order)), name
    a, b = read(home, "training").sort_by("event_id"), read(other, "training").sort_by("event_id")
    # The smoothed CTRs use the prior stored with the first state (the first window's positive rate): only
    # the counts and recencies are the same whichever way the window was cut.
    for column in [c for c in a.column_names if c.startswith(("d_user", "d_item")) and "ctr" not in c]:
        np.testing.assert_allclose(a[column].to_numpy(), b[column].to_numpy(), rtol=1e-6, err_msg=column)


def test_a_sparse_log_gets_day_or_week_files_and_only_periods_with_events():
    from recloop.features.job import HOUR_US, choose_period_hours

    hour = HOUR_US
    dense = np.arange(0, 48 * hour, hour // 50)  # 50 events an hour
    assert choose_period_hours(dense) == 1
    daily = np.arange(0, 400 * 24 * hour, 24 * hour // 20)  # 20 a day, over a year
    assert choose_period_hours(daily) == 24
    decades = np.arange(0, 22 * 365 * 24 * hour, 24 * hour // 20)  # as many a day, over 22 years: 8,000 days
    assert choose_period_hours(decades) == 168
    sparse = np.arange(0, 22 * 365 * 24 * hour, 24 * hour * 3)  # one every three days for 22 years
    assert choose_period_hours(sparse) == 168
    # a small log inside one day (Criteo's published 200-row sample): hourly files, not one daily file that
    # training could not split into training and held-out periods
    one_day = np.linspace(0, 24 * hour - 1, 200).astype(np.int64)
    assert choose_period_hours(one_day) == 1


# the entity counts and recency (standardized numbers and the CTRs' prior keep the first window's statistics,
# as on any later run, so late events do not move them)
ENTITY_COUNTS = [f"d_{prefix}_{stat}" for prefix in ("user", "item")
                 for stat in ("recency", "events_1h", "events_24h", "events_total")]


def late_homes(lake_home: Path, tmp_path: Path, late: dict[str, np.ndarray], end: datetime | None = None):
    """The lake's events (up to ``end``) as parquet files: all of them, built into an on-time home; and the
    events no ``late`` mask holds ingested into a second home (``delayed``, not built yet). Returns the
    files' folder, both homes, the events and their times (µs)."""
    from recloop.ingest import ingest, lake

    events = lake.read_window(Settings(home=lake_home), SPEC, None, lake.to_us(end) if end else None)
    events = events.select([c.name for c in SPEC.columns])
    files = tmp_path / "files"
    files.mkdir()
    kept = ~np.logical_or.reduce(list(late.values()))
    for name, keep in {"all": np.ones(events.num_rows, bool), "main": kept, **late}.items():
        pq.write_table(events.filter(pa.array(keep)), files / f"{name}.parquet")
    on_time, delayed = (Settings(home=tmp_path / name, frame_backend="pandas") for name in ("on-time", "delayed"))
    ingest(files / "all.parquet", SPEC, on_time, now=datetime(2026, 1, 4, tzinfo=UTC))
    build_features(on_time, SPEC, CONFIG)
    ingest(files / "main.parquet", SPEC, delayed, now=datetime(2026, 1, 4, tzinfo=UTC))
    return files, on_time, delayed, events["ts"].cast(pa.int64()).to_numpy()


def test_late_events_get_their_rows_and_count_in_the_totals_after_them(lake_home: Path, tmp_path: Path):
    """Events that land after the job has built their period (late data) are not left out: the next run
    builds again from their period, so every event has its training row and the entity statistics of
    every later row count them, as if they had landed on time (the ids keep the latest vocabulary)."""
    from recloop.ingest import ingest, lake

    ts = lake.read_window(Settings(home=lake_home), SPEC, None, None, columns=["ts"])["ts"].cast(pa.int64()).to_numpy()
    ten, eleven = (lake.to_us(datetime(2026, 1, 1, h, tzinfo=UTC)) for h in (10, 11))
    late = (ts >= ten) & (ts < eleven + 1_800_000_000) & (np.arange(len(ts)) % 2 == 0)  # 10:00-11:30, half
    files, on_time, delayed, _ = late_homes(lake_home, tmp_path, {"late": late})
    build_features(delayed, SPEC, CONFIG)
    ingest(files / "late.parquet", SPEC, delayed, now=datetime(2026, 1, 4, tzinfo=UTC))
    again = build_features(delayed, SPEC, CONFIG)
    assert again.late_from == datetime(2026, 1, 1, 10, tzinfo=UTC).isoformat()

    expected, got = (read(s, "training").sort_by("event_id") for s in (on_time, delayed))
    assert got.num_rows == expected.num_rows == len(ts) and late.sum() > 30
    assert got["event_id"].equals(expected["event_id"])
    for column in ENTITY_COUNTS:
        assert np.allclose(got[column].to_numpy(), expected[column].to_numpy(), equal_nan=True), column
    assert StateStore(FeatureLayout.for_settings(delayed).state).latest().as_of_us == \
        StateStore(FeatureLayout.for_settings(on_time).state).latest().as_of_us
    assert build_features(delayed, SPEC, CONFIG).late_from is None  # nothing new: nothing rebuilt


def test_an_id_is_out_of_vocabulary_until_it_was_seen_min_count_times_before_the_event(tmp_path: Path):
    """User and item ids admit at two sightings: a row takes the id's index only once the id had been seen
    twice before its event, so one window and the same events split in two agree (with admission at the
    window's end, the first of a user's two events already said "this user comes back")."""
    from datetime import timedelta

    from recloop.features.vocab import OOV_INDEX
    from recloop.ingest import ingest

    base = datetime(2026, 1, 1, tzinfo=UTC)
    n = 40
    users = [100 + i for i in range(n)]
    users[0] = users[-1] = 7  # twice: 00:00 and 01:57
    users[5] = users[10] = users[30] = 8  # three times: 00:15, 00:30, 01:30
    table = pa.table({
        "event_id": [f"e{i}" for i in range(n)],
        "ts": pa.array([base + timedelta(minutes=3 * i) for i in range(n)], pa.timestamp("us", tz="UTC")),
        "user_id": users, "item_id": [1] * n, "label": pa.array([0, 1] * (n // 2), pa.int8()),
        "device": ["d"] * n, "country": ["US"] * n, "category": [1] * n, "price": [1.0] * n, "position": [1] * n,
        "history": pa.array([[1]] * n, pa.list_(pa.int64())), "p_click": [0.5] * n})
    pq.write_table(table, tmp_path / "events.parquet")
    homes = [Settings(home=tmp_path / name, frame_backend="pandas") for name in ("one", "two")]
    for home in homes:
        ingest(tmp_path / "events.parquet", SPEC, home, now=base + timedelta(days=2))
    build_features(homes[0], SPEC, CONFIG)
    build_features(homes[1], SPEC, CONFIG, end=base + timedelta(hours=1))
    build_features(homes[1], SPEC, CONFIG)
    for home in homes:
        rows = read(home, "training").sort_by("ts").to_pydict()
        index = dict(zip(rows["event_id"], rows["c_user_id"], strict=True))
        assert index["e0"] == index["e39"] == OOV_INDEX  # user 7: seen 0, then 1 time before
        assert index["e5"] == index["e10"] == OOV_INDEX and index["e30"] > OOV_INDEX  # user 8's third event
        item = rows["c_item_id"]
        assert item[:2] == [OOV_INDEX, OOV_INDEX] and all(i > OOV_INDEX for i in item[2:])


def test_two_late_arrivals_in_windows_of_a_few_rows_give_the_on_time_features(lake_home: Path, tmp_path: Path):
    """Late events twice, over a history of several states, rebuilt in many small windows: every row, its
    entity counts and whether its user and item were admitted yet are those of the on-time home (a second
    rebuild used to start from a state the first had left stale; corrected states in the middle of a
    rebuild carried the latest vocabulary counts into the admission of ids)."""
    from datetime import timedelta

    from recloop.features.vocab import OOV_INDEX
    from recloop.ingest import ingest, lake

    day = datetime(2026, 1, 1, tzinfo=UTC)
    ts = lake.read_window(Settings(home=lake_home), SPEC, None, lake.to_us(day + timedelta(days=1)),
                          columns=["ts"])["ts"].cast(pa.int64()).to_numpy()
    hour, pick = (ts - lake.to_us(day)) // 3_600_000_000, np.arange(len(ts)) % 3 == 0
    late = {"a": pick & (hour == 3), "b": pick & (hour == 9)}
    files, on_time, delayed, _ = late_homes(lake_home, tmp_path, late, end=day + timedelta(days=1))
    for end in (6, 12, 18, None):  # states at 06:00, 12:00, 18:00 and the end
        build_features(delayed, SPEC, CONFIG, end=day + timedelta(hours=end) if end else None)
    for name in late:
        ingest(files / f"{name}.parquet", SPEC, delayed, now=datetime(2026, 1, 4, tzinfo=UTC))
        assert build_features(delayed, SPEC, CONFIG, max_window_rows=150).late_from is not None

    expected, got = (read(s, "training").sort_by("event_id") for s in (on_time, delayed))
    assert got["event_id"].equals(expected["event_id"]) and late["b"].sum() > 10
    for column in ENTITY_COUNTS:
        assert np.allclose(got[column].to_numpy(), expected[column].to_numpy(), equal_nan=True), column
    for prefix in ("user", "item"):
        admitted = [(r.to_numpy() > OOV_INDEX) for r in (got[f"c_{prefix}_id"], expected[f"c_{prefix}_id"])]
        assert (admitted[0] == admitted[1]).all(), prefix


def test_a_run_with_an_end_before_the_latest_state_leaves_the_late_events_to_the_next_run(lake_home: Path,
                                                                                         tmp_path: Path):
    """Late events found by a run given an explicit end before the latest state: that run rebuilds up to
    its end only, so the next run (without an end) must still see them as late and correct the states and
    rows after that end (they used to be recorded as read, and every later row missed them)."""
    from recloop.ingest import ingest, lake

    ts = lake.read_window(Settings(home=lake_home), SPEC, None, None, columns=["ts"])["ts"].cast(pa.int64()).to_numpy()
    ten, eleven = (lake.to_us(datetime(2026, 1, 1, h, tzinfo=UTC)) for h in (10, 11))
    late = (ts >= ten) & (ts < eleven + 1_800_000_000) & (np.arange(len(ts)) % 2 == 0)
    files, on_time, delayed, _ = late_homes(lake_home, tmp_path, {"late": late})
    build_features(delayed, SPEC, CONFIG)
    ingest(files / "late.parquet", SPEC, delayed, now=datetime(2026, 1, 4, tzinfo=UTC))
    partial = build_features(delayed, SPEC, CONFIG, end=datetime(2026, 1, 1, 14, tzinfo=UTC))
    assert partial.late_from == datetime(2026, 1, 1, 10, tzinfo=UTC).isoformat()
    assert "corrected by the next run" in partial.message
    assert build_features(delayed, SPEC, CONFIG).late_from == datetime(2026, 1, 1, 10, tzinfo=UTC).isoformat()

    expected, got = (read(s, "training").sort_by("event_id") for s in (on_time, delayed))
    assert got["event_id"].equals(expected["event_id"])
    after = got["ts"].cast(pa.int64()).to_numpy() >= lake.to_us(datetime(2026, 1, 1, 14, tzinfo=UTC))
    assert after.sum() > 100  # rows after the partial run's end: the ones it left stale
    for column in ENTITY_COUNTS:
        assert np.allclose(got[column].to_numpy(), expected[column].to_numpy(), equal_nan=True), column
