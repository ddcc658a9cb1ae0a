"""Commands over the whole loop: drift checks, retrains, the local services, the demo and the replay."""

from __future__ import annotations

import logging
from datetime import datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from recloop.cli.base import (
    Drift,
    JsonOption,
    SpecOption,
    app,
    console,
    drift_day_within,
    emit,
    fail_usage,
    figure,
    load_spec,
    parse_time,
    penalties,
    quiet_logs,
)
from recloop.cli_boundary import FAILURE
from recloop.settings import Settings


@app.command("drift")
def drift_command(
    hours: Annotated[int, typer.Option(min=1, help="Newest hours of events to check.")] = 24,
    reference_days: Annotated[int, typer.Option(min=1, help="Reference when there is no champion: days "
                                                "before the checked hours.")] = 7,
    spec: SpecOption = None,
    config: Annotated[Path | None, typer.Option(help="YAML of MonitorConfig fields (thresholds, per-column "
                                                "drift methods, min_rows).")] = None,
    current: Annotated[str | None, typer.Option(help="The checked window START..END (UTC, ISO), instead of the "
                                                "newest --hours.")] = None,
    reference: Annotated[str | None, typer.Option(help="The reference window START..END (UTC, ISO); with "
                                                  "--current.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Check the newest events for drift and broken columns against the champion's training window.

    Below MonitorConfig's min_rows events in either window the answer is insufficient_data (never a retrain).
    Every check, whatever it decides, leaves its snapshots in the Evidently workspace (`recloop up` shows it).
    """
    from recloop import pipeline
    from recloop.monitor.runner import MonitorError, load_config

    dataset = load_spec(Settings(), spec)
    if (current is None) != (reference is None):
        raise fail_usage("--current and --reference go together (each START..END)")
    windows = (_window("--reference", reference), _window("--current", current)) if current else None
    try:
        result = pipeline.check_drift(Settings(), dataset, hours=hours, reference_days=reference_days,
                                      config=load_config(config), windows=windows, snapshot=True).to_dict()
    except (MonitorError, ValueError, OSError) as err:
        raise fail_usage(str(err)) from err
    if json_out:
        emit(result)
        return
    current, reference = result["current"], result["reference"]
    console.print(f"[bold]{result['decision']}[/] ({current[0]} → {current[1]} vs {reference[0]} → {reference[1]}): "
                  + "; ".join(result["reasons"]))


def _window(option: str, value: str) -> tuple[datetime, datetime]:
    start, sep, end = value.partition("..")
    if not sep:
        raise fail_usage(f"{option} {value!r} is not START..END (e.g. 2015-01-01..2015-02-01)")
    first, last = parse_time(start, option), parse_time(end, option)  # (it named --start for --current)
    if first >= last:
        raise fail_usage(f"{option} {value!r}: the start must be before the end")
    return first, last


@app.command("retrain")
def retrain_command(
    full: Annotated[bool, typer.Option("--full", help="Full retrain from scratch instead of incremental.")] = False,
    reason: Annotated[str, typer.Option(help="Why: recorded on the flow run.")] = "by hand",
    wait: Annotated[bool, typer.Option(help="With a Prefect server: wait for the run to finish.")] = False,
    spec: SpecOption = None,
    json_out: JsonOption = False,
) -> None:
    """Start a retrain now: the deployment on the Prefect server (RECLOOP_PREFECT_API_URL), else the flow here."""
    import os

    from recloop import datasets
    from recloop.flow_support import configure_prefect

    settings = Settings()
    load_spec(settings, spec)  # validated (exit 2 on a bad spec) and remembered by this home
    spec_source = datasets.source(settings, spec)
    configure_prefect(settings)
    mode = "full" if full else "incremental"
    if os.environ.get("PREFECT_API_URL"):
        from prefect.deployments import run_deployment

        from recloop import endpoints

        endpoints.require_prefect(os.environ["PREFECT_API_URL"], endpoints.limits_for(settings))

        name = f"retrain/{mode}-retrain"
        # the worker's own spec (RECLOOP_SPEC, its home's) unless --spec names one: this machine's would
        # replace it (a path here, or the shipped default)
        parameters = {"mode": mode, "reason": reason, **({"spec": spec_source} if spec else {})}
        try:
            run = run_deployment(name, parameters=parameters, timeout=None if wait else 0)
        except Exception as err:  # noqa: BLE001 - e.g. not deployed yet: say so in one line
            raise fail_usage(f"could not start deployment {name!r} ({err}); run `prefect deploy --all` first") from err
        result = deployment_result(name, run, wait)
    else:
        from flows.retrain_flow import retrain_flow
        from recloop.flow_support import in_process_runs, settings_parameter

        # a failure is the boundary's one line: Prefect's ERROR records (with their tracebacks) stay out
        with quiet_logs(logging_level=logging.CRITICAL), in_process_runs():
            outcome = retrain_flow(mode=mode, reason=reason, spec=spec_source, settings=settings_parameter(settings))
        ingested = {k: outcome["ingest"][k] for k in ("rows_in", "rows_landed", "rows_quarantined")}
        if "skipped" in outcome:  # nothing new since the champion: nothing trained, no version registered
            result = {"mode": mode, "spec": spec_source, "ingest": ingested, "skipped": outcome["skipped"]}
        else:
            result = {"mode": mode, "spec": spec_source, "version": outcome["train"]["mlflow"]["version"],
                      "ingest": ingested, "gate": {k: outcome["gate"][k] for k in ("passed", "alias", "reasons")},
                      "canary": outcome.get("canary")}
            result["retriever"] = _retriever_outcome(outcome.get("retriever") or {})
    if json_out:
        emit(result)
    else:
        console.print(result)


def deployment_result(name: str, run, wait: bool) -> dict:
    """What ``recloop retrain`` says of a deployment's flow run; with ``--wait``, a run that did not complete
    (failed, crashed, cancelled) is an error (exit 1), not a result."""
    state = run.state
    if wait and (state is None or not state.is_completed()):
        ended = state.name if state else "without a state"
        detail = f": {state.message}" if state and state.message else ""
        raise fail_usage(f"deployment {name!r}: flow run {run.id} ended {ended}{detail}", code=FAILURE)
    return {"deployment": name, "flow_run_id": str(run.id), "state": state.name if state else None}


def _retriever_outcome(outcome: dict) -> dict:
    """The retrain's retriever part in a few fields: its version and gate, or why it was not trained."""
    if "skipped" in outcome.get("train", {}):
        return {"skipped": outcome["train"]["skipped"]}
    if "skipped" in outcome:  # trained, not gated: the same retriever as a registered version, or judged already
        return {"version": outcome["train"]["mlflow"]["version"], "skipped": outcome["skipped"]}
    if "gate" not in outcome:
        return {}
    return {"version": outcome["gate"]["version"], **{k: outcome["gate"][k] for k in ("passed", "alias", "reasons")},
            "canary": (outcome.get("canary") or {}).get("action")}


@app.command("up")
def up_command(host: Annotated[str, typer.Option(help="Address the services listen on.")] = "127.0.0.1",
               prefect_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Prefect's port (default: "
                                                               "RECLOOP_UP_PREFECT_PORT, 4200).")] = None,
               mlflow_port: Annotated[int | None, typer.Option(min=1, max=65535, help="MLflow's port (default: "
                                                              "RECLOOP_UP_MLFLOW_PORT, 5000).")] = None,
               evidently_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Evidently's port "
                                                                 "(default: RECLOOP_UP_EVIDENTLY_PORT, 8001).")] = None,
               serving_port: Annotated[int | None, typer.Option(min=1, max=65535, help="The serving API's port "
                                                               "(default: RECLOOP_UP_SERVING_PORT, 8000).")] = None,
               json_out: JsonOption = False) -> None:
    """Start the Prefect, MLflow and Evidently UIs and the serving API in the background; print their addresses.
    Each home can take its own ports, so several run side by side."""
    from recloop import services

    settings = Settings()
    started = services.up(settings, host, services=services.services_for(settings, {
        "prefect": prefect_port, "mlflow": mlflow_port, "evidently": evidently_port, "serving": serving_port}))
    prefect = started.get("prefect", {})
    api_url = f"{prefect.get('url')}/api"
    hint = services.deployments_hint(services.deployment_count(api_url), api_url, services.checkout()) \
        if prefect.get("status") in ("up", "running") else None
    if json_out:
        emit({**started, "deployments_hint": hint} if hint else started)
        return
    for name, entry in started.items():
        console.print(f"{name:10} {entry['url']:28} {entry['status']} (pid {entry['pid']})")
    if hint:
        console.print(hint, markup=False, highlight=False)
    console.print("stop them with: recloop down")
    if any(entry["status"].startswith("failed") for entry in started.values()):
        raise typer.Exit(1)


