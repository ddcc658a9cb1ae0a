"""``/recommend`` end to end: a real server, the shared champion ranker, a retriever trained on the same
lake and registered as ``recloop-retriever``; the filtering rules through the journal and the catalog
file; bad input; and the retriever's canary (sticky split, promote, roll back) beside the ranker's."""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx
import numpy as np
import pytest
from polling import eventually, wait_for
from safetensors.torch import load_file, save_file

from recloop import registry
from recloop.canary import CanaryConfig, controller
from recloop.gate.retrieval import RetrievalThresholds
from recloop.gate.retrieval_runner import run_retrieval_gate
from recloop.registry import RETRIEVER_NAME
from recloop.retrieval.data import RetrievalFeatures, read_rows
from recloop.retrieval.publish import log_retriever
from recloop.retrieval.retriever import Retriever
from recloop.retrieval.train import RetrievalTrainConfig, train_retriever
from recloop.serve.app import ServerThread, create_app
from recloop.serve.catalog import write_unavailable
from recloop.settings import Settings

TOKEN = "s3cret-admin-token"
TS = datetime(2026, 1, 3, 20, tzinfo=UTC).isoformat()  # inside the featurized days of the shared champion
CONTEXT = {"device": "ios", "country": "DE"}


@pytest.fixture(scope="module")
def home(champion_home: Settings, tmp_path_factory, copy_home) -> Settings:
    """The shared champion's home with a retriever trained on its lake, gated champion of recloop-retriever."""
    settings = copy_home(
        champion_home,
        tmp_path_factory.mktemp("recommend") / "home",
        feast=True,
        admin_token=TOKEN,
        serve_poll_seconds=0.1,
        feedback_flush_seconds=3600,
        recommend_candidates=200,
    )
    summary = train_retriever(
        settings,
        RetrievalTrainConfig(
            days=3, epochs=1, batch_size=256, validation_hours=12, eval_ks=(100,), device="cpu"
        ),
    )
    logged = log_retriever(settings, summary)
    outcome = run_retrieval_gate(
        settings, logged.version, RetrievalThresholds(k=100, min_recall=0.0, min_lift_over_popularity=0.0)
    )
    assert outcome["alias"] == "champion", outcome["reasons"]
    return settings


@pytest.fixture(scope="module")
def app(home: Settings):
    application = create_app(home)
    with ServerThread(application) as server:
        application.state.url = server.url
        application.state.service.unavailable.check_seconds = 0.0  # read the catalog file on every request
        yield application


@pytest.fixture
def http(app, home: Settings):
    """A client, with the retriever deployment reset to champion v1 and no challenger."""
    if registry.version_by_alias(home, "challenger", RETRIEVER_NAME):
        registry.remove_alias(home, "challenger", RETRIEVER_NAME)
    if registry.version_by_alias(home, "champion", RETRIEVER_NAME) != "1":
        registry.set_alias(home, "champion", "1", model_name=RETRIEVER_NAME)
    write_unavailable(home.unavailable_items_path, [])
    with httpx.Client(base_url=app.state.url, timeout=30) as client:
        wait_for(client, lambda h: h["retriever"]["versions"] == {"champion": "1", "challenger": None})
        yield client


def known_users(home: Settings, count: int) -> list[int]:
    training = sorted((home.home / "features" / "training").glob("*.parquet"))
    users = read_rows(training[-24:], RetrievalFeatures()).columns["user_id"]
    return [int(u) for u in dict.fromkeys(users.tolist())][:count]


def catalog(home: Settings) -> Retriever:
    from recloop.retrieval.publish import retriever_folder

    return Retriever.load(retriever_folder(home, "1"))


