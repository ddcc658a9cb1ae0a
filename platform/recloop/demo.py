"""``recloop demo``: the whole loop over simulated days, on embedded defaults, with a report.

Day 0 bootstraps: the world's first day lands, the ``retrain`` flow trains a full model and the gate makes
it champion. The serving API starts (in this process). Then each simulated day:

1. **morning to evening**: simulated users call ``/rank`` and click by the ground truth, in rounds; after
   each round the ``canary`` flow judges a challenger if there is one (hold, step, promote, roll back);
   their feedback is written to the landing zone;
2. **night**: the world's own events for the day land too and are ingested, their features built; the
   ``drift`` flow compares the day with the champion's training window (events and the champion's
   scores) — drift or KPI decay starts a full ``retrain`` (debounced by a cool-down in simulated time);
   otherwise the hourly schedule's work runs as one incremental ``retrain``
   (ingest → features → train → gate → canary start).

Every flow is a Prefect flow run (state under ``$RECLOOP_HOME/prefect``), every model an MLflow run and
version, so ``recloop up`` shows the same history in the Prefect and MLflow UIs.

Alongside, the same requests are ranked offline by the day-0 model, never retrained: the baseline
the loop must beat after a drift. Both are measured as expected clicks relative to the oracle that
ranks by the true click probability (``vs_oracle``).

Each day also scores an **evaluation panel** (``recloop.panel``): requests drawn independently of serving,
ranked by the live champion and the never-retrained model, as normalized reward (0: random, 1: the oracle)
with a user-cluster bootstrap interval. With ``twin`` the same loop runs again on the world's no-drift twin
(same seed, identical until the drift day) under ``home/twin``, and the summary's efficacy figure is the
**twin-world recovery**: the champion's normalized reward with the drift over the twin's, two cycles after
the drift, with its interval.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from recloop.canary import CanaryConfig
from recloop.gate import GateThresholds
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig


@dataclass(frozen=True)
class DemoConfig:
    """Args:
    days: simulated days (day 0 bootstraps the first model).
    events_per_day: the world's own impressions per day (the logged traffic every retrain learns from).
    requests_per_day: ranking requests simulated users send to the serving API per day.
    rounds: the day's requests come in this many rounds; the canary is judged after each.
    drift, drift_day: the world's drift scenario and its first day.
    cooldown_days: after a drift-triggered retrain, no other for this long (simulated time).
    """

    days: int = 5
    events_per_day: int = 20_000
    requests_per_day: int = 400
    rounds: int = 4
    seed: int = 0
    drift: str = "sudden"
    drift_day: int = 2
    cooldown_days: float = 1.5
    full_epochs: int = 3
    batch_size: int | None = None  # default: about 32 steps per day of events
    candidates: int = 100
    shown: int = 10
    panel_requests: int = 300
    twin: bool = False
    # A small world judged on a few hundred requests per step, in one process with everything else: the
    # interleaved CTR comparison decides, with a minimum effect of 30 % (what a few hundred interleaved
    # requests can show); p99 of ~100 scoring times is their maximum (a pause anywhere in the process), and
    # AUC pooled over two different halves of the users is not comparable at this size.
    canary: CanaryConfig = field(default_factory=lambda: CanaryConfig(
        steps=(0.25, 0.5, 1.0), bake_seconds=0, min_requests=15, min_feedback=100, max_ctr_drop=0.3,
        max_p99_ratio=10.0, max_auc_drop=1.0, min_effect=0.3))
    # Held-out windows of a few thousand rows: an incremental model may lose up to 0.01 AUC, and calibration
    # is measured within ±25 % (noise at this size; the defaults suit production windows).
    gate: GateThresholds = field(default_factory=lambda: GateThresholds(
        max_auc_drop_incremental=0.01, max_slice_auc_drop=0.03, calibration_range=(0.75, 1.33)))


@dataclass
class DayRecord:
    day: int
    events: int = 0
    requests: int = 0
    drift: str = "-"
    drift_reasons: list[str] = field(default_factory=list)
    retrain: str = "-"
    candidate_version: str | None = None
    candidate_auc: float | None = None
    champion_auc: float | None = None
    oracle_auc: float | None = None
    gate: str = "-"
    canary: list[str] = field(default_factory=list)
    champion: str | None = None
    online_ctr: dict[str, float] = field(default_factory=dict)
    vs_oracle: float | None = None
    baseline_vs_oracle: float | None = None
    panel: dict[str, dict[str, float]] = field(default_factory=dict)
    seconds: float = 0.0


def run_demo(settings: Settings, config: DemoConfig, on_day: Callable[[DayRecord], None] | None = None,
             on_stage: Callable[[int, str], None] | None = None) -> dict:
    """Run the demo; ``on_day`` gets each finished day, ``on_stage`` ``(day, stage)`` as each stage begins."""
    stage = on_stage or (lambda day, what: None)
    from recloop.flow_support import configure_prefect, settings_parameter

    configure_prefect(settings)
    flows = _flows(settings_parameter(settings))
    started = time.perf_counter()
    canary_path = _write_canary_config(settings, config.canary)
    world_config = WorldConfig(seed=config.seed, days=config.days, events_per_day=config.events_per_day,
                               drift=config.drift, drift_day=config.drift_day)  # type: ignore[arg-type]
    world = World(world_config)
    batch_size = config.batch_size or max(128, min(2048, config.events_per_day // 32))
    train_args = {"batch_size": batch_size, "validation_hours": 6, "canary_config": str(canary_path),
                  "gate_thresholds": str(_write_json(settings, "gate.json", asdict(config.gate)))}

    bootstrap = DayRecord(day=0)
    stage(0, "landing the first day's events")
    bootstrap.events = _land_day(world, 0, settings)
    stage(0, "full retrain (bootstrap): ingest, features, train, gate")
    first = flows["retrain"](mode="full", reason="bootstrap", days=1, epochs=config.full_epochs, **train_args)
    _record_training(bootstrap, first, "full (bootstrap)")
    if first["gate"]["alias"] != "champion":
        raise RuntimeError("the first model did not pass the gate's floors, so nothing can be served: "
                           + "; ".join(first["gate"]["reasons"]) + " (more --events-per-day helps)")
    records = [bootstrap]
    bootstrap.seconds = round(time.perf_counter() - started, 1)
    if on_day:
        on_day(bootstrap)
    frozen = _FrozenRanker(settings, first["gate"]["version"])
    last_full_day = 0

    from recloop import registry
    from recloop.serve.app import ServerThread, create_app

    serving = Settings(**{**settings.model_dump(), "serve_poll_seconds": 0.2, "feedback_flush_seconds": 3600})
    app = create_app(serving)
    freshness: list[float] = []
    panels: dict[int, dict] = {}
    with ServerThread(app) as server:
        for day in range(1, config.days):
            began = time.perf_counter()
            record = DayRecord(day=day)
            stage(day, f"serving {config.requests_per_day} requests in {config.rounds} rounds (canary checks between)")
            served, baseline = _serve_day(server.url, app, world, day, config, flows, canary_path, record, frozen)
            record.requests, record.online_ctr = served["requests"], served["ctr"]
            record.vs_oracle, record.baseline_vs_oracle = served["vs_oracle"], baseline
            panels[day] = frozen.panel(world, day, config, registry.version_by_alias(settings, "champion"))
            record.panel = panels[day]["figures"]
            app.state.service.land_feedback()
            stage(day, "landing the day's events and feedback")
            record.events = _land_day(world, day, settings)
            landed_at = time.perf_counter()
            # By the time the monitor looks, the hourly runs have landed the day and built its features.
            stage(day, "ingest")
            flows["ingest"]()
            stage(day, "features (and Feast materialize)")
            flows["features"]()
            stage(day, "drift check (Evidently); a full retrain if it drifted")
            now = (world_config.start + timedelta(days=day + 1)).timestamp()
            drift = flows["drift"](hours=24, now=now, cooldown_seconds=config.cooldown_days * 86400,
                                        retrain_inline=True, retrain_parameters={
                                            **train_args, "days": day + 1, "epochs": config.full_epochs})
            record.drift, record.drift_reasons = drift["decision"], list(drift["reasons"])
            if "retrain" in drift:
                outcome, kind = drift["retrain"], f"full ({drift['decision']})"
                last_full_day = day
            else:
                stage(day, "incremental retrain: train, gate")
                outcome = flows["retrain"](mode="incremental", reason="scheduled", days=day + 1, **train_args)
                kind = "incremental"
            _record_training(record, outcome, kind)
            if outcome.get("gate", {}).get("alias") == "challenger":
                freshness.append(_until_serving(server.url, outcome["gate"]["version"]) + time.perf_counter()
                                 - landed_at)
            record.champion = registry.version_by_alias(settings, "champion")
            record.seconds = round(time.perf_counter() - began, 1)
            records.append(record)
            if on_day:
                on_day(record)
    summary = _summarize(records, config, freshness, last_full_day)
    summary["panels"] = {day: {k: v.tolist() for k, v in panel["rewards"].items()} | {"users": panel["users"].tolist()}
                         for day, panel in panels.items()}
    if config.twin and config.drift != "none":
        from dataclasses import replace

        twin_settings = Settings(**{**settings.model_dump(), "home": settings.home / "twin"})
        twin = run_demo(twin_settings, replace(config, drift="none", twin=False))
        summary["twin"] = {"report": twin["report"], "days": twin["days"]}
        summary["recovery"] = _twin_recovery(panels, twin["panels"], config)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["report"] = str(write_report(settings, records, summary, config))
    return summary


def _flows(settings: dict) -> dict[str, Callable]:
    """The Prefect flows, each called with this demo's settings."""
    from functools import partial

    from flows.canary_flow import canary_flow
    from flows.drift_flow import drift_flow
    from flows.features_flow import features_flow
    from flows.ingest_flow import ingest_flow
    from flows.retrain_flow import retrain_flow

    return {flow.name: partial(flow, settings=settings)
            for flow in (ingest_flow, features_flow, retrain_flow, canary_flow, drift_flow)}


