"""The feature job on a real 2-worker Dask ``LocalCluster`` gives the same files as the single-process job."""

from __future__ import annotations

import shutil
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.features.state import StateStore
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig

SPEC = load_spec("synthetic")
CONFIG = FeatureConfig.for_spec(SPEC)


@pytest.fixture(scope="module")
def lake(tmp_path_factory, lake_factory) -> Settings:
    """Two simulated days, a new catalog wave on the second (new ids join the vocabularies then)."""
    world = WorldConfig(seed=33, days=2, events_per_day=2500, drift="sudden", drift_day=1)
    return lake_factory(tmp_path_factory.mktemp("dask-lake"), world, features=False)


@pytest.fixture(scope="module")
def cluster():
    from distributed import LocalCluster

    with LocalCluster(n_workers=2, threads_per_worker=1, processes=True, dashboard_address=None) as cluster:
        yield cluster


def _outputs(settings: Settings) -> dict[str, pa.Table]:
    """Every file the job wrote (hour files, state versions), by path relative to features/."""
    root = FeatureLayout.for_settings(settings).root
    return {str(p.relative_to(root)): pq.read_table(p) for p in sorted(root.rglob("*.parquet"))}


def test_two_dask_workers_build_the_same_features_as_one_process(lake: Settings, cluster, tmp_path: Path):
    homes = {}
    for engine in ("local", "dask"):
        shutil.copytree(lake.home, tmp_path / engine)
        extra = {"dask_scheduler": cluster.scheduler_address, "dask_partitions": 3} if engine == "dask" else {}
        homes[engine] = Settings(home=tmp_path / engine, frame_backend="pandas", features_engine=engine, **extra)
        # Two runs: the first state (vocabularies from nothing, statistics), then a window that carries
        # totals over from it and admits the second day's new ids after the existing indices.
        first = build_features(homes[engine], SPEC, CONFIG, end=datetime(2026, 1, 1, 15, tzinfo=UTC))
        second = build_features(homes[engine], SPEC, CONFIG)
        assert first.rows > 0 and second.rows > 0 and second.state_version == 2
        if engine == "dask":
            assert second.backend == "dask/pandas"
    # The workers wrote every period file (the driver saw names and counts): the same files, byte for byte
    # in content (rows in the same order, same types); the snapshots are in parts, one per key partition.
    local, dask = _outputs(homes["local"]), _outputs(homes["dask"])
    files = {k for k in local if "snapshot-" not in k}
    assert files == {k for k in dask if "snapshot-" not in k}
    assert any(k.startswith("training/") for k in local) and any(k.startswith("user_stats/") for k in local)
    assert any("vocab-item_id" in k for k in local)
    for name in files:
        assert dask[name].equals(local[name]), name
    assert any(k.startswith("state/v000002/snapshot-user/part-") for k in dask)
    stores = [StateStore(FeatureLayout.for_settings(h).state) for h in homes.values()]
    for version in (1, 2):
        states = [store.load(version) for store in stores]
        assert states[0].stats == states[1].stats and states[0].snapshots.keys() == states[1].snapshots.keys()
        for prefix, table in states[0].snapshots.items():
            assert states[1].snapshots[prefix].equals(table), (version, prefix)
    old, new = stores[1].load(1).vocabularies["item_id"], stores[1].load(2).vocabularies["item_id"]
    assert new.size > old.size  # the wave's items were admitted after the existing ones
    schemas = [FeatureLayout.for_settings(h).schema.read_text() for h in homes.values()]
    assert schemas[0] == schemas[1]
