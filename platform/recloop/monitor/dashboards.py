"""The monitoring history as an Evidently workspace under ``$RECLOOP_HOME/evidently`` (``evidently ui``).

One project, ``recloop``, with panels for the drift share over time, each monitored column's drift
against its own test's threshold (``ColumnDrift.over_threshold``: p-values and distances on one scale), the
unseen-id shares and the drift share against their thresholds, the decisions as markers, and
the online KPIs of the serving model; every monitoring run adds snapshots (the drift report, the
decision's figures, and the KPIs of the served feedback in the same window). ``recloop up`` starts ``evidently ui`` on it.

Example::

    record_run(settings, drift_snapshot, kpis={"ctr": 0.12, "auc": 0.66}, version="7", when=datetime(...))
"""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pandas as pd

from recloop.settings import Settings

PROJECT = "recloop"


def workspace_path(settings: Settings) -> Path:
    path = settings.home.resolve() / "evidently"
    path.mkdir(parents=True, exist_ok=True)
    return path


# Evidently dates each snapshot at its window's end in event time (the monitored events' own clock, simulated in the
# demo) while Prefect, MLflow and Prometheus stamp wall-clock time: each panel says which clock its dates are on.
EVENT_TIME = ". Dates: event time (the monitored events' clock; simulated in the demo), not the wall clock"


def project(settings: Settings, columns: tuple[str, ...] = (), keys: tuple[str, ...] = ("user_id", "item_id"),
            tests: dict[str, str] | None = None):
    """The workspace and its ``recloop`` project, created with its panels the first time (a per-column drift
    bar for each of ``columns``: the dataset spec's monitored columns, each named with its test from ``tests``;
    an unseen-id line per entity key). A project created by an older recloop keeps its panels."""
    from evidently.sdk.models import PanelMetric
    from evidently.sdk.panels import bar_plot_panel, counter_panel, line_plot_panel
    from evidently.ui.workspace import Workspace

    workspace = Workspace(str(workspace_path(settings)))
    found = [p for p in workspace.list_projects() if p.name == PROJECT]
    if found:
        return workspace, found[0]
    created = workspace.create_project(PROJECT, description="recloop's drift monitor: one snapshot per check")
    created.dashboard.add_panel(line_plot_panel(
        "Drift share over time", [PanelMetric(legend="share of drifted columns", metric="DriftedColumnsCount",
                                              metric_labels={"value_type": "share"})],
        description="Evidently DataDriftPreset: recent events vs the champion's training window" + EVENT_TIME),
        tab="Drift")
    created.dashboard.add_panel(bar_plot_panel(
        "Per-column drift ÷ its test's threshold (1 = the threshold, above = drifted)",
        [PanelMetric(legend=f"{column} ({tests[column]})" if column in (tests or {}) else column, metric="MeanValue",
                     metric_labels={"column": f"{column}{OVER_THRESHOLD}"}) for column in columns],
        description="each column's figure against the threshold of the test Evidently ran on it: a distance "
        "(Jensen-Shannon for categorical columns, normed Wasserstein for numeric ones over 1000 rows; drift at "
        "or above 0.1 by default) ÷ its threshold, or the threshold ÷ a p-value (K-S for numeric columns up to "
        "1000 rows, chi-square or Z for few values; drift below 0.05), capped at 10. Each run's drift report "
        "names every column's test, raw figure and threshold (the legend, the tests of the first check)."),
        tab="Drift")
    created.dashboard.add_panel(line_plot_panel(
        "Unseen-id share vs its threshold", [
            *(PanelMetric(legend=f"{key} {what}", metric="MeanValue", metric_labels={"column": f"{key}_unseen_{column}"})
              for key in keys for what, column in (("unseen", "share"), ("drifts above", "limit")))],
        description="share of recent events on user or item ids unseen in the reference; drift at or above its "
        "limit: what an unchanged world would show (e, Good-Turing: the reference's events on ids seen once) "
        "with a share new_id_share of the events from new ids, e + new_id_share (1 - e), when beyond the noise "
        "too (new_id_z standard errors)"), tab="Drift")
    created.dashboard.add_panel(line_plot_panel(
        "Drift share vs its threshold", [
            PanelMetric(legend="drift share", metric="MeanValue", metric_labels={"column": "drift_share"}),
            PanelMetric(legend="threshold", metric="MeanValue",
                        metric_labels={"column": "drift_share_threshold"})],
        description="share of drifted columns; drift at or above the threshold (drift_share)" + EVENT_TIME), tab="Drift")
    created.dashboard.add_panel(bar_plot_panel(
        "Decisions: 1 = drift or KPI decay (a full retrain is requested unless cooling down), -1 = broken data",
        [PanelMetric(legend="decision", metric="MeanValue", metric_labels={"column": "decision_code"})],
        description="one bar per monitoring check: the retrain markers" + EVENT_TIME), tab="Drift")
    created.dashboard.add_panel(line_plot_panel(
        "Online CTR of the serving model", [PanelMetric(legend="online CTR", metric="MeanValue",
                                                        metric_labels={"column": "clicked"})],
        description="clicks / impressions from /feedback in the monitored window; the version is the run's tag"
        + EVENT_TIME), tab="KPIs")
    created.dashboard.add_panel(counter_panel(
        "Online CTR of the serving model, last check", [PanelMetric(legend="online CTR", metric="MeanValue",
                                                                    metric_labels={"column": "clicked"})],
        description="the champion's clicks / impressions on /feedback in the last monitored window (the demo "
        "report's 'champion CTR (monitor)' column)", aggregation="last"), tab="KPIs")
    created.dashboard.add_panel(line_plot_panel(
        "Online AUC of the serving model", [PanelMetric(legend="online AUC", metric="MeanValue",
                                                        metric_labels={"column": "online_auc"})],
        description="ranking quality on served impressions" + EVENT_TIME), tab="KPIs")
    return workspace, created