def _write_canary_config(settings: Settings, canary: CanaryConfig) -> Path:
    return _write_json(settings, "canary.json", {**asdict(canary), "steps": list(canary.steps)})


def _write_json(settings: Settings, name: str, content: dict) -> Path:
    """A config file the flows read (flow parameters stay small and visible in the Prefect UI)."""
    path = settings.home.resolve() / "loop" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


def _land_day(world: World, day: int, settings: Settings) -> int:
    """The world's own events of a day, one parquet file per hour, into the landing zone."""
    date = (world.config.start + timedelta(days=day)).strftime("%Y-%m-%d")
    folder = settings.landing_dir / "world" / date
    folder.mkdir(parents=True, exist_ok=True)
    events = 0
    for hour in range(24):
        table = world.hour_events(day, hour)
        tmp = folder / f".events-{date}T{hour:02d}.parquet.tmp"
        pq.write_table(table, tmp)
        tmp.rename(folder / f"events-{date}T{hour:02d}.parquet")
        events += table.num_rows
    return events


def _record_training(record: DayRecord, outcome: dict, kind: str) -> None:
    record.retrain = kind
    if "skipped" in outcome:  # no hour the champion has not seen: nothing trained (never in the demo's days)
        record.retrain, record.gate = f"{kind} skipped", "-"
        return
    gate = outcome["gate"]
    record.candidate_version = gate["version"]
    record.candidate_auc = gate["candidate"].get("auc")
    record.oracle_auc = gate["candidate"].get("oracle_auc")
    record.champion_auc = (gate.get("champion_scores") or {}).get("auc")
    record.gate = ("passed → " + gate["alias"]) if gate["passed"] else "refused"
    if "canary" in outcome:
        record.canary.append(f"start v{gate['version']}")