@app.command("down")
def down_command(json_out: JsonOption = False) -> None:
    """Stop what `recloop up` started."""
    from recloop import services

    stopped = services.down(Settings())
    emit(stopped) if json_out else console.print(stopped or "nothing was running")


@app.command("demo")
def demo_command(
    ctx: typer.Context,
    days: Annotated[int, typer.Option(min=2, help="Simulated days (day 0 bootstraps the first model).")] = 5,
    events_per_day: Annotated[int, typer.Option(min=100, help="The world's own impressions per day.")] = 20_000,
    requests_per_day: Annotated[int, typer.Option(min=4, help="Ranking requests simulated users send per day.")]
    = 400,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    drift: Annotated[Drift, typer.Option(help="Drift scenario.")] = Drift.sudden,
    drift_day: Annotated[int, typer.Option(min=1, help="First drifted day, counted from 0.")] = 2,
    twin: Annotated[bool, typer.Option(help="Run the loop again on the no-drift twin world and report the "
                                            "twin-world recovery as well (about twice the time).")] = False,
    daily_full: Annotated[bool, typer.Option(help="Also train a full model from scratch each day, scored on the "
                                                  "evaluation panel as the upper reference (not served).")] = False,
    reference_seeds: Annotated[int, typer.Option(min=1, help="With --daily-full: the reference is the mean of this "
                                                             "many full retrains differing only in their seed (one "
                                                             "retrain is one draw of the training).")] = 1,
    full_every_days: Annotated[float, typer.Option(min=0, help="A scheduled retrain starts over from scratch once "
                                                               "the champion's chain of incremental runs spans this "
                                                               "many days (0: never).")] = 3.0,
    json_out: JsonOption = False,
) -> None:
    """The whole loop over simulated days: serving, feedback, canary, drift checks, retrains; table + HTML report."""
    from recloop.demo import DayRecord, DemoConfig, run_demo

    drift = Drift(drift).value
    drift_day = drift_day_within(ctx, drift, drift_day, days)
    settings = Settings()
    config = DemoConfig(days=days, events_per_day=events_per_day, requests_per_day=requests_per_day, seed=seed,
                        drift=drift, drift_day=drift_day, twin=twin, daily_full=daily_full,
                        reference_seeds=reference_seeds, full_every_days=full_every_days)
    if not json_out:
        console.print(f"recloop demo: {days} simulated days, drift '{drift}' from day {drift_day}; "
                      f"home {settings.home.resolve()}")

    live = _StageLine(console, quiet=json_out)

    def on_day(record: DayRecord) -> None:
        if not json_out:
            candidate = f" → v{record.candidate_version} {record.gate}" if record.candidate_version else ""
            retriever = f" v{record.retriever_version}" if record.retriever_version else ""
            # (the stage line's "serving N requests" counts both kinds; "drift check: drift" read "drift drift")
            live.done(f"day {record.day}: {record.events:,} events, {record.requests} /rank and "
                      f"{record.recommend_requests} /recommend requests, drift check: {record.drift}, "
                      f"{record.retrain}{candidate}; canary "
                      f"{', '.join(record.canary) or '-'}; retriever{retriever} "
                      f"{record.retriever_gate} (oracle recall {figure(record.retriever_oracle_recall)}), "
                      f"/recommend {record.recommend_clicks} clicks ({record.seconds} s)")

    import os

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    with quiet_logs(), live:
        summary = run_demo(settings, config, on_day=on_day, on_stage=live.stage)
    if json_out:
        emit(summary)
        return
    width = min(console.width, DEMO_WIDTH) if console.is_terminal else DEMO_WIDTH  # a log file is not 80 wide
    Console(stderr=True, width=width).print(demo_table(summary))
    paired = summary.get("paired") or {}
    headline = paired.get("headline") or {}
    for name, found in headline.items():
        policy, baseline = name.split(" - ")  # "served - …" only when a canary ran at the panel
        who = "the champion's" if policy == "champion" else "the ranking as served (a running canary's share included)"
        console.print(f"loop efficacy (same panel, paired): on day {paired['day']} {who} normalized reward "
                      f"is {found['difference']:+.3f} [95% CI {found['low']:+.3f}, {found['high']:+.3f}] against the "
                      f"{baseline.replace('_', ' ')} model's on the same requests (0: random, 1: the oracle)")
    recovery = (summary.get("recovery") or {}).get("headline")
    if recovery:
        mine, frozen = recovery["champion"], recovery["never_retrained"]
        console.print(f"loop efficacy (twin worlds): on day {summary['recovery']['day']} the champion's normalized "
                      f"reward on the evaluation panel is {mine['recovery']:.1%} [95% CI {mine['low']:.1%}, "
                      f"{mine['high']:.1%}] of the no-drift twin's (never retrained: {frozen['recovery']:.1%} "
                      f"[{frozen['low']:.1%}, {frozen['high']:.1%}]); target ≥ 95% (lower bound): "
                      f"{'met' if summary['recovery']['met'] else 'not met'}")
    efficacy = summary.get("efficacy")
    if efficacy and not recovery and not paired.get("headline"):
        console.print(f"loop efficacy: two cycles after the drift the served ranking earns {efficacy['recovery']:.1%} "
                      f"of its pre-drift share of the oracle's clicks (never retrained: "
                      f"{efficacy['never_retrain_recovery']:.1%}); target ≥ 95%: "
                      f"{'met' if efficacy['met'] else 'not met'}")
    console.print(f"freshness (events landed → challenger serving): {summary['freshness_seconds']} s; "
                  f"full retrains triggered by drift: {summary['full_retrains']}; total {summary['seconds']} s")
    console.print(f"report: {summary['report']}")
    console.print("review it all: .venv/bin/recloop up  (Prefect, MLflow and Evidently UIs, the serving API)")


