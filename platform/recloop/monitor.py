"""Drift and data-quality monitoring: a recent window of events against the champion's training window.

Findings, in the order they decide:

1. **data quality** — a column that suddenly arrives null or constant is its own finding, not drift:
   retraining on broken data would teach the model the breakage, so it alerts and does not retrain;
2. **KPI decay** — online CTR (and AUC) per model version against the baseline recorded when the
   champion was promoted (fed by serving; none yet: the decision then rests on the data);
3. **drift** — Evidently's ``DataDriftPreset`` over the context and item columns (per-column methods and
   thresholds as Evidently chooses them for the sample size), judged by the share of drifted columns;
   and, for entity keys, the share of recent events on ids the reference never saw (a new catalog wave
   is that, more than any distribution distance over thousands of ids); and **prediction drift**: the
   champion's scores on the recent window's feature rows against its scores on the reference window's
   (the same Evidently test, on the one ``prediction`` column) — reported in ``notes``, and deciding
   only when ``prediction_drift_decides`` is set (see ``MonitorConfig``);
4. otherwise **ok**.

Windows are sampled to at most ``sample_rows`` rows each, so a 10M-row window costs no more than a small
one. ``decide`` is pure; ``run_monitor`` does the IO.

Example::

    decision = run_monitor(settings, load_spec("synthetic"), reference=(start, end), current=(start, end))
    decision.decision, decision.drifted_columns
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
from typing import Literal

import numpy as np
import pandas as pd

Outcome = Literal["ok", "drift", "kpi_decay", "data_quality"]


@dataclass(frozen=True)
class MonitorConfig:
    """What counts as drift, decay or broken data.

    Args:
        drift_share: dataset drift when at least this share of the monitored columns drifted.
        new_id_share: drift when at least this share of recent events use entity ids unseen in the
            reference (a new catalog, a new user base).
        null_jump: a column whose null share rose by more than this is broken.
        sample_rows: rows sampled from each window.
        prediction_drift: the champion's scores drifted when their drift score reaches this. Evidently's
            default for one column (0.1) flags ordinary days at tens of thousands of rows: the demo's
            days without drift measure 0.05-0.17, its sudden drift 0.49.
        prediction_drift_decides: whether prediction drift alone makes the decision ``drift``. Off by default:
            the model's inputs include entity counts that grow as history accumulates, so its scores move on
            ordinary days while the world warms up (0.43 on day 1 of a 4,000-events-a-day world); found,
            it is reported in ``notes``, the figures, MLflow and the dashboards.
        max_ctr_drop: relative drop of online CTR against the promotion baseline that counts as decay.
        max_auc_drop: absolute drop of online AUC (from feedback) against the baseline that counts as decay.
        kpi_z: and a CTR or AUC drop must be this many standard errors (both sides' impressions), when known.
        min_impressions: feedback impressions the window needs before its KPIs are judged.
        per_column_method, per_column_threshold: Evidently's drift test and threshold for named columns
            (e.g. ``{"price": "psi"}``, ``{"price": 0.2}``); the others get Evidently's choice for their
            type and sample size.
    """

    drift_share: float = 0.3
    new_id_share: float = 0.3
    null_jump: float = 0.5
    sample_rows: int = 50_000
    prediction_drift: float = 0.3
    prediction_drift_decides: bool = False
    max_ctr_drop: float = 0.10
    max_auc_drop: float = 0.03
    kpi_z: float = 3.0
    min_impressions: int = 2000
    seed: int = 0
    per_column_method: dict[str, str] = field(default_factory=dict)
    per_column_threshold: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class MonitorDecision:
    decision: Outcome
    reasons: tuple[str, ...]
    drift_share: float
    drifted_columns: tuple[str, ...]
    kpi: dict[str, float | None] = field(default_factory=dict)
    figures: dict[str, float] = field(default_factory=dict)
    notes: tuple[str, ...] = ()  # findings reported for review that did not take part in the decision

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"], out["drifted_columns"] = list(self.reasons), list(self.drifted_columns)
        out["notes"] = list(self.notes)
        return out


# --- pure checks ---------------------------------------------------------------------------------------------


def quality_findings(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str],
                     config: MonitorConfig) -> list[str]:
    """Columns that went null or constant in the current window (while they were not in the reference)."""
    findings = []
    for column in columns:
        before, now = reference[column].isna().mean(), current[column].isna().mean()
        if now - before > config.null_jump:
            findings.append(f"{column}: {now:.0%} null (reference {before:.0%})")
            continue
        if current[column].nunique(dropna=True) <= 1 < reference[column].nunique(dropna=True):
            findings.append(f"{column}: constant in the current window")
    return findings


def new_id_findings(reference: pd.DataFrame, current: pd.DataFrame, keys: list[str],
                    config: MonitorConfig) -> tuple[list[str], dict[str, float]]:
    findings, figures = [], {}
    for key in keys:
        unseen = float((~current[key].isin(set(reference[key].dropna().unique()))).mean())
        figures[f"{key}_unseen_share"] = unseen
        if unseen >= config.new_id_share:
            findings.append(f"{key}: {unseen:.0%} of recent events on ids unseen in the reference")
    return findings, figures


def kpi_findings(kpis: dict[str, float | None], baseline: dict[str, float | None], config: MonitorConfig) -> list[str]:
    """Online CTR against the baseline recorded at promotion (both optional)."""
    findings = []
    ctr, base = kpis.get("ctr"), baseline.get("ctr")
    if ctr is not None and base is not None and base > 0 and ctr < base * (1 - config.max_ctr_drop) \
            and _significant_drop(ctr, kpis.get("impressions"), base, baseline.get("impressions"), config.kpi_z):
        findings.append(f"online CTR {ctr:.4f} is {1 - ctr / base:.0%} below the baseline {base:.4f}")
    auc, base_auc = kpis.get("auc"), baseline.get("auc")
    if auc is not None and base_auc is not None and base_auc - auc > config.max_auc_drop and _significant_auc_drop(
            auc, kpis.get("impressions"), kpis.get("ctr"), base_auc, baseline.get("impressions"), base, config.kpi_z):
        findings.append(f"online AUC {auc:.4f} is {base_auc - auc:.4f} below the baseline {base_auc:.4f}")
    return findings


def _significant_drop(ctr: float, n: float | None, base: float, base_n: float | None, z: float) -> bool:
    """A two-proportion z-test of the drop, when both sides' impression counts are known (else: assume it is).

    The baseline is measured on a canary step's few thousand impressions and the window on a day's: a 10 %
    difference between two such CTRs is often noise.
    """
    if not n or not base_n:
        return True
    pooled = (ctr * n + base * base_n) / (n + base_n)
    spread = (pooled * (1 - pooled) * (1 / n + 1 / base_n)) ** 0.5
    return spread == 0 or (base - ctr) / spread >= z


def _auc_se(auc: float, positives: float, negatives: float) -> float:
    """Hanley & McNeil's standard error of an AUC."""
    q1, q2 = auc / (2 - auc), 2 * auc * auc / (1 + auc)
    variance = (auc * (1 - auc) + (positives - 1) * (q1 - auc * auc) + (negatives - 1) * (q2 - auc * auc)) \
        / (positives * negatives)
    return max(variance, 0.0) ** 0.5


def _significant_auc_drop(auc: float, n: float | None, ctr: float | None, base_auc: float, base_n: float | None,
                          base_ctr: float | None, z: float) -> bool:
    """The AUC drop in standard errors of both measurements, when their sizes are known (else: assume it is)."""
    if not n or not base_n or not ctr or not base_ctr:
        return True
    spread = (_auc_se(auc, ctr * n, (1 - ctr) * n) ** 2 + _auc_se(base_auc, base_ctr * base_n,
                                                                     (1 - base_ctr) * base_n) ** 2) ** 0.5
    return spread == 0 or (base_auc - auc) / spread >= z


def decide(quality: list[str], kpi: list[str], drift_share: float, drifted: list[str], new_ids: list[str],
           config: MonitorConfig, kpis: dict | None = None, figures: dict | None = None,
           prediction: list[str] | None = None) -> MonitorDecision:
    """The typed decision (see the module docstring for the order)."""
    kpis, figures, prediction = kpis or {}, figures or {}, prediction or []
    drifted_columns = tuple(sorted(set(drifted) | {reason.split(":")[0] for reason in [*new_ids, *prediction]}))
    if quality:
        return MonitorDecision("data_quality", tuple(quality), drift_share, drifted_columns, kpis, figures)
    if kpi:
        return MonitorDecision("kpi_decay", tuple(kpi), drift_share, drifted_columns, kpis, figures)
    reasons = [*new_ids, *prediction]
    if drift_share >= config.drift_share:
        reasons.append(f"{drift_share:.0%} of monitored columns drifted: {', '.join(sorted(drifted))}")
    if reasons:
        return MonitorDecision("drift", tuple(reasons), drift_share, drifted_columns, kpis, figures)
    return MonitorDecision("ok", ("no drift, no broken column, no KPI decay",), drift_share, drifted_columns, kpis,
                           figures)


# --- Evidently and IO ----------------------------------------------------------------------------------------


def evidently_drift(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str],
                    config: MonitorConfig, timestamp: datetime | None = None
                    ) -> tuple[float, list[str], dict[str, float], object]:
    """Share of drifted columns, the drifted ones, each column's drift score, and Evidently's snapshot."""
    from evidently import DataDefinition, Dataset, Report
    from evidently.presets import DataDriftPreset

    numeric = [c for c in columns if pd.api.types.is_numeric_dtype(reference[c]) and reference[c].nunique() > 20]
    categorical = [c for c in columns if c not in numeric]
    definition = DataDefinition(numerical_columns=numeric, categorical_columns=categorical)

    def dataset(frame: pd.DataFrame) -> Dataset:
        data = frame[columns].copy()
        for column in categorical:
            data[column] = data[column].astype("string").fillna("<null>")
        return Dataset.from_pandas(data, data_definition=definition)

    chosen = {"per_column_method": {c: m for c, m in config.per_column_method.items() if c in columns} or None,
              "per_column_threshold": {c: t for c, t in config.per_column_threshold.items() if c in columns} or None}
    snapshot = Report([DataDriftPreset(drift_share=config.drift_share, **chosen)], include_tests=True).run(
        current_data=dataset(current), reference_data=dataset(reference),
        timestamp=timestamp.replace(tzinfo=None) if timestamp else None)
    result = snapshot.dict()
    scores, drifted, share = {}, [], 0.0
    for metric in result["metrics"]:
        name = str(metric.get("metric_name") or metric.get("metric_id"))
        if name.startswith("DriftedColumnsCount"):
            share = float(metric["value"]["share"])
        elif name.startswith("ValueDrift(column="):
            scores[name.split("column=")[1].split(",")[0]] = float(metric["value"])
    for test in result["tests"]:
        name = str(test.get("name", ""))
        if name.startswith("Value Drift for column ") and str(test.get("status")).endswith("FAIL"):
            drifted.append(name.removeprefix("Value Drift for column "))
    return share, sorted(drifted), scores, snapshot


