"""``recloop demo``: the whole loop over simulated days, on embedded defaults, with a report.

Day 0 bootstraps: the world's first day lands, the ``retrain`` flow trains a full model and the gate makes
it champion. The serving API starts (in this process). Then each simulated day:

1. **morning to evening**: simulated users call ``/rank`` (a candidate list) and ``/recommend`` (a user
   id alone: retrieve from the whole catalog → filter → rank → order) and click by the ground truth, in
   rounds; after each round the ``canary`` flow judges each model's challenger if there is one (the
   ranker's and the retriever's, independently: hold, step, promote, roll back); their feedback is
   written to the landing zone;
2. **night**: the world's own events for the day land too and are ingested, their features built; the
   ``drift`` flow compares the day with the champion's training window (events and the champion's
   scores) — drift or KPI decay starts a full ``retrain`` (debounced by a cool-down in simulated time);
   otherwise the hourly schedule's work runs as one incremental ``retrain``, or a full one from scratch
   once the champion's chain of incremental runs spans ``full_every_days``
   (ingest → features → train → gate → canary start, for the ranker and then the retriever); a model
   whose canary is still running is not retrained that night (``waits for v2's canary``): a new challenger
   would reset its evidence.

Every flow is a Prefect flow run (state under ``$RECLOOP_HOME/prefect``), every model an MLflow run and
version, so ``recloop up`` shows the same history in the Prefect and MLflow UIs.

Alongside, the same requests are ranked offline by the day-0 model, never retrained: the baseline
the loop must beat after a drift. Both are measured as expected clicks relative to the oracle that
ranks by the true click probability (``vs_oracle``). The whole path (``/recommend``) is measured by its
clicks per day and its expected clicks relative to the oracle that shows each user the catalog's best
items; each retriever candidate by its oracle recall@K (the share of each user's K truly best catalog
items it retrieves) beside the popularity baseline's, on its held-out hours.

Each day also scores an **evaluation panel** (``recloop.panel``): requests drawn independently of serving,
ranked by the live champion and the never-retrained model (and, with ``daily_full``, a full retrain from
scratch on every day so far: the upper reference), as normalized reward (0: random, 1: the oracle) with a
user-cluster bootstrap interval. With ``twin`` the same loop runs again on the world's no-drift twin
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
from jinja2 import Environment
from markupsafe import Markup

from recloop.canary import CanaryConfig
from recloop.canary.decision import shipped
from recloop.gate import GateThresholds
from recloop.gate.retrieval import RetrievalThresholds
from recloop.retrieval.evaluate import WorldOracle
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
    # an incremental retrain also replays older hours, this share of its new ones (TrainConfig.replay_fraction;
    # the retrain flow's default: +0.018 held-out AUC [0.005, 0.030] over none along the loop's chain)
    replay_fraction: float = 1.0
    # a scheduled retrain starts over from scratch once the champion's chain of incremental runs spans this
    # many days (the retrain flow's ``full_every_hours``; 0: never): a chain trails a full retrain over the
    # same days, by 0.05 normalized reward on the panel on average over 6 days (benchmarks/RESULTS.md)
    full_every_days: float = 3.0
    batch_size: int | None = None  # default: about 32 steps per day of events
    candidates: int = 100
    shown: int = 10
    panel_requests: int = 300
    twin: bool = False
    # The upper reference: each day also a full retrain from scratch on every day so far (not registered, not
    # served), scored on the next day's panel beside the live champion ("daily_full").
    daily_full: bool = False
    # The recommendation path: this share of each round's requests goes to /recommend, which retrieves
    # ``retrieve_k`` of the catalog (a few hundred items in this small world) for the ranker.
    # Items shown to a user within ``seen_hours`` (simulated) are not recommended again: a few hours, as
    # this small world's catalog would be exhausted by its most active users within a day.
    recommend_share: float = 0.5
    retrieve_k: int = 100
    seen_hours: float = 3.0
    # The shipped canary's margins (``canary.decision.shipped``: 5 % minimum effect, paired online AUC), at
    # the pace of a small world judged a few hundred requests at a time: the ranker's canary starts at half
    # of the users (interleaved lists: half of each list is still the champion's) and is judged without a
    # bake. A few hundred interleaved requests a day cannot show a 5 % non-inferiority: such a challenger is
    # held at the last step ("not yet shown within 5 %") rather than promoted on a margin that admits worse
    # models, and the next day's retrain replaces it once it has waited a day (the retrain flow's
    # ``canary_wait_hours``).
    canary: CanaryConfig = field(default_factory=lambda: shipped(
        steps=(0.5, 1.0), bake_seconds=0, min_requests=15, min_feedback=100))
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
    trigger: str = "-"  # the retrain trigger's verdict on the drift check (why a finding did or did not retrain)
    retrain: str = "-"
    candidate_version: str | None = None
    candidate_auc: float | None = None
    champion_auc: float | None = None
    oracle_auc: float | None = None
    gate: str = "-"
    retriever_version: str | None = None
    retriever_gate: str = "-"
    retriever_oracle_recall: float | None = None
    popularity_oracle_recall: float | None = None
    retriever_champion: str | None = None
    recommend_requests: int = 0
    recommend_clicks: int = 0
    recommend_vs_oracle: float | None = None
    popularity_answers: int = 0
    canary: list[str] = field(default_factory=list)
    # each canary move of the day (start, step, promote, rollback) with the evidence that decided it
    # (``canary.explain``'s columns, and ``day``, ``model``, ``version``, ``champion``)
    decisions: list[dict] = field(default_factory=list)
    champion: str | None = None
    online_ctr: dict[str, float] = field(default_factory=dict)
    # the champion's CTR on its served feedback in the night's monitored window (/rank and /recommend): the
    # figure the drift monitor judges and Evidently's KPI panels plot (``dashboards.online_ctr``)
    monitor_ctr: float | None = None
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
    clock = {"day": 0}  # the simulated day the flows run on: each run is tagged and named for it
    flows = _flows(settings_parameter(settings), clock)
    started = time.perf_counter()
    canary_path = _write_canary_config(settings, config.canary)
    world_config = WorldConfig(seed=config.seed, days=config.days, events_per_day=config.events_per_day,
                               drift=config.drift, drift_day=config.drift_day)  # type: ignore[arg-type]
    world = World(world_config)
    batch_size = config.batch_size or max(128, min(2048, config.events_per_day // 32))
    retriever_gate = RetrievalThresholds(k=config.retrieve_k)
    train_args = {"batch_size": batch_size, "validation_hours": 6, "canary_config": str(canary_path),
                  "gate_thresholds": str(_write_json(settings, "gate.json", asdict(config.gate))),
                  "retriever_thresholds": str(_write_json(settings, "retriever_gate.json", asdict(retriever_gate))),
                  "retriever_epochs": config.full_epochs}
    oracle = WorldOracle(World(world_config))  # its own copy: the oracle reads tastes, never the histories

    bootstrap = DayRecord(day=0)
    stage(0, "landing the first day's events")
    bootstrap.events = _land_day(world, 0, settings)
    stage(0, "full retrain (bootstrap): ingest, features, train, gate (ranker, then retriever)")
    first = flows["retrain"](mode="full", reason="bootstrap", days=1, epochs=config.full_epochs, **train_args)
    _record_training(bootstrap, first, "full (bootstrap)")
    _record_retriever(bootstrap, first, settings, oracle, config.retrieve_k)
    if first["gate"]["alias"] != "champion":
        raise RuntimeError("the first model did not pass the gate's floors, so nothing can be served: "
                           + "; ".join(first["gate"]["reasons"]) + first_model_hint(first["gate"]["reasons"]))
    if (first["retriever"].get("gate") or {}).get("alias") != "champion":
        raise RuntimeError("the first retriever did not pass its gate's floors, so /recommend cannot serve: "
                           + "; ".join((first["retriever"].get("gate") or {}).get("reasons", [])
                                       or [first["retriever"]["train"].get("skipped", "")]))
    records = [bootstrap]
    bootstrap.seconds = round(time.perf_counter() - started, 1)
    if on_day:
        on_day(bootstrap)
    frozen = _FrozenRanker(settings, first["gate"]["version"])
    if config.daily_full:
        frozen.reference = frozen.model  # day 0's full retrain is the bootstrap model itself
    last_full_day = 0

    from recloop import registry
    from recloop.monitor.dashboards import online_ctr
    from recloop.serve.app import ServerThread, create_app

    serving = Settings(**{**settings.model_dump(), "serve_poll_seconds": 0.2, "feedback_flush_seconds": 3600,
                          "recommend_candidates": config.retrieve_k, "recommend_seen_hours": config.seen_hours})
    app = create_app(serving)
    freshness: list[float] = []
    panels: dict[int, dict] = {}
    with ServerThread(app) as server:
        for day in range(1, config.days):
            began = time.perf_counter()
            clock["day"] = day
            record = DayRecord(day=day)
            stage(day, f"serving {config.requests_per_day} requests in {config.rounds} rounds (canary checks between)")
            served, baseline = _serve_day(server.url, app, world, day, config, flows, canary_path, record, frozen)
            record.requests, record.online_ctr = served["requests"], served["ctr"]
            record.vs_oracle, record.baseline_vs_oracle = served["vs_oracle"], baseline
            panels[day] = frozen.panel(world, day, config, registry.version_by_alias(settings, "champion"))
            record.panel = panels[day]["figures"]
            path = served["recommend"]
            record.recommend_requests, record.recommend_clicks = path["requests"], sum(path["clicks"].values())
            record.recommend_vs_oracle, record.popularity_answers = path["vs_oracle"], path["popularity"]
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
            record.monitor_ctr = online_ctr(drift.get("kpi"))
            record.trigger = drift["trigger"]["reason"]
            if "retrain" in drift:
                outcome, kind = drift["retrain"], f"full ({drift['decision']})"
                last_full_day = day
            else:
                stage(day, "scheduled retrain (incremental; from scratch when the chain is long): train, gate "
                           "(ranker, then retriever)")
                outcome = flows["retrain"](mode="incremental", reason="scheduled", days=day + 1,
                                           replay_fraction=config.replay_fraction,
                                           full_every_hours=config.full_every_days * 24 or None,
                                           full_epochs=config.full_epochs, **train_args)
                kind = "incremental" + (f" ({_held(record.trigger)})" if drift["decision"] != "ok" else "")
                if outcome.get("mode") == "full":
                    kind, last_full_day = "full (periodic)", day
            _record_training(record, outcome, kind)
            _record_retriever(record, outcome, settings, oracle, config.retrieve_k)
            if outcome.get("gate", {}).get("alias") == "challenger":
                freshness.append(_until_serving(server.url, outcome["gate"]["version"]) + time.perf_counter()
                                 - landed_at)
            if config.daily_full:
                stage(day, "daily full retrain from scratch (the panel's upper reference; not served)")
                frozen.reference = _train_reference(settings, day, config, batch_size)
            record.champion = registry.version_by_alias(settings, "champion")
            record.retriever_champion = registry.version_by_alias(settings, "champion", registry.RETRIEVER_NAME)
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
        twin = run_demo(twin_settings, replace(config, drift="none", twin=False), on_stage=(
            (lambda day, what: on_stage(day, f"no-drift twin: {what}")) if on_stage else None))
        summary["twin"] = {"report": twin["report"], "days": twin["days"]}
        summary["recovery"] = _twin_recovery(panels, twin["panels"], config)
    summary["seconds"] = round(time.perf_counter() - started, 1)
    summary["report"] = str(write_report(settings, records, summary, config))
    return summary


def _flows(settings: dict, clock: dict) -> dict[str, Callable]:
    """The Prefect flows, each called with this demo's settings, in this process (``in_process_runs``), tagged
    ``day:N`` for the simulated day ``clock["day"]`` (subflows too): their names say the day, not the hour."""
    from prefect import tags

    from flows.canary_flow import canary_flow
    from flows.drift_flow import drift_flow
    from flows.features_flow import features_flow
    from flows.ingest_flow import ingest_flow
    from flows.retrain_flow import retrain_flow
    from recloop.flow_support import SIMULATED_DAY_TAG, in_process_runs

    def in_process(flow: Callable) -> Callable:
        def call(**parameters):
            with in_process_runs(), tags(f"{SIMULATED_DAY_TAG}{clock['day']}"):
                return flow(settings=settings, **parameters)
        return call

    return {flow.name: in_process(flow) for flow in (ingest_flow, features_flow, retrain_flow, canary_flow, drift_flow)}


def _write_canary_config(settings: Settings, canary: CanaryConfig) -> Path:
    return _write_json(settings, "canary.json", {**asdict(canary), "steps": list(canary.steps)})


def _write_json(settings: Settings, name: str, content: dict) -> Path:
    """A config file the flows read (flow parameters stay small and visible in the Prefect UI)."""
    path = settings.home.resolve() / "loop" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=2) + "\n")
    return path


def first_model_hint(reasons: list[str]) -> str:
    """What may help a first model the gate refused, from its reasons: more events only where the refusal
    is about too little data (a serving check failing on a busy host was told "more --events-per-day helps")."""
    data = ("held-out rows", "auc ", "logloss", "calibration")
    if any(r.startswith(data) or "held-out rows" in r for r in reasons):
        return " (more --events-per-day gives the first model more to learn from and judge on)"
    if any(r.startswith("serving check") for r in reasons):
        return (" (the serving check: the model could not be loaded or scored in a fresh process, or exceeded the "
                "gate thresholds' smoke_budget_ms; more events would not change that)")
    return ""


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


def _held(trigger_reason: str) -> str:
    """Why a finding of the drift check started no full retrain, in a few words (the trigger says it whole)."""
    if "cool-down" in trigger_reason:
        return "full held: cool-down"
    if trigger_reason.startswith("data quality"):
        return "no retrain on broken data"
    return "no full retrain requested"


def _record_training(record: DayRecord, outcome: dict, kind: str) -> None:
    record.retrain = kind
    if "waiting_for" in outcome:  # a scheduled incremental while the ranker's canary runs: its evidence is kept
        record.retrain, record.gate = f"{kind}: waits for v{outcome['waiting_for']['version']}'s canary", "-"
        return
    if "skipped" in outcome:  # no hour the champion has not seen: nothing trained (never in the demo's days)
        record.retrain, record.gate = f"{kind} skipped", "-"
        return
    gate = outcome["gate"]
    record.candidate_version = gate["version"]
    record.candidate_auc = gate["candidate"].get("auc")
    record.oracle_auc = gate["candidate"].get("oracle_auc")
    record.champion_auc = (gate.get("champion_scores") or {}).get("auc")
    record.gate = ("passed → " + gate["alias"]) if gate["passed"] else (
        "insufficient evidence → " + gate["alias"]) if gate.get("verdict") == "insufficient evidence" else "refused"
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
        per_day[day] = {policy: twin_recovery(mine, theirs, panel["users"], policy)
                        for policy in ("champion", "never_retrained", "daily_full") if policy in mine and policy in theirs}
    headline = per_day.get(config.drift_day + 2) or (per_day[max(per_day)] if per_day else None)
    return {"per_day": per_day, "day": config.drift_day + 2 if config.drift_day + 2 in per_day else
            (max(per_day) if per_day else None), "headline": headline,
            "target": "champion's normalized reward >= 0.95 of the no-drift twin within two cycles (95 % CI "
                      "lower bound stated)",
            "met": bool(headline and headline["champion"]["low"] >= 0.95)}


def _record_retriever(record: DayRecord, outcome: dict, settings: Settings, oracle: WorldOracle, k: int) -> None:
    """The retrain's retriever: its version, gate, canary start, and its oracle recall@k on its held-out
    hours beside the popularity baseline's (scored here: only the demo knows the world)."""
    retriever = outcome.get("retriever") or {}  # the ranker may have waited for its canary and the retriever not
    if "waiting_for" in retriever:
        record.retriever_gate = f"waits for v{retriever['waiting_for']['version']}'s canary"
        return
    if "gate" not in retriever:
        record.retriever_gate = "not trained: " + retriever.get("train", {}).get("skipped", "-")
        return
    gate = retriever["gate"]
    record.retriever_version = gate["version"]
    record.retriever_gate = ("passed → " + gate["alias"]) if gate["passed"] else "refused"
    if "canary" in retriever:
        record.canary.append(f"start retriever v{gate['version']}")
    from recloop.features.definition import FeatureLayout
    from recloop.retrieval.publish import retriever_folder
    from recloop.retrieval.retriever import Retriever, score_window

    hours = retriever["train"]["validation_hours"]
    first, last = hours[0], hours[-1]
    held_out = [p for p in sorted(FeatureLayout.for_settings(settings).training.glob("*.parquet"))
                if first <= p.stem <= last]
    scores = score_window(Retriever.load(retriever_folder(settings, gate["version"])), held_out, (k,), oracle)
    record.retriever_oracle_recall = scores.overall.get(f"oracle_recall@{k}")
    record.popularity_oracle_recall = (scores.popularity or {}).get(f"oracle_recall@{k}")