def _twin_recovery(panels: dict[int, dict], twin: dict, config: DemoConfig) -> dict:
    """Per day from the drift on: the champion's normalized reward with the drift over its twin's, with a
    user-cluster interval; the headline is two cycles after the drift."""
    from recloop.panel import twin_recovery

    per_day = {}
    for day, panel in panels.items():
        other = twin.get(day) or twin.get(str(day))
        if day < config.drift_day or other is None:
            continue
        mine = panel["rewards"]
        theirs = {k: np.asarray(v) for k, v in other.items() if k != "users"}
        per_day[day] = {"champion": twin_recovery(mine, theirs, panel["users"], "champion"),
                        "never_retrained": twin_recovery(mine, theirs, panel["users"], "never_retrained")}
    headline = per_day.get(config.drift_day + 2) or (per_day[max(per_day)] if per_day else None)
    return {"per_day": per_day, "day": config.drift_day + 2 if config.drift_day + 2 in per_day else
            (max(per_day) if per_day else None), "headline": headline,
            "target": "champion's normalized reward >= 0.95 of the no-drift twin within two cycles (95 % CI "
                      "lower bound stated)",
            "met": bool(headline and headline["champion"]["low"] >= 0.95)}


class _FrozenRanker:
    """The day-0 model ranking the day's requests offline with the same online features (the baseline),
    and the day's evaluation panel scored by it and by the live champion."""

    def __init__(self, settings: Settings, version: str):
        from recloop.features.config import FeatureConfig
        from recloop.schema import load_spec
        from recloop.serve.features import RequestFeatures, online_reader
        from recloop.serve.models import load_version

        spec = load_spec("synthetic")
        self.settings = settings
        self.model = load_version(settings, version)
        self.features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), online_reader(settings))
        self._models = {version: self.model}

    def panel(self, world: World, day: int, config: DemoConfig, champion: str | None) -> dict:
        """The day's panel (drawn on its own stream): per-request expected clicks of the oracle, a random
        ranking, the never-retrained model and the live champion; normalized rewards with intervals."""
        from datetime import datetime

        from recloop.panel import draw_panel, per_request, request_bodies, score_panel
        from recloop.serve.models import load_version, score

        panel = draw_panel(world, day + 0.5, config.panel_requests, min(config.candidates, 50), seed=config.seed)
        if champion is not None and champion not in self._models:
            self._models[champion] = load_version(self.settings, champion)
        scores: dict[str, list] = {"never_retrained": [], "champion": []}
        self.features.refresh_if_published()
        for body in request_bodies(world, panel):
            ts_us = int(datetime.fromisoformat(body["ts"]).timestamp() * 1_000_000)
            rows, _ = self.features.rows(body["user_id"], body["item_ids"], body["context"], ts_us)
            scores["never_retrained"].append(score(self.model, rows).numpy())
            scores["champion"].append(score(self._models.get(champion, self.model), rows).numpy())
        stacked = {k: np.stack(v) for k, v in scores.items()}
        rows = per_request(world, panel, stacked, k=config.shown, seed=config.seed)
        figures = score_panel(world, panel, stacked, k=config.shown, seed=config.seed)
        return {"rewards": {k: v["reward"] for k, v in rows.items()}, "users": panel.users,
                "figures": {k: {m: round(x, 4) for m, x in v.items()} for k, v in figures.items()
                            if k in ("champion", "never_retrained")}}

    def rank(self, body: dict) -> list[int]:
        from datetime import datetime

        from recloop.serve.models import score

        self.features.refresh()
        ts_us = int(datetime.fromisoformat(body["ts"]).timestamp() * 1_000_000)
        rows, _ = self.features.rows(body["user_id"], body["item_ids"], body["context"], ts_us)
        scores = score(self.model, rows).numpy()
        return [body["item_ids"][i] for i in np.argsort(-scores, kind="stable")]