def prediction_findings(reference: np.ndarray, current: np.ndarray, config: MonitorConfig
                        ) -> tuple[list[str], dict[str, float]]:
    """Whether the model's scores drifted between the windows: Evidently's drift score for one numeric
    column (normed Wasserstein distance at these sizes) at least ``config.prediction_drift``."""
    rng = np.random.default_rng(config.seed)
    frames = [pd.DataFrame({"prediction": rng.choice(scores, config.sample_rows, replace=False)
                            if len(scores) > config.sample_rows else scores}) for scores in (reference, current)]
    _, _, scores, _ = evidently_drift(frames[0], frames[1], ["prediction"], config)
    figures = {"prediction_drift_score": scores.get("prediction", float("nan")),
               "prediction_mean_reference": float(np.mean(reference)), "prediction_mean_current": float(np.mean(current))}
    if not figures["prediction_drift_score"] >= config.prediction_drift:
        return [], figures
    return [f"prediction: the champion's mean score moved from {figures['prediction_mean_reference']:.4f} to "
            f"{figures['prediction_mean_current']:.4f} (drift score {figures['prediction_drift_score']:.3f})"], figures


def load_config(path) -> MonitorConfig:
    """A MonitorConfig from YAML or JSON (keys as the dataclass fields); defaults for what it leaves out."""
    from pathlib import Path

    import yaml

    raw = yaml.safe_load(Path(path).read_text()) or {}
    unknown = sorted(set(raw) - set(MonitorConfig.__dataclass_fields__))
    if unknown:
        raise ValueError(f"{path}: unknown monitor settings {unknown}; known: {sorted(MonitorConfig.__dataclass_fields__)}")
    return MonitorConfig(**raw)


