"""Distribution drift with Evidently: pure computations over two windows of data (no files, no MLflow).

``evidently_drift`` runs ``DataDriftPreset`` over chosen columns and reads its typed results (share of
drifted columns, each column's verdict and score), or, where no one looks at the report, runs the same
per-column tests without it (``value_drift``); ``prediction_findings`` applies the same test to
the champion's scores on both windows. Windows are sampled (``sample``) so millions of rows cost no
more than a few tens of thousands.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Collection, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime

import numpy as np
import pandas as pd

from recloop.monitor.decision import MonitorConfig


def sample(frame: pd.DataFrame, rows: int, seed: int) -> pd.DataFrame:
    return frame.sample(rows, random_state=seed) if len(frame) > rows else frame


# Categorical columns are compared by Jensen-Shannon distance at every sample size. Evidently's own choice
# below 1000 reference rows is chi-square, whose p-value is 0 as soon as the current window holds a value the
# reference lacks: a 26-value ``category`` (or ``country``) against a few hours of reference is "drifted"
# every time. Jensen-Shannon (drift at a distance of 0.1) is what it uses above 1000 rows.
CATEGORICAL_METHOD = "jensenshannon"


def evidently_drift(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str],
                    config: MonitorConfig, timestamp: datetime | None = None, categorical: Collection[str] = (),
                    numeric: Collection[str] = (), snapshot: bool = True
                    ) -> tuple[float, list[str], dict[str, float], object]:
    """Share of drifted columns, the drifted ones, each column's drift score, and Evidently's snapshot.

    ``categorical`` and ``numeric``: columns typed so whatever their dtype (the dataset spec's roles: an
    integer id is a category, a slot number a quantity); the others are numeric when they are numbers with
    more than 20 distinct values, else categorical. Categorical columns are tested by ``CATEGORICAL_METHOD``
    unless ``config.per_column_method`` names another; numeric ones by Evidently's choice for their size.

    ``snapshot=False``: the same tests, run column by column as the report's ``ValueDrift`` runs them, without
    the report (whose plots are four fifths of its time: 27 of 34 s in a 3-day demo) and with ``None`` for
    the snapshot: for figures that are decided on or logged, not shown in the workspace. Its share is that of
    the columns' verdicts (the report's own count differs only for a numeric column holding ±inf)."""

    numeric = [c for c in columns if c in numeric or (c not in categorical and pd.api.types.is_numeric_dtype(
        reference[c]) and reference[c].nunique() > 20)]
    categorical = [c for c in columns if c not in numeric]
    methods = {**{c: CATEGORICAL_METHOD for c in categorical}, **config.per_column_method}
    chosen = {"per_column_method": {c: m for c, m in methods.items() if c in columns} or None,
              "per_column_threshold": {c: t for c, t in config.per_column_threshold.items() if c in columns} or None}
    if not snapshot:
        frames = [dataset_frame(frame, columns, categorical) for frame in (reference, current)]
        results = {c: value_drift(frames[0], frames[1], c, c in numeric, methods.get(c),
                                  config.per_column_threshold.get(c)) for c in columns}
        drifted = sorted(c for c, r in results.items() if r.drifted)
        return len(drifted) / len(columns) if columns else 0.0, drifted, {c: r.score for c, r in results.items()}, None
    from evidently import DataDefinition, Dataset, Report
    from evidently.presets import DataDriftPreset

    definition = DataDefinition(numerical_columns=numeric, categorical_columns=categorical)

    def dataset(frame: pd.DataFrame) -> Dataset:
        return Dataset.from_pandas(dataset_frame(frame, columns, categorical), data_definition=definition)

    with zero_expected_counts():
        snapshot = Report([DataDriftPreset(drift_share=config.drift_share, **chosen)], include_tests=True).run(
            current_data=dataset(current), reference_data=dataset(reference),
            timestamp=timestamp.replace(tzinfo=None) if timestamp else None)
    share = next((float(m["value"]["share"]) for m in snapshot.dict()["metrics"]
                  if str(m.get("metric_name") or m.get("metric_id")).startswith("DriftedColumnsCount")), 0.0)
    results = column_drift(snapshot)
    return (share, sorted(c for c, r in results.items() if r.drifted), {c: r.score for c, r in results.items()},
            snapshot)


@contextmanager
def zero_expected_counts() -> Iterator[None]:
    """Inside, scipy's "divide by zero" is not shown: a value the reference window never had has an expected
    count of 0, and the chi-square statistic is infinite on its way to the right verdict (drift). Shown, it
    reached `recloop replay`'s output on Criteo's sample (a count column with a handful of values)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "divide by zero", RuntimeWarning)
        yield


def dataset_frame(frame: pd.DataFrame, columns: list[str], categorical: Collection[str]) -> pd.DataFrame:
    """``columns`` of ``frame`` as the drift tests take them: categories as strings, missing ones ``<null>``."""
    data = frame[columns].copy()
    for column in categorical:
        data[column] = data[column].astype("string").fillna("<null>")
    return data


