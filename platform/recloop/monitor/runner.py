"""Running the monitor (IO): read the lake's windows and the serving journal, decide, record, trigger.

One check resolves the champion once (its version, training window, KPI baseline and checkpoint all come
from that one lookup, so an alias moving mid-check cannot mix two champions), picks the windows
(``decision.choose_windows``), compares the lake's events (the world's own: served impressions left out, ``decision.world_rows``; ``drift.evidently_drift``, unseen ids, broken
columns), the champion's scores on both windows (prediction drift) and its online KPIs from the serving
journal against the baseline recorded at its promotion, and decides (``decision.decide``). With ``log``
the result is an MLflow run in the ``recloop-monitor`` experiment, a snapshot in the Evidently workspace
and the loop's state under ``$RECLOOP_HOME/loop``. ``request_retrain`` applies the trigger's rule
against the recorded history of requests, under a lock.

Example::

    report = check(settings, load_spec("synthetic"), hours=24, log=True)
    verdict = request_retrain(settings, report.decision, now=time.time())
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import pandas as pd

from recloop.hours import hour_stem, parse_hour
from recloop.ingest import lake
from recloop.locks import exclusive_lock
from recloop.monitor.decision import (
    MonitorConfig,
    MonitorDecision,
    TriggerConfig,
    TriggerVerdict,
    Window,
    choose_windows,
    decide,
    insufficient,
    kpi_findings,
    new_id_findings,
    quality_findings,
    should_retrain,
    world_rows,
)
from recloop.monitor.drift import evidently_drift, prediction_findings, sample
from recloop.schema import DatasetSpec
from recloop.settings import Settings

EXPERIMENT = "recloop-monitor"


class MonitorError(RuntimeError):
    """The monitor cannot check: the lake or one of the windows is empty."""


def load_config(path: str | Path | None) -> MonitorConfig:
    """A MonitorConfig from YAML/JSON (keys as the dataclass fields); defaults for what the file leaves out."""
    from recloop.config_files import load_dataclass

    return MonitorConfig() if path is None else load_dataclass(path, MonitorConfig)


@dataclass(frozen=True)
class Champion:
    """The champion as one check sees it (looked up once)."""

    version: str
    trained: Window | None  # its training and validation hours (``data_window``)
    baseline: dict[str, float]


@dataclass(frozen=True)
class MonitorReport:
    """One check: the decision and what it was made on."""

    decision: MonitorDecision
    champion: str | None
    reference: Window
    current: Window
    baseline: dict[str, float]
    served_features: dict | None = None
    mlflow_run_id: str | None = None
    evidently_snapshot: str | None = None

    def to_dict(self) -> dict:
        return {**self.decision.to_dict(), "champion": self.champion,
                "reference": [t.isoformat() for t in self.reference], "current": [t.isoformat() for t in self.current],
                "baseline": self.baseline, "served_features": self.served_features,
                "mlflow_run_id": self.mlflow_run_id, "evidently_snapshot": self.evidently_snapshot}


def champion(settings: Settings) -> Champion | None:
    """The champion's version, training window and promotion baseline; None when there is no champion."""
    from recloop import registry
    from recloop.canary.tag import kpi_baseline

    version = registry.version_by_alias(settings, "champion")
    if version is None:
        return None
    info = registry.version_info(settings, version)
    return Champion(version, data_window(info.train_window, info.validation_window), kpi_baseline(info.tags))


def data_window(train: tuple[str, str] | None, validation: tuple[str, str] | None) -> Window | None:
    """``[start, end)`` of the hours a version was built on: its training hours and, after them, the held-out
    hours its training validated it on (and its gate judged it by), from their ``YYYY-MM-DDTHH`` bounds.

    The held-out hours count: they are the newest the version was accepted on. Without them a full retrain
    answering a step in the inputs (training through 18:00 of the day it came, held out from 18:00) left the
    next checks a reference of the last 24 training hours — six of them from before the step — and they
    reported the very drift it was retrained on again, with a second full retrain that replaced the next
    incremental run in its canary (the loop grid's ``covariate`` world, 4 of 10 seeds)."""
    if train is None:
        return None
    first, last = parse_hour(train[0]), parse_hour(train[1])
    if validation is not None:
        last = max(last, parse_hour(validation[1]))
    return first, last + timedelta(hours=1)