def sample(frame: pd.DataFrame, rows: int, seed: int) -> pd.DataFrame:
    return frame.sample(rows, random_state=seed) if len(frame) > rows else frame


def run_monitor(settings, spec, reference: tuple[datetime, datetime], current: tuple[datetime, datetime],
                config: MonitorConfig | None = None, kpis: dict | None = None,
                baseline: dict | None = None, on_snapshot=None,
                predictions: tuple[np.ndarray, np.ndarray] | None = None) -> MonitorDecision:
    """Compare the lake's events in ``current`` with those in ``reference`` (both [start, end)).

    ``on_snapshot`` receives Evidently's snapshot of the drift report (for the workspace's history);
    ``predictions``: the champion's scores on the reference and current windows, for prediction drift.
    """
    from recloop.features.job import _to_us, read_lake_window

    config = config or MonitorConfig()
    keys = [k for k in (spec.user_key, spec.item_key) if k]
    monitored = [c.name for c in spec.columns if c.role in ("categorical", "numeric")]
    columns = [*monitored, *keys]

    def window(bounds: tuple[datetime, datetime]) -> pd.DataFrame:
        table = read_lake_window(settings, spec, _to_us(bounds[0]), _to_us(bounds[1]), columns=columns)
        return sample(table.to_pandas(), config.sample_rows, config.seed) if table.num_rows else pd.DataFrame()

    ref, cur = window(reference), window(current)
    if ref.empty or cur.empty:
        raise ValueError(f"no events in the {'reference' if ref.empty else 'current'} window")
    quality = quality_findings(ref, cur, monitored, config)
    healthy = [c for c in monitored if not any(f.startswith(f"{c}:") for f in quality)]
    share, drifted, scores, snapshot = evidently_drift(ref, cur, healthy, config, timestamp=current[1]) \
        if healthy else (0.0, [], {}, None)
    if on_snapshot is not None and snapshot is not None:
        on_snapshot(snapshot)
    new_ids, figures = new_id_findings(ref, cur, keys, config)
    figures.update({f"drift_score.{k}": v for k, v in scores.items() if not math.isnan(v)})
    figures.update(reference_rows=float(len(ref)), current_rows=float(len(cur)))
    prediction: list[str] = []
    if predictions is not None and all(len(p) >= 2 for p in predictions):
        prediction, prediction_figures = prediction_findings(*predictions, config)
        figures.update(prediction_figures)
    kpis = kpis or {}
    decisive = prediction if config.prediction_drift_decides else []
    decision = decide(quality, kpi_findings(kpis, baseline or {}, config), share, drifted, new_ids, config, kpis,
                      figures, decisive)
    return replace(decision, notes=tuple(prediction)) if prediction and not decisive else decision

