"""The whole loop as `recloop demo` runs it, under a real Prefect server (``prefect_test_harness``), MLflow on
SQLite, Feast on SQLite and an Evidently workspace (the flows one at a time are tests/test_flows.py)."""

from __future__ import annotations

from pathlib import Path

from recloop.settings import Settings


def test_the_demo_runs_every_stage_each_day(prefect_server, tmp_path: Path):
    """Two cycles after the bootstrap day, a sudden drift on day 2: the whole loop, as `recloop demo` runs it
    (the cool-down after the drift's retrain is the chain test's)."""
    from recloop.demo import DemoConfig, run_demo
    from recloop.monitor.dashboards import project

    settings = Settings(home=tmp_path / "home", frame_backend="pandas")
    summary = run_demo(settings, DemoConfig(days=3, events_per_day=4000, requests_per_day=120, rounds=3, seed=1,
                                            drift="sudden", drift_day=2, panel_requests=100))
    days = summary["days"]
    assert [d["day"] for d in days] == [0, 1, 2]
    assert days[0]["gate"] == "passed → champion" and days[0]["retrain"] == "full (bootstrap)"
    assert (days[1]["drift"], days[1]["retrain"]) == ("ok", "incremental")  # no false alarm before the drift
    assert (days[2]["drift"], days[2]["retrain"]) == ("drift", "full (drift)")
    assert summary["full_retrains"] == 1
    assert days[0]["retriever_gate"] == "passed → champion" and days[0]["retriever_oracle_recall"] is not None
    for day in days[1:]:
        assert day["requests"] + day["recommend_requests"] == 120 and day["events"] == 4000
        assert day["recommend_requests"] == 60 and day["recommend_clicks"] > 0 and day["recommend_vs_oracle"]
        assert day["retriever_gate"] in ("refused", "passed → challenger")
        # only the first model goes straight to champion; a window too small to decide hands it to the canary
        assert day["gate"] in ("refused", "passed → challenger", "insufficient evidence → challenger")
        assert day["vs_oracle"] is not None and day["online_ctr"]
        panel = day["panel"]  # the day's evaluation panel, scored against the ground truth
        assert panel["champion"]["low"] <= panel["champion"]["normalized_reward"] <= panel["champion"]["high"]
        assert -1 < panel["never_retrained"]["normalized_reward"] < 1
    def ranker(canary: list[str]) -> list[str]:  # the ranker's canary entries (the retriever's say "retriever")
        return [entry for entry in canary if "retriever" not in entry]

    assert ranker(days[1]["canary"]) == (
        [f"start v{days[1]['candidate_version']}"] if days[1]["gate"] != "refused" else [])
    retriever_started = [f"start retriever v{days[1]['retriever_version']}"]
    assert [c for c in days[1]["canary"] if "retriever" in c] == (
        retriever_started if days[1]["retriever_gate"] != "refused" else [])
    if days[1]["gate"] != "refused":  # the day-1 challenger was judged on day 2's traffic
        assert any(c.split()[0] in ("step", "promote", "rollback") for c in ranker(days[2]["canary"])), days[2][
            "canary"]
    report = Path(summary["report"]).read_text()
    assert "plotly" in report and "served / oracle" in report and "oracle recall@100" in report
    workspace, found = project(settings)
    assert len(workspace.list_runs(found.id)) >= 2  # a drift snapshot per monitoring run (and KPIs)


def test_the_table_says_why_a_finding_started_no_full_retrain():
    """The retrain column of a day whose drift check found something but asked for no full retrain names the
    trigger's reason (the demo's day 3 read "kpi_decay · incremental" with no word of the cool-down)."""
    from recloop.demo import _held
    from recloop.monitor.decision import MonitorDecision, TriggerConfig, should_retrain

    config = TriggerConfig(cooldown_seconds=6 * 3600)
    held = should_retrain(MonitorDecision("kpi_decay", ("ctr",), 0.0, ()), 0.0, 3600.0, config,
                          last_outcome="deployed", outcome_at=1800.0)
    broken = should_retrain(MonitorDecision("data_quality", ("nulls",), 0.0, ()), None, 0.0, config)
    assert not held.retrain and not broken.retrain
    assert _held(held.reason) == "full held: cool-down"
    assert _held(broken.reason) == "no retrain on broken data"
