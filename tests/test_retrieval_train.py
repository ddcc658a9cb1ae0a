"""Retriever training on a simulated lake: it beats popularity on the oracle, warm-starts and grows, and
is registered, gated and aliased as ``recloop-retriever`` beside the ranker."""

from __future__ import annotations

import shutil
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import isolated
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from recloop import checkpoint, registry, tracking
from recloop.features.config import FeatureConfig
from recloop.features.job import build_features
from recloop.retrieval.data import RetrievalFeatures, read_rows
from recloop.retrieval.evaluate import WorldOracle
from recloop.retrieval.publish import CONTENT
from recloop.retrieval.retriever import Retriever, score_window
from recloop.retrieval.train import RetrievalTrainConfig, features_for, train_retriever
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig

SPEC = load_spec("synthetic")
WORLD = WorldConfig(seed=5, days=4, events_per_day=12_000, num_items=1500, drift="sudden", drift_day=3)


@pytest.fixture(scope="module")
def lake(tmp_path_factory, lake_factory) -> Path:
    """Four simulated days (a new catalog wave on the fourth), ingested; features for the first three."""
    return lake_factory(tmp_path_factory.mktemp("retrieval"), WORLD, features_end=datetime(2026, 1, 4, tzinfo=UTC)).home


@pytest.fixture
def home(lake: Path, tmp_path: Path) -> Settings:
    shutil.copytree(lake, tmp_path / "home")
    return Settings(home=tmp_path / "home", frame_backend="pandas")


def config(**changes) -> RetrievalTrainConfig:
    return RetrievalTrainConfig(**{**dict(mode="full", days=3, validation_hours=12, eval_ks=(100, 500), batch_size=256,
                                          device="cpu"), **changes})


def test_a_full_run_beats_popularity_on_the_oracle_and_round_trips(home: Settings):
    oracle = WorldOracle(World(WORLD))
    summary = train_retriever(home, config(), oracle=oracle)
    overall, popular = summary.scores["overall"], summary.scores["popularity"]
    assert summary.clicks > 2000 and summary.steps > 10 and 1000 < summary.catalog_items <= 1500
    # What retrieval should return, it returns more of than "the most clicked items" does.
    assert overall["oracle_recall@100"] > popular["oracle_recall@100"], summary.scores
    assert 0 < overall["recall@500"] <= 1 and overall["clicks"] > 300
    assert len(summary.loss_curve) >= 3 and summary.loss_curve[-1][1] < summary.loss_curve[0][1]
    folder = Path(summary.checkpoint)
    assert {p.name for p in folder.iterdir()} == {"model.safetensors", "items.safetensors", "index.faiss",
                                                 "index.safetensors", "index.json", "state.json"}
    loaded = Retriever.load(folder)  # safetensors + JSON + the index file: same answers as when trained
    validation = sorted((home.home / "features" / "training").glob("*.parquet"))[-12:]
    again = score_window(loaded, validation, (100, 500), oracle)
    assert again.overall == pytest.approx(overall)
    assert train_retriever(home, config(), oracle=oracle).run_id == summary.run_id  # done: not retrained


def test_incremental_warm_start_grows_tables_and_keeps_untouched_rows(home: Settings):
    base = train_retriever(home, config())
    build_features(home, SPEC, FeatureConfig.for_spec(SPEC))  # day four: new users and a catalog wave
    incremental = train_retriever(home, config(mode="incremental"))
    assert incremental.warm_start == base.checkpoint and incremental.train_hours[0] >= base.trained_until
    old_rows, new_rows = incremental.grown_tables["c_item_id"]
    assert new_rows > old_rows and incremental.catalog_items > base.catalog_items
    before = load_file(Path(base.checkpoint) / "model.safetensors")
    after = load_file(Path(incremental.checkpoint) / "model.safetensors")
    old = Retriever.load(Path(base.checkpoint)).model.item_tower.embeddings.weight("c_item_id")
    new = Retriever.load(Path(incremental.checkpoint)).model.item_tower.embeddings.weight("c_item_id")
    training = home.home / "features" / "training"
    clicked = set(read_rows([p for p in sorted(training.glob("*.parquet")) if p.stem >= base.trained_until][:-12],
                            RetrievalFeatures()).columns["c_item_id"].tolist())
    untouched = [r for r in range(2, old_rows) if r not in clicked]
    touched = sorted(clicked & set(range(2, old_rows)))
    assert untouched and touched
    assert torch.equal(old[untouched], new[untouched])  # indices never move; unclicked rows keep their values
    assert not torch.equal(old[touched], new[touched])
    assert before.keys() == after.keys()
    # popularity (the fallback and the gate's baseline) counts the window's clicks, not only the new hours'
    assert Retriever.load(Path(incremental.checkpoint)).item_clicks.sum() > 2 * incremental.clicks


