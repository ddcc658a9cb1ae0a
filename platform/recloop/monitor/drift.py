"""Distribution drift with Evidently: pure computations over two windows of data (no files, no MLflow).

``evidently_drift`` runs ``DataDriftPreset`` over chosen columns and reads its typed results (share of
drifted columns, each column's verdict and score); ``prediction_findings`` applies the same test to
the champion's scores on both windows. Windows are sampled (``sample``) so millions of rows cost no
more than a few tens of thousands.
"""

from __future__ import annotations

from collections.abc import Collection
from datetime import datetime

import numpy as np
import pandas as pd

from recloop.monitor.decision import MonitorConfig


def sample(frame: pd.DataFrame, rows: int, seed: int) -> pd.DataFrame:
    return frame.sample(rows, random_state=seed) if len(frame) > rows else frame


def evidently_drift(reference: pd.DataFrame, current: pd.DataFrame, columns: list[str],
                    config: MonitorConfig, timestamp: datetime | None = None, categorical: Collection[str] = ()
                    ) -> tuple[float, list[str], dict[str, float], object]:
    """Share of drifted columns, the drifted ones, each column's drift score, and Evidently's snapshot.

    ``categorical``: columns typed categorical whatever their dtype (the dataset spec's categorical
    columns: an integer id is a category, not a quantity); the rest are numeric when they are numbers with
    more than 20 distinct values."""
    from evidently import DataDefinition, Dataset, Report
    from evidently.presets import DataDriftPreset

    numeric = [c for c in columns if c not in categorical and pd.api.types.is_numeric_dtype(reference[c])
               and reference[c].nunique() > 20]
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