def check(settings: Settings, spec: DatasetSpec, hours: int = 24, reference_days: int = 7,
          config: MonitorConfig | None = None, kpis: dict | None = None, baseline: dict | None = None,
          log: bool = False, windows: tuple[Window, Window] | None = None, snapshot: bool = False
          ) -> MonitorReport:
    """The monitor over the newest ``hours`` of the lake against the champion's training window.

    ``windows``: ``(reference, current)`` chosen by the caller (``recloop drift --reference/--current``)
    instead of ``choose_windows``. ``snapshot`` (implied by ``log``): the check's Evidently snapshots go to
    the workspace the Evidently UI shows, whatever it decides (``ok`` included), and the report names them.

    KPIs default to the champion's online CTR and AUC over the same hours (from the serving journal),
    against the baseline recorded when it was promoted.
    """
    config = config or MonitorConfig()
    bounds = lake.time_bounds(settings, spec)
    if bounds is None:
        raise MonitorError("the lake has no events yet: run `recloop ingest`")
    current_champion = champion(settings)
    reference, current = windows or choose_windows(datetime.fromtimestamp(bounds[1] / 1_000_000, tz=UTC), hours,
                                                   current_champion.trained if current_champion else None,
                                                   reference_days)
    concept = None
    if kpis is None:
        kpis = champion_kpis(settings, current_champion, current, config.min_impressions)
        concept = champion_concept(settings, current_champion, current, config)
    if baseline is None:
        baseline = current_champion.baseline if current_champion else {}
    inputs = served_inputs(settings, current_champion.version, reference, current, config.sample_rows) \
        if current_champion else None
    snapshots: list = []
    snapshot = snapshot or log
    decision = compare_windows(settings, spec, reference, current, config, kpis, baseline,
                               snapshots.append if snapshot else None,
                               None if inputs is None else tuple(frame["prediction"].to_numpy() for frame in inputs),
                               concept)
    served = None
    if inputs is not None:
        # The model's inputs as served (entity state, recency, counts shift by nature as time passes):
        # reported per column for review, not decided on; the scores they produce are (prediction drift).
        columns = [c for c in inputs[0].columns if c != "prediction"]
        share, drifted, _, _ = evidently_drift(inputs[0], inputs[1], columns, config, snapshot=False)
        served = {"drift_share": share, "drifted_columns": drifted}
    report = MonitorReport(decision, current_champion.version if current_champion else None, reference, current,
                           baseline or {}, served)
    run_id = None
    if log:
        run_id = log_to_mlflow(settings, report)
        _remember(settings, report)
    if not snapshot:
        return report
    from recloop.monitor import dashboards

    # every check: the drift report when there was one to make (not on too few rows or only broken columns),
    # and always the decision's own figures
    monitored = tuple(c.name for c in spec.columns if c.role in ("categorical", "numeric"))
    snapshot_id = dashboards.record_run(settings, snapshots[0] if snapshots else None, kpis=decision.kpi or None,
                                        version=report.champion, when=current[1], decision=decision.decision,
                                        columns=monitored, config=config,
                                        figures={**decision.figures, "drift_share": decision.drift_share})
    return replace(report, mlflow_run_id=run_id, evidently_snapshot=snapshot_id)