def test_registered_gated_and_aliased_beside_the_ranker(home: Settings):
    import mlflow

    from recloop.gate.retrieval_runner import run_retrieval_gate
    from recloop.retrieval.publish import log_retriever

    first = train_retriever(home, config(epochs=2))
    logged = log_retriever(home, first)
    assert log_retriever(home, first).version == logged.version  # a rerun finds it
    # another run that ended with the same towers and catalog (its own folder, its own run): no new version
    copy = Path(first.checkpoint).parent / f"{Path(first.checkpoint).name}-again"
    shutil.copytree(first.checkpoint, copy)
    (copy / "index.json").write_text((copy / "index.json").read_text() + "\n")  # the index is not the model
    again = log_retriever(home, replace(first, checkpoint=str(copy), run_id=f"{first.run_id}-again"))
    assert (again.version, again.duplicate_of) == (logged.version, logged.version) and again.run_id != logged.run_id
    assert registry.mlflow_client(home).get_run(again.run_id).data.tags[tracking.DUPLICATE_TAG] == logged.version
    assert len(registry.mlflow_client(home).search_model_versions(f"name='{registry.RETRIEVER_NAME}'")) == 1
    digest = registry.version_info(home, logged.version, registry.RETRIEVER_NAME).tags[checkpoint.WEIGHTS_TAG]
    assert digest == checkpoint.files_digest(copy, CONTENT)
    outcome = run_retrieval_gate(home, logged.version)
    assert outcome["passed"] and outcome["alias"] == "champion", outcome["reasons"]
    second = train_retriever(home, config(epochs=3))
    challenger = log_retriever(home, second)
    outcome = run_retrieval_gate(home, challenger.version)
    name = registry.RETRIEVER_NAME
    tags = registry.version_info(home, challenger.version, name).tags
    gate = registry.gate_record(tags)
    assert gate["verdict"] == ("passed" if outcome["passed"] else "failed") and gate["reasons"] == outcome["reasons"]
    assert sorted(k for k in tags if k.startswith("gate")) == ["gate", "gate.json"] and any(k.startswith("recall@") for k in gate)
    assert tags["gate"].startswith(gate["verdict"])  # the line a person reads; its record in gate.json
    assert outcome["alias"] == ("challenger" if outcome["passed"] else None)
    assert registry.aliases(home, name)["champion"] == logged.version
    assert registry.aliases(home) == {"champion": None, "challenger": None, "previous": None}  # the ranker's
    registry.promote(home, challenger.version, who="test", model_name=name)
    assert registry.aliases(home, name) == {"champion": challenger.version, "challenger": None,
                                            "previous": logged.version}
    model = mlflow.pyfunc.load_model(f"models:/{name}@champion")
    rows = read_rows(sorted((home.home / "features" / "training").glob("*.parquet"))[-1:], RetrievalFeatures())
    frame = __import__("pandas").DataFrame({"c_user_id": rows.columns["c_user_id"][:3],
                                            "c_device": rows.columns["c_device"][:3],
                                            "c_country": rows.columns["c_country"][:3],
                                            "m_history": [rows.take(np.array([i])).lists["m_history"][1]
                                                          for i in range(3)]})
    answer = model.predict(frame, params={"k": 20})
    assert len(answer) == 3 and all(len(ids) == 20 and (np.asarray(ids) >= 0).all() for ids in answer["item_ids"])


