"""The whole loop as `recloop demo` runs it, under a real Prefect server (``prefect_test_harness``), MLflow on
SQLite, Feast on SQLite and an Evidently workspace (the flows one at a time are tests/test_flows.py)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from recloop.settings import Settings


@pytest.fixture(scope="module")
def demo(prefect_server, tmp_path_factory) -> tuple[Settings, dict]:
    """Two cycles after the bootstrap day, a sudden drift on day 2: the whole loop, as `recloop demo` runs it;
    run once for this file (its stages' test, and the pages a reviewer then opens)."""
    from recloop.demo import DemoConfig, run_demo

    settings = Settings(home=tmp_path_factory.mktemp("demo") / "home", frame_backend="pandas")
    summary = run_demo(settings, DemoConfig(days=3, events_per_day=4000, requests_per_day=120, rounds=3, seed=1,
                                            drift="sudden", drift_day=2, panel_requests=100, daily_full=True,
                                            reference_seeds=2, train_seed=3))
    return settings, summary


@pytest.mark.timeout(600)  # the module's demo runs in this test's setup: three simulated days on 2 shared cores
def test_the_demo_runs_every_stage_each_day(demo):
    """The whole loop, each stage each day (the cool-down after the drift's retrain is the chain test's)."""
    from recloop.monitor.dashboards import project

    settings, summary = demo
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
    paired = summary["paired"]  # the efficacy figure: champion - never retrained on the same panel, the last day
    assert paired["day"] == 2 and sorted(paired["per_day"]) == [1, 2]
    headline = paired["headline"]["champion - never_retrained"]
    assert headline["low"] <= headline["difference"] <= headline["high"]
    # the upper reference, a daily full retrain from scratch, is the mean of its two seeds request by request
    for day, rewards in summary["panels"].items():
        seeds = np.array([rewards["daily_full_seed0"], rewards["daily_full_seed1"]])
        assert np.allclose(rewards["daily_full"], seeds.mean(axis=0)), day
        assert not np.allclose(seeds[0], seeds[1]), day  # two trainings, not one model twice
    assert "champion - daily_full" in paired["headline"]
    # as served: the champion, or within a running canary's share the challenger's lists; the efficacy gives it
    # only on a day when a canary ran at the panel
    for day in days[1:]:
        rewards = summary["panels"][day["day"]]
        ran = "challenger" in day["panel"]  # a ranker canary ran at the panel: some users got its lists
        assert np.allclose(rewards["served"], rewards["champion"]) != ran, day["day"]
        assert ("served - daily_full" in paired["per_day"][day["day"]]) == ran, day["day"]
    # every ranker the loop trained (bootstrap, incremental, the drift's full retrain) used the configured seed
    from recloop import checkpoint

    versions = {d["candidate_version"] for d in days if d["candidate_version"]}
    assert len(versions) == 3, versions
    for version in versions:
        assert checkpoint.load_model(checkpoint.resolve(settings, version))[1]["train"]["seed"] == 3, version
    report = Path(summary["report"]).read_text()
    assert "plotly" in report and "served / oracle" in report and "oracle recall@100" in report
    assert "Loop efficacy (same panel, paired)" in report
    workspace, found = project(settings)
    assert len(workspace.list_runs(found.id)) >= 2  # a drift snapshot per monitoring run (and KPIs)


def test_the_table_says_why_a_finding_started_no_full_retrain():
    """The retrain column of a day whose drift check found something but asked for no full retrain names the
    trigger's reason (the demo's day 3 read "kpi_decay · incremental" with no word of the cool-down)."""
    from recloop.demo.loop import _held
    from recloop.monitor.decision import MonitorDecision, TriggerConfig, should_retrain

    config = TriggerConfig(cooldown_seconds=6 * 3600)
    held = should_retrain(MonitorDecision("kpi_decay", ("ctr",), 0.0, ()), 0.0, 3600.0, config,
                          last_outcome="deployed", outcome_at=1800.0)
    broken = should_retrain(MonitorDecision("data_quality", ("nulls",), 0.0, ()), None, 0.0, config)
    assert not held.retrain and not broken.retrain
    assert _held(held.reason) == "full held: cool-down"
    assert _held(broken.reason) == "no retrain on broken data"


def _free_port() -> int:
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.browser
@pytest.mark.timeout(600)  # four services to start and six pages to render, on a loaded 2-core machine
def test_the_pages_a_reviewer_opens_tell_the_truth(demo, tmp_path: Path, monkeypatch):
    """After the demo, `recloop up`'s four services (on free ports) and the report, opened in headless Chromium
    as a reviewer would: each page's rendered text says why each model moved, the gate table has no None or
    nan, the Prefect run is named for its day and version with its outcome, the Evidently CTR panel shows the
    loop's own figure, and Swagger lists the API's operations from files the app serves. Screenshots are kept
    under this test's temporary folder (``screenshots/``)."""
    import re

    import httpx
    from browser import render, text
    from mlflow import MlflowClient
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags
    from prefect.settings import get_current_settings

    from recloop import registry, services
    from recloop.canary.controller import EXPERIMENT as CANARY_EXPERIMENT
    from recloop.monitor.dashboards import project

    settings, summary = demo
    shots = tmp_path / "screenshots"
    shots.mkdir()
    # The Prefect UI over the database this session's Prefect server (the harness) wrote the demo's runs to.
    database = get_current_settings().server.database.connection_url
    monkeypatch.setenv("PREFECT_SERVER_DATABASE_CONNECTION_URL", getattr(database, "get_secret_value",
                                                                         lambda: database)())
    wanted = tuple(services.Service(s.name, _free_port(), s.health) for s in services.SERVICES)
    started = services.up(settings, timeout=240, services=wanted)
    try:
        assert all(entry["status"] == "up" for entry in started.values()), started
        url = {name: entry["url"] for name, entry in started.items()}
        # MLflow's UI as one process serving (its launcher and one uvicorn worker): its default four workers
        # and seven job-runner consumers took 33 CPU-seconds to start on a 2-core host, 9 without them
        mlflow_processes = _session_members(started["mlflow"]["pid"])
        assert len(mlflow_processes) <= 2, mlflow_processes

        # 1. The demo report: every move in the decisions table, with its evidence and reason.
        page = render(Path(summary["report"]).as_uri(), shots / "1-demo-report.png", budget_ms=3000)
        assert "Canary decisions: why each model moved" in text(page)
        table = re.search(r'<table class="decisions">(.*?)</table>', page, flags=re.S).group(1)
        rows = [text(row) for row in re.findall(r"<tr><td>.*?</tr>", table, flags=re.S)]
        moves = [m for day in summary["days"] for m in day["decisions"]]
        assert len(rows) == len(moves) > 0, rows
        for row, move in zip(rows, moves, strict=True):
            assert move["why"] in row and move["action"] in row, (row, move)
            if move["model"] == "ranker" and move["action"] in ("step", "promote"):
                assert "interleaving" in row.split("step" if move["action"] == "step" else "promote", 1)[1], row  # the evidence that allowed it
        assert not re.search(r"\bNone\b|\bnan\b", text(table))

        # 2. MLflow: the champion's page shows the gate report as rendered tables, no None or nan in them.
        champion = registry.version_by_alias(settings, "champion")
        page = render(f"{url['mlflow']}/#/models/{registry.MODEL_NAME}/versions/{champion}",
                      shots / "2-mlflow-champion.png")
        shown = text(page)
        assert f"Gate: version {champion}" in shown and "Which AUC is which" in shown, shown[:3000]
        report = shown[shown.index(f"Gate: version {champion}"):]
        assert "threshold value" in report and not re.search(r"\bNone\b|\bnan\b", report[:6000]), report[:6000]
        assert "<table" in page[page.index("Which AUC is which") - 20000:]
        # its cells spaced (MLflow pads no table cell and strips styles: "candidatechampion" ran together)
        assert re.search(r"<th>candidate(&nbsp;|\u00a0)+</th>", page), page[page.index("<table"):][:600]
        # the version's tags read as lines (the page showed raw JSON), each record beside it under <name>.json
        registry.configure(settings)
        client = MlflowClient()
        tags = client.get_model_version(registry.MODEL_NAME, champion).tags
        for name in ("gate", "alias.champion", "checkpoint.manifest"):
            assert not tags[name].startswith(("{", "[")) and tags[name] in shown, (name, tags[name])
            assert f"{name}.json" in tags, sorted(tags)
        assert tags["gate"].startswith(("passed", "insufficient evidence (the canary decides)")), tags["gate"]

        # ... and the canary run's description, the table of its decisions.
        experiment = client.get_experiment_by_name(CANARY_EXPERIMENT)
        run = client.search_runs([experiment.experiment_id], "tags.`recloop.model` = 'recloop-ranker'",
                                 max_results=1, order_by=["attributes.start_time DESC"])[0]
        page = render(f"{url['mlflow']}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}",
                      shots / "3-mlflow-canary-run.png")
        assert "online CTR evidence (what decides)" in text(page) and "interleaving, user clusters:" in text(page)

        # 3. Prefect: a canary check that moved a model, named for its day and version, its outcome its state.
        with get_client(sync_client=True) as prefect:
            moved = [r for r in prefect.read_flow_runs(flow_run_filter=FlowRunFilter(
                tags=FlowRunFilterTags(all_=["model:recloop-ranker"]))) if "no-op" not in r.tags]
        assert moved
        chosen = moved[0]
        assert re.fullmatch(r"canary-(check|start)-v\d+-day\d-[0-9a-f]{6}", chosen.name), chosen.name
        page = render(f"{url['prefect']}/runs/flow-run/{chosen.id}", shots / "4-prefect-run.png")
        assert chosen.name in text(page) and chosen.state.name in text(page), text(page)[:3000]
        with get_client(sync_client=True) as prefect:
            runs = prefect.read_flow_runs(limit=200)  # the API's most; a 3-day demo makes ~45
        names = [r.name for r in runs]
        assert len(names) == len(set(names)), sorted(n for n in names if names.count(n) > 1)  # 44 runs had ~10 names
        assert all(re.search(r"-day\d", r.name) for r in runs if r.name.startswith("canary-")), names
        noop = [r for r in runs if "no-op" in r.tags]  # checks that moved nothing: filterable, named so
        assert all(r.state.name in ("NoCanary", "Held") for r in noop), [(r.name, r.state.name) for r in noop]
        api = f"{url['prefect']}/api"  # an empty Deployments page after `up` says how to fill it
        assert "prefect deploy --all" in services.deployments_hint(services.deployment_count(api), api, None)

        # 4. Evidently: the KPI tab's online CTR panel, at the loop's own figure.
        _, found = project(settings)
        page = render(f"{url['evidently']}/projects/{found.id}", shots / "5-evidently.png")
        shown = text(page)
        assert "Online CTR of the serving model, last check" in shown, shown[:3000]
        last = summary["days"][-1]["monitor_ctr"]  # the report's "champion CTR (monitor)" of the last night
        counter = shown[shown.index("Online CTR of the serving model, last check"):][:600]
        figures = re.findall(r"(?<![\d.])(0\.\d+|1\.0+|0)(?![\d.])", counter)  # as shown: Evidently rounds it
        assert last is not None and any(abs(float(f) - last) <= 0.5 * 10 ** -len((f + ".").split(".")[1]) + 1e-12
                                        for f in figures), (last, counter)
        report = text(Path(summary["report"]).read_text())
        assert "champion CTR (monitor, as Evidently plots it)" in report and f"{last:.3f}" in report
        assert "Dates: event time" in shown, shown[:3000]  # its clock named (Prefect and MLflow show wall-clock time)
        scraped = httpx.get(f"{url['serving']}/metrics", timeout=30).text  # /metrics: both clocks, each named
        assert re.search(r"# HELP recloop_last_retrain_request_timestamp_seconds .*in event time", scraped)
        assert re.search(r"# HELP recloop_last_retrain_request_wallclock_timestamp_seconds .*wall-clock", scraped)

        # 5. The serving API's docs: Swagger lists its operations, from files the app serves.
        page = render(f"{url['serving']}/docs", shots / "6-swagger.png")
        operations = set(re.findall(r'data-path="(/[^"]+)"', page)) | set(
            re.findall(r'opblock-summary-path[^>]*>.*?<span[^>]*>(/[^<]+)<', page, flags=re.S))
        assert {"/rank", "/recommend", "/feedback"} <= {o.replace("\u200b", "") for o in operations}, operations
        for docs in ("/docs", "/redoc"):  # both pages' files from the app itself, none from a CDN
            served = httpx.get(f"{url['serving']}{docs}", timeout=30).text
            assets = re.findall(r'(?:src|href)="([^"]+\.(?:js|css))"', served)
            assert assets and all(a.startswith("/") for a in assets), (docs, assets)
            assert all(httpx.get(f"{url['serving']}{a}", timeout=30).status_code == 200 for a in assets), assets
    finally:
        services.down(settings, wanted)


def _session_members(leader: int) -> list[str]:
    """The command lines of the processes in ``leader``'s session (``up`` starts each service as a session leader)."""
    members = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[3]) == leader and fields[0] != "Z":  # after the name: state, ppid, pgrp, session
                members.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:160])
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return members