DEMO_WIDTH = 120


def demo_table(summary: dict) -> Table:
    """The demo's per-day table, narrow enough for 120 columns: the AUCs and the drift's reasons are in
    ``--json`` and the HTML report."""
    from rich import box

    table = Table(title="recloop demo", box=box.SIMPLE_HEAD, padding=(0, 0),
                  caption="vs oracle: the served ranking's clicks as a share of the oracle's; frozen: the same for "
                  "the day-0 model never retrained. AUCs, reasons and the recommendation path (each day's line above): "
                  "--json and the report.")
    for column in ("day", "events", "drift", "retrain", "gate", "canary", "champion", "online CTR", "vs oracle",
                   "frozen"):
        table.add_column(column, justify="right" if column in ("day", "events", "vs oracle", "frozen") else "left")
    for day in summary["days"]:
        verdict = day["gate"].replace("passed → ", "→ ")
        table.add_row(str(day["day"]), f"{day['events']:,}", day["drift"], day["retrain"],
                      f"v{day['candidate_version']} {verdict}" if day.get("candidate_version") else verdict,
                      "\n".join(c.split(":")[0] for c in day["canary"]) or "-", f"v{day['champion']}" if day["champion"] else "-",
                      "\n".join(f"v{v}: {c:.3f}" for v, c in day["online_ctr"].items()) or "-",
                      figure(day["vs_oracle"]), figure(day["baseline_vs_oracle"]))
    return table