def _train_reference(settings: Settings, day: int, config: DemoConfig, batch_size: int):
    """A full retrain from scratch on days 0..``day`` (held-out hours excluded, as the loop's), loaded for the
    panel; no MLflow run, no version: it serves nobody."""
    from recloop.scoring import load_checkpoint
    from recloop.train import TrainConfig, train

    summary = train(settings, TrainConfig(mode="full", days=day + 1, epochs=config.full_epochs,
                                          batch_size=batch_size, validation_hours=6))
    return load_checkpoint(summary.checkpoint, f"daily-full-day{day}")


def rank_panel(features, world: World, panel, models: dict) -> dict[str, np.ndarray]:
    """Each model's click probabilities for the panel's candidates, (requests, candidates), every model
    scoring the same rows: the request's online features (``features``, a ``RequestFeatures``) as served."""
    from datetime import datetime

    from recloop.panel import request_bodies
    from recloop.scoring import score

    scores: dict[str, list] = {name: [] for name in models}
    features.refresh_if_published()
    for body in request_bodies(world, panel):
        ts_us = int(datetime.fromisoformat(body["ts"]).timestamp() * 1_000_000)
        rows, _ = features.rows(body["user_id"], body["item_ids"], body["context"], ts_us)
        for name, model in models.items():
            scores[name].append(score(model, rows).numpy())
    return {name: np.stack(values) for name, values in scores.items()}


