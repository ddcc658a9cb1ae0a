"""The canary's one ``canary`` tag on the challenger's version: what the controller writes at each change of a
real MLflow registry, and what serving reads from it (share, mode, salt). No server, no traffic: the
controller is judged on an empty journal with guardrails that need none (test_serve.py runs real traffic)."""

from __future__ import annotations

import json
import time

import pytest

from recloop import registry
from recloop.canary import CanaryConfig, controller
from recloop.canary.tag import (
    CANARY_TAG,
    CanaryTag,
    kpi_baseline,
    kpi_baseline_tag,
    load_failure,
    load_failure_tag,
)
from recloop.serve.models import RegistryReader, Wanted, registry_wanted
from recloop.settings import Settings

# Nothing to wait for: each step is judged at once (no traffic breaks no guardrail); A/B by user.
# Promotion needs the CTR evidence that only traffic brings: here an operator promotes.
QUICK = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=0, min_feedback=0, holdout=0.0, mode="canary")


@pytest.fixture(scope="module")
def home(champion_home: Settings, tmp_path_factory, copy_home) -> Settings:
    """A copy of the shared champion's installation (v1 champion) for this module's versions."""
    return copy_home(champion_home, tmp_path_factory.mktemp("canary-tag") / "home")


@pytest.fixture
def challenger(home: Settings) -> str:
    """A new version (the champion's model) as the challenger, its canary not started."""
    info = registry.version_info(home, "1")
    version = registry.register(home, info.source, info.run_id)
    registry.set_alias(home, "challenger", version, who="test", why="canary tag test")
    return version


def canary_tags(home: Settings, version: str) -> tuple[list[str], CanaryTag | None]:
    """The version's tag keys about the canary, and its ``canary`` tag read back."""
    tags = registry.version_info(home, version).tags
    return sorted(k for k in tags if k.startswith("canary")), CanaryTag.from_tags(tags)


def test_start_step_promote_leaves_one_tag_that_serving_reads(home: Settings, challenger: str):
    reader = RegistryReader()  # a watcher's source: one client kept from poll to poll sees every change
    assert registry_wanted(home) == reader(home) == Wanted("1", challenger, 0.0, "canary", None)  # no traffic yet
    controller.start(home, QUICK, now=1000.0)
    keys, tag = canary_tags(home, challenger)
    assert keys == [CANARY_TAG, f"{CANARY_TAG}.json"]  # a line to read, the state as JSON
    assert (tag.state, tag.share, tag.mode, tag.started_at, tag.step_started_at) == ("running", 0.5, "canary",
                                                                                      1000.0, 1000.0)
    assert tag.salt.startswith(f"recloop-canary-v{challenger}-")
    assert registry_wanted(home) == reader(home) == Wanted("1", challenger, 0.5, "canary", tag.salt)

    stepped = controller.step(home, QUICK, now=2000.0)
    assert stepped.action == "step", stepped.decision
    keys, tag = canary_tags(home, challenger)
    assert keys == [CANARY_TAG, f"{CANARY_TAG}.json"]  # a line to read, the state as JSON
    assert (tag.state, tag.share, tag.step_started_at, tag.started_at, tag.last_action) == ("running", 1.0, 2000.0,
                                                                                            1000.0, "step")
    assert tag.run_id is not None and tag.last_reasons == stepped.decision.reasons
    assert registry_wanted(home) == Wanted("1", challenger, 1.0, "canary", tag.salt)  # same salt: same users

    held = controller.step(home, QUICK, now=3000.0)  # no users: non-inferiority not shown (test_serve.py shows it)
    assert held.action == "hold", held.decision
    _, tag = canary_tags(home, challenger)
    assert (tag.state, tag.share, tag.step_started_at, tag.last_action) == ("running", 1.0, 2000.0, "hold")
    controller.manual(home, "promote", "looks good", who="carol")
    keys, final = canary_tags(home, challenger)
    assert keys == [CANARY_TAG, f"{CANARY_TAG}.json"]  # a line to read, the state as JSON
    assert (final.state, final.last_action, final.run_id, final.salt) == ("promoted", "promote", tag.run_id, tag.salt)
    assert final.reasons == ("manual promote by carol: looks good",) and final.serving_share == 0.0
    assert registry.aliases(home) == {"champion": challenger, "challenger": None, "previous": "1"}
    assert registry_wanted(home) == reader(home) == Wanted(challenger, None, 0.0, "canary", None)
    registry.promote(home, "1", who="test", why="back to v1 for the next test")