def test_a_history_with_a_null_in_it_is_one_list_not_one_per_candidate(http: httpx.Client, home: Settings):
    """``"history": [null, 5]`` was read as one value per candidate (its first element is null) and refused with
    "/recommend takes one value per column … not one per candidate"; it is one list with a null in it, which
    ingestion takes (the null is no item), so it is answered."""
    user = known_users(home, 1)[0]
    answer = http.post("/recommend", json={"user_id": user, "context": {**CONTEXT, "history": [None, 5]}, "k": 5,
                                           "ts": TS})
    assert answer.status_code == 200, answer.text
    per_candidate = http.post("/recommend", json={"user_id": user, "context": {**CONTEXT, "history": [[5], None]},
                                                  "k": 5, "ts": TS})
    assert per_candidate.status_code == 422 and "not one per candidate" in per_candidate.text
    text = http.post("/recommend", json={"user_id": user, "context": CONTEXT, "k": "5", "ts": TS})
    assert text.status_code == 422 and "valid integer" in text.text  # k is a JSON integer, not "5" (nor true)


def test_a_known_user_gets_k_items_from_the_catalog_named_by_both_models(http: httpx.Client, home: Settings):
    user = known_users(home, 1)[0]
    answer = http.post(
        "/recommend", json={"user_id": user, "context": {**CONTEXT, "history": [3, 5]}, "k": 10, "ts": TS}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    ids = [item["item_id"] for item in body["items"]]
    assert len(ids) == 10 == len(set(ids))
    assert body["retriever"] == {"version": "1", "variant": "champion"}
    assert body["ranker"] == {"version": "1", "variant": "champion"}
    assert body["source"] == "retrieval" and body["fallback_reason"] is None
    assert body["candidates"]["retrieved"] == 200 and body["candidates"]["ranked"] <= 200
    retriever = catalog(home)
    positions = retriever.positions(np.array(ids))
    assert (positions >= 0).all()  # every answer is a catalog item
    categories = retriever.attributes["category"][positions]
    assert np.unique(categories, return_counts=True)[1].max() <= home.recommend_category_cap
    scores = [item["score"] for item in body["items"]]
    assert (
        scores == sorted(scores, reverse=True) or len(set(categories)) < 10
    )  # best first (a cap can reorder)
    metrics = http.get("/metrics").text
    for stage in ("retrieve", "filter", "rank", "order", "total"):
        assert f'recloop_recommend_stage_seconds_count{{stage="{stage}"}}' in metrics
        cpu = re.search(rf'recloop_recommend_stage_cpu_seconds_total{{stage="{stage}"}} (\S+)', metrics)
        assert cpu and float(cpu.group(1)) > 0, stage
    assert 'recloop_recommendations_total{source="retrieval",variant="champion",version="1"}' in metrics
    assert 'recloop_retriever_info{alias="champion",version="1"} 1.0' in metrics
    assert 'recloop_model_evaluations_total{role="served",status="ok",version="retriever:1"}' in metrics


def test_seen_excluded_and_unavailable_items_are_filtered(http: httpx.Client, home: Settings):
    user = known_users(home, 2)[1]
    request = {"user_id": user, "context": CONTEXT, "k": 10, "ts": TS}
    first = http.post("/recommend", json=request).json()
    shown = [item["item_id"] for item in first["items"]]
    feedback = http.post(
        "/feedback", json={"request_id": first["request_id"], "impressions": shown, "clicks": shown[:1]}
    )
    assert feedback.status_code == 200 and feedback.json()["accepted"] == 10
    second = http.post("/recommend", json=request).json()
    again = [item["item_id"] for item in second["items"]]
    assert not set(again) & set(shown) and second["candidates"]["seen"] == 10  # shown within 24 h: left out
    excluded, withdrawn = again[:3], again[3:5]
    write_unavailable(home.unavailable_items_path, withdrawn)
    third = http.post("/recommend", json={**request, "exclude": excluded}).json()
    final = {item["item_id"] for item in third["items"]}
    assert not final & (set(excluded) | set(withdrawn) | set(shown))
    assert third["candidates"]["excluded"] == 3 and third["candidates"]["unavailable"] == 2
    later = http.post(
        "/recommend", json={**request, "ts": datetime(2026, 1, 5, tzinfo=UTC).isoformat()}
    ).json()
    assert later["candidates"]["seen"] == 0  # more than 24 h later the shown items may come back


def lake_clicks(home: Settings, before: datetime) -> dict[int, set[int]]:
    """Each user's clicked items in the lake before ``before``, read straight from the lake."""
    from recloop.ingest import lake
    from recloop.schema import load_spec

    spec = load_spec("synthetic")
    events = lake.read_window(home, spec, None, int(before.timestamp() * 1_000_000))
    clicks: dict[int, set[int]] = {}
    for user, item, label in zip(*(events[c].to_pylist() for c in ("user_id", "item_id", "label")), strict=True):
        if label == 1:
            clicks.setdefault(user, set()).add(item)
    return clicks


def test_items_a_user_clicked_in_the_lake_days_ago_are_never_recommended_to_them(http: httpx.Client,
                                                                                   home: Settings):
    """Issue 37: the journal knows one day of /feedback; the lake knows what the log says the user clicked."""
    clicks = lake_clicks(home, datetime.fromisoformat(TS) - timedelta(days=1))
    journaled = set(known_users(home, 2))  # the filter test's user has journal feedback: left out here
    user = max((u for u in clicks if u not in journaled), key=lambda u: len(clicks[u]))
    answer = http.post("/recommend", json={"user_id": user, "context": CONTEXT, "k": 100, "ts": TS}).json()
    ids = {item["item_id"] for item in answer["items"]}
    assert answer["skipped_filters"] == [] and answer["candidates"]["seen_history"] >= 1
    assert not ids & clicks[user]  # not one of the items they clicked a day or more ago
    # another user who never clicked such an item still gets it
    others = [u for u in clicks if u != user and u not in journaled][:20]
    given = {}
    for other in others:
        body = http.post("/recommend", json={"user_id": other, "context": CONTEXT, "k": 100, "ts": TS}).json()
        given[other] = {item["item_id"] for item in body["items"]} & (clicks[user] - clicks[other])
    assert any(given.values()), "no other user was recommended an item the first user clicked"


def test_recommend_answers_without_the_lake_history_until_the_feature_job_writes_it(http: httpx.Client,
                                                                                    home: Settings):
    from recloop.features.definition import FeatureLayout

    path = FeatureLayout.for_settings(home).seen
    aside = path.with_name("seen-aside.parquet")
    user = known_users(home, 1)[0]
    request = {"user_id": user, "context": CONTEXT, "k": 5, "ts": TS}
    path.rename(aside)
    try:
        answer = http.post("/recommend", json=request)
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert len(body["items"]) == 5 and body["candidates"]["seen_history"] == 0
        assert body["skipped_filters"] == ["seen_history: no history of the lake yet (the feature job writes it)"]
    finally:
        aside.rename(path)
    body = http.post("/recommend", json=request).json()  # published again: read on the next request
    assert body["skipped_filters"] == [] and body["candidates"]["seen_history"] >= 1


def test_an_unknown_user_gets_the_popular_items_and_is_told_so(http: httpx.Client, home: Settings):
    answer = http.post("/recommend", json={"user_id": 10**12, "context": CONTEXT, "k": 5, "ts": TS})
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["source"] == "popularity" and "unknown" in body["fallback_reason"]
    popular = set(catalog(home).popular(200).tolist())
    assert len(body["items"]) == 5 and {item["item_id"] for item in body["items"]} <= popular
    assert body["retriever"]["version"] == "1" and body["ranker"]["version"] == "1"


def test_on_a_log_of_choices_an_unknown_users_popular_items_are_ordered_by_popularity_too(home: Settings):
    """The order stage's propensity for the popular answer: each item's share of the retriever's training
    clicks (+1), normalized over what is left; the similarity path unchanged. Before, the popular answer kept
    the ranker's order alone: a ratings log's unknown users got the best-rated rarities (RESULTS.md)."""
    from recloop.serve.recommend import pick_propensity

    retriever = catalog(home)
    popular = retriever.popular(50)
    kept = popular[::-1][:40]  # the least popular of the 50 first
    clicks = retriever.item_clicks[retriever.positions(kept)].astype(float)
    assert clicks.max() > clicks.min()  # popularity varies over them, or the test shows nothing
    propensity = pick_propensity(retriever, popular, None, kept, 1.0)
    np.testing.assert_allclose(propensity, (clicks + 1) / (clicks + 1).sum(), rtol=1e-9)
    assert np.argmax(propensity) == np.argmax(clicks)
    halved = pick_propensity(retriever, popular, None, kept, 0.5)
    np.testing.assert_allclose(halved, np.exp(0.5 * np.log(propensity)), rtol=1e-9)
    similarity = np.linspace(0.9, 0.1, len(popular))
    by_similarity = pick_propensity(retriever, popular, similarity, kept, 1.0)
    np.testing.assert_allclose(by_similarity, np.exp(retriever.log_propensity(kept, similarity[::-1][:40])))


@pytest.mark.parametrize(
    "change",
    [
        {"k": 0},
        {"k": 101},
        {"k": "ten"},
        {"user_id": -1},
        {"extra": 1},
        {"context": {"category": 3}},
        {"context": {"device": ["ios", "web"]}},
        {"context": {"colour": "red"}},
        {"exclude": list(range(1001))},
    ],
)
def test_bad_requests_are_refused_with_422(http: httpx.Client, change: dict):
    answer = http.post("/recommend", json={"user_id": 3, "context": CONTEXT, "k": 10, **change})
    assert answer.status_code == 422, answer.text


def test_a_body_over_the_limit_is_refused_before_it_is_read(http: httpx.Client, home: Settings):
    answer = http.post(
        "/recommend",
        content=b'{"user_id": 1, "context": {"x": "' + b"a" * home.serve_max_body_bytes + b'"}}',
        headers={"content-type": "application/json"},
    )
    assert answer.status_code == 413


def twin(home: Settings, broken: bool = False) -> str:
    """A new recloop-retriever version: the champion's folder registered again (its weights garbled if broken)."""
    from recloop.retrieval.publish import retriever_folder
    from recloop.retrieval.train import RetrievalSummary, read_state

    source = retriever_folder(home, "1")
    target = home.home / "retrieval" / f"twin-{time.time_ns()}"
    shutil.copytree(source, target)
    if broken:
        (target / "model.safetensors").write_bytes(b"not a safetensors file")
    else:  # saved again with metadata: another file, or it would be the champion's version (the same digest)
        save_file(load_file(target / "model.safetensors"), target / "model.safetensors", metadata={"twin": target.name})
    summary = RetrievalSummary(**read_state(target)["summary"])
    return log_retriever(
        home, replace(summary, checkpoint=str(target), run_id=f"{summary.run_id}-{target.name}")
    ).version


def test_the_retriever_canary_splits_users_on_its_own_and_promotes(http: httpx.Client, home: Settings):
    challenger = twin(home)
    registry.set_alias(home, "challenger", challenger, who="test", model_name=RETRIEVER_NAME)
    config = CanaryConfig(
        steps=(0.5, 1.0),
        bake_seconds=0,
        min_requests=5,
        min_feedback=15,
        max_p99_ratio=100.0,
        holdout=0.0,  # straight to 100 % (the champion holdout at the last step is the ranker tests')
    )
    started = controller.step(home, config, model_name=RETRIEVER_NAME)  # not started yet: the step starts it
    assert started.action == "start" and started.status.model == RETRIEVER_NAME
    assert registry.aliases(home)["challenger"] is None  # the ranker's canary is untouched
    wait_for(
        http,
        lambda h: h["retriever"]["versions"]["challenger"] == challenger and h["retriever"]["share"] == 0.5,
    )
    users = known_users(home, 20)
    seen = {}
    for user in users * 2:
        body = http.post("/recommend", json={"user_id": user, "context": CONTEXT, "k": 5, "ts": TS}).json()
        assert body["ranker"] == {"version": "1", "variant": "champion"}
        if user in seen:
            assert body["retriever"] == seen[user]  # sticky: a user stays with one retriever
        seen[user] = body["retriever"]
        shown = [item["item_id"] for item in body["items"]]
        http.post(
            "/feedback", json={"request_id": body["request_id"], "impressions": shown, "clicks": shown[:1]}
        )
    variants = {v["variant"] for v in seen.values()}
    assert variants == {"champion", "challenger"}
    assert {v["version"] for v in seen.values() if v["variant"] == "challenger"} == {challenger}
    status = controller.status(home, config, model_name=RETRIEVER_NAME)
    assert status.stats["challenger"].requests >= 5 and status.stats["challenger"].impressions >= 15
    assert status.stats["challenger"].online_auc is None  # a retriever has no scores of its own to judge
    stepped = controller.step(home, config, model_name=RETRIEVER_NAME)
    assert stepped.action == "step" and stepped.decision.share == 1.0, stepped.decision
    wait_for(http, lambda h: h["retriever"]["share"] == 1.0)
    for user in users[:10]:
        body = http.post("/recommend", json={"user_id": user, "context": CONTEXT, "k": 5, "ts": TS}).json()
        shown = [item["item_id"] for item in body["items"]]
        http.post(
            "/feedback", json={"request_id": body["request_id"], "impressions": shown, "clicks": shown[:1]}
        )
    promoted = controller.step(home, config, model_name=RETRIEVER_NAME)
    assert promoted.action == "promote", promoted.decision
    assert registry.aliases(home, RETRIEVER_NAME) == {
        "champion": challenger,
        "challenger": None,
        "previous": "1",
    }
    assert registry.aliases(home)["champion"] == "1"
    import mlflow

    runs = mlflow.search_runs(
        experiment_names=["recloop-canary"], filter_string=f"tags.`recloop.model` = '{RETRIEVER_NAME}'"
    )
    assert f"canary-retriever-v{challenger}" in set(runs["tags.mlflow.runName"])
    wait_for(http, lambda h: h["retriever"]["versions"]["champion"] == challenger)


def test_the_rankers_interleaved_canary_merges_both_rankings_on_recommend_and_credits_teams(
    http: httpx.Client, home: Settings
):
    """Half of the demo's traffic goes to /recommend: its rank stage interleaves too, so each of those
    requests is evidence for the ranker's canary, credited to the ranker that placed each clicked item."""
    import json

    from variants import inverted, variant

    from recloop.journal import open_journal

    version = variant(home, inverted)
    registry.set_alias(home, "challenger", version, who="test", why="interleaving on /recommend")
    controller.start(home, CanaryConfig(steps=(1.0,), holdout=0.0))  # interleave: the ranker's default
    wait_for(http, lambda h: h["versions"]["challenger"] == version and h["mode"] == "interleave")
    retriever = catalog(home)
    clicked = 0
    # users whose lake history (the seen_history filter) leaves enough of the small test catalog for 10 items
    history = lake_clicks(home, datetime(2026, 1, 5, tzinfo=UTC))
    users = [u for u in known_users(home, 100) if len(history.get(u, ())) <= 30][:15]
    assert len(users) == 15
    for user in users:
        body = http.post("/recommend", json={"user_id": user, "context": CONTEXT, "k": 10, "ts": TS}).json()
        assert body["ranker"] == {"version": version, "variant": "interleave"}
        shown = [item["item_id"] for item in body["items"]]
        categories = retriever.attributes["category"][retriever.positions(np.array(shown))]
        assert np.unique(categories, return_counts=True)[1].max() <= home.recommend_category_cap
        http.post("/feedback", json={"request_id": body["request_id"], "impressions": shown, "clicks": shown[:2]})
        clicked += 2
    journal = open_journal(home)
    try:
        rows = journal._query("SELECT payload FROM requests WHERE variant = 'interleave' AND served_version = ?",
                              [version])
        _, champion_clicks, challenger_clicks = journal.interleaving_credits(version)
    finally:
        journal.close()
    assert len(rows) == 15
    own_scores = {0: [], 1: []}  # the champion's score of the items each team placed
    for (raw,) in rows:
        payload = json.loads(raw)
        assert payload["route"] == "recommend" and payload["interleaving"]["champion"] == "1"
        assert len(payload["interleaving"]["teams"]) == len(payload["ranked"]) == 10
        for team, score in zip(payload["interleaving"]["teams"], payload["scores"]["1"], strict=True):
            own_scores[team].append(score)
    # the challenger is the champion inverted: what its team placed, the champion scores lower
    assert np.mean(own_scores[0]) > np.mean(own_scores[1])
    assert champion_clicks.sum() + challenger_clicks.sum() == clicked  # every click credited to one team
    judged = controller.status(home, CanaryConfig(steps=(1.0,), holdout=0.0, bake_seconds=0, min_requests=5,
                                                  min_feedback=10))
    assert judged.evidence is not None and judged.evidence["units"] > 0
    controller.manual(home, "rollback", "test over")
    wait_for(http, lambda h: h["versions"]["challenger"] is None)


def test_a_retriever_that_does_not_load_is_rolled_back_while_the_champion_serves(
    http: httpx.Client, home: Settings
):
    broken = twin(home, broken=True)
    registry.set_alias(home, "challenger", broken, who="test", model_name=RETRIEVER_NAME)
    controller.start(home, CanaryConfig(), model_name=RETRIEVER_NAME)
    health = wait_for(http, lambda h: broken in h["retriever"]["load_failures"])
    assert health["retriever"]["versions"]["challenger"] is None
    answer = http.post(
        "/recommend", json={"user_id": known_users(home, 1)[0], "context": CONTEXT, "k": 5, "ts": TS}
    )
    assert answer.status_code == 200 and answer.json()["retriever"]["version"] == "1"
    # the server tags the version as failing to load; the controller reads the tag
    eventually(lambda: controller.LOAD_FAILED_TAG in registry.version_info(home, broken, RETRIEVER_NAME).tags,
               10, "the load failure was never recorded on the version")
    step = controller.step(home, CanaryConfig(), model_name=RETRIEVER_NAME)
    assert step.action == "rollback" and "does not load" in step.decision.reasons[0]
    assert registry.aliases(home, RETRIEVER_NAME)["challenger"] is None


def test_admin_routes_act_on_the_model_they_name(http: httpx.Client, home: Settings):
    challenger = twin(home)
    registry.set_alias(home, "challenger", challenger, who="test", model_name=RETRIEVER_NAME)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    interleave = http.post("/admin/canary", json={"share": 0.3, "mode": "interleave", "model": RETRIEVER_NAME},
                           headers=auth)  # it would serve no one: /recommend routes canary and shadow only
    assert interleave.status_code == 422 and "cannot interleave" in interleave.json()["detail"]
    answer = http.post("/admin/canary", json={"share": 0.3, "model": RETRIEVER_NAME}, headers=auth)
    assert answer.status_code == 200 and answer.json()["version"] == challenger
    assert http.get("/healthz").json()["retriever"]["share"] == 0.3
    assert (
        http.post("/admin/canary", json={"share": 0.3}, headers=auth).status_code == 409
    )  # the ranker has none
    answer = http.post("/admin/rollback", json={"reason": "test", "model": RETRIEVER_NAME}, headers=auth)
    assert answer.status_code == 200 and answer.json()["aliases"]["challenger"] is None


def test_no_retriever_answers_503_with_the_reason(champion_home: Settings, tmp_path: Path, copy_home):
    settings = copy_home(champion_home, tmp_path / "home", feast=True)
    with ServerThread(create_app(settings)) as server:
        answer = httpx.post(f"{server.url}/recommend", json={"user_id": 3, "k": 5}, timeout=30)
        assert answer.status_code == 503 and "recloop-retriever" in answer.json()["detail"]
        assert httpx.get(f"{server.url}/healthz", timeout=30).status_code == 200  # /rank does not need one


def test_an_incremental_retriever_starts_from_the_retriever_champion(home: Settings):
    """The retrain flow's retriever step: warm start from the registered champion (through the registry, not
    a path on the trainer's disk); with no hour the champion has not seen, nothing is trained."""
    from recloop import checkpoint, pipeline
    from recloop.retrieval.train import RetrievalTrainError

    champion = registry.version_by_alias(home, "champion", RETRIEVER_NAME)
    base = pipeline.retriever_warm_start(home)
    assert base == checkpoint.resolve(home, champion, RETRIEVER_NAME) and (base / "state.json").exists()
    versions = registry.aliases(home, RETRIEVER_NAME)
    with pytest.raises(RetrievalTrainError, match="nothing new to train on"):
        pipeline.train_and_register_retriever(
            home, RetrievalTrainConfig(mode="incremental", validation_hours=12, device="cpu")
        )
    assert registry.aliases(home, RETRIEVER_NAME) == versions


def test_recommend_answers_without_the_seen_filter_when_the_journal_cannot_be_read(
        home: Settings, tmp_path: Path, copy_home):
    """The seen filter reads the journal's store (PostgreSQL across replicas); with the store failing, the
    answer comes without that filter and says so, instead of a 500 for every user (/rank kept working)."""
    settings = copy_home(home, tmp_path / "home", feast=True, feedback_flush_seconds=3600)
    application = create_app(settings)
    with ServerThread(application) as server:
        user = known_users(settings, 1)[0]
        answer = httpx.post(f"{server.url}/recommend", json={"user_id": user, "k": 5}, timeout=30)
        assert answer.status_code == 200 and answer.json()["skipped_filters"] == []
        application.state.service.journal._query("DROP TABLE feedback", [])  # the store fails every read of it
        answer = httpx.post(f"{server.url}/recommend", json={"user_id": user, "k": 5}, timeout=30)
        assert answer.status_code == 200, answer.text
        assert answer.json()["skipped_filters"][0].startswith("seen: the journal could not be read")
        assert len(answer.json()["items"]) == 5


def test_a_retriever_under_row_budgets_recommends_after_evicting(champion_home: Settings, tmp_path: Path, copy_home):
    """The champion retriever trained under budgets far below its users and items (40 and 30 rows): a user who
    kept a row is answered by retrieval, an evicted one by the popular items (told why), never an error; the
    index holds the evicted items too (embedded from their fallback rows)."""
    from recloop.model.retrieval import RetrievalConfig

    settings = copy_home(champion_home, tmp_path / "home", feast=True, recommend_candidates=50)
    model = RetrievalConfig(max_rows=(("c_user_id", 40), ("c_item_id", 30)), fallback_rows=8, admit_after=1)
    summary = train_retriever(settings, RetrievalTrainConfig(days=3, epochs=1, batch_size=256, validation_hours=12,
                                                             eval_ks=(50,), device="cpu", model=model))
    logged = log_retriever(settings, summary)
    outcome = run_retrieval_gate(settings, logged.version, RetrievalThresholds(k=50, min_recall=0.0,
                                                                                 min_lift_over_popularity=0.0))
    assert outcome["alias"] == "champion", outcome["reasons"]
    retriever = Retriever.load(Path(summary.checkpoint))
    user_tower, item_tower = retriever.model.user_tower, retriever.model.item_tower
    assert user_tower.embeddings.rows_held()["c_user_id"] == 40 and item_tower.embeddings.rows_held()["c_item_id"] == 30
    assert len(retriever.catalog) > 30  # every catalog item is indexed, most without a row of their own
    rows = read_rows(sorted((settings.home / "features" / "training").glob("*.parquet"))[-24:], RetrievalFeatures())
    users = dict(zip(rows.columns["user_id"].tolist(), rows.columns["c_user_id"].tolist(), strict=True))
    kept = next(raw for raw, index in users.items() if retriever.has_user_row(index))
    evicted = next(raw for raw, index in users.items() if not retriever.has_user_row(index))
    with ServerThread(create_app(settings)) as server:
        answers = {who: httpx.post(f"{server.url}/recommend", json={"user_id": user, "context": CONTEXT, "k": 5,
                                                                     "ts": TS}, timeout=30)
                   for who, user in (("kept", kept), ("evicted", evicted))}
    for who, answer in answers.items():
        assert answer.status_code == 200, (who, answer.text)
        assert len(answer.json()["items"]) == 5 and answer.json()["retriever"]["version"] == logged.version
    assert answers["kept"].json()["source"] == "retrieval"
    assert answers["evicted"].json()["source"] == "popularity"
    assert "no row" in answers["evicted"].json()["fallback_reason"]