def _serve_day(url: str, app, world: World, day: int, config: DemoConfig, flows: dict, canary_path: Path,
               record: DayRecord, frozen: _FrozenRanker) -> tuple[dict, float]:
    from recloop.serve.traffic import SimulatedUsers, TrafficSummary, drive

    total = TrafficSummary()
    baseline_clicks = oracle_clicks = 0.0
    per_round = max(1, config.requests_per_day // config.rounds)
    for round_index in range(config.rounds):
        users = SimulatedUsers(world, day=day + (round_index + 0.5) / config.rounds, candidates=config.candidates,
                               shown=config.shown, seed=config.seed * 1000 + day * 10 + round_index)
        pairs = [users.request() for _ in range(per_round)]
        summary = asyncio.run(drive(url, users, pairs, concurrency=4))
        for body, who in pairs:
            baseline_clicks += users.expected(frozen.rank(body), who)
            oracle_clicks += users.oracle_expected(body, who)
        total.requests += summary.requests
        total.failed += summary.failed
        for counter in ("errors", "versions", "impressions", "clicks", "expected_clicks", "oracle_clicks"):
            getattr(total, counter).update(getattr(summary, counter))
        step = flows["canary"](config_path=str(canary_path))
        if step["action"] not in ("none", "hold"):
            record.canary.append(f"{step['action']} v{step['challenger']}" + (
                f" → {step['share']:.0%}" if step["action"] == "step" else ""))
            if step["action"] == "rollback":
                record.canary[-1] += ": " + "; ".join(step["decision"]["reasons"])
            _wait_for_deployment(url, app.state.service.settings)
    served = total.to_dict()
    expected = sum(total.expected_clicks.values())
    served["vs_oracle"] = expected / sum(total.oracle_clicks.values()) if total.oracle_clicks else None
    if total.failed:
        raise RuntimeError(f"{total.failed} requests failed on day {day}: {dict(total.errors)}")
    return served, baseline_clicks / oracle_clicks if oracle_clicks else None


def _wait_for_deployment(url: str, settings: Settings, timeout: float = 30.0) -> None:
    """Let the server pick up moved aliases and shares before the next round (it polls every 0.2 s)."""
    import httpx

    from recloop.serve.models import registry_wanted

    wanted = registry_wanted(settings)
    target = (wanted.champion, wanted.challenger, wanted.share if wanted.challenger else 0.0)
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = httpx.get(f"{url}/healthz").json()
        if (health["versions"]["champion"], health["versions"]["challenger"], health["share"]) == target:
            return
        time.sleep(0.05)
    raise RuntimeError(f"the serving API did not pick up {target} within {timeout:.0f} s")


def _until_serving(url: str, version: str, timeout: float = 30.0) -> float:
    """Seconds until the server routes canary traffic to ``version``."""
    import httpx

    began = time.perf_counter()
    while time.perf_counter() - began < timeout:
        health = httpx.get(f"{url}/healthz").json()
        if health["versions"]["challenger"] == version and health["share"] > 0:
            break
        time.sleep(0.05)
    return time.perf_counter() - began


def _summarize(records: list[DayRecord], config: DemoConfig, freshness: list[float], last_full_day: int) -> dict:
    days = [asdict(r) for r in records]
    summary: dict = {"days": days, "config": asdict(config),
                     "full_retrains": sum(r.retrain in ("full (drift)", "full (kpi_decay)") for r in records),
                     "freshness_seconds": [round(f, 1) for f in freshness]}
    served = {r.day: r.vs_oracle for r in records if r.vs_oracle is not None}
    baseline = {r.day: r.baseline_vs_oracle for r in records if r.baseline_vs_oracle is not None}
    before = [served[d] for d in served if d < config.drift_day]
    if config.drift != "none" and before and config.drift_day + 2 in served:
        pre = float(np.mean(before))
        recovered = served[config.drift_day + 2]
        summary["efficacy"] = {
            "pre_drift_vs_oracle": round(pre, 4), "drift_day_vs_oracle": round(served.get(config.drift_day, np.nan), 4),
            "two_cycles_after_vs_oracle": round(recovered, 4), "recovery": round(recovered / pre, 4),
            "never_retrain_two_cycles_after": round(baseline.get(config.drift_day + 2, np.nan), 4),
            "never_retrain_recovery": round(baseline.get(config.drift_day + 2, np.nan) / pre, 4),
            "target": ">= 0.95 of the pre-drift level within two cycles",
            "met": bool(recovered / pre >= 0.95)}
    return summary


def write_report(settings: Settings, records: list[DayRecord], summary: dict, config: DemoConfig) -> Path:
    """An HTML page: the per-day table and plots of online KPI and AUC with retrain, promotion and drift markers."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    days = [r.day for r in records]
    figure = make_subplots(rows=2, cols=1, shared_xaxes=True, vertical_spacing=0.12, subplot_titles=(
        "Served ranking vs the oracle (expected clicks)", "Offline AUC on each day's held-out hours"))
    figure.add_trace(go.Scatter(x=days, y=[r.vs_oracle for r in records], name="recloop (served)",
                                mode="lines+markers"), row=1, col=1)
    figure.add_trace(go.Scatter(x=days, y=[r.baseline_vs_oracle for r in records], name="never retrained",
                                mode="lines+markers", line={"dash": "dot"}), row=1, col=1)
    for name, values in (("candidate", [r.candidate_auc for r in records]), ("champion", [r.champion_auc for r in records]),
                         ("oracle", [r.oracle_auc for r in records])):
        figure.add_trace(go.Scatter(x=days, y=values, name=f"{name} AUC", mode="lines+markers"), row=2, col=1)
    for r in records:
        if r.drift not in ("-", "ok"):
            figure.add_vline(x=r.day, line={"color": "red", "dash": "dash"}, annotation_text=r.drift)
        if r.retrain.startswith("full"):
            figure.add_vline(x=r.day + 0.1, line={"color": "purple"}, annotation_text="full retrain",
                             annotation_position="bottom right")
        if any(c.startswith("promote") for c in r.canary):
            figure.add_vline(x=r.day - 0.1, line={"color": "green"}, annotation_text="promoted",
                             annotation_position="top left")
    if config.drift != "none":
        figure.add_vrect(x0=config.drift_day - 0.5, x1=config.days - 0.5, fillcolor="red", opacity=0.05,
                         line_width=0)
    figure.update_yaxes(title_text="expected clicks / oracle's", row=1, col=1)
    figure.update_yaxes(title_text="AUC", row=2, col=1)
    figure.update_layout(height=760, width=1100, title=f"recloop demo — {config.days} days, drift "
                         f"'{config.drift}' from day {config.drift_day}", xaxis2_title="simulated day")
    rows = "".join(
        f"<tr><td>{r.day}</td><td>{r.events:,}</td><td>{r.requests}</td><td>{r.drift}</td><td>{r.retrain}</td>"
        f"<td>{_f(r.candidate_auc)}</td><td>{_f(r.champion_auc)}</td><td>{_f(r.oracle_auc)}</td><td>{r.gate}</td>"
        f"<td>{'<br>'.join(r.canary) or '-'}</td><td>{r.champion or '-'}</td>"
        f"<td>{', '.join(f'v{v}: {c:.3f}' for v, c in r.online_ctr.items()) or '-'}</td>"
        f"<td>{_f(r.vs_oracle)}</td><td>{_f(r.baseline_vs_oracle)}</td></tr>" for r in records)
    efficacy = summary.get("efficacy")
    verdict = "" if not efficacy else (
        f"<p><b>Loop efficacy</b>: two cycles after the drift the served ranking earns {efficacy['recovery']:.1%} of "
        f"its pre-drift share of the oracle's clicks (never retrained: {efficacy['never_retrain_recovery']:.1%}); "
        f"target ≥ 95%: {'met' if efficacy['met'] else 'not met'}.</p>")
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>recloop demo</title>
<style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style></head><body>
<h1>recloop demo</h1>{verdict}
<table><tr><th>day</th><th>events</th><th>requests</th><th>drift</th><th>retrain</th><th>candidate AUC</th>
<th>champion AUC</th><th>oracle AUC</th><th>gate</th><th>canary</th><th>champion</th><th>online CTR</th>
<th>served / oracle</th><th>never retrained / oracle</th></tr>{rows}</table>
{figure.to_html(full_html=False, include_plotlyjs=True)}
<p>Freshness (events landed → challenger serving canary traffic): {summary['freshness_seconds']} s.
Total {summary.get('seconds', '')} s.</p></body></html>"""
    path = settings.home.resolve() / "reports" / "demo.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path


def _f(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"