def compare_windows(settings: Settings, spec: DatasetSpec, reference: Window, current: Window,
                    config: MonitorConfig | None = None, kpis: dict | None = None, baseline: dict | None = None,
                    on_snapshot=None, predictions: tuple[np.ndarray, np.ndarray] | None = None,
                    concept: tuple[list[str], dict] | None = None) -> MonitorDecision:
    """Compare the lake's events in ``current`` with those in ``reference`` (both ``[start, end)``).

    Args:
        kpis, baseline: online KPIs of the window and the champion's baseline (KPI decay).
        on_snapshot: receives Evidently's snapshot of the drift report (the workspace's history).
        predictions: the champion's scores on the reference and current windows (prediction drift).
        concept: concept-drift findings and figures from served feedback (``champion_concept``): KPI decay.
    """
    config, kpis, baseline = config or MonitorConfig(), kpis or {}, baseline or {}
    keys = [k for k in (spec.user_key, spec.item_key) if k]
    monitored = [c.name for c in spec.columns if c.role in ("categorical", "numeric")]
    columns = [*monitored, *keys]

    def window(bounds: Window) -> pd.DataFrame:
        table = lake.read_window(settings, spec, lake.to_us(bounds[0]), lake.to_us(bounds[1]),
                                 columns=[*columns, spec.event_id])
        return table.to_pandas() if table.num_rows else pd.DataFrame()

    whole = window(reference), window(current)
    if whole[0].empty or whole[1].empty:
        raise MonitorError(f"no events in the {'reference' if whole[0].empty else 'current'} window "
                           f"{hour_stem((reference if whole[0].empty else current)[0])}..")
    too_few = insufficient(len(whole[0]), len(whole[1]), config)
    if too_few is not None:
        return too_few
    # Broken columns on every row (served feedback is trained on too); drift on the world's own events where
    # both windows hold enough of them (``world_rows``: the impressions a ranker chose are not the world's).
    served = served_event_ids(settings, reference, current)
    compared = world_rows(*whole, served, spec.event_id, config.min_rows) if served and any(served) else None
    ref, cur = (sample(frame, config.sample_rows, config.seed) for frame in whole)
    quality = quality_findings(ref, cur, monitored, config)
    if compared is not None:
        ref, cur = (sample(frame, config.sample_rows, config.seed) for frame in compared)
    healthy = [c for c in monitored if not any(f.startswith(f"{c}:") for f in quality)]
    share, drifted, scores, snapshot = 0.0, [], {}, None
    if healthy:  # typed by the spec's roles: the integer ``category`` is a category, ``position`` a quantity
        roles = {c.name: c.role for c in spec.columns}
        share, drifted, scores, snapshot = evidently_drift(
            ref, cur, healthy, config, timestamp=current[1],
            categorical=[c for c in healthy if roles[c] == "categorical"],
            numeric=[c for c in healthy if roles[c] == "numeric"],
            snapshot=on_snapshot is not None)  # the report (its plots) only for the workspace
    if snapshot is not None and on_snapshot is not None:
        on_snapshot(snapshot)
    new_ids, figures = new_id_findings(ref, cur, keys, config)
    figures.update({f"drift_score.{k}": v for k, v in scores.items() if not math.isnan(v)})
    figures.update(reference_rows=float(len(ref)), current_rows=float(len(cur)))
    if compared is not None:
        figures.update({"served_rows_left_out.reference": float(len(whole[0]) - len(compared[0])),
                        "served_rows_left_out.current": float(len(whole[1]) - len(compared[1]))})
    prediction: list[str] = []
    if predictions is not None and all(len(p) >= 2 for p in predictions):
        prediction, prediction_figures = prediction_findings(*predictions, config)
        figures.update(prediction_figures)
    decisive = prediction if config.prediction_drift_decides else []
    concept_found, concept_figures = concept or ([], {})
    figures.update(concept_figures)
    decision = decide(quality, kpi_findings(kpis, baseline, config) + concept_found, share, drifted, new_ids, config,
                      kpis, figures, decisive)
    return replace(decision, notes=tuple(prediction)) if prediction and not decisive else decision


def served_event_ids(settings: Settings, reference: Window, current: Window) -> tuple[set[str], set[str]] | None:
    """The event ids serving landed as feedback in each window (the journal's); None without a journal."""
    from recloop.journal import open_journal

    journal = open_journal(settings, create=False)
    if journal is None:
        return None
    try:
        return tuple(journal.served_event_ids((lake.to_us(a), lake.to_us(b))) for a, b in (reference, current))
    finally:
        journal.close()


def champion_kpis(settings: Settings, current_champion: Champion | None, window: Window, min_impressions: int
                  ) -> dict:
    """The champion's online CTR and AUC over requests with event time in the window (serving journal);
    only the counts when there were fewer than ``min_impressions`` impressions."""
    from recloop.journal import open_journal

    journal = open_journal(settings, create=False) if current_champion is not None else None
    if journal is None:
        return {}
    try:
        stats = journal.stats(current_champion.version, event_window=(lake.to_us(window[0]), lake.to_us(window[1])))
    finally:
        journal.close()
    counts = {"impressions": float(stats.impressions), "clicks": float(stats.clicks)}
    if stats.impressions < min_impressions:
        return counts
    return {**counts, "ctr": stats.ctr, "auc": stats.online_auc, "version": current_champion.version}


BASELINE_DAYS, DAY_US = 7, 86_400 * 1_000_000