class _FrozenRanker:
    """The day-0 model ranking the day's requests offline with the same online features (the baseline),
    and the day's evaluation panel scored by it and by the live champion."""

    def __init__(self, settings: Settings, version: str):
        from recloop.features.config import FeatureConfig
        from recloop.features.online import RequestFeatures, online_reader
        from recloop.schema import load_spec
        from recloop.scoring import load_version

        spec = load_spec("synthetic")
        self.settings = settings
        self.model = load_version(settings, version)
        self.features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), online_reader(settings))
        self._models = {version: self.model}
        self.reference = None  # the daily full retrain (``DemoConfig.daily_full``), when there is one

    def panel(self, world: World, day: int, config: DemoConfig, champion: str | None) -> dict:
        """The day's panel (drawn on its own stream): per-request expected clicks of the oracle, a random
        ranking, the never-retrained model and the live champion; normalized rewards with intervals."""
        from recloop.panel import draw_panel, per_request, score_panel
        from recloop.scoring import load_version

        panel = draw_panel(world, day + 0.5, config.panel_requests, min(config.candidates, 50), seed=config.seed)
        if champion is not None and champion not in self._models:
            self._models[champion] = load_version(self.settings, champion)
        models = {"never_retrained": self.model, "champion": self._models.get(champion, self.model)}
        if self.reference is not None:
            models["daily_full"] = self.reference
        stacked = rank_panel(self.features, world, panel, models)
        rows = per_request(world, panel, stacked, k=config.shown, seed=config.seed)
        figures = score_panel(world, panel, stacked, k=config.shown, seed=config.seed)
        return {"rewards": {k: v["reward"] for k, v in rows.items()}, "users": panel.users,
                "figures": {k: {m: round(x, 4) for m, x in v.items()} for k, v in figures.items()
                            if k in ("champion", "never_retrained", "daily_full")}}

    def rank(self, body: dict) -> list[int]:
        from datetime import datetime

        from recloop.scoring import score

        self.features.refresh()
        ts_us = int(datetime.fromisoformat(body["ts"]).timestamp() * 1_000_000)
        rows, _ = self.features.rows(body["user_id"], body["item_ids"], body["context"], ts_us)
        scores = score(self.model, rows).numpy()
        return [body["item_ids"][i] for i in np.argsort(-scores, kind="stable")]