def value_drift(reference: pd.DataFrame, current: pd.DataFrame, column: str, is_numeric: bool, method: str | None,
                threshold: float | None) -> ColumnDrift:
    """One column's drift test, as Evidently's ``ValueDrift`` metric computes it (its ``ValueDriftCalculation``:
    the same options, the same function), without rendering its plots. ``method`` and ``threshold``: None for
    Evidently's choice by column type and size."""
    from evidently.legacy.calculations.data_drift import get_one_column_drift
    from evidently.legacy.core import ColumnType
    from evidently.legacy.metric_results import DatasetColumns, DatasetUtilityColumns
    from evidently.legacy.options.data_drift import DataDriftOptions

    kind = ColumnType.Numerical if is_numeric else ColumnType.Categorical
    with zero_expected_counts():
        drift = get_one_column_drift(
            current_data=current, reference_data=reference, column_name=column,
            options=DataDriftOptions(all_features_stattest=method, all_features_threshold=threshold),
            dataset_columns=DatasetColumns(
                utility_columns=DatasetUtilityColumns(date=None, id=None, target=None, prediction=None),
                target_type=None, task=None, num_feature_names=[column] if is_numeric else [],
                cat_feature_names=[] if is_numeric else [column], text_feature_names=[], datetime_feature_names=[],
                target_names=None),
            column_type=kind, agg_data=True)
    return ColumnDrift(str(method or drift.stattest_name), float(drift.drift_score), float(drift.stattest_threshold),
                       bool(drift.drift_detected))


@dataclass(frozen=True)
class ColumnDrift:
    """One column's drift test in a report: the test Evidently ran, its figure, its threshold, its verdict.

    A p-value test (K-S, chi-square, Z) drifts when its figure is *below* the threshold; a distance
    (Jensen-Shannon, normed Wasserstein, PSI) when it is at or *above*: the raw figures of two columns are
    not comparable. ``over_threshold`` puts both on one scale."""

    method: str
    score: float
    threshold: float
    drifted: bool

    @property
    def p_value(self) -> bool:
        """Whether the figure is a p-value, read from Evidently's own verdict (drifted below the threshold,
        or not drifted at or above it)."""
        return self.drifted == (self.score < self.threshold)

    def over_threshold(self, cap: float = 10.0) -> float:
        """How far the column is past its test's threshold, 1 at the threshold and above 1 when drifted:
        a distance ÷ its threshold, or the threshold ÷ a p-value; at most ``cap`` (a p-value of 0)."""
        if not math.isfinite(self.threshold):
            return math.nan
        if self.p_value:
            return cap if self.score <= self.threshold / cap else self.threshold / self.score
        return min(cap, self.score / self.threshold) if self.threshold > 0 else cap


def column_drift(snapshot) -> dict[str, ColumnDrift]:
    """Each tested column's ``ColumnDrift``, from a drift report's typed metrics (``ValueDrift``'s config names
    the method and threshold) and its tests' verdicts."""
    result = snapshot.dict()
    failed = {str(t.get("name", "")).removeprefix("Value Drift for column ") for t in result["tests"]
              if str(t.get("name", "")).startswith("Value Drift for column ") and str(t.get("status")).endswith("FAIL")}
    columns = {}
    for metric in result["metrics"]:
        config = metric.get("config") or {}
        if str(config.get("type", "")).endswith(":ValueDrift"):
            columns[config["column"]] = ColumnDrift(str(config.get("method")), float(metric["value"]),
                                                    math.nan if config.get("threshold") is None
                                                    else float(config["threshold"]),
                                                    config["column"] in failed)
    return columns


def prediction_findings(reference: np.ndarray, current: np.ndarray, config: MonitorConfig
                        ) -> tuple[list[str], dict[str, float]]:
    """Whether the model's scores drifted between the windows: Evidently's drift score for one numeric
    column (normed Wasserstein distance at these sizes) at least ``config.prediction_drift``."""
    rng = np.random.default_rng(config.seed)
    frames = [pd.DataFrame({"prediction": rng.choice(scores, config.sample_rows, replace=False)
                            if len(scores) > config.sample_rows else scores}) for scores in (reference, current)]
    _, _, scores, _ = evidently_drift(frames[0], frames[1], ["prediction"], config, snapshot=False)
    figures = {"prediction_drift_score": scores.get("prediction", float("nan")),
               "prediction_mean_reference": float(np.mean(reference)), "prediction_mean_current": float(np.mean(current))}
    if not figures["prediction_drift_score"] >= config.prediction_drift:
        return [], figures
    return [f"prediction: the champion's mean score moved from {figures['prediction_mean_reference']:.4f} to "
            f"{figures['prediction_mean_current']:.4f} (drift score {figures['prediction_drift_score']:.3f})"], figures