def champion_concept(settings: Settings, current_champion: Champion | None, window: Window,
                     config: MonitorConfig) -> tuple[list[str], dict] | None:
    """Concept drift (``monitor.concept``) from the champion's served feedback with event time in the window,
    against its own served history, or the model line's (every champion's) when it has too little of its own:
    then only the online CTR's drop is tested (``concept_findings``' ``same_model``)."""
    from recloop.journal import open_journal
    from recloop.monitor.concept import concept_findings

    journal = open_journal(settings, create=False) if current_champion is not None else None
    if journal is None:
        return None
    start, end = lake.to_us(window[0]), lake.to_us(window[1])
    own = True  # both sides the champion's own served feedback (else its calibration's move is not tested)
    reference = "the champion's own"
    try:
        served = journal.served_predictions(current_champion.version, (start, end))
        if len(served["labels"]) < config.min_impressions:
            own = False
            # A champion promoted during the window served little of it: the window is the model line's, every
            # impression with the prediction of the version that served it (as the baseline below). With the
            # champion's own rows alone, a loop promoting every day or two judged nothing (gradual drift: 0 of 3
            # seeds acted on; benchmarks/RESULTS.md, issue 36).
            served = journal.served_predictions(None, (start, end))
        # Its baseline: the same champion's served feedback since it started serving, up to a week, before
        # the window (a real ranker is not calibrated on what it serves; only a move away from its own
        # calibration is changed tastes). Its whole history, not the window before: tastes that rotate a
        # little each day never move far from yesterday, but do from the day the champion started serving
        # (and a longer baseline halves the comparison's noise).
        first = journal.first_served_us(current_champion.version)
        since = max(first, start - BASELINE_DAYS * DAY_US) if first is not None and first < start else \
            start - (end - start)
        before = journal.served_predictions(current_champion.version, (since, start))
        if len(before["labels"]) < config.min_impressions:
            # A champion promoted daily has (almost) no served history of its own: the reference is the model
            # line's, every champion's served feedback of the week before (each impression with the prediction
            # of the version that served it). Without it the concept check never judged in the real loop
            # (gradual drift: 0 of 3 checks), only beside it with a frozen champion.
            before = journal.served_predictions(None, (start - BASELINE_DAYS * DAY_US, start))
            own, reference = False, "the model line's"
    finally:
        journal.close()
    return concept_findings(served["labels"], served["predictions"], served["users"], {"device": served["device"]},
                            config, baseline=(before["labels"], before["predictions"], before["users"],
                                              {"device": before["device"]}), same_model=own, reference=reference)


def served_inputs(settings: Settings, version: str, reference: Window, current: Window, rows: int = 50_000
                  ) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """About ``rows`` shuffled feature rows of each window as the champion sees them (its dense inputs,
    ``d_*``) with its score (``prediction``); None without feature rows for a window."""
    import itertools

    import torch

    from recloop import checkpoint
    from recloop.data import ChunkLoader, FeatureSchema
    from recloop.data.loader import training_files
    from recloop.features.definition import FeatureLayout

    layout = FeatureLayout.for_settings(settings)
    if not layout.schema.exists():
        return None
    windows = [training_files(layout.training, hour_stem(a), hour_stem(b)) for a, b in (reference, current)]
    if not all(windows):
        return None
    model, _ = checkpoint.load_model(checkpoint.resolve(settings, version))
    schema = FeatureSchema.load(layout.schema)
    frames = []
    for files in windows:
        parts = []
        with torch.no_grad():
            for batch in itertools.islice(ChunkLoader(files, schema, 4096).epoch(0), math.ceil(rows / 4096)):
                part = pd.DataFrame(batch.dense.numpy(), columns=list(schema.dense))
                part["prediction"] = torch.sigmoid(model(batch.dense, batch.values, batch.offsets)).numpy()
                parts.append(part)
        frames.append(pd.concat(parts, ignore_index=True))
    return frames[0], frames[1]


def log_to_mlflow(settings: Settings, report: MonitorReport) -> str:
    """One MLflow run per check: decision and reasons as tags, figures as metrics, the whole report as JSON."""
    import mlflow

    from recloop import registry

    registry.configure(settings)
    result = report.to_dict()
    with mlflow.start_run(experiment_id=registry.experiment(settings, EXPERIMENT),
                          run_name=f"monitor {result['current'][0]} (event time)") as run:
        # MLflow's own columns are wall-clock time; the window is the events' (simulated in the demo): labelled
        mlflow.set_tags({"recloop.kind": "monitor", "decision": result["decision"],
                         "reasons": "; ".join(result["reasons"])[:4000],
                         "window": "..".join(result["current"]) + " (event time)",
                         "drifted_columns": ", ".join(result["drifted_columns"]),
                         "champion": report.champion or ""})
        served = report.served_features or {}
        figures = {"drift_share": result["drift_share"], **result["figures"],
                   **({"served_features_drift_share": served["drift_share"]} if served else {}),
                   **{f"kpi.{k}": v for k, v in result["kpi"].items() if isinstance(v, int | float)}}
        mlflow.log_metrics({registry.metric_name(k): float(v) for k, v in figures.items()
                            if isinstance(v, int | float) and v == v})
        mlflow.log_dict(result, "monitor.json")
    return run.info.run_id


