"""The synthetic world: deterministic, internally consistent, and each drift does what it claims."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest

from recloop.simulate import DEVICES, World, WorldConfig, simulate


def _auc(labels: np.ndarray, scores: np.ndarray) -> float:
    order = np.argsort(scores, kind="stable")
    ranks = np.empty(len(scores))
    ranks[order] = np.arange(1, len(scores) + 1)
    positives = labels == 1
    n_pos, n_neg = positives.sum(), (~positives).sum()
    return float((ranks[positives].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def _day(world: World, day: int, hours=range(24)):
    import pyarrow as pa

    return pa.concat_tables([world.hour_events(day, h) for h in hours])


def test_same_seed_same_files_and_different_seed_different(tmp_path: Path):
    config = WorldConfig(seed=3, days=1, events_per_day=2000)
    a = simulate(config, tmp_path / "a")
    b = simulate(config, tmp_path / "b")
    c = simulate(WorldConfig(seed=4, days=1, events_per_day=2000), tmp_path / "c")
    assert a.files == 24 and a.events == 2000
    for pa_, pb in zip(a.paths, b.paths, strict=True):
        assert Path(pa_).read_bytes() == Path(pb).read_bytes()
    assert not pq.read_table(a.paths[12]).equals(pq.read_table(c.paths[12]))
    assert Path(a.paths[0]).parent.name == "2026-01-01" and Path(a.paths[0]).name == "events-2026-01-01T00.parquet"
    assert not list((tmp_path / "a").rglob(".*")), "no temporary files left behind"


def test_events_are_consistent_and_learnable():
    world = World(WorldConfig(seed=5, days=2, events_per_day=20_000))
    table = _day(world, 0).to_pandas()
    assert len(table) == 20_000 and table["event_id"].is_unique
    assert table["ts"].is_monotonic_increasing and str(table["ts"].dt.tz) == "UTC"
    assert table["p_click"].between(0, 1).all() and set(table["label"].unique()) <= {0, 1}
    # Labels follow the ground truth: observed CTR matches mean p_click, and the oracle ranks well.
    assert abs(table["label"].mean() - table["p_click"].mean()) < 0.01
    assert _auc(table["label"].to_numpy(), table["p_click"].to_numpy()) > 0.68
    # A user's history only holds items that user clicked earlier.
    clicked = table[table["label"] == 1].groupby("user_id")["item_id"].apply(set).to_dict()
    day_two = _day(world, 1, hours=[0]).to_pandas()
    with_history = day_two[day_two["history"].map(len) > 0]
    assert len(with_history) > 0
    for user, history in zip(with_history["user_id"], with_history["history"], strict=True):
        assert set(history) <= clicked.get(user, set()), user
        assert len(history) <= world.config.history_length


def _fixed_impressions(world: World, n: int = 5000):
    rng = np.random.default_rng(0)
    return (rng.integers(0, world.config.users, n), rng.integers(0, world.num_original_items, n),
            rng.integers(0, len(DEVICES), n), rng.integers(1, 20, n))


@pytest.mark.parametrize("scenario", ["none", "covariate", "broken_column"])
def test_scenarios_that_keep_the_click_model(scenario: str):
    world = World(WorldConfig(seed=1, days=6, events_per_day=2000, drift=scenario, drift_day=2))
    impressions = _fixed_impressions(world)
    before, after = world.click_probability(1, *impressions), world.click_probability(5, *impressions)
    np.testing.assert_allclose(before, after)


def test_gradual_drift_rotates_tastes_progressively():
    world = World(WorldConfig(seed=1, days=10, events_per_day=2000, drift="gradual", drift_day=2))
    impressions = _fixed_impressions(world)
    base = world.click_probability(1, *impressions)
    correlations = [np.corrcoef(base, world.click_probability(d, *impressions))[0, 1] for d in (2, 4, 8)]
    assert correlations[0] > correlations[1] > correlations[2]
    assert correlations[0] < 0.999 and correlations[2] < 0.8


def test_sudden_drift_brings_a_new_catalog_and_reshuffles_popularity():
    world = World(WorldConfig(seed=2, days=3, events_per_day=20_000, drift="sudden", drift_day=1))
    before, after = _day(world, 0).to_pandas(), _day(world, 1).to_pandas()
    new_ids = world.num_original_items
    assert (before["item_id"] >= new_ids).mean() == 0
    assert (after["item_id"] >= new_ids).mean() > 0.5
    top_before = set(before["item_id"].value_counts().index[:20])
    top_after_old = set(after.loc[after["item_id"] < new_ids, "item_id"].value_counts().index[:20])
    assert len(top_before & top_after_old) < 10


def test_covariate_drift_changes_the_context_mix():
    world = World(WorldConfig(seed=2, days=3, events_per_day=20_000, drift="covariate", drift_day=1))
    before, after = _day(world, 0).to_pandas(), _day(world, 1).to_pandas()
    assert before["device"].eq("mobile").mean() - after["device"].eq("mobile").mean() > 0.25
    assert after["device"].eq("tablet").mean() > 0.4
    boosted = ["BR", "IN", "MX"]
    assert after["country"].isin(boosted).mean() > before["country"].isin(boosted).mean() + 0.15


def test_broken_column_goes_null_from_the_drift_day():
    world = World(WorldConfig(seed=2, days=3, events_per_day=2000, drift="broken_column", drift_day=1))
    before, after = _day(world, 0), _day(world, 1)
    assert pc.sum(pc.is_null(before["price"])).as_py() == 0
    assert pc.all(pc.is_null(after["price"])).as_py()


def test_bad_config_is_refused():
    with pytest.raises(ValueError, match="unknown drift scenario"):
        WorldConfig(drift="meteor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 1"):
        WorldConfig(days=0)


def test_twin_worlds_agree_before_the_drift_day():
    """The same seed with and without drift: identical events (and ground truth) until the drift day, so a
    loop's recovery can be measured against its no-drift twin."""
    from recloop.simulate import World, WorldConfig

    for drift in ("sudden", "gradual", "covariate"):
        drifted = World(WorldConfig(seed=3, days=3, events_per_day=2000, drift=drift, drift_day=2))
        twin = World(WorldConfig(seed=3, days=3, events_per_day=2000, drift="none", drift_day=2))
        for day in (0, 1):
            for hour in (0, 13):
                assert drifted.hour_events(day, hour).equals(twin.hour_events(day, hour)), (drift, day, hour)
        assert not drifted.hour_events(2, 5).equals(twin.hour_events(2, 5))
