"""Train/serve consistency through the real Feast store (SQLite by default, Redis under ``services``)."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest

from recloop.features import ops, store
from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.state import StateStore
from recloop.ingest import ingest
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate

SPEC = load_spec("synthetic")
CONFIG = FeatureConfig.for_spec(SPEC)
END = datetime(2026, 1, 3, tzinfo=UTC)
TTL = timedelta(seconds=CONFIG.ttl_seconds)


@pytest.fixture(scope="module")
def built(tmp_path_factory, lake_factory) -> Settings:
    """Two simulated days, ingested, features built, repo applied, online store loaded."""
    settings = lake_factory(tmp_path_factory.mktemp("feast"), WorldConfig(seed=5, days=2, events_per_day=2000))
    assert store.apply_repo(settings) is True
    assert store.apply_repo(settings) is False  # nothing changed: not applied again
    assert store.materialize(settings, END, TTL) == ["user_stats", "item_stats"]
    return settings


def offline_latest(settings: Settings, name: str, key: str) -> pd.DataFrame:
    table = ds.dataset(FeatureLayout.for_settings(settings).root / name, format="parquet").to_table().to_pandas()
    return table.sort_values("event_timestamp").drop_duplicates(key, keep="last").set_index(key)


def test_training_rows_equal_feasts_point_in_time_features(built: Settings):
    training = ds.dataset(FeatureLayout.for_settings(built).training, format="parquet").to_table().to_pandas()
    sample = training.sample(300, random_state=0).reset_index(drop=True)
    entity_rows = pd.DataFrame({"user_id": sample["user_id"], "item_id": sample["item_id"],
                                "event_timestamp": sample["ts"] - pd.Timedelta(microseconds=1)})
    features = store.historical_features(built, entity_rows)
    assert len(features) == len(sample)  # row counts guarded (Feast can drop entity rows)
    stats = StateStore(FeatureLayout.for_settings(built).state).latest().stats
    ts_us = (sample["ts"].astype("int64") if sample["ts"].dtype.unit == "us"
             else sample["ts"].astype("int64") // 1000).to_numpy()
    for prefix in ("user", "item"):
        raw = {f"{prefix}_{s}": features[f"{prefix}_{s}"].astype("float64").to_numpy() for s in ops.STAT_NAMES}
        served = ops.entity_dense(np, raw, prefix, ts_us, prior=stats["prior_ctr"], smoothing=CONFIG.smoothing,
                                  recency_cap_seconds=CONFIG.recency_cap_seconds)
        for name, values in served.items():
            np.testing.assert_allclose(sample[f"d_{name}"].to_numpy(), values, rtol=1e-5, atol=1e-6, err_msg=name)
    assert sample["user_is_new"].any() and not sample["user_is_new"].all()  # both cases were checked


def test_online_store_serves_the_latest_offline_value(built: Settings):
    users = offline_latest(built, "user_stats", "user_id")
    items = offline_latest(built, "item_stats", "item_id")
    user_ids, item_ids = list(users.index[:50]), list(items.index[:50])
    online = store.online_features(built, {"user_id": user_ids, "item_id": item_ids})
    for prefix, expected in (("user", users.loc[user_ids]), ("item", items.loc[item_ids])):
        for stat in ops.STAT_NAMES:
            column = f"{prefix}_{stat}"
            np.testing.assert_allclose(online[column].astype(float).to_numpy(), expected[column].to_numpy(),
                                       err_msg=column)
    unknown = store.online_features(built, {"user_id": [10**12], "item_id": [10**12]})
    assert unknown["user_events_total"].isna().all()


def test_a_later_window_materializes_incrementally(built: Settings, tmp_path: Path):
    settings = Settings(home=tmp_path / "home", frame_backend="pandas")
    shutil.copytree(built.home, settings.home)
    simulate(WorldConfig(seed=5, days=3, events_per_day=2000), tmp_path / "landing")
    ingest(tmp_path / "landing", SPEC, settings, now=datetime(2026, 2, 1, tzinfo=UTC))
    assert build_features(settings, SPEC, CONFIG).rows == 2000  # only the third day is new
    store.apply_repo(settings)  # the copy has its own RECLOOP_HOME: the sources point there now
    assert store.materialize(settings, END + timedelta(days=1), TTL) == ["user_stats", "item_stats"]
    users = offline_latest(settings, "user_stats", "user_id")
    recent = users[users["event_timestamp"] >= pd.Timestamp(END)].index[:20].tolist()
    online = store.online_features(settings, {"user_id": recent, "item_id": [0] * len(recent)})
    np.testing.assert_allclose(online["user_events_total"].astype(float), users.loc[recent, "user_events_total"])


def test_the_feast_cli_reads_the_offline_store_quietly(built: Settings, tmp_path: Path):
    """`feast materialize` as a user runs it on this repository: the offline store's DuckDB connection is
    released at exit, so stderr holds no "nanobind: leaked" lines (47 lines with Feast's plain duckdb store)."""
    import os
    import sqlite3
    import subprocess
    import sys

    home = tmp_path / "home"
    shutil.copytree(built.home, home)
    with sqlite3.connect(home / "feast" / "online.db") as db:
        db.execute("DELETE FROM recloop_user_stats")
    checkout = Path(__file__).resolve().parents[1]
    env = {**os.environ, "RECLOOP_HOME": str(home),
           "PYTHONPATH": os.pathsep.join(str(checkout / p) for p in ("platform", "kernels", ""))}
    done = subprocess.run([str(Path(sys.executable).with_name("feast")), "-c", str(checkout / "feature_repo"),
                           "materialize", "2026-01-01T00:00:00", END.strftime("%Y-%m-%dT%H:%M:%S")],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stderr == "", done.stderr[-3000:]
    with sqlite3.connect(home / "feast" / "online.db") as db:
        assert db.execute("SELECT COUNT(*) FROM recloop_user_stats").fetchone()[0] > 0


def test_a_copied_home_never_touches_the_original_online_store(built: Settings, tmp_path: Path):
    """Feast's registry records each SQLite online table with its absolute path; a copied home's first
    apply used to tear down the tables at those paths: the original's."""
    users = offline_latest(built, "user_stats", "user_id")
    ids = list(users.index[:10])
    before = store.online_features(built, {"user_id": ids, "item_id": [0] * len(ids)})
    original_db = built.home / "feast" / "online.db"
    tables = _sqlite_tables(original_db)
    assert {"recloop_user_stats", "recloop_item_stats"} <= tables

    copy = Settings(home=tmp_path / "copy", frame_backend="pandas")
    shutil.copytree(built.home, copy.home)
    assert store.apply_repo(copy) is True
    store.materialize(copy, END + timedelta(hours=1), TTL)

    assert _sqlite_tables(original_db) == tables
    after = store.online_features(built, {"user_id": ids, "item_id": [0] * len(ids)})
    pd.testing.assert_frame_equal(after, before)
    copied = store.online_features(copy, {"user_id": ids, "item_id": [0] * len(ids)})
    np.testing.assert_allclose(copied["user_events_total"].astype(float), users.loc[ids, "user_events_total"])


def _sqlite_tables(path: Path) -> set[str]:
    import sqlite3

    with sqlite3.connect(path) as db:
        return {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}


@pytest.mark.services
def test_redis_online_store(built: Settings, tmp_path: Path):
    import redis

    client = redis.Redis.from_url("redis://127.0.0.1:6379/13")
    client.flushdb()
    settings = Settings(home=tmp_path / "home", frame_backend="pandas", feast_online_store="redis",
                        redis_url="redis://127.0.0.1:6379/13")
    shutil.copytree(built.home, settings.home)
    # A fresh registry: the copied one remembers what was materialized into SQLite.
    (settings.home / "feast" / "registry.db").unlink()
    assert store.apply_repo(settings) is True  # the online-store setting changed: applied again
    assert store.materialize(settings, END, TTL) == ["user_stats", "item_stats"]
    assert client.dbsize() > 0
    users = offline_latest(settings, "user_stats", "user_id")
    ids = list(users.index[:30])
    online = store.online_features(settings, {"user_id": ids, "item_id": [0] * len(ids)})
    np.testing.assert_allclose(online["user_events_total"].astype(float), users.loc[ids, "user_events_total"])
    client.flushdb()


def test_fast_redis_layout_is_feasts_own():
    import pyarrow as pa
    from feast.infra.online_stores.helpers import _redis_key
    from feast.protos.feast.types.EntityKey_pb2 import EntityKey
    from feast.protos.feast.types.Value_pb2 import Value

    from recloop.features.online_keys import redis_keys
    from recloop.features.online_writer import _serialized_values

    ids = np.array([0, 1, -1, 7, 2**40 + 3, -(2**63), 2**63 - 1], dtype=np.int64)
    ours = redis_keys("user_id", "recloop", ids)
    feasts = [_redis_key("recloop", EntityKey(join_keys=["user_id"], entity_values=[Value(int64_val=int(i))]), 3)
              for i in ids]
    assert ours == feasts
    counts = pa.chunked_array([pa.array([3, None, 3, -5], pa.int64())])
    assert _serialized_values(counts, Value) == [Value(int64_val=3).SerializeToString(), b"",
                                                 Value(int64_val=3).SerializeToString(),
                                                 Value(int64_val=-5).SerializeToString()]
    seen = pa.chunked_array([pa.array([1.5, 1767225600.123456], pa.float64())])
    assert _serialized_values(seen, Value) == [Value(double_val=v).SerializeToString() for v in (1.5, 1767225600.123456)]


def test_late_events_reach_the_online_store(built: Settings, tmp_path: Path):
    """Events landing after their period was built and loaded: the job rebuilds from their period, and the
    online store is loaded again from there (it used to continue from its last load's end, so the entities
    the late events touched kept their stale values online: training and serving disagreed for good)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from recloop import pipeline
    from recloop.ingest import lake

    events = lake.read_window(built, SPEC, None, None).select([c.name for c in SPEC.columns])
    ts = events["ts"].cast(pa.int64()).to_numpy()
    ten, twelve = (lake.to_us(datetime(2026, 1, 1, h, tzinfo=UTC)) for h in (10, 12))
    late = (ts >= ten) & (ts < twelve) & (np.arange(len(ts)) % 2 == 0)
    for name, keep in (("main", ~late), ("late", late)):
        pq.write_table(events.filter(pa.array(keep)), tmp_path / f"{name}.parquet")
    settings = Settings(home=tmp_path / "home", frame_backend="pandas")
    ingest(tmp_path / "main.parquet", SPEC, settings, now=datetime(2026, 2, 1, tzinfo=UTC))
    assert pipeline.build_features(settings, SPEC).materialized == ["user_stats", "item_stats"]
    ingest(tmp_path / "late.parquet", SPEC, settings, now=datetime(2026, 2, 1, tzinfo=UTC))
    again = pipeline.build_features(settings, SPEC)
    assert again.late_from is not None and again.materialized == ["user_stats", "item_stats"]

    for name, key, other in (("user_stats", "user_id", "item_id"), ("item_stats", "item_id", "user_id")):
        latest = offline_latest(settings, name, key)
        touched = set(events.filter(pa.array(late))[key].to_pylist())
        ids = [i for i in latest.index if i in touched]
        assert len(ids) > 10, name
        online = store.online_features(settings, {key: ids, other: [0] * len(ids)})
        column = f"{name.split('_')[0]}_events_total"
        np.testing.assert_allclose(online[column].astype(float).to_numpy(), latest.loc[ids, column].to_numpy(),
                                   err_msg=name)


def test_feast_is_imported_without_typeguards_instrumentation_and_typeguard_is_left_as_it_was():
    """``recloop.features.feast_import``: Feast's classes take their arguments unchecked (typeguard's
    instrumentation took 4.4 of Feast's 7.5 s of import on a 2-core host), and typeguard's decorator is its own
    again for everything imported after."""
    import typeguard

    from recloop.features.feast_import import import_feast

    feast = import_feast()
    with pytest.warns(DeprecationWarning, match="value_type"):
        entity = feast.Entity(name=123, join_keys=["k"])  # instrumented: TypeCheckError on the int name
    assert entity.name == 123

    @typeguard.typechecked
    def checked(value: str) -> str:
        return value

    with pytest.raises(typeguard.TypeCheckError):
        checked(1)


def test_every_feast_import_in_recloop_comes_after_import_feast():
    """A ``from feast… import`` that runs before ``import_feast()`` imports Feast with typeguard's instrumentation
    (4 s more per process): in ``platform/`` and ``flows/``, each is preceded by the call in its scope."""
    import re

    root = Path(__file__).resolve().parents[1]
    bare = []
    for path in sorted([*(root / "platform").rglob("*.py"), *(root / "flows").rglob("*.py")]):
        if path.name == "feast_import.py":
            continue
        lines = path.read_text().splitlines()
        for number, line in enumerate(lines):
            found = re.match(r"(\s*)(from feast\b|import feast\b)", line)
            if not found:
                continue
            indent, above = found.group(1), number - 1
            while above >= 0 and (re.match(rf"{indent}(from feast\b|import feast\b)", lines[above])
                                  or not lines[above].strip()):
                above -= 1  # a block of feast imports (and blank lines): the call precedes the block
            if above < 0 or not lines[above].strip().startswith("import_feast()"):
                bare.append(f"{path.relative_to(root)}:{number + 1}: {line.strip()}")
    assert not bare, bare
