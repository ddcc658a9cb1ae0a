"""Concept drift from served feedback (pure): does the champion still predict what users do?

Input drift misses changed tastes: the same users and items arrive, but clicks follow a different rule.
The champion's own predictions on the items it served, against the clicks they got, show it: when tastes
move, its calibration on served traffic (mean predicted / observed CTR) leaves 1, overall and per
segment (device, country…). Each segment's gap is tested with user-cluster standard errors (a heavy
user is one unit of evidence) and Holm across segments; a finding needs both a gap larger than
``max_calibration_error`` and significance.

Example::

    concept_findings(labels, predictions, users, {"device": devices}, MonitorConfig())
"""

from __future__ import annotations

import numpy as np
from scipy import stats

from recloop.evidence.ranking import holm
from recloop.evidence.sequential import cluster_mean


def calibration_gap(labels, predictions, users) -> tuple[float, float, float]:
    """(predicted CTR, observed CTR, z of predicted − observed with user-cluster errors)."""
    labels = np.asarray(labels, dtype=np.float64)
    predictions = np.asarray(predictions, dtype=np.float64)
    if len(labels) < 2:
        return float("nan"), float("nan"), 0.0
    gap, variance = cluster_mean(predictions - labels, users)
    z = gap / np.sqrt(variance) if variance and np.isfinite(variance) and variance > 0 else 0.0
    return float(predictions.mean()), float(labels.mean()), float(z)


def concept_findings(
    labels, predictions, users, segments: dict[str, np.ndarray], config
) -> tuple[list[str], dict]:
    """Findings and figures (calibration on served feedback, overall and per segment value).

    ``config``: a ``MonitorConfig`` (``max_calibration_error``, ``concept_alpha``, ``min_impressions``,
    ``min_segment_impressions``).
    """
    labels = np.asarray(labels, dtype=np.float64)
    predictions = np.asarray(predictions, dtype=np.float64)
    users = np.asarray(users)
    figures: dict[str, float] = {}
    if len(labels) < config.min_impressions:
        return [], figures
    tests: list[tuple[str, float, float, float]] = []
    for name, mask in [("all", np.ones(len(labels), dtype=bool))] + [
        (f"{column}={value}", np.asarray(values) == value)
        for column, values in segments.items()
        for value in np.unique(np.asarray(values))
    ]:
        if mask.sum() < (config.min_impressions if name == "all" else config.min_segment_impressions):
            continue
        predicted, observed, z = calibration_gap(labels[mask], predictions[mask], users[mask])
        ratio = predicted / observed if observed > 0 else float("inf")
        figures[f"served_calibration.{name}"] = ratio
        tests.append((name, ratio, 2 * stats.norm.sf(abs(z)), predicted - observed))
    if not tests:
        return [], figures
    adjusted = holm([p for _, _, p, _ in tests])
    findings = []
    for (name, ratio, _, _), p in zip(tests, adjusted, strict=True):
        if abs(ratio - 1.0) > config.max_calibration_error and p < config.concept_alpha:
            where = "served feedback" if name == "all" else f"served feedback, {name}"
            findings.append(
                f"concept drift: the champion's calibration on {where} is {ratio:.2f} "
                f"(predicted / observed CTR; Holm-adjusted p {p:.2g})"
            )
    return findings, figures