def _serve_day(url: str, app, world: World, day: int, config: DemoConfig, flows: dict, canary_path: Path,
               record: DayRecord, frozen: _FrozenRanker) -> tuple[dict, float]:
    from recloop.registry import RETRIEVER_NAME
    from recloop.serve.traffic import SimulatedUsers, TrafficSummary, drive

    total, path = TrafficSummary(), TrafficSummary()
    baseline_clicks = oracle_clicks = 0.0
    per_round = max(1, config.requests_per_day // config.rounds)
    recommended = round(per_round * config.recommend_share)
    for round_index in range(config.rounds):
        users = SimulatedUsers(world, day=day + (round_index + 0.5) / config.rounds, candidates=config.candidates,
                               shown=config.shown, seed=config.seed * 1000 + day * 10 + round_index)
        pairs = [users.request() for _ in range(per_round - recommended)]
        asks = [users.recommend_request() for _ in range(recommended)]
        for summary, into in ((asyncio.run(drive(url, users, pairs, concurrency=4)), total),
                              (asyncio.run(drive(url, users, asks, concurrency=4)), path)):
            into.requests += summary.requests
            into.failed += summary.failed
            for counter in ("errors", "versions", "retrievers", "sources", "impressions", "clicks", "expected_clicks",
                            "oracle_clicks"):
                getattr(into, counter).update(getattr(summary, counter))
        for body, who in pairs:
            baseline_clicks += users.expected(frozen.rank(body), who)
            oracle_clicks += users.oracle_expected(body, who)
        moved = False
        for model_name, label in (("recloop-ranker", ""), (RETRIEVER_NAME, "retriever ")):
            step = flows["canary"](config_path=str(canary_path), model_name=model_name)
            if step["action"] not in ("none", "hold"):
                record.canary.append(f"{step['action']} {label}v{step['challenger']}" + (
                    f" → {step['share']:.0%}" if step["action"] == "step" else ""))
                if step["action"] == "rollback":
                    record.canary[-1] += ": " + "; ".join(step["decision"]["reasons"])
                record.decisions.append(_decision(record.day, label, step))
                moved = True
        if moved:
            _wait_for_deployment(url, app.state.service.settings)
    served = total.to_dict()
    expected = sum(total.expected_clicks.values())
    served["vs_oracle"] = expected / sum(total.oracle_clicks.values()) if total.oracle_clicks else None
    served["recommend"] = {**path.to_dict(), "popularity": path.sources["popularity"],
                           "vs_oracle": sum(path.expected_clicks.values()) / sum(path.oracle_clicks.values())
                           if path.oracle_clicks else None}
    if total.failed or path.failed:
        raise RuntimeError(f"{total.failed + path.failed} requests failed on day {day}: "
                           f"{dict(total.errors + path.errors)}")
    return served, baseline_clicks / oracle_clicks if oracle_clicks else None




def _decision(day: int, label: str, step: dict) -> dict:
    """A canary move as the report's row: which model and version, and why (``canary.explain``)."""
    from recloop.canary import explain

    decision = step.get("decision") or {}
    row = explain.decision_row(day, step["action"], step["share"], decision.get("figures") or {},
                               decision.get("reasons") or [])
    return {"day": day, "model": (label.strip() or "ranker"), "version": step.get("challenger"),
            "champion": step.get("champion"), **row}


def _raw_ctr_notes(records: list[DayRecord]) -> list[str]:
    """The promotions (rollbacks) whose challenger's raw online CTR on the day was below (above) its
    champion's: what decided them instead, in a sentence per move."""
    from recloop.canary import explain

    notes = []
    for record in records:
        for move in record.decisions:
            mine, theirs = record.online_ctr.get(str(move["version"])), record.online_ctr.get(str(move["champion"]))
            if move["model"] == "ranker" and explain.raw_ctr_disagrees(move["action"], theirs, mine):
                notes.append(f"Day {record.day}: v{move['version']} was {'promoted' if move['action'] == 'promote' else 'rolled back'} "
                             f"while its online CTR that day ({mine:.3f}) was {'below' if move['action'] == 'promote' else 'above'} "
                             f"v{move['champion']}'s ({theirs:.3f}). The interleaved evidence decided: "
                             f"{move['online CTR evidence (what decides)']}; {explain.RAW_CTR_NOTE}.")
    return notes


def _wait_for_deployment(url: str, settings: Settings, timeout: float = 30.0) -> None:
    """Let the server pick up moved aliases and shares before the next round (it polls every 0.2 s)."""
    import httpx

    from recloop.registry import RETRIEVER_NAME
    from recloop.serve.models import registry_wanted

    def deployed(wanted) -> tuple:
        return wanted.champion, wanted.challenger, wanted.share if wanted.challenger else 0.0

    target = (deployed(registry_wanted(settings)), deployed(registry_wanted(settings, RETRIEVER_NAME)))
    deadline = time.time() + timeout
    while time.time() < deadline:
        health = httpx.get(f"{url}/healthz").json()
        retriever = health["retriever"]
        if ((health["versions"]["champion"], health["versions"]["challenger"], health["share"]),
                (retriever["versions"]["champion"], retriever["versions"]["challenger"], retriever["share"])) == target:
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
    summary["recommend"] = {"clicks_per_day": {r.day: r.recommend_clicks for r in records if r.recommend_requests},
                            "vs_oracle": {r.day: r.recommend_vs_oracle for r in records if r.recommend_requests},
                            "retriever_oracle_recall": {r.day: r.retriever_oracle_recall for r in records
                                                        if r.retriever_oracle_recall is not None},
                            "popularity_oracle_recall": {r.day: r.popularity_oracle_recall for r in records
                                                         if r.popularity_oracle_recall is not None}}
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
    figure = make_subplots(rows=3, cols=1, shared_xaxes=True, vertical_spacing=0.08, subplot_titles=(
        "Served ranking vs the oracle (expected clicks)", "Offline AUC on each day's held-out hours",
        "The recommendation path: retrieval's oracle recall and /recommend vs the catalog oracle"))
    figure.add_trace(go.Scatter(x=days, y=[r.vs_oracle for r in records], name="recloop (served)",
                                mode="lines+markers"), row=1, col=1)
    figure.add_trace(go.Scatter(x=days, y=[r.baseline_vs_oracle for r in records], name="never retrained",
                                mode="lines+markers", line={"dash": "dot"}), row=1, col=1)
    for name, values in (("candidate", [r.candidate_auc for r in records]), ("champion", [r.champion_auc for r in records]),
                         ("oracle", [r.oracle_auc for r in records])):
        figure.add_trace(go.Scatter(x=days, y=values, name=f"{name} AUC", mode="lines+markers"), row=2, col=1)
    for name, values in (("retriever oracle recall", [r.retriever_oracle_recall for r in records]),
                         ("popularity oracle recall", [r.popularity_oracle_recall for r in records]),
                         ("/recommend vs catalog oracle", [r.recommend_vs_oracle for r in records])):
        figure.add_trace(go.Scatter(x=days, y=values, name=name, mode="lines+markers"), row=3, col=1)
    for r in records:  # one marker per day, its events in one label: markers never overlap
        events = _day_events(r)
        if events:
            color = "red" if any(e.startswith(("rolled back", "drift", "kpi")) for e in events) else "purple"
            figure.add_vline(x=r.day, line={"color": color, "dash": "dash"}, annotation_text="<br>".join(events),
                             annotation_position="top right", annotation_font_size=11, row=1, col=1)
            for row in (2, 3):  # labelled once, on the first plot
                figure.add_vline(x=r.day, line={"color": color, "dash": "dash"}, row=row, col=1)
    if config.drift != "none":
        figure.add_vrect(x0=config.drift_day - 0.5, x1=config.days - 0.5, fillcolor="red", opacity=0.05,
                         line_width=0)
    figure.update_yaxes(title_text="expected clicks / oracle's", row=1, col=1)
    figure.update_yaxes(title_text="AUC", row=2, col=1)
    figure.update_yaxes(title_text="share", row=3, col=1)
    figure.update_layout(height=1050, width=1100, title=f"recloop demo — {config.days} days, drift "
                         f"'{config.drift}' from day {config.drift_day}", xaxis3_title="simulated day")
    from recloop.canary import explain

    html = _REPORT.render(records=records, summary=summary, efficacy=summary.get("efficacy"), fmt=_f, config=config,
                          decisions=[m for r in records for m in r.decisions], columns=explain.COLUMNS,
                          notes=_raw_ctr_notes(records), raw_ctr_note=explain.RAW_CTR_NOTE,
                          recovery=(summary.get("recovery") or {}).get("headline"),
                          plot=Markup(figure.to_html(full_html=False, include_plotlyjs=True)))
    path = settings.home.resolve() / "reports" / "demo.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path


def _day_events(record: DayRecord) -> list[str]:
    """What happened to the models on a day, for its marker: drift, retrains, promotions, rollbacks."""
    events = [record.drift] if record.drift not in ("-", "ok") else []
    if record.retrain.startswith("full"):
        events.append(record.retrain.replace(" (", " retrain (", 1) if "(" in record.retrain else "full retrain")
    for action in record.canary:
        verb, _, version = action.split(":")[0].partition(" ")
        label = {"promote": "promoted", "rollback": "rolled back"}.get(verb)
        if label:
            events.append(f"{label} {version}".strip())
    return events


_REPORT = Environment(autoescape=True).from_string("""<!doctype html>
<html><head><meta charset="utf-8"><title>recloop demo</title>
<style>body{font-family:sans-serif;margin:24px}table{border-collapse:collapse;font-size:13px}
td,th{border:1px solid #ccc;padding:4px 8px;text-align:right}td.moves{white-space:nowrap;text-align:left}
table.decisions td{text-align:left;vertical-align:top}</style></head><body>
<h1>recloop demo</h1>
{% if recovery %}<p><b>Loop efficacy (twin worlds)</b>: on day {{ summary.recovery.day }} the champion's normalized
reward on the evaluation panel is {{ "%.1f%%" % (recovery.champion.recovery * 100) }} [95% CI
{{ "%.1f%%" % (recovery.champion.low * 100) }}, {{ "%.1f%%" % (recovery.champion.high * 100) }}] of the no-drift
twin's (never retrained: {{ "%.1f%%" % (recovery.never_retrained.recovery * 100) }}); target ≥ 95% (lower bound):
{{ "met" if summary.recovery.met else "not met" }}.</p>{% endif %}
{% if efficacy %}<p>Served clicks relative to the oracle: two cycles after the drift the served ranking earns
{{ "%.1f%%" % (efficacy.recovery * 100) }} of its pre-drift share of the oracle's clicks (never retrained:
{{ "%.1f%%" % (efficacy.never_retrain_recovery * 100) }}){% if not recovery %}; target ≥ 95%:
{{ "met" if efficacy.met else "not met" }}{% else %} (served traffic, one run, no interval: the twin-world
figure above is the efficacy measure){% endif %}.</p>{% endif %}
<table><tr><th>day</th><th>events</th><th>requests</th><th>drift</th><th>retrain</th><th>candidate AUC</th>
<th>champion AUC</th><th>oracle AUC</th><th>gate</th><th>canary</th><th>champion</th><th>online CTR (/rank, by version)</th>
<th>champion CTR (monitor, as Evidently plots it)</th>
<th>served / oracle</th><th>never retrained / oracle</th></tr>
{% for r in records %}<tr><td>{{ r.day }}</td><td>{{ "{:,}".format(r.events) }}</td><td>{{ r.requests }}</td>
<td>{{ r.drift }}</td><td>{{ r.retrain }}</td><td>{{ fmt(r.candidate_auc) }}</td><td>{{ fmt(r.champion_auc) }}</td>
<td>{{ fmt(r.oracle_auc) }}</td><td>{{ r.gate }}</td><td class="moves">{% for c in r.canary %}{{ c.split(":")[0] }}{% if not loop.last %}<br>{% endif %}{% else %}-{% endfor %}{% if r.decisions %} (<a href="#canary-decisions">why</a>){% endif %}</td>
<td>{{ r.champion or "-" }}</td>
<td>{% for v, c in r.online_ctr.items() %}v{{ v }}: {{ "%.3f" % c }}{% if not loop.last %}, {% endif %}{% else %}-{% endfor %}</td>
<td class="monitor-ctr">{{ "%.3f" % r.monitor_ctr if r.monitor_ctr is not none else "-" }}</td>
<td>{{ fmt(r.vs_oracle) }}</td><td>{{ fmt(r.baseline_vs_oracle) }}</td></tr>
{% endfor %}</table>
<h2 id="canary-decisions">Canary decisions: why each model moved</h2>
<p>Each step, promotion and rollback the canary controller made between the rounds of a day's traffic (a
canary starts when its challenger passes the gate: the retrain column), with the evidence that decided it. The ranker's
canary is interleaved: its online CTR evidence is the interleaved credit (challenger − champion, relative, with
its always-valid interval); the raw CTRs beside it are for reference only ({{ raw_ctr_note }}).</p>
{% if decisions %}<table class="decisions"><tr><th>day</th><th>model</th><th>version</th>{% for c in columns[1:] %}<th>{{ c }}</th>{% endfor %}</tr>
{% for m in decisions %}<tr><td>{{ m.day }}</td><td>{{ m.model }}</td><td>v{{ m.version }} (champion v{{ m.champion }})</td>
{% for c in columns[1:] %}<td>{{ m[c] }}</td>{% endfor %}</tr>
{% endfor %}</table>{% else %}<p>No canary moved.</p>{% endif %}
{% for note in notes %}<p class="raw-ctr-note"><b>Why a lower raw CTR was promoted.</b> {{ note }}</p>{% endfor %}
<h2>Evaluation panel (normalized reward: 0 random, 1 the oracle; 95% user-cluster interval)</h2>
<table><tr><th>day</th><th>live champion</th><th>never retrained</th>{% if config.daily_full %}<th>daily full retrain (upper
reference)</th>{% endif %}<th>NDCG@{{ config.shown }} (champion)</th></tr>
{% for r in records if r.panel %}<tr><td>{{ r.day }}</td>
{% for policy in (["champion", "never_retrained", "daily_full"] if config.daily_full else ["champion", "never_retrained"]) %}
{% set f = r.panel.get(policy) %}<td>{% if f %}{{ "%.3f" % f.normalized_reward }} [{{ "%.3f" % f.low }}, {{ "%.3f" % f.high }}]{% else %}-{% endif %}</td>
{% endfor %}<td>{{ fmt(r.panel.champion.ndcg) }}</td></tr>
{% endfor %}</table>
<h2>The recommendation path (/recommend: retrieve {{ config.retrieve_k }} → filter → rank → order → top {{ config.shown }})</h2>
<table><tr><th>day</th><th>retriever candidate</th><th>retriever gate</th>
<th>oracle recall@{{ config.retrieve_k }}</th><th>popularity's</th><th>retriever champion</th><th>requests</th>
<th>popularity answers</th><th>clicks</th><th>expected clicks / catalog oracle's</th></tr>
{% for r in records %}<tr><td>{{ r.day }}</td><td>{{ r.retriever_version or "-" }}</td><td>{{ r.retriever_gate }}</td>
<td>{{ fmt(r.retriever_oracle_recall) }}</td><td>{{ fmt(r.popularity_oracle_recall) }}</td>
<td>{{ r.retriever_champion or "-" }}</td><td>{{ r.recommend_requests }}</td><td>{{ r.popularity_answers }}</td>
<td>{{ r.recommend_clicks }}</td><td>{{ fmt(r.recommend_vs_oracle) }}</td></tr>
{% endfor %}</table>
{{ plot }}
<p>Freshness (events landed → challenger serving canary traffic): {{ summary.freshness_seconds }} s.
Total {{ summary.seconds }} s.</p></body></html>
""")


def _f(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"