class _StageLine:
    """The demo's current stage: one live line on a terminal (``day 2 · features · 14 s``), replaced by each
    day's summary when it ends; a plain line per stage when stderr is not a terminal (logs, CI)."""

    def __init__(self, console: Console, quiet: bool):
        import time

        self.console, self.quiet, self.clock = console, quiet, time.perf_counter
        self.status = None if quiet or not console.is_terminal else console.status("")
        self.began = self.clock()

    def __enter__(self):
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)

    def stage(self, day: int, what: str) -> None:
        if self.quiet:
            return
        line = f"day {day} · {what} · {self.clock() - self.began:.0f} s"
        if self.status is not None:
            self.status.update(line)
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def done(self, line: str) -> None:
        self.console.print(line, highlight=False, soft_wrap=True)


@app.command("replay")
def replay_command(
    data: Annotated[Path, typer.Option(help="Your event log: a parquet/CSV file or a folder of them.")],
    spec: SpecOption = None,
    period: Annotated[str, typer.Option(help="day, week, month (30 days) or auto (from the log's density).")]
    = "auto",
    periods: Annotated[int, typer.Option(min=1, help="Periods replayed after the first model's bootstrap.")] = 6,
    epochs: Annotated[int, typer.Option(min=1, help="Passes of each full retrain.")] = 3,
    embedding_l2_choices: Annotated[str, typer.Option(help="Embedding penalties each full retrain of the ranker "
                                                      "tries besides the default (kept only when better on the "
                                                      "newest rows); empty: none tried.")] = "0.1,1.0",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    json_out: JsonOption = False,
) -> None:
    """Your own timestamped log through the loop, period by period: ingest, features, retrain, gate, drift;
    held-out AUC/NDCG of the models and the simple baselines per period; HTML report."""
    import os

    from recloop.replay import PERIODS, PeriodRecord, ReplayConfig, ReplayError, run_replay

    if period != "auto" and period not in PERIODS:
        raise fail_usage(f"--period {period!r} is not one of auto, {', '.join(PERIODS)}")
    if not data.exists():
        raise fail_usage(f"--data {data} does not exist")
    settings = Settings()
    dataset = load_spec(settings, spec)
    choices = penalties(embedding_l2_choices, "--embedding-l2-choices")
    config = ReplayConfig(period=period, periods=periods, epochs=epochs, device=device,  # type: ignore[arg-type]
                          embedding_l2_choices=choices)

    def on_period(record: PeriodRecord) -> None:
        if json_out:
            return
        figures = ", ".join(f"{name} {scores['auc']:.4f}" for name, scores in record.scores.items()
                            if scores.get("auc") is not None)
        console.print(f"period {record.period} ({record.start[:10]}): {record.landed:,} events; AUC {figures}; "
                      f"drift {record.drift}; incremental v{record.incremental_version} {record.gate}; "
                      f"full {record.full_retrain}"
                      + (f" (embedding penalty {record.full_embedding_l2:g})" if record.full_embedding_l2 is not None
                         else "") + f" ({record.seconds} s)")
        if record.canary != "-":
            console.print(f"  canary: {record.canary}")
        recommend = record.recommend
        if recommend.get("users"):
            k = recommend["k"]
            lists = ", ".join(f"{name} {recommend[name][f'recall@{k}']:.3f}"
                              for name in ("recommend", "popularity", "cooccurrence"))
            console.print(f"  recall@{k} over {recommend['users']} users: {lists}")

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        with quiet_logs():
            summary = run_replay(settings, dataset, data, config, on_period=on_period)
    except ReplayError as err:
        raise fail_usage(str(err)) from err
    if json_out:
        emit(summary)
        return
    scored = summary.get("scores_overall") or {}
    for name, figures in (scored.get("versus") or {}).items():
        parts = ", ".join(f"{label} {v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" for metric, label in
                          (("auc", "AUC"), ("logloss", "log loss")) for v in [figures.get(metric)] if v)
        console.print(f"champion − {name} over every period's {scored['rows']:,} rows: {parts}")
    overall = summary.get("recommend_overall") or {}
    if overall.get("users"):
        k = overall["k"]
        versus = ", ".join(
            f"{name} {v[0]:+.3f} [{v[1]:+.3f}, {v[2]:+.3f}]"
            for name in ("popularity", "cooccurrence")
            for v in [overall["recommend"][f"versus {name}"][f"recall@{k}"]])
        console.print(f"recall@{k} over every period's {overall['users']} users: /recommend "
                      f"{overall['recommend'][f'recall@{k}']:.3f}; − {versus}")
    console.print(f"replayed {len(summary['periods'])} {summary['period']}s in {summary['seconds']} s; "
                  f"report: {summary['report']}")
