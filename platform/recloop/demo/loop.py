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
   whose canary started that night is not retrained (``waits for v2's canary``): a new challenger
   would reset its evidence; one still undecided after a whole day of traffic is superseded, as
   ``canary_wait_hours`` (24 h) supersedes it in real time.

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
user-cluster bootstrap interval. The summary's efficacy figure (``paired``) is the **same-panel
difference**: the champion's normalized reward minus the never-retrained model's (and the daily full
retrain's) on the same requests, with a paired user-cluster interval, two cycles after the drift. With
``twin`` the same loop runs again on the world's no-drift twin (same seed, identical until the drift day)
under ``home/twin`` (twice the time), adding the **twin-world recovery**: the champion's normalized reward
with the drift over the twin's, two cycles after the drift, with its interval (a ratio: wide when the
twin's champion is weak, and its interval covers one run's panel users, not runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path

import pyarrow.parquet as pq

from recloop.canary import CanaryConfig
from recloop.demo.panel import FrozenRanker, paired_efficacy, train_reference, twin_recovery
from recloop.demo.records import DayRecord, DemoConfig
from recloop.demo.report import summarize, write_report
from recloop.gate.retrieval import RetrievalThresholds
from recloop.readiness import NotReady, wait_until
from recloop.retrieval.evaluate import WorldOracle
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig


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
                  "retriever_epochs": config.full_epochs, "seed": config.train_seed}
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
    frozen = FrozenRanker(settings, first["gate"]["version"])
    if config.daily_full:
        # day 0's full retrain is the bootstrap model itself (its other seeds trained alike)
        frozen.reference = [frozen.model, *train_reference(settings, 0, config, batch_size, first=1)]
    last_full_day = 0

    from recloop import registry
    from recloop.monitor.dashboards import online_ctr
    from recloop.serve.app import ServerThread, create_app
    from recloop.serve.models import registry_wanted

    serving = Settings(**{**settings.model_dump(), "serve_poll_seconds": 1.0, "feedback_flush_seconds": 3600,
                          "recommend_candidates": config.retrieve_k, "recommend_seen_hours": config.seen_hours})
    app = create_app(serving)
    freshness: list[float] = []
    panels: dict[int, dict] = {}
    with ServerThread(app) as server:
        for day in range(1, config.days):
            began, day_started_at = time.perf_counter(), time.time()
            clock["day"] = day
            record = DayRecord(day=day)
            stage(day, f"serving {config.requests_per_day} requests in {config.rounds} rounds (canary checks between)")
            served, baseline = _serve_day(server.url, app, world, day, config, flows, canary_path, record, frozen)
            record.requests, record.online_ctr = served["requests"], served["ctr"]
            record.vs_oracle, record.baseline_vs_oracle = served["vs_oracle"], baseline
            # the ranker as serving routes it now (a canary's share included)
            panels[day] = frozen.panel(world, day, config, registry_wanted(settings))
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
                # A canary waits at most a day of traffic, as ``canary_wait_hours`` (24) does in real time:
                # one started before today's traffic began has had its day and is superseded (a wall-clock
                # 24 h never passes in the demo, so an undecided challenger held back every later retrain).
                outcome = flows["retrain"](mode="incremental", reason="scheduled", days=day + 1,
                                           canary_wait_hours=(time.time() - day_started_at) / 3600,
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
                frozen.reference = train_reference(settings, day, config, batch_size)
            record.champion = registry.version_by_alias(settings, "champion")
            record.retriever_champion = registry.version_by_alias(settings, "champion", registry.RETRIEVER_NAME)
            record.seconds = round(time.perf_counter() - began, 1)
            records.append(record)
            if on_day:
                on_day(record)
    summary = summarize(records, config, freshness, last_full_day)
    summary["panels"] = {day: {k: v.tolist() for k, v in panel["rewards"].items()} | {"users": panel["users"].tolist()}
                         for day, panel in panels.items()}
    summary["paired"] = paired_efficacy(panels, config)
    if config.twin and config.drift != "none":
        from dataclasses import replace

        twin_settings = Settings(**{**settings.model_dump(), "home": settings.home / "twin"})
        twin = run_demo(twin_settings, replace(config, drift="none", twin=False), on_stage=(
            (lambda day, what: on_stage(day, f"no-drift twin: {what}")) if on_stage else None))
        summary["twin"] = {"report": twin["report"], "days": twin["days"]}
        summary["recovery"] = twin_recovery(panels, twin["panels"], config)
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


def _serve_day(url: str, app, world: World, day: int, config: DemoConfig, flows: dict, canary_path: Path,
               record: DayRecord, frozen: FrozenRanker) -> tuple[dict, float]:
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
        for (body, who), order in zip(pairs, frozen.rank([body for body, _ in pairs]), strict=True):
            baseline_clicks += users.expected(order, who)
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


def _wait_for_deployment(url: str, settings: Settings, timeout: float = 30.0) -> None:
    """Let the server pick up moved aliases and shares before the next round (it polls every second)."""
    import httpx

    from recloop.registry import RETRIEVER_NAME
    from recloop.serve.models import registry_wanted

    def deployed(wanted) -> tuple:
        return wanted.champion, wanted.challenger, wanted.share if wanted.challenger else 0.0

    target = (deployed(registry_wanted(settings)), deployed(registry_wanted(settings, RETRIEVER_NAME)))

    def serving() -> tuple:
        health = httpx.get(f"{url}/healthz").json()
        retriever = health["retriever"]
        return ((health["versions"]["champion"], health["versions"]["challenger"], health["share"]),
                (retriever["versions"]["champion"], retriever["versions"]["challenger"], retriever["share"]))

    wait_until(lambda: serving() == target, what=f"the serving API picking up {target}", timeout=timeout)


def _until_serving(url: str, version: str, timeout: float = 30.0) -> float:
    """Seconds until the server routes canary traffic to ``version`` (``timeout`` if it never does: the
    freshness figure then shows the wait, as it always has)."""
    import httpx

    def routed() -> bool:
        health = httpx.get(f"{url}/healthz").json()
        return health["versions"]["challenger"] == version and health["share"] > 0

    began = time.perf_counter()
    with contextlib.suppress(NotReady):
        wait_until(routed, what=f"canary traffic to version {version}", timeout=timeout)
    return time.perf_counter() - began