@pytest.mark.slow
def test_the_champion_loads_and_answers_where_recloop_is_not_installed(home: Settings, tmp_path: Path):
    """The registered retriever carries recloop and its kernels (and names no path of this machine): a fresh
    process without recloop loads ``models:/recloop-retriever@champion`` and answers as this one does."""
    import mlflow
    import pandas as pd

    from recloop.gate.retrieval_runner import run_retrieval_gate
    from recloop.retrieval.publish import log_retriever

    logged = log_retriever(home, train_retriever(home, config(epochs=1)))
    assert run_retrieval_gate(home, logged.version)["alias"] == "champion"
    uri = f"models:/{registry.RETRIEVER_NAME}@champion"
    _, requirements = isolated.shipped_model(uri, registry.tracking_uri(home), tmp_path / "download",
                                             [isolated.CHECKOUT, home.home.resolve()])
    rows = read_rows(sorted((home.home / "features" / "training").glob("*.parquet"))[-1:], RetrievalFeatures())
    frame = pd.DataFrame({name: rows.columns[name][:4] for name in ("c_user_id", "c_device", "c_country")})
    frame["m_history"] = [rows.take(np.array([i])).lists["m_history"][1] for i in range(4)]
    frame.to_parquet(tmp_path / "users.parquet")
    expected = mlflow.pyfunc.load_model(uri).predict(frame, params={"k": 20})  # here, with recloop installed
    found = isolated.load_and_predict(uri, tmp_path / "users.parquet", registry.tracking_uri(home), tmp_path,
                                      params={"k": 20})
    assert found["answer"]["item_ids"] == [list(ids) for ids in expected["item_ids"]]
    assert all(len(ids) == 20 for ids in found["answer"]["item_ids"])
    for package in ("recloop", "recloop_kernels"):  # from the model's own code folder
        assert Path(found[package]).parent.parent.name == "code", found[package]
    assert "faiss-cpu" in found["distributions"] and not isolated.uncovered(found["distributions"], requirements)


def test_the_towers_columns_come_from_the_spec_and_the_data(home: Settings):
    """Derived from the spec's roles and which columns are fixed per item, the synthetic world's towers are
    the ones written by hand for it: device and country are request context, category and price belong to
    the item, the position varies per event and is left out, the history shares the item vocabulary."""
    from recloop.features.definition import FeatureLayout

    assert features_for(home, "synthetic", FeatureLayout.for_settings(home).schema) == RetrievalFeatures()


def test_text_item_attributes_are_kept_as_text_and_the_category_is_an_integer_column(tmp_path: Path):
    """A categorical item attribute written as text (a brand) is kept per catalog item as text, saved beside
    the safetensors (it used to be cast to float after the whole fit, and the run failed); the category the
    cap and boosts group by is the first integer categorical attribute, not the spec's first attribute (a
    price listed before the category used to be taken)."""
    import json

    import pyarrow as pa

    from recloop.retrieval.data import ItemCatalog, newest_attributes
    from recloop.retrieval.retriever import saved_attributes
    from recloop.schema import DatasetSpec
    from recloop.serve.recommend import _candidate_context

    spec = DatasetSpec.model_validate({"name": "shop", "columns": [
        {"name": "event_id", "role": "event_id", "dtype": "string"},
        {"name": "ts", "role": "timestamp", "dtype": "timestamp"},
        {"name": "buyer", "role": "user_key", "dtype": "int64", "min": 0},
        {"name": "sku", "role": "item_key", "dtype": "int64", "min": 0},
        {"name": "bought", "role": "label", "dtype": "int8", "allowed": [0, 1]},
        {"name": "price", "role": "numeric", "dtype": "float64", "min": 0, "max": 1000},
        {"name": "brand", "role": "categorical", "dtype": "string"},
        {"name": "aisle", "role": "categorical", "dtype": "int64"}]})
    events = pa.table({"sku": [1, 2, 1, 3], "ts": pa.array([1, 2, 3, 4], pa.timestamp("us", tz="UTC")),
                       "price": [9.5, 3.0, 9.5, 4.0], "brand": ["acme", "zeta", "acme", None], "aisle": [4, 7, 4, 7],
                       "buyer": [1, 1, 2, 2]})
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"categorical": {f"c_{c}": {"num_embeddings": 10} for c in
                                                  ("buyer", "sku", "brand", "aisle")},
                                  "dense": ["d_price"], "multi_hot": {}}))
    features = RetrievalFeatures.for_spec(spec, events.to_pandas(), schema)
    assert features.item_attributes == ("price", "brand", "aisle") and features.category == "aisle"

    raw_ids = np.array([3, 1, 9, 2])  # 9: no row in the lake
    attributes = newest_attributes(events, "sku", "ts", features.item_attributes, raw_ids)
    assert attributes["brand"].tolist() == [None, "acme", None, "zeta"]
    np.testing.assert_array_equal(attributes["aisle"], [7, 4, np.nan, 7])

    retriever = Retriever.__new__(Retriever)  # the catalog's files alone, without a model
    retriever.catalog = ItemCatalog(np.arange(4), raw_ids, {}, np.zeros((4, 1), np.float32))
    retriever.item_clicks = np.zeros(4, np.int64)
    retriever.attributes = attributes
    retriever.save_items(tmp_path)
    items = {k: v.numpy() for k, v in load_file(tmp_path / "items.safetensors").items()}
    loaded = saved_attributes(tmp_path, items)
    assert loaded["brand"].tolist() == attributes["brand"].tolist()
    np.testing.assert_array_equal(loaded["price"], attributes["price"])
    retriever.attributes = loaded
    context = _candidate_context(retriever, np.array([1, 3, 2]), spec)
    assert context == {"price": [9.5, 3.0, None], "brand": ["acme", "zeta", None], "aisle": [4, 7, None]}
    assert type(context["aisle"][0]) is int and type(context["brand"][0]) is str


