"""Concept drift from served feedback (pure): does the champion still predict what users do?

Input drift misses changed tastes: the same users and items arrive, but clicks follow a different rule.
The champion's own predictions on the items it served, against the clicks they got, show it: when tastes
move, its calibration on served traffic (mean predicted / observed CTR) leaves 1, overall and per
segment (device, country…). Each segment's gap is tested with user-cluster standard errors (a heavy
user is one unit of evidence) and Holm across segments; a finding needs both a gap larger than
``max_calibration_error`` and significance.

With a ``baseline`` (the same champion's served feedback of an earlier window), the test is of the
*change* in calibration against it: a real ranker is not calibrated on what it serves (the items it ranks
first are those it over-rates, and served lists carry position effects: a young champion's predicted /
observed ratio on its own top-10 was 1.56 in the demo, before any drift), so only a move away from its
own served calibration is taken as changed tastes. Segments the baseline holds too few impressions of
are not judged. Against the baseline the online CTR of each segment is judged too: a drop of more than
``max_ctr_drop`` (relative), significant with user-cluster errors, in the same Holm family as the
calibration tests (a segment whose users stopped clicking is decay even when the model's predictions
fell with it).

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
    labels, predictions, users, segments: dict[str, np.ndarray], config, baseline: tuple | None = None,
    same_model: bool = True, reference: str = "the champion's own",
) -> tuple[list[str], dict]:
    """Findings and figures (calibration on served feedback, overall and per segment value).

    ``config``: a ``MonitorConfig`` (``max_calibration_error``, ``concept_alpha``, ``min_impressions``,
    ``min_segment_impressions``). ``baseline``: ``(labels, predictions, users, segments)`` of an earlier
    window of the same model: the gap is then the ratio's move against the baseline's ratio.
    ``same_model`` False: the window or the baseline holds other versions' served feedback (the model line's:
    a champion promoted daily has little of its own). The calibration's move is then reported, not tested:
    each version over-rates the items it ranks first by its own amount (winner's curse), so a new champion
    moves the ratio with no change in tastes (a no-drift world at 1,500 requests a day: 1.21 → 1.59, p 1e-21,
    a full retrain for nothing; benchmarks/RESULTS.md, issue 36). The online CTR's drop is still tested: a
    champion that passed its gate and canary serving fewer clicks than the line did is decay. ``reference``:
    whose earlier served traffic the baseline is, as the findings name it.
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
        if baseline is not None:
            then = _segment(baseline, name)
            if len(then[0]) < (config.min_impressions if name == "all" else config.min_segment_impressions):
                continue  # nothing of the champion's own to compare this segment with
            then_predicted, then_observed, _ = calibration_gap(*then)
            then_ratio = then_predicted / then_observed if then_observed > 0 else float("inf")
            figures[f"served_calibration_baseline.{name}"] = then_ratio
            z = _change_z((labels[mask], predictions[mask], users[mask]), then)
            ratio = ratio / then_ratio if np.isfinite(then_ratio) and then_ratio > 0 else float("inf")
            figures[f"online_ctr.{name}"] = observed
            figures[f"online_ctr_baseline.{name}"] = then_observed
            ctr_z = _change_z((labels[mask], np.zeros(int(mask.sum())), users[mask]),
                              (then[0], np.zeros(len(then[0])), then[2]))  # z of the drop: then − now
            drop = 1.0 - observed / then_observed if then_observed > 0 else 0.0
            tests.append(("ctr " + name, drop, stats.norm.sf(ctr_z), then_observed - observed))
        if same_model or baseline is None:
            tests.append((name, ratio, 2 * stats.norm.sf(abs(z)), predicted - observed))
    if not tests:
        return [], figures
    adjusted = holm([p for _, _, p, _ in tests])
    findings = []
    for (name, ratio, _, _), p in zip(tests, adjusted, strict=True):
        if name.startswith("ctr "):
            segment = name[4:]
            if ratio > config.max_ctr_drop and p < config.concept_alpha:
                where = "served feedback" if segment == "all" else f"served feedback, {segment}"
                findings.append(
                    f"online CTR on {where} is {ratio:.0%} below {reference} earlier served traffic "
                    f"({figures[f'online_ctr.{segment}']:.4f} vs {figures[f'online_ctr_baseline.{segment}']:.4f}; "
                    f"Holm-adjusted p {p:.2g})"
                )
            continue
        if abs(ratio - 1.0) > config.max_calibration_error and p < config.concept_alpha:
            where = "served feedback" if name == "all" else f"served feedback, {name}"
            what = "moved by a factor" if baseline is not None else "is"
            findings.append(
                f"concept drift: the champion's calibration on {where} {what} {ratio:.2f} "
                f"(predicted / observed CTR{' against its own earlier served traffic' if baseline is not None else ''}; "
                f"Holm-adjusted p {p:.2g})"
            )
    return findings, figures


def _segment(window: tuple, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(labels, predictions, users) of one segment (``all`` or ``column=value``) of a window."""
    labels, predictions, users, segments = window
    labels, predictions, users = (np.asarray(a) for a in (labels, predictions, users))
    if name == "all":
        return labels.astype(np.float64), predictions.astype(np.float64), users
    column, _, value = name.partition("=")
    values = np.asarray(segments.get(column, np.array([], dtype=object))).astype(str)
    mask = values == value if len(values) == len(labels) else np.zeros(len(labels), dtype=bool)
    return labels[mask].astype(np.float64), predictions[mask].astype(np.float64), users[mask]


def _change_z(now: tuple, then: tuple) -> float:
    """z of the change in (predicted − observed) between two windows, user-cluster errors in each."""
    gap_now, var_now = cluster_mean(now[1] - now[0], now[2])
    gap_then, var_then = cluster_mean(then[1] - then[0], then[2])
    variance = (var_now or 0.0) + (var_then or 0.0)
    return float((gap_now - gap_then) / np.sqrt(variance)) if variance > 0 and np.isfinite(variance) else 0.0
