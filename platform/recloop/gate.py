"""The gate: may a candidate model replace the champion? A pure decision over metrics.

Candidate and champion are scored on the same held-out window (newest data, never trained on). The
candidate must pass, overall:

- absolute floors: AUC at least ``min_auc`` and log loss at most ``max_logloss`` (judged with MLflow's
  ``MetricThreshold`` / ``validate_evaluation_results``), calibration (mean prediction / mean label)
  within ``calibration_range``, and no NaN or infinite prediction;
- change against the champion: AUC may drop at most ``max_auc_drop_incremental`` for an incremental
  candidate; a full retrain may not be worse (``max_auc_drop_full``). MLflow's ``MetricThreshold``
  only expresses required improvements (its ``min_absolute_change`` must be positive), so tolerated
  drops are judged here;

and per slice (new vs returning users, top item categories, device), each slice with at least
``min_slice_rows`` rows: AUC may drop at most ``max_slice_auc_drop`` against the champion's AUC on the
same slice. The first model ever (no champion) only has to pass the floors.

Example::

    decision = decide(candidate, champion, GateThresholds(), mode="incremental")
    decision.passed, decision.reasons
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Literal


@dataclass(frozen=True)
class GateThresholds:
    min_auc: float = 0.55
    max_logloss: float = 0.6
    calibration_range: tuple[float, float] = (0.9, 1.1)
    max_auc_drop_incremental: float = 0.002
    max_auc_drop_full: float = 0.0
    max_slice_auc_drop: float = 0.01
    min_slice_rows: int = 200


@dataclass(frozen=True)
class ModelScores:
    """A model's metrics on the held-out window: overall (``auc``, ``logloss``, ``calibration``,
    ``nan_predictions``, ``rows``) and per slice (``{"device=mobile": {"auc": ..., "rows": ...}}``)."""

    overall: dict[str, float]
    slices: dict[str, dict[str, float]] = field(default_factory=dict)


@dataclass(frozen=True)
class GateDecision:
    passed: bool
    reasons: tuple[str, ...]
    figures: dict[str, dict[str, float | None]]
    first_model: bool

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        return out


def _floor_failures(scores: ModelScores, thresholds: GateThresholds) -> list[str]:
    from mlflow import validate_evaluation_results
    from mlflow.exceptions import MlflowException
    from mlflow.models import MetricThreshold
    from mlflow.models.evaluation import EvaluationResult

    floors = {"auc": MetricThreshold(threshold=thresholds.min_auc, greater_is_better=True),
              "logloss": MetricThreshold(threshold=thresholds.max_logloss, greater_is_better=False)}
    failures = []
    for name, threshold in floors.items():
        value = scores.overall.get(name, math.nan)
        if not math.isfinite(value):
            failures.append(f"{name} is {value}")
            continue
        try:
            validate_evaluation_results(validation_thresholds={name: threshold},
                                        candidate_result=EvaluationResult(metrics={name: value}, artifacts={}))
        except MlflowException:
            bound = "below the floor" if threshold.greater_is_better else "above the ceiling"
            failures.append(f"{name} {value:.4f} {bound} {threshold.threshold}")
    return failures


def decide(candidate: ModelScores, champion: ModelScores | None, thresholds: GateThresholds,
           mode: Literal["full", "incremental"]) -> GateDecision:
    """Pass or fail, with every reason and the figures compared (see the module docstring)."""
    reasons: list[str] = []
    overall = candidate.overall
    nan_count = int(overall.get("nan_predictions", 0))
    if nan_count:
        reasons.append(f"{nan_count} NaN or infinite predictions")
    reasons += _floor_failures(candidate, thresholds)
    low, high = thresholds.calibration_range
    calibration = overall.get("calibration", math.nan)
    if math.isfinite(calibration) and not low <= calibration <= high:
        reasons.append(f"calibration {calibration:.3f} outside [{low}, {high}]")

    figures: dict[str, dict[str, float | None]] = {
        name: {"candidate": overall.get(name), "champion": champion.overall.get(name) if champion else None}
        for name in ("auc", "logloss", "calibration", "rows")
    }
    if champion is not None:
        allowed = thresholds.max_auc_drop_incremental if mode == "incremental" else thresholds.max_auc_drop_full
        drop = champion.overall.get("auc", math.nan) - overall.get("auc", math.nan)
        figures["auc"]["allowed_drop"] = allowed
        if math.isfinite(drop) and drop > allowed:
            reasons.append(f"auc dropped {drop:.4f} below the champion's {champion.overall['auc']:.4f} "
                           f"(a {mode} candidate may drop at most {allowed})")
        for name, scores in sorted(candidate.slices.items()):
            theirs = champion.slices.get(name)
            if theirs is None or min(scores.get("rows", 0), theirs.get("rows", 0)) < thresholds.min_slice_rows:
                continue
            slice_drop = theirs.get("auc", math.nan) - scores.get("auc", math.nan)
            figures[f"slice {name}"] = {"candidate": scores.get("auc"), "champion": theirs.get("auc"),
                                        "rows": scores.get("rows")}
            if math.isfinite(slice_drop) and slice_drop > thresholds.max_slice_auc_drop:
                reasons.append(f"slice {name}: auc dropped {slice_drop:.4f} (at most "
                               f"{thresholds.max_slice_auc_drop} allowed per slice)")
    return GateDecision(passed=not reasons, reasons=tuple(reasons), figures=figures, first_model=champion is None)