def test_start_rollback_leaves_one_tag_saying_rolled_back(home: Settings, challenger: str):
    controller.start(home, QUICK, mode="shadow")
    _, started = canary_tags(home, challenger)
    assert registry_wanted(home) == Wanted("1", challenger, 0.0, "shadow", started.salt)  # shadow: scores, serves no one
    controller.set_share(home, 0.25, who="alice")
    _, moved = canary_tags(home, challenger)
    assert (moved.share, moved.mode, moved.share_set_by, moved.salt) == (0.25, "shadow", "alice", started.salt)
    assert registry_wanted(home).share == 0.25

    controller.manual(home, "rollback", "bad reviews", who="bob")
    keys, tag = canary_tags(home, challenger)
    assert keys == [CANARY_TAG, f"{CANARY_TAG}.json"]  # a line to read, the state as JSON
    assert (tag.state, tag.share, tag.last_action) == ("rolled_back", 0.0, "rollback")
    assert tag.reasons == ("manual rollback by bob: bad reviews",) and tag.run_id is not None
    assert registry.aliases(home)["challenger"] is None and registry_wanted(home).challenger is None
    # A line a person reads in MLflow's UI, and the state as one JSON record beside it.
    tags = registry.version_info(home, challenger).tags
    assert json.loads(tags[f"{CANARY_TAG}.json"])["state"] == "rolled_back"
    assert tags[CANARY_TAG] == "rolled back: manual rollback by bob: bad reviews"


def test_a_version_tagged_before_the_one_tag_is_read_from_its_old_tags(home: Settings, challenger: str):
    registry.tag(home, challenger, {"canary.share": 0.25, "canary.mode": "interleave", "canary.salt": "old-salt",
                                    "canary.step_started_at": 1500.0, "canary.started_at": 1000.0})
    assert registry_wanted(home) == Wanted("1", challenger, 0.25, "interleave", "old-salt")
    seen = controller.status(home, QUICK, now=2000.0)
    assert seen.started and (seen.share, seen.mode, seen.step_started_at) == (0.25, "interleave", 1500.0)
    controller.manual(home, "rollback", "test over")
    _, tag = canary_tags(home, challenger)  # the next write is the one tag, carrying the old state over
    assert (tag.state, tag.salt, tag.started_at) == ("rolled_back", "old-salt", 1000.0)


def test_an_unreadable_tag_is_no_canary_not_a_crash(home: Settings, challenger: str):
    registry.tag(home, challenger, {CANARY_TAG: "{not json"})
    assert registry_wanted(home) == Wanted("1", challenger, 0.0, "canary", None)
    assert controller.status(home, QUICK).started is False
    registry.tag(home, challenger, {CANARY_TAG: json.dumps({"state": "exploded", "share": 0.5})})
    assert registry_wanted(home).share == 0.0
    registry.remove_alias(home, "challenger")


def test_tag_round_trip_and_the_other_one_tag_concerns():
    tag = CanaryTag(share=0.25, mode="interleave", salt="s", started_at=1.0, step_started_at=2.0, run_id="r",
                    last_action="step", last_reasons=("held", "every guardrail"))
    assert CanaryTag.from_tags(tag.to_tag()) == tag and list(tag.to_tag()) == [f"{CANARY_TAG}.json", CANARY_TAG]
    assert tag.to_tag()[CANARY_TAG] == "running: 25% of users, interleave; last check: step (held)"
    legacy = {CANARY_TAG: tag.to_tag()[f"{CANARY_TAG}.json"]}  # a version tagged before the readable line
    assert CanaryTag.from_tags(legacy) == tag
    assert CanaryTag.from_tags({}) is None and CanaryTag.from_tags({"gate": "passed"}) is None
    failed = {"serving.load_failed": json.dumps({"reason": "bad bytes", "at": time.time()})}
    assert load_failure(failed) == "bad bytes" and load_failure({"serving.load_failed": "old text"}) == "old text"
    assert load_failure({}) is None
    marked = load_failure_tag("bad bytes " * 100, 5.0)
    assert load_failure(marked) == ("bad bytes " * 100)[:4000] and marked["serving.load_failed"].startswith(
        "does not load in serving: bad bytes") and len(marked["serving.load_failed"]) <= 250
    earned = kpi_baseline_tag({"ctr": 0.1234, "auc": None, "impressions": 4321})
    assert kpi_baseline(earned) == {"ctr": 0.1234, "impressions": 4321.0}
    assert earned["kpi.baseline"] == "earned in its canary: CTR 0.1234, over 4,321 impressions"
    assert kpi_baseline({"kpi.baseline": json.dumps({"ctr": 0.1, "auc": None})}) == {"ctr": 0.1}
    assert kpi_baseline({"kpi.baseline_ctr": "0.2", "kpi.baseline_auc": "0.7"}) == {"ctr": 0.2, "auc": 0.7}
    assert kpi_baseline({"kpi.baseline": "[1, 2]"}) == {}


