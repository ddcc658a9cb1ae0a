"""The loop's stages as plain functions returning JSON-ready dicts: what the CLI and the Prefect flows call.

Each stage reads and writes through ``Settings`` only, so a flow run on a worker and a command on a
laptop do the same thing. No stage knows about Prefect; ``flows/`` wraps them as tasks.

Example::

    ingest_new(settings)                      # landing/ → lake
    build_features(settings)                  # lake → features, Feast online store
    trained = train_and_register(settings, TrainConfig(mode="incremental"))
    gate(settings, trained["mlflow"]["version"])
    check_drift(settings, hours=24)
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from recloop.schema import load_spec
from recloop.settings import Settings

if TYPE_CHECKING:
    import pandas as pd


def ingest_new(settings: Settings, spec: str = "synthetic", source: Path | None = None) -> dict:
    """Ingest what is new in the landing zone (or ``source``); a file seen before is skipped."""
    from recloop.ingest import ingest

    summary = ingest(source or settings.landing_dir, load_spec(spec), settings)
    return {k: v for k, v in summary.to_dict().items() if k != "results"}


def build_features(settings: Settings, spec: str = "synthetic", window: dict | None = None,
                   materialize: bool = True) -> dict:
    """The feature job, then (if the dataset has users and items) Feast apply + incremental materialize."""
    from recloop.features.config import FeatureConfig
    from recloop.features.job import build_features as run_job

    dataset = load_spec(spec)
    config = FeatureConfig.for_spec(dataset)
    summary = run_job(settings, dataset, config, **(window or {})).to_dict()
    summary["feast_applied"], summary["materialized"] = False, []
    if materialize and summary["rows"] and dataset.user_key and dataset.item_key:
        from recloop.features import store

        summary["feast_applied"] = store.apply_repo(settings)
        summary["materialized"] = store.materialize(settings, datetime.fromisoformat(summary["end"]),
                                                    timedelta(seconds=config.ttl_seconds))
    return summary


def register_training(settings: Settings, summary) -> dict:
    """Log a training run to MLflow and register its model (once per run: a rerun finds it)."""
    import pyarrow.parquet as pq

    from recloop import registry

    example = pq.read_table(sorted(Path(summary.checkpoint).parents[2].glob("features/training/*.parquet"))[-1])
    logged = registry.log_training(settings, summary, example.slice(0, 5).to_pandas())
    return {"run_id": logged.run_id, "version": logged.version, "model_uri": logged.model_uri}


def train_and_register(settings: Settings, config, warm_start: Path | None = None) -> dict:
    """Train (full, or incremental from the champion's checkpoint) and register the model in MLflow.

    Incremental runs warm-start from the champion when there is one (the model users get), else from
    the newest completed run.
    """
    from recloop import registry
    from recloop.train import train

    if config.mode == "incremental" and warm_start is None:
        champion = registry.version_by_alias(settings, "champion")
        if champion is not None:
            warm_start = Path(registry.version_info(settings, champion)["checkpoint"])
    summary = train(settings, config, warm_start=warm_start)
    result = summary.to_dict()
    result["mlflow"] = register_training(settings, summary)
    return result


def gate(settings: Settings, version: str | None = None, thresholds=None, smoke_check: bool = True) -> dict:
    from recloop.gate import run_gate

    return run_gate(settings, version, thresholds, smoke_check=smoke_check)


def champion_window(settings: Settings) -> tuple[datetime, datetime] | None:
    """The champion's training window (from its MLflow run), or None without a champion."""
    from recloop import registry

    try:
        version = registry.version_by_alias(settings, "champion")
        if version is None:
            return None
        from mlflow import MlflowClient

        run = MlflowClient().get_run(registry.version_info(settings, version)["run_id"])
        first, last = run.data.tags["recloop.train_window"].split("..")
    except Exception:  # noqa: BLE001 - no registry yet: the caller falls back to the days before
        return None
    start = datetime.strptime(first, "%Y-%m-%dT%H").replace(tzinfo=UTC)
    return start, datetime.strptime(last, "%Y-%m-%dT%H").replace(tzinfo=UTC) + timedelta(hours=1)


def champion_kpis(settings: Settings, start: datetime, end: datetime, min_impressions: int
                  ) -> tuple[dict, dict]:
    """The champion's online KPIs over served requests in [start, end) and its baseline from promotion."""
    from recloop import registry
    from recloop.serve.journal import Journal

    journal_path = settings.serving_dir / "journal.db"
    version = registry.version_by_alias(settings, "champion")
    if version is None or not journal_path.exists():
        return {}, {}
    journal = Journal(journal_path)
    try:
        kpis = journal.window_kpis(version, int(start.timestamp() * 1e6), int(end.timestamp() * 1e6))
    finally:
        journal.close()
    if kpis["impressions"] < min_impressions:
        return {k: v for k, v in kpis.items() if k in ("impressions", "clicks")}, {}
    tags = registry.version_info(settings, version)["tags"]
    baseline = {k: float(tags[f"kpi.baseline_{k}"]) for k in ("ctr", "auc", "impressions") if f"kpi.baseline_{k}" in tags}
    return {**kpis, "version": version}, baseline


def check_drift(settings: Settings, spec: str = "synthetic", hours: int = 24, reference_days: int = 7,
                config=None, kpis: dict | None = None, baseline: dict | None = None, log: bool = False) -> dict:
    """The monitor over the newest ``hours`` of the lake against the champion's training window.

    KPIs default to the champion's online CTR and AUC over the same hours (from the serving journal),
    against the baseline recorded when it was promoted. With ``log``, the decision is an MLflow run.
    """
    from recloop.monitor import MonitorConfig

    config = config or MonitorConfig()
    from recloop.features.job import lake_time_bounds
    from recloop.monitor import run_monitor

    dataset = load_spec(spec)
    bounds = lake_time_bounds(settings, dataset)
    if bounds is None:
        raise ValueError("the lake has no events yet: run `recloop ingest`")
    newest = datetime.fromtimestamp(bounds[1] / 1_000_000, tz=UTC)
    end = newest.replace(minute=0, second=0, microsecond=0) + timedelta(hours=1)
    current = (end - timedelta(hours=hours), end)
    trained = champion_window(settings)
    if trained is None:
        reference = (current[0] - timedelta(days=reference_days), current[0])
    else:
        # The newest stretch the champion learned from, as long as the checked window: like with like. (All of
        # a full retrain's week would keep reporting the drift it was retrained on, as long as it holds
        # days from before the change.)
        last = min(trained[1], current[0])
        reference = (max(trained[0], last - timedelta(hours=hours)), last)
        if reference[0] >= reference[1]:
            reference = (current[0] - timedelta(hours=hours), current[0])
    if kpis is None:
        kpis, found_baseline = champion_kpis(settings, current[0], current[1], config.min_impressions)
        baseline = baseline if baseline is not None else found_baseline
    snapshots: list = []
    inputs = served_inputs(settings, reference, current, config.sample_rows)
    predictions = None if inputs is None else tuple(frame["prediction"].to_numpy() for frame in inputs)
    decision = run_monitor(settings, dataset, reference=reference, current=current, config=config, kpis=kpis,
                           baseline=baseline, on_snapshot=snapshots.append, predictions=predictions)
    result = {**decision.to_dict(), "reference": [t.isoformat() for t in reference],
              "current": [t.isoformat() for t in current], "baseline": baseline or {}}
    if inputs is not None:
        # The model's inputs as served (entity state, recency, counts shift by nature as time passes):
        # reported per column for review, not decided on; the scores they produce are (prediction drift).
        from recloop.monitor import evidently_drift

        columns = [c for c in inputs[0].columns if c != "prediction"]
        share, drifted, _, _ = evidently_drift(inputs[0], inputs[1], columns, config)
        result["served_features"] = {"drift_share": share, "drifted_columns": drifted}
    else:
        result["served_features"] = None
    if log:
        result["mlflow_run_id"] = log_monitoring(settings, result)
        _remember(settings, result)
        from recloop import dashboards

        if snapshots:
            result["evidently_snapshot"] = dashboards.record_run(
                settings, snapshots[0], kpis=result.get("kpi"), version=(result.get("kpi") or {}).get("version"),
                when=current[1], decision=result["decision"])
    return result


def served_inputs(settings: Settings, reference: tuple[datetime, datetime], current: tuple[datetime, datetime],
                  rows: int = 50_000) -> tuple[pd.DataFrame, pd.DataFrame] | None:
    """About ``rows`` shuffled feature rows of each window as the champion sees them (its dense inputs,
    ``d_*``) with its score (``prediction``); None without a champion or feature rows for a window."""
    import itertools
    import math

    import pandas as pd
    import torch

    from recloop import registry
    from recloop.data import ChunkLoader, FeatureSchema
    from recloop.data.loader import training_files
    from recloop.features.job import FeatureLayout
    from recloop.train import load_model

    version = registry.version_by_alias(settings, "champion")
    layout = FeatureLayout.for_settings(settings)
    if version is None or not layout.schema.exists():
        return None
    windows = [training_files(layout.training, f"{a:%Y-%m-%dT%H}", f"{b:%Y-%m-%dT%H}") for a, b in (reference, current)]
    if not all(windows):
        return None
    model, _ = load_model(registry.version_info(settings, version)["checkpoint"])
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


MONITOR_EXPERIMENT = "recloop-monitor"


def _remember(settings: Settings, result: dict) -> None:
    """Keep the latest monitoring result and a count per decision (the loop's Prometheus metrics read them)."""
    import json
    import os

    folder = settings.home.resolve() / "loop"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "monitor.json"
    state = json.loads(path.read_text()) if path.exists() else {"decisions": {}}
    state["decisions"][result["decision"]] = state["decisions"].get(result["decision"], 0) + 1
    state["last"] = {k: result[k] for k in ("decision", "drift_share", "drifted_columns", "current")}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(state, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def log_monitoring(settings: Settings, result: dict) -> str:
    """One MLflow run per monitoring check: decision and reasons as tags, figures as metrics, all as JSON."""
    import mlflow

    from recloop import registry

    registry.configure(settings)
    experiment_id = registry.experiment(settings, MONITOR_EXPERIMENT)
    with mlflow.start_run(experiment_id=experiment_id, run_name=f"monitor {result['current'][0]}") as run:
        mlflow.set_tags({"recloop.kind": "monitor", "decision": result["decision"],
                         "reasons": "; ".join(result["reasons"])[:4000], "window": "..".join(result["current"]),
                         "drifted_columns": ", ".join(result["drifted_columns"])})
        served = result.get("served_features") or {}
        figures = {"drift_share": result["drift_share"], **result.get("figures", {}),
                   **({"served_features_drift_share": served["drift_share"]} if served else {}),
                   **{f"kpi.{k}": v for k, v in result.get("kpi", {}).items() if isinstance(v, int | float)}}
        mlflow.log_metrics({k.replace(":", "."): float(v) for k, v in figures.items()
                            if isinstance(v, int | float) and v == v})
        mlflow.log_dict(result, "monitor.json")
    return run.info.run_id
