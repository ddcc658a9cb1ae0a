"""Materializing entity rows into the Redis online store: recloop's pipelined writer vs Feast's own.

    python benchmarks/materialize.py [--entities 1000000] [--baseline-entities 200000] [--json out.json]

Needs Redis at 127.0.0.1:6379 (uses database 12, flushed). Both paths write the same rows of one view;
each result is read back through Feast and compared before any time is reported.
Target (issue: features): >= 50k entities/s into Redis on the 2-core machine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import redis
from common import machine, report

from recloop.features import store
from recloop.features.ops import STAT_NAMES
from recloop.settings import Settings

REDIS_URL = "redis://127.0.0.1:6379/12"
NOON = datetime(2026, 1, 1, 12, tzinfo=UTC)


def make_home(root: Path, users: int) -> Settings:
    rng = np.random.default_rng(0)
    for prefix, count in (("user", users), ("item", 10)):
        folder = root / "features" / f"{prefix}_stats"
        folder.mkdir(parents=True)
        stamps = int(NOON.timestamp() * 1e6) + rng.integers(0, 3_600_000_000, count)
        table = {f"{prefix}_id": pa.array(np.arange(count), pa.int64()),
                 "event_timestamp": pa.array(stamps, pa.timestamp("us", tz="UTC"))}
        for stat in STAT_NAMES[:-1]:
            table[f"{prefix}_{stat}"] = pa.array(rng.integers(0, 500, count), pa.int64())
        table[f"{prefix}_last_seen"] = pa.array(stamps / 1e6, pa.float64())
        pq.write_table(pa.table(table), folder / "2026-01-01T12.parquet")
    return Settings(home=root, feast_online_store="redis", redis_url=REDIS_URL)


def timed_materialize(settings: Settings, feasts_own: bool) -> float:
    redis.Redis.from_url(REDIS_URL).flushdb()
    store.apply_repo(settings, force=True)
    feature_store = store.feature_store(settings)  # built before timing: both paths pay it once
    started = time.perf_counter()
    if feasts_own:
        feature_store.materialize(start_date=NOON - timedelta(days=1), end_date=NOON + timedelta(days=1),
                                  feature_views=["user_stats"])
    else:
        view = feature_store.get_feature_view("user_stats")
        store._materialize_redis(settings, feature_store, view, NOON - timedelta(days=1), NOON + timedelta(days=1))
    return time.perf_counter() - started


def check(settings: Settings, users: int) -> None:
    ids = [0, users // 2, users - 1]
    online = store.online_features(settings, {"user_id": ids, "item_id": [0, 1, 2]})
    table = pq.read_table(settings.home / "features" / "user_stats" / "2026-01-01T12.parquet").to_pandas()
    expected = table.set_index("user_id").loc[ids, "user_events_total"].to_numpy()
    assert np.array_equal(online["user_events_total"].astype(int).to_numpy(), expected), (online, expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--entities", type=int, default=1_000_000)
    parser.add_argument("--baseline-entities", type=int, default=200_000,
                        help="Feast's own path runs at ~11k/s here; measure it on fewer rows")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recloop-bench-materialize-"))
    rows = []
    try:
        for name, count, feasts_own in (("recloop pipelined writer", args.entities, False),
                                        ("recloop pipelined writer", args.baseline_entities, False),
                                        ("Feast materialize (baseline)", args.baseline_entities, True)):
            settings = make_home(work / f"{name[:6]}-{count}", count)
            seconds = timed_materialize(settings, feasts_own)
            check(settings, count)
            rows.append({"path": name, "entities": count, "seconds": f"{seconds:.2f}",
                         "entities_per_s": f"{count / seconds:,.0f}", "target": ">= 50k/s"})
        base = float(rows[2]["seconds"]) / args.baseline_entities
        ours = float(rows[1]["seconds"]) / args.baseline_entities
        for row in rows:
            row["vs_feast"] = f"{base / (float(row['seconds']) / row['entities']):.1f}x"
    finally:
        redis.Redis.from_url(REDIS_URL).flushdb()
        shutil.rmtree(work, ignore_errors=True)
    assert ours > 0
    report("materialization into the Redis online store", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