def _remember(settings: Settings, report: MonitorReport) -> None:
    """Keep the latest check and a count per decision (the loop's Prometheus metrics read them)."""
    folder = settings.home.resolve() / "loop"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "monitor.json"
    state = json.loads(path.read_text()) if path.exists() else {"decisions": {}}
    outcome = report.decision.decision
    state["decisions"][outcome] = state["decisions"].get(outcome, 0) + 1
    state["last"] = {"decision": outcome, "drift_share": report.decision.drift_share,
                     "drifted_columns": list(report.decision.drifted_columns),
                     "current": [t.isoformat() for t in report.current]}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str) + "\n")
    os.replace(tmp, path)


# --- the trigger's memory -------------------------------------------------------------------------------------


def _requests_path(settings: Settings) -> Path:
    return settings.home.resolve() / "loop" / "triggers.json"


def retrain_requests(settings: Settings) -> list[dict]:
    """Every retrain the monitor requested: ``{"at", "decision", "reasons"}``."""
    path = _requests_path(settings)
    return json.loads(path.read_text()) if path.exists() else []


def request_retrain(settings: Settings, decision: MonitorDecision, now: float,
                    config: TriggerConfig | None = None) -> TriggerVerdict:
    """Apply the trigger's rule against the recorded requests and record a new one, atomically across
    processes (the cool-down's memory outlives flow runs)."""
    config = config or TriggerConfig()
    path = _requests_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        past = retrain_requests(settings)
        last = max(past, key=lambda t: t["at"], default={})
        deployed = [t["outcome_at"] for t in past if t.get("outcome") == "deployed" and t.get("outcome_at")]
        verdict = should_retrain(decision, last.get("at"), now, config, last_outcome=last.get("outcome"),
                                 outcome_at=max(deployed, default=None) if last.get("outcome") == "deployed" else None,
                                 gate_reasons=last.get("gate_reasons", ()),
                                 in_canary=_still_in_canary(settings, last) if decision.decision in config.retrain_on
                                 else None)  # (the registry asked only when a retrain is in question)
        if verdict.retrain:
            past.append({"at": now, "wall_at": time.time(), "decision": decision.decision,
                         "reasons": list(decision.reasons),
                         "outcome": None, "retry_of_refused": last.get("outcome") == "refused"})
            _write_requests(path, past)
    return verdict


def _still_in_canary(settings: Settings, request: dict) -> str | None:
    """The version a deployed retrain request made (or the one that replaced it, ``carry_request``), while it is
    still the challenger (its canary running)."""
    if request.get("outcome") != "deployed" or not request.get("version"):
        return None
    from recloop import registry

    challenger = registry.aliases(settings).get("challenger")
    if challenger != str(request["version"]):
        return None
    made = request.get("made")
    return f"{challenger} (which replaced v{made})" if made and made != challenger else challenger


def carry_request(settings: Settings, superseded: str, successor: str) -> bool:
    """A scheduled retrain's candidate ``successor`` replaced ``superseded``, the challenger the last deployed
    request made, after it waited ``canary_wait_hours`` undecided (``flows/retrain_flow.py``); it trained on
    every hour the champion had not seen, the ones the request answered included, so the request's hold passes
    to it. Without this the monitor saw its retrain gone from the canary, the pre-drift champion still
    serving, and asked for another full retrain once the cool-down ended, which superseded the model trained
    on the drifted days in turn (the loop grid's ``covariate`` seed 0). The hold stays bounded by
    ``TriggerConfig.canary_hold_seconds`` from the request's outcome. Returns whether a request was carried."""
    path = _requests_path(settings)
    if not path.exists():
        return False
    with exclusive_lock(path.with_suffix(".lock")):
        past = retrain_requests(settings)
        last = max(past, key=lambda t: t["at"], default=None)
        if last is None or last.get("outcome") != "deployed" or str(last.get("version")) != str(superseded):
            return False
        last.setdefault("made", str(superseded))
        last["version"] = str(successor)
        _write_requests(path, past)
    return True


def record_retrain_outcome(settings: Settings, deployed: bool, now: float, gate_reasons: list[str] | tuple = (),
                           version: str | None = None) -> dict | None:
    """Record what became of the last requested retrain: ``deployed`` (passed the gate: the cool-down starts
    now; ``version``, the model it made, holds further requests while it is the challenger) or ``refused``
    (the next check asks again, with these reasons). Returns the updated request."""
    path = _requests_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        past = retrain_requests(settings)
        if not past:
            return None
        last = max(past, key=lambda t: t["at"])
        last.update(outcome="deployed" if deployed else "refused", outcome_at=now, gate_reasons=list(gate_reasons),
                    version=version)
        last.pop("made", None)  # a version carried from an earlier outcome of this request no longer stands
        _write_requests(path, past)
    return last


def _write_requests(path: Path, past: list[dict]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(past, indent=2) + "\n")
    os.replace(tmp, path)
