"""The gate and the registry end to end, on a real MLflow tracking store (SQLite; PostgreSQL under
``services``): candidates become challengers or are refused with the right reasons; aliases move."""

from __future__ import annotations

import dataclasses
import shutil
import threading
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load_file, save_file

from recloop import registry
from recloop.features.config import FeatureConfig
from recloop.features.job import FeatureLayout, build_features
from recloop.features.state import StateStore
from recloop.gate import GateThresholds, run_gate
from recloop.model import ModelConfig
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig
from recloop.train import TrainConfig, train

SPEC = load_spec("synthetic")
MODEL = ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,))
# Tests judge one rule at a time; calibration of these small models is checked with a wide band.
LENIENT = GateThresholds(calibration_range=(0.5, 2.0), max_auc_drop_incremental=0.02, max_slice_auc_drop=0.05)


def config(**changes) -> TrainConfig:
    return TrainConfig(**{**dict(mode="full", days=3, epochs=2, batch_size=512, validation_hours=12,
                                 checkpoint_every=1000, device="cpu", model=MODEL), **changes})


def example_rows(settings: Settings):
    files = sorted(FeatureLayout.for_settings(settings).training.glob("*.parquet"))
    return pq.read_table(files[-1]).slice(0, 5).to_pandas()


@pytest.fixture(scope="module")
def champion_home(tmp_path_factory, lake_factory) -> Path:
    """Three days of a world, a first model trained, registered and gated: version 1 is champion."""
    settings = lake_factory(tmp_path_factory.mktemp("registry"), WorldConfig(seed=4, days=4, events_per_day=6000),
                            features_end=datetime(2026, 1, 4, tzinfo=UTC))
    summary = train(settings, config())
    logged = registry.log_training(settings, summary, example_rows(settings))
    outcome = run_gate(settings, logged.version, LENIENT, smoke_check=True)  # loads in a fresh process
    assert outcome["passed"] and outcome["alias"] == "champion" and outcome["first_model"], outcome["reasons"]
    return settings.home


@pytest.fixture
def home(champion_home: Path, tmp_path: Path) -> Settings:
    shutil.copytree(champion_home, tmp_path / "home")
    settings = Settings(home=tmp_path / "home", frame_backend="pandas")
    # The copied registry points at the original home's files; re-register version 1 from here.
    return settings


def corrupted(settings: Settings, base_summary, change) -> object:
    """A copy of a trained checkpoint with its weights changed, as a training summary to log."""
    from recloop.train import latest_checkpoint

    source = latest_checkpoint(settings)  # this test's copy, not the shared original
    target = settings.home / "checkpoints" / f"altered-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target)
    state = load_file(target / "model.safetensors")
    change(state)
    save_file(state, target / "model.safetensors")
    return dataclasses.replace(base_summary, checkpoint=str(target), run_id=base_summary.run_id + "-altered")


def test_first_model_is_champion_and_a_better_incremental_becomes_challenger(home: Settings):
    assert registry.aliases(home)["champion"] == "1"
    build_features(home, SPEC, FeatureConfig.for_spec(SPEC))  # day four
    incremental = train(home, config(mode="incremental"))
    logged = registry.log_training(home, incremental, example_rows(home))
    outcome = run_gate(home, logged.version, LENIENT, smoke_check=False)
    assert outcome["passed"], outcome["reasons"]
    assert outcome["alias"] == "challenger" and registry.aliases(home)["challenger"] == logged.version
    info = registry.version_info(home, logged.version)
    assert info["tags"]["gate"] == "passed" and info["tags"]["gate.champion"] == "1"
    assert outcome["champion_scores"]["rows"] == outcome["candidate"]["rows"]  # the same held-out rows
    from mlflow import MlflowClient

    run = MlflowClient().get_run(logged.run_id)
    assert run.data.params["train.mode"] == "incremental" and run.data.tags["recloop.state_version"] == "2"
    assert "slice_auc.device.mobile" in run.data.metrics and run.data.metrics["auc"] == incremental.auc
    history = MlflowClient().get_metric_history(logged.run_id, "train_loss")
    assert len(history) == len(incremental.loss_curve) > 0


def test_a_model_trained_on_shuffled_labels_is_refused(home: Settings):
    training = FeatureLayout.for_settings(home).training
    files = sorted(training.glob("*.parquet"))[:-12]  # shuffle everything but the held-out hours
    rng = np.random.default_rng(0)
    for path in files:
        table = pq.read_table(path)
        labels = rng.permutation(table["label"].to_numpy())
        pq.write_table(table.set_column(table.column_names.index("label"), "label", pa.array(labels)), path)
    shuffled = train(home, config(seed=7))
    logged = registry.log_training(home, shuffled, example_rows(home))
    outcome = run_gate(home, logged.version, GateThresholds(calibration_range=(0.5, 2.0)), smoke_check=False)
    assert not outcome["passed"] and outcome["alias"] is None
    assert any("below the floor 0.55" in r for r in outcome["reasons"]), outcome["reasons"]
    assert any("auc dropped" in r for r in outcome["reasons"]), outcome["reasons"]
    assert registry.version_info(home, logged.version)["tags"]["gate"] == "failed"
    assert registry.aliases(home)["challenger"] is None