DECISION_CODES = {"ok": 0.0, "drift": 1.0, "kpi_decay": 1.0, "data_quality": -1.0}
OVER_THRESHOLD = "_drift_over_threshold"  # a column's figure in the decision snapshot: ColumnDrift.over_threshold


def record_run(settings: Settings, drift_snapshot, kpis: dict | None, version: str | None, when: datetime,
               decision: str, columns: tuple[str, ...] = (), figures: dict | None = None, config=None) -> str:
    """Add one monitoring run: the drift report's snapshot (None: the check made no report, too few rows or
    only broken columns); the decision's own figures with the thresholds they were held to (unseen-id shares,
    drift share, each column's drift over its test's threshold, the decision as a marker); and (when there
    was feedback) a KPI snapshot. Returns the id of the drift report's snapshot, else the decision's."""
    from evidently import DataDefinition, Dataset, Report
    from evidently.metrics import MeanValue

    from recloop.monitor.decision import MonitorConfig
    from recloop.monitor.drift import column_drift

    config, figures = config or MonitorConfig(), figures or {}
    keys = tuple(k.removesuffix("_unseen_share") for k in figures if k.endswith("_unseen_share"))
    results = column_drift(drift_snapshot) if drift_snapshot is not None else {}
    workspace, found = project(settings, columns, keys or ("user_id", "item_id"),
                               {column: result.method for column, result in results.items()})
    # Snapshots are placed at the monitored window's end in event time (simulated in the demo); Prefect and
    # MLflow stamp wall-clock time: the names say which, and a tag keeps the wall-clock time of the check.
    tags = [f"decision:{decision}", f"checked-at:{datetime.now(UTC):%Y-%m-%dT%H:%M}Z (wall clock)"] + (
        [f"model-version:{version}"] if version else [])
    reference = None
    if drift_snapshot is not None:  # a check with too few rows has no drift report: its decision is still kept
        drift_snapshot._tags = [*(drift_snapshot._tags or []), *tags]
        reference = workspace.add_run(found.id, drift_snapshot, name=f"drift {when:%Y-%m-%d %H:%M} (event time)")
    loop = {**{f"{key}_unseen_share": float(figures[f"{key}_unseen_share"]) for key in keys},
            **{f"{key}_unseen_limit": _unseen_limit(float(figures.get(f"{key}_unseen_expected", 0.0)),
                                                    config.new_id_share) for key in keys},
            "new_id_share_threshold": float(config.new_id_share), "drift_share_threshold": float(config.drift_share),
            "drift_share": float(figures.get("drift_share", drift_share_of(drift_snapshot)
                                             if drift_snapshot is not None else 0.0)),
            "decision_code": DECISION_CODES.get(decision, 0.0),
            **{f"{column}{OVER_THRESHOLD}": result.over_threshold() for column, result in results.items()}}
    data = Dataset.from_pandas(pd.DataFrame({k: [v] for k, v in loop.items()}),
                               data_definition=DataDefinition(numerical_columns=list(loop)))
    figures_run = workspace.add_run(found.id, Report([MeanValue(column=c) for c in loop]).run(
        current_data=data, tags=tags, timestamp=when.replace(tzinfo=None)), name=f"decision {when:%Y-%m-%d %H:%M} (event time)")
    ctr = online_ctr(kpis)
    if ctr is not None:
        auc = (kpis or {}).get("auc")
        values = {"clicked": [ctr], **({"online_auc": [float(auc)]} if auc is not None and auc == auc else {})}
        data = Dataset.from_pandas(pd.DataFrame(values), data_definition=DataDefinition(numerical_columns=list(values)))
        snapshot = Report([MeanValue(column=c) for c in values]).run(
            current_data=data, tags=tags, timestamp=when.replace(tzinfo=None))
        workspace.add_run(found.id, snapshot, name=f"KPIs {when:%Y-%m-%d %H:%M} (event time)")
    return str((reference or figures_run).id)


def online_ctr(kpis: dict | None) -> float | None:
    """The serving champion's online CTR in the monitored window, as the KPI panels plot it: clicks /
    impressions of its served feedback whenever there was any. The decision judges KPIs only past
    ``min_impressions``; the panels showed nothing (read as 0) on a day the demo reported a CTR of 0.156."""
    kpis = kpis or {}
    if kpis.get("ctr") is not None:
        return float(kpis["ctr"])
    impressions = float(kpis.get("impressions") or 0.0)
    return float(kpis.get("clicks") or 0.0) / impressions if impressions > 0 else None


def drift_share_of(snapshot) -> float:
    """The share of drifted columns in a drift report's snapshot (its typed ``DriftedColumnsCount``)."""
    for metric in snapshot.dict()["metrics"]:
        if str(metric.get("metric_name") or metric.get("metric_id")).startswith("DriftedColumnsCount"):
            return float(metric["value"]["share"])
    return float("nan")


def _unseen_limit(expected: float, new_id_share: float) -> float:
    """The unseen share at which a key drifts (``decision.new_id_findings``): an unchanged world's share
    ``expected`` with ``new_id_share`` of the events on new ids."""
    return expected + new_id_share * (1 - expected)