def test_the_windows_are_time_whatever_the_files_period():
    """Daily files: 12 hours held out is the newest day, and 7 days of training are 7 files (counting files
    held out 12 days and trained on 168); hourly files with gaps: the hours, not the files."""
    from datetime import timedelta

    from recloop.retrieval.train import RetrievalTrainError, time_windows

    start = datetime(2026, 1, 1, tzinfo=UTC)
    daily = [Path(f"{(start + timedelta(days=d)):%Y-%m-%dT%H}.parquet") for d in range(30)]
    validation, trainable, recent = time_windows(daily, validation_hours=12, days=7)
    assert validation == daily[-1:] and trainable == daily[:-1] and recent == daily[-8:-1]
    hourly = [Path(f"{(start + timedelta(hours=h)):%Y-%m-%dT%H}.parquet") for h in range(0, 96, 3)]  # every 3rd hour
    validation, _, recent = time_windows(hourly, validation_hours=6, days=1)
    assert [f.stem for f in validation] == ["2026-01-04T18", "2026-01-04T21"] and len(recent) == 8
    with pytest.raises(RetrievalTrainError, match="nothing is left"):
        time_windows(daily[:3], validation_hours=24 * 5, days=7)
    with pytest.raises(RetrievalTrainError, match="no training rows in the 7 days"):  # a gap before the held out
        time_windows([*daily[:3], *daily[-1:]], validation_hours=12, days=7)
    # A sparse log's last period holds one click: the held-out window grows back to the gate's minimum, never
    # past half of the periods.
    clicks = {f: (1 if f == daily[-1] else 60) for f in daily}
    validation, trainable, _ = time_windows(daily, validation_hours=12, days=7, min_clicks=150, clicks=clicks.get)
    assert validation == daily[-4:] and trainable == daily[:-4]
    validation, _, _ = time_windows(daily, validation_hours=12, days=7, min_clicks=10**6, clicks=clicks.get)
    assert len(validation) == 15


def test_a_retriever_flow_whose_candidate_was_judged_already_does_not_gate_it_again(prefect_server, home: Settings):
    """Two retriever flows in a row on one home (a retrain queued behind another): the first trains, registers and
    gates v1; the second finds the same run done and v1 judged, and skips the gate, saying so (issue 41)."""
    from flows.retriever_flow import retriever_flow
    from recloop.flow_support import settings_parameter

    first = retriever_flow(mode="full", days=3, epochs=1, validation_hours=12, settings=settings_parameter(home))
    assert first["gate"]["alias"] == "champion", first["gate"]
    record = registry.gate_record(registry.version_info(home, "1", registry.RETRIEVER_NAME).tags)
    second = retriever_flow(mode="full", days=3, epochs=1, validation_hours=12, settings=settings_parameter(home))
    assert "gate" not in second and second["train"]["mlflow"]["version"] == "1"
    assert second["skipped"].startswith("v1 was judged already (passed by the gate"), second["skipped"]
    assert registry.gate_record(registry.version_info(home, "1", registry.RETRIEVER_NAME).tags) == record
    assert len(registry.mlflow_client(home).search_model_versions(f"name='{registry.RETRIEVER_NAME}'")) == 1