def test_running_names_the_challenger_only_while_its_canary_runs(home: Settings, challenger: str):
    """What a scheduled retrain waits for: a started canary, not yet promoted or rolled back."""
    assert controller.running(home) is None  # a challenger whose canary has not started
    controller.start(home, QUICK, now=1000.0)
    assert controller.running(home) == challenger
    version, tag = controller.running_tag(home)  # the same read, with the tag the retrain's wait needs
    assert version == challenger and tag.state == "running" and tag.started_at == 1000.0 and tag.share > 0
    assert controller.running(home, model_name=registry.RETRIEVER_NAME) is None  # each model its own canary
    controller.manual(home, "rollback", "test over")
    assert controller.running(home) is None
    registry.set_alias(home, "challenger", challenger, who="test", why="the alias back on a rolled-back version")
    assert controller.running(home) is None  # the tag's state, not the alias alone, says it runs
    registry.remove_alias(home, "challenger")

    promoted = registry.register(home, registry.version_info(home, "1").source, registry.version_info(home, "1").run_id)
    registry.set_alias(home, "challenger", promoted, who="test", why="promote it")
    controller.start(home, QUICK, now=1000.0)
    assert controller.running(home) == promoted
    controller.manual(home, "promote", "looks good")
    assert controller.running(home) is None and registry.aliases(home)["champion"] == promoted
    registry.set_alias(home, "challenger", promoted, who="test", why="the alias back on a promoted version")
    assert controller.running(home) is None
    registry.remove_alias(home, "challenger")
    registry.promote(home, "1", who="test", why="back to v1 for the next test")


def test_a_challenger_replaced_before_its_decision_is_marked_superseded(home: Settings, challenger: str):
    """A drift retrain's candidate takes the alias from a challenger still in its canary: that version's tag
    says superseded (share 0, by whom), so the MLflow UI shows no canary "running" for ever."""
    controller.start(home, QUICK, now=1000.0)
    source, run_id = registry.version_info(home, "1").source, registry.version_info(home, "1").run_id
    newer = registry.register(home, source, run_id)
    controller.set_challenger(home, newer, who="gate", why="passed the gate")
    _, old = canary_tags(home, challenger)
    assert old.state == "superseded" and old.serving_share == 0.0
    assert old.reasons == (f"superseded by v{newer} before a decision (gate: passed the gate)",)
    assert registry.aliases(home)["challenger"] == newer and controller.running(home) is None
    controller.set_challenger(home, newer, who="gate", why="again")  # the same version: nothing superseded
    assert canary_tags(home, newer)[1] is None
    registry.remove_alias(home, "challenger")


def test_a_challenger_the_scheduled_step_starts_runs_in_the_configured_mode(home: Settings, challenger: str):
    """A challenger set without its canary started (``recloop gate``, a failed start) is started by the next
    scheduled step in the configured mode: a shadow configuration serves it to nobody (it started A/B)."""
    from dataclasses import replace

    shadow = replace(QUICK, mode="shadow")
    assert controller.status(home, shadow).mode == "shadow"
    started = controller.step(home, shadow, now=1000.0)
    assert started.action == "start", started.decision
    _, tag = canary_tags(home, challenger)
    assert (tag.mode, tag.share) == ("shadow", 0.0)
    assert registry_wanted(home) == Wanted("1", challenger, 0.0, "shadow", tag.salt)
    controller.manual(home, "rollback", "test over", who="test")


def test_the_monitor_asks_no_new_retrain_while_the_last_ones_challenger_is_in_canary(home: Settings, challenger: str):
    """A drift retrain deployed as the challenger: the champion keeps serving during its canary, so the
    drift persists; the monitor holds (asking again would supersede the canary and reset its evidence),
    and asks again once the canary has ended without promotion."""
    from dataclasses import replace

    from recloop.monitor import MonitorDecision, TriggerConfig
    from recloop.monitor.runner import record_retrain_outcome, request_retrain

    config = TriggerConfig(cooldown_seconds=3600)
    drift = MonitorDecision("drift", ("item_id: 63% unseen",), 0.5, ("item_id",))
    assert request_retrain(home, drift, now=0.0, config=config).retrain
    record_retrain_outcome(home, deployed=True, now=100.0, version=challenger)
    held = request_retrain(home, drift, now=100.0 + 7200, config=config)  # past the cool-down
    assert not held.retrain and f"v{challenger}, the last full retrain, is still in its canary" in held.reason
    assert request_retrain(home, drift, now=100.0 + 7200, config=replace(config, canary_hold_seconds=3600)).retrain
    record_retrain_outcome(home, deployed=True, now=100.0, version=challenger)  # (that request, deployed too)
    controller.manual(home, "rollback", "worse online", who="test")
    assert request_retrain(home, drift, now=100.0 + 7300, config=config).retrain