def test_a_model_that_emits_nan_is_refused(home: Settings):
    from recloop.train import TrainSummary, latest_checkpoint, read_checkpoint

    base = TrainSummary(**read_checkpoint(latest_checkpoint(home))["summary"])

    def poison(state):
        state["over_arch.layers.0.weight"][0, 0] = float("nan")

    logged = registry.log_training(home, corrupted(home, base, poison), example_rows(home))
    outcome = run_gate(home, logged.version, LENIENT, smoke_check=True)
    assert not outcome["passed"]
    assert any("NaN" in r for r in outcome["reasons"]), outcome["reasons"]
    assert any("serving check" in r for r in outcome["reasons"]), outcome["reasons"]


def test_a_model_worse_on_one_slice_only_is_refused(home: Settings):
    from recloop.train import TrainSummary, latest_checkpoint, read_checkpoint

    base = TrainSummary(**read_checkpoint(latest_checkpoint(home))["summary"])
    tablet = StateStore(FeatureLayout.for_settings(home).state).latest().vocabularies["device"]
    index = int(tablet.lookup_arrow(pa.array(["tablet"]))[0].as_py())
    state = read_checkpoint(latest_checkpoint(home))
    dim = state["model"]["embedding_dim"]
    offset = sum(rows for name, rows in state["tables"][: [n for n, _ in state["tables"]].index("c_device")]) * dim

    def scramble_tablet(weights):
        flat = weights["sparse_arch.embeddings.weights"]
        flat[offset + index * dim: offset + (index + 1) * dim] = torch.randn(dim, generator=torch.Generator()
                                                                           .manual_seed(0)) * 20

    logged = registry.log_training(home, corrupted(home, base, scramble_tablet), example_rows(home))
    thresholds = dataclasses.replace(LENIENT, max_auc_drop_full=0.05, max_slice_auc_drop=0.01)
    outcome = run_gate(home, logged.version, thresholds, smoke_check=False)
    assert not outcome["passed"]
    assert [r for r in outcome["reasons"] if "slice" in r] == [r for r in outcome["reasons"]], outcome["reasons"]
    assert any("slice device=tablet" in r for r in outcome["reasons"]), outcome["reasons"]
    assert "| device=tablet |" in registry.version_info(home, logged.version)["tags"].get("gate.reasons", "") or \
        "device=tablet" in outcome["report"]


def test_promote_and_rollback_move_the_aliases(home: Settings):
    info = registry.version_info(home, "1")
    second = registry.register(home, info["source"], info["run_id"])
    state = registry.promote(home, second, who="alice", why="manual review")
    assert state == {"champion": second, "challenger": None, "previous": "1"}
    assert registry.version_info(home, second)["tags"]["alias.champion.by"] == "alice"
    state = registry.rollback(home, who="bob", why="bad online CTR")
    assert state == {"champion": "1", "challenger": None, "previous": None}
    assert registry.version_info(home, second)["tags"]["rolled_back.why"] == "bad online CTR"
    with pytest.raises(RuntimeError, match="nothing to roll back"):
        registry.rollback(home, why="again")


def _register_concurrently(settings: Settings, source: str, run_id: str, count: int) -> list[str]:
    versions, errors = [], []

    def work() -> None:
        try:
            versions.append(registry.register(settings, source, run_id))
        except Exception as err:  # noqa: BLE001 - reported by the assertion below
            errors.append(err)

    threads = [threading.Thread(target=work) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    return versions


def test_registrations_at_once_all_land_with_distinct_versions(home: Settings):
    info = registry.version_info(home, "1")
    versions = _register_concurrently(home, info["source"], info["run_id"], 4)
    assert len(set(versions)) == 4 and "1" not in versions


@pytest.mark.services
def test_registry_on_postgresql(champion_home: Path, tmp_path: Path):
    import psycopg2

    database = f"recloop_test_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {database}")
    try:
        settings = Settings(home=tmp_path / "home", mlflow_tracking_uri=f"postgresql://postgres@127.0.0.1:5432/{database}")
        shutil.copytree(champion_home / "features", settings.home / "features")
        shutil.copytree(champion_home / "checkpoints", settings.home / "checkpoints")
        from recloop.train import TrainSummary, latest_checkpoint, read_checkpoint

        summary = TrainSummary(**read_checkpoint(latest_checkpoint(settings))["summary"])
        summary.checkpoint = str(latest_checkpoint(settings))
        logged = registry.log_training(settings, summary, example_rows(settings))
        outcome = run_gate(settings, logged.version, LENIENT, smoke_check=False)
        assert outcome["alias"] == "champion"
        versions = _register_concurrently(settings, logged.model_uri, logged.run_id, 3)
        assert len(set(versions)) == 3
        assert registry.promote(settings, versions[0], why="pg")["previous"] == logged.version
    finally:
        import mlflow
        from sqlalchemy.pool import NullPool  # noqa: F401 - make sure connections are released

        mlflow.set_tracking_uri(None)
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {database} WITH (FORCE)")
        admin.close()
