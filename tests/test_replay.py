"""A user's own log through the whole loop: a rating log with other key names (``customer``/``product``), a
genre multi-hot column, epoch-second timestamps, a spec file of any name — replayed week by week (ingest,
features with Feast, train, gate, drift, incremental vs full, baselines, the HTML report), then served."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import SMALL_MODEL_DIMS
from ratings_log import SPEC, START, write_log

from recloop import datasets
from recloop.model import ModelConfig
from recloop.replay import ReplayConfig, choose_period, run_replay
from recloop.settings import Settings


@pytest.fixture(scope="module")
def replayed(tmp_path_factory) -> tuple[Settings, dict]:
    root = tmp_path_factory.mktemp("replay")
    spec_file = root / "my_ratings_v2.yaml"  # the file name is not the spec's name
    spec_file.write_text(SPEC)
    settings = Settings(home=root / "home", frame_backend="pandas", serve_poll_seconds=60, admin_token="t")
    spec = datasets.resolve(settings, str(spec_file))
    config = ReplayConfig(
        period="week",
        periods=2,
        epochs=2,
        batch_size=512,
        device="cpu",
        model=ModelConfig(**SMALL_MODEL_DIMS),
        min_bootstrap_rows=500,
    )
    return settings, run_replay(settings, spec, write_log(root / "log", events=5000), config)


def test_the_replay_scores_each_period_before_training_on_it(replayed):
    settings, summary = replayed
    assert summary["period"] == "week" and len(summary["periods"]) == 2
    assert summary["source"]["rows_quarantined"] == 0  # epoch seconds and 1995.0 years: declared in the spec
    for period in summary["periods"]:
        assert period["landed"] > 200 and period["quarantined"] == 0
        scores = period["scores"]
        assert {
            "model",
            "incremental",
            "full",
            "baseline:base_rate",
            "baseline:ctr",
            "baseline:logistic",
        } <= set(scores)
        assert scores["baseline:base_rate"]["auc"] == 0.5
        for name in ("model", "incremental", "full", "baseline:ctr", "baseline:logistic"):
            assert 0.5 < scores[name]["auc"] < 1.0 and 0.0 < scores[name]["ndcg"] <= 1.0, (name, scores[name])
        assert period["gate"] in ("passed", "refused", "insufficient evidence") and period["incremental_version"]
        # an undecided candidate starts as the canary (judged on the next period's rows): said in the record
        assert period["gate"] != "insufficient evidence" or "canary" in period["canary"], period["canary"]
        # the champion against each baseline on the same rows, with paired intervals over the spec's users
        versus = scores["model"]["versus"]
        assert set(versus) == {"ctr", "logistic"} and versus["logistic"]["over"] == "users", versus
        for name, figures in versus.items():
            difference, low, high = figures["auc"]
            assert low <= difference <= high and figures["units"] > 20, (name, figures)
        assert versus["logistic"]["logloss"][1] <= versus["logistic"]["logloss"][2] and "logloss" not in versus["ctr"]
    # /recommend (retrieve → filter → rank) against popularity and co-occurrence, asked at each period's start
    for period in summary["periods"]:
        recommend = period["recommend"]
        assert recommend["users"] > 20 and recommend["errors"] == {}, recommend
        for name in ("recommend", "popularity", "cooccurrence"):
            assert 0.0 <= recommend[name]["ndcg@10"] <= 1.0 and 0.0 <= recommend[name]["recall@10"] <= 1.0
        for name in ("popularity", "cooccurrence"):
            difference, low, high = recommend["recommend"][f"versus {name}"]["recall@10"]
            assert low <= difference <= high, recommend
        # the served lists find what users went on to like: the spec's rows are choices (`events: chosen`), so
        # /recommend weighs how likely a user picks an item beside the ranker's "will they like it" (0.12 and
        # 0.07 by the ranker alone on this log, 0.67 and 0.64 with the retriever's propensity)
        assert recommend["recommend"]["recall@10"] > 0.3, recommend
    # the champion against the baselines over every period's rows together, paired over users
    scored = summary["scores_overall"]
    assert scored["rows"] == sum(p["scores"]["model"]["rows"] for p in summary["periods"]) and scored["periods"] == 2
    assert set(scored["versus"]) == {"ctr", "logistic"} and scored["versus"]["logistic"]["over"] == "users"
    for figures in scored["versus"].values():
        assert figures["auc"][1] <= figures["auc"][0] <= figures["auc"][2]
    loss = scored["versus"]["logistic"]["logloss"]
    per_period = [p["scores"]["model"]["logloss"] - p["scores"]["baseline:logistic"]["logloss"] for p in summary["periods"]]
    rows = [p["scores"]["model"]["rows"] for p in summary["periods"]]
    # log loss is a mean over rows: the pooled difference is the periods' differences weighted by their rows
    assert abs(loss[0] - sum(d * n for d, n in zip(per_period, rows, strict=True)) / sum(rows)) < 1e-3, loss
    # every period's users together: each user-period a unit, the means weighted by the periods' users
    overall = summary["recommend_overall"]
    periods = [p["recommend"] for p in summary["periods"]]
    assert overall["users"] == sum(p["users"] for p in periods)
    for name in ("recommend", "popularity", "cooccurrence"):
        weighted = sum(p[name]["recall@10"] * p["users"] for p in periods) / overall["users"]
        assert abs(overall[name]["recall@10"] - weighted) < 1e-3, (name, overall, periods)
    difference, low, high = overall["recommend"]["versus popularity"]["recall@10"]
    assert low <= difference <= high
    assert abs(difference - (overall["recommend"]["recall@10"] - overall["popularity"]["recall@10"])) < 1e-3
    assert all(p["retriever_version"] for p in summary["periods"]), [p["retriever_gate"] for p in summary["periods"]]
    assert summary["periods"][1]["drift"] in ("ok", "drift", "insufficient_data", "data_quality")
    # each period's incremental candidate made one pass over it (the full retrains' epochs are theirs alone)
    from recloop import checkpoint

    for period in summary["periods"]:
        state = checkpoint.read(checkpoint.resolve(settings, period["incremental_version"]))
        assert (state["train"]["mode"], state["train"]["epochs"]) == ("incremental", 1), state["train"]
    # every full retrain chose its embedding penalty among the replay's (the default 0.01, or 0.1 or 1.0)
    assert summary["bootstrap_gate"]["embedding_l2"] in (0.01, 0.1, 1.0)
    assert all(p["full_embedding_l2"] in (0.01, 0.1, 1.0) for p in summary["periods"]), summary["periods"]
    first = checkpoint.read(checkpoint.resolve(settings, summary["bootstrap_gate"]["version"]))
    kept = summary["bootstrap_gate"]["embedding_l2"]  # the default kept stays unset (its chain trains at its own)
    assert first["train"]["embedding_l2"] == (None if kept == 0.01 else kept)
    report = Path(summary["report"]).read_text()
    assert "baseline:logistic AUC" in report and "recloop replay: ratings" in report
    assert "champion − baseline (95 % paired bootstrap)" in report and "logistic: auc " in report
    assert json.loads((settings.home / "reports" / "replay.json").read_text())["period"] == "week"
    assert "Recommendations: /recommend against popularity and co-occurrence" in report
    assert "<tr><td>all</td>" in report  # the pooled row under the periods'
    assert "Over every replayed period's" in report
    assert f"(penalty {summary['periods'][0]['full_embedding_l2']:g})" in report


def test_features_and_feast_follow_the_spec_keys_and_genre_vocabulary(replayed):
    from recloop.features import store
    from recloop.features.definition import FeatureLayout

    settings, _ = replayed
    assert store.join_keys(settings) == {"user": "customer", "item": "product"}
    online = store.online_features(settings, {"customer": [1, 2], "product": [3, 4]})
    assert {"customer", "product", "user_events_total", "item_events_total"} <= set(online.columns)
    schema = json.loads(FeatureLayout.for_settings(settings).schema.read_text())
    # The genre lists have a vocabulary of their own (20 genres + reserved rows), not the item vocabulary's.
    assert schema["multi_hot"]["m_genres"]["vocabulary"] == "genres"
    assert (
        schema["multi_hot"]["m_genres"]["num_embeddings"]
        <= 22
        < schema["categorical"]["c_product"]["num_embeddings"]
    )
    assert (settings.home / "spec.yaml").read_text().count("customer") == 1  # the home remembers the spec


def test_the_replayed_champion_serves_requests_by_the_spec_keys(replayed):
    from fastapi.testclient import TestClient

    from recloop.serve.app import create_app

    settings, _ = replayed
    with TestClient(create_app(settings)) as client:  # no spec given: the home's
        answer = client.post(
            "/rank",
            json={
                "user_id": 1,
                "item_ids": [3, 4, 5],
                "context": {"genres": [[1, 2], [3], [4, 5]], "year": 1999},
            },
        )
        assert answer.status_code == 200, answer.text
        assert sorted(i["item_id"] for i in answer.json()["items"]) == [3, 4, 5]
        # the spec allows no null in genres (a list) or year (a number): left out, both are named at once
        refused = client.post("/rank", json={"user_id": 1, "item_ids": [3]})
        assert refused.status_code == 422 and "['year', 'genres'] required" in refused.text, refused.text


def test_the_period_is_inferred_from_density():
    import numpy as np

    day = 86_400 * 1_000_000
    dense = np.arange(0, 20 * day, day // 1000)  # 1000 events a day
    assert choose_period(dense, 3, 500) == "day"
    sparse = np.arange(0, 200 * day, day // 100)  # 100 a day: 700 a week
    assert choose_period(sparse, 3, 500) == "week"


def test_the_example_spec_in_the_readme_loads():
    from recloop.schema import load_spec

    spec = load_spec(Path(__file__).parents[1] / "examples" / "ratings.yaml")
    assert (spec.user_key, spec.item_key, spec.column("rated_at").format) == (
        "customer",
        "product",
        "epoch_s",
    )


def test_replay_refuses_bad_options_clearly(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from recloop.cli import app

    monkeypatch.setenv("RECLOOP_HOME", str(tmp_path / "home"))
    missing = CliRunner().invoke(app, ["replay", "--data", str(tmp_path / "nowhere")])
    assert missing.exit_code == 2 and "does not exist" in missing.output
    fortnight = CliRunner().invoke(app, ["replay", "--data", str(tmp_path), "--period", "fortnight"])
    assert fortnight.exit_code == 2 and "fortnight" in fortnight.output


def test_every_flow_and_the_drift_triggered_retrain_take_the_spec():
    import inspect

    import yaml

    from flows.drift_flow import drift_flow
    from flows.features_flow import features_flow
    from flows.ingest_flow import ingest_flow
    from flows.retrain_flow import retrain_flow

    for flow in (drift_flow, features_flow, ingest_flow, retrain_flow):
        assert inspect.signature(flow.fn).parameters["spec"].default is None, (
            flow.name
        )  # None: the home's spec
    deployments = yaml.safe_load((Path(__file__).parents[1] / "prefect.yaml").read_text())["deployments"]
    [full] = [d for d in deployments if d["name"] == "full-retrain"]
    assert full["triggers"][0]["parameters"]["spec"] == "{{ event.payload.spec }}"


def test_a_spec_is_resolved_once_the_same_way_everywhere(tmp_path, monkeypatch):
    settings = Settings(home=tmp_path / "home")
    assert datasets.source(settings) == "synthetic"
    spec_file = tmp_path / "odd name.yml"
    spec_file.write_text(SPEC)
    assert datasets.resolve(settings, str(spec_file)).name == "ratings"
    assert datasets.source(settings) == str(settings.home.resolve() / "spec.yaml")  # remembered by the home
    assert datasets.resolve(settings).user_key == "customer"
    assert datasets.source(Settings(home=tmp_path / "home", spec="criteo")) == "criteo"  # RECLOOP_SPEC wins
    monkeypatch.chdir(tmp_path)
    assert datasets.source(settings, "odd name.yml") == str(spec_file.resolve())  # paths made absolute


def test_the_retrain_flow_takes_new_files_of_the_users_log_to_a_gated_version(replayed, prefect_server, tmp_path):
    """After the replay: a later week of the same log dropped into the landing zone, the hourly retrain flow
    (as the deployment runs it, spec from the home) lands it, trains from the champion, gates and serves it.
    Runs last in this module: it moves the shared home forward."""
    import pandas as pd

    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.flow_support import settings_parameter

    settings, _ = replayed
    later = pd.read_csv(next(write_log(tmp_path / "later", events=6000, weeks=10, seed=3, files=1).glob("*.csv")))
    later = later[later["rated_at"] >= START + 8 * 7 * 86400].assign(rating_id=lambda f: "later-" + f["rating_id"])
    settings.landing_dir.mkdir(parents=True, exist_ok=True)
    later.to_csv(settings.landing_dir / "week-9.csv", index=False)
    champion_before = registry.version_by_alias(settings, "champion")
    undecided = registry.version_by_alias(settings, "challenger")  # the replay's canary, if its last was undecided

    result = retrain_flow(mode="incremental", validation_hours=24, settings=settings_parameter(settings))
    assert datasets.resolve(settings, result["spec"], remember=False).user_key == "customer"  # the home's spec
    assert result["ingest"]["rows_landed"] == len(later) and result["ingest"]["rows_quarantined"] == 0
    if "train" not in result:
        # The replay handed its last, undecided candidate on as the challenger; the scheduled run judged it again on
        # the hours landed since its gate and, its canary started, waits for the canary's decision (whether the
        # replay's last gate was undecided depends on the run: the test takes whichever the replay left).
        assert undecided is not None and f"v{undecided}'s canary is still running" in result["skipped"], result
        assert result["grown_evidence"]["version"] == undecided
        from recloop.canary import controller

        controller.manual(settings, "rollback", "the test goes on to the retrain", who="test")
        assert registry.version_by_alias(settings, "challenger") is None
        result = retrain_flow(mode="incremental", validation_hours=24, settings=settings_parameter(settings))
        assert result["ingest"]["rows_landed"] == 0  # landed by the first run, trained on now
    trained = result["train"]
    assert trained["mode"] == "incremental" and trained["warm_start"] and trained["steps"] > 0
    gate = result["gate"]
    assert gate["version"] == trained["mlflow"]["version"] != champion_before
    # passed → challenger; insufficient evidence → challenger too (the canary decides); refused → no alias
    assert (gate["passed"] or gate["verdict"] == "insufficient evidence") == (gate["alias"] is not None)
    assert gate["passed"] or gate["reasons"] or gate["insufficient"]
    assert "retriever" in result  # the same flow ran the retriever on the spec's keys


def _logged(rng, rows: int, candidate_signal: float, champion_signal: float = 1.0) -> dict:
    """One period's logged rows as ``_score_period`` hands them over: labels, the champion's and the canary's
    scores (each the label times its signal plus its own noise), rows without a user key."""
    import numpy as np

    labels = (rng.random(rows) < 0.3).astype(np.float32)
    champion = champion_signal * labels + rng.normal(0, 1, rows)
    canary = candidate_signal * labels + rng.normal(0, 1, rows)
    return {"scored": {"model": (labels, champion), "canary": (labels, canary)}, "groups": None}


def test_an_undecided_candidate_is_judged_as_a_canary_on_the_logged_rows_that_follow():
    """A candidate the gate could not decide on was dropped, and on Criteo's 900-row days the first model was
    never replaced; the replay now runs it as the canary on the periods that follow, with the gate's paired
    test on every logged row it has met (module docstring, step 5)."""
    import numpy as np

    from recloop.replay import _Canary

    config = ReplayConfig(canary_periods=2)
    rng = np.random.default_rng(7)
    better = _Canary("4", "full", 1, champion="1")
    note, verdict = better.judge(_logged(rng, 3000, candidate_signal=2.0), config)
    assert verdict == "promote" and "shown non-inferior" in note and "3,000 logged rows" in note, note
    worse = _Canary("5", "incremental", 1, champion="1")
    note, verdict = worse.judge(_logged(rng, 3000, candidate_signal=0.0), config)
    assert verdict == "rollback" and "shown worse" in note, note
    # as good, on too few rows to tell: held while the rows add up, then rolled back as inconclusive
    undecided = _Canary("6", "incremental", 1, champion="1")
    note, verdict = undecided.judge(_logged(rng, 150, candidate_signal=1.0), config)
    assert verdict == "hold" and "insufficient evidence" in note, note
    note, verdict = undecided.judge(_logged(rng, 150, candidate_signal=1.0), config)
    assert verdict == "rollback" and "inconclusive after 2 period(s)" in note and "300 logged rows" in note, note


def test_one_canary_at_a_time_but_drift_full_retrain_takes_the_place_of_its_periods_incremental():
    from recloop.replay import _Canary

    canary, note = _Canary.offer(None, "3", "incremental", 2, champion="1")
    assert (canary.version, canary.champion) == ("3", "1") and note == "v3 starts as the canary"
    replaced, note = _Canary.offer(canary, "4", "full", 2, champion="1")
    assert replaced.version == "4" and "replaces v3" in note
    kept, note = _Canary.offer(replaced, "5", "incremental", 3, champion="1")
    assert kept is replaced and note == "v5 not served: canary v4 still runs"
    kept, note = _Canary.offer(replaced, "6", "full", 3, champion="1")  # a canary of an earlier period is not cut
    assert kept is replaced


def test_the_catalog_gives_the_ranker_each_items_genres(replayed):
    """``/recommend``'s rank stage gives each candidate its catalog attributes as context. A list fixed per
    item (a film's genres) was not among them, so the ranker, trained with genres, scored every candidate of
    a ratings log with its genres unknown, and what it fed back lacked a column the spec requires."""
    import numpy as np

    from recloop import registry
    from recloop.ingest.lake import read_window
    from recloop.retrieval.publish import retriever_folder
    from recloop.retrieval.retriever import Retriever
    from recloop.serve.recommend import _candidate_context

    settings, _ = replayed
    version = registry.aliases(settings, registry.RETRIEVER_NAME)["champion"]
    retriever = Retriever.load(retriever_folder(settings, version))  # as saved and loaded: JSON lists
    assert "genres" in retriever.features.item_attributes and "year" in retriever.attributes
    events = read_window(settings, datasets.resolve(settings, None), None, None, columns=["product", "genres"])
    seen: dict[int, list] = {}  # every list a product has in the lake (other tests of this module land more)
    for product, genres in zip(events["product"].to_pylist(), events["genres"].to_pylist(), strict=True):
        seen.setdefault(product, []).append(genres)
    positions = np.arange(min(20, len(retriever.catalog)))
    context = _candidate_context(retriever, positions, datasets.resolve(settings, None))
    ids = retriever.catalog.raw_ids[positions].tolist()
    assert all(genres in seen[i] for i, genres in zip(ids, context["genres"], strict=True)), context["genres"]
    assert any(context["genres"])