def test_the_monitor_takes_the_champions_window_with_its_held_out_hours(home: Settings):
    """``monitor.runner.champion`` reads the registered version's training and validation hours: its window ends
    with the held-out hours, after the training ones (the reference for the next drift checks)."""
    from datetime import timedelta

    from recloop.hours import parse_hour
    from recloop.monitor.runner import champion, data_window

    info = registry.version_info(home, "1")
    assert info.train_window is not None and info.validation_window is not None
    found = champion(home)
    assert found is not None and found.version == "1"
    assert found.trained == data_window(info.train_window, info.validation_window)
    assert found.trained[1] == parse_hour(info.validation_window[1]) + timedelta(hours=1)
    assert found.trained[1] > parse_hour(info.train_window[1]) + timedelta(hours=1)


def test_a_scheduled_run_replacing_the_monitors_challenger_takes_over_its_hold(home: Settings, challenger: str):
    """The drift retrain's challenger waited a day undecided; the scheduled run's candidate replaced it, trained on
    every hour the champion had not seen (``flows/retrain_flow.py``), the drifted ones included, so the monitor's
    hold passes to it: before, the monitor saw the pre-drift champion still serving and no canary of "its"
    version, and asked for another full retrain, which replaced the successor in turn (the grid's `covariate`
    seed 0)."""
    from recloop.monitor import MonitorDecision, TriggerConfig
    from recloop.monitor.runner import carry_request, record_retrain_outcome, request_retrain

    config = TriggerConfig(cooldown_seconds=3600)
    drift = MonitorDecision("drift", ("country: drifted",), 0.4, ("country",))
    start = 1_000_000.0  # after the requests of this module's other tests
    assert request_retrain(home, drift, now=start, config=config).retrain
    record_retrain_outcome(home, deployed=True, now=start + 100, version=challenger)
    controller.start(home, QUICK, now=start + 100)
    info = registry.version_info(home, "1")
    successor = registry.register(home, info.source, info.run_id)
    controller.set_challenger(home, successor, who="gate", why="passed the gate")  # the scheduled run's candidate
    assert not carry_request(home, "999", successor)  # a version the request did not make: nothing carried
    assert carry_request(home, challenger, successor)
    held = request_retrain(home, drift, now=start + 100 + 7200, config=config)  # past the cool-down
    assert not held.retrain, held.reason
    assert f"v{successor} (which replaced v{challenger}), the last full retrain, is still in its canary" in held.reason
    controller.manual(home, "rollback", "worse online", who="test")  # its canary ends: the monitor may ask again
    assert request_retrain(home, drift, now=start + 100 + 7300, config=config).retrain


def test_a_rollback_leaves_a_newer_challenger_alone(home: Settings, challenger: str):
    """A canary check judged v(n) while a retrain's gate made v(n+1) the challenger: the rollback marks the
    version it judged and leaves the alias to the newer one (it used to remove the alias whatever it pointed
    at, and the retrain's canary then found no challenger)."""
    from recloop.canary.decision import CanaryDecision

    controller.start(home, QUICK, now=1000.0)
    info = registry.version_info(home, "1")
    newer = registry.register(home, info.source, info.run_id)
    registry.set_alias(home, "challenger", newer, who="test", why="a retrain's gate, meanwhile")
    controller._apply(home, challenger, CanaryDecision("rollback", 0.0, ("guardrail: errors",), {}), who="canary",
                      now=2000.0)
    _, judged = canary_tags(home, challenger)
    assert judged.state == "rolled_back" and registry.aliases(home)["challenger"] == newer
    registry.remove_alias(home, "challenger")


def test_a_decision_applied_stands_when_logging_it_fails(home: Settings, challenger: str, monkeypatch, caplog):
    """MLflow failing after the decision was applied (the tag written, the alias moved): the step returns
    the decision and warns. It raised, the flow retried, found no canary and said "none": the promotion or
    rollback went uncounted."""
    def unavailable(*args):
        raise ConnectionError("MLflow is restarting")

    controller.start(home, QUICK, now=1000.0)
    monkeypatch.setattr(controller, "_log", unavailable)
    result = controller.manual(home, "rollback", "bad reviews", who="bob")
    assert result.action == "rollback" and registry.aliases(home)["challenger"] is None
    assert canary_tags(home, challenger)[1].state == "rolled_back"
    assert "logging it to MLflow's canary run failed: MLflow is restarting" in caplog.text
