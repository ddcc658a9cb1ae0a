"""The retriever's gate: may a candidate retriever replace the champion? A pure decision over scores.

It mirrors the ranker's gate (``recloop.gate``): candidate and champion are scored on the same held-out
clicks (``score_window``), and the answer is a ``GateDecision`` (passed, reasons, figures). The
candidate must pass, at the gate's K:

- floors: recall@K at least ``min_recall``, and at least ``min_lift_over_popularity`` times the
  popularity baseline's recall on the same clicks (a retriever that cannot beat "the most clicked
  items" is not worth its index); in a simulated world, oracle recall@K at least ``min_oracle_recall``;
- against the champion: recall@K (by the mode's allowance) and NDCG@K may drop by at most a tolerance; a drop
  beyond it fails only when it is also larger than ``z`` paired standard errors (both models answer
  the same clicks, so the test is on the per-click differences, which are far less noisy than either
  model's recall alone);
- per slice (new users, new items), each with at least ``min_slice_clicks`` clicks: recall@K may drop
  at most ``max_slice_recall_drop``.

The first retriever (no champion) only has to pass the floors.

Example::

    decision = decide(candidate_scores, champion_scores, RetrievalThresholds(), mode="incremental")
    decision.passed, decision.reasons
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np

from recloop.gate.decision import GateDecision
from recloop.retrieval.evaluate import RetrievalScores


@dataclass(frozen=True)
class RetrievalThresholds:
    """Floors and tolerated changes of the retriever's gate.

    Args:
        k: the K the gate judges at (the number of candidates retrieval hands to the ranker).
        min_recall, min_lift_over_popularity, min_oracle_recall: floors (see the module docstring).
        max_recall_drop_incremental, max_recall_drop_full: tolerated absolute drop of recall@K.
        max_ndcg_drop: tolerated absolute drop of NDCG@K.
        z: standard errors a drop beyond the tolerance must also exceed to fail (paired test).
        max_slice_recall_drop, min_slice_clicks: per slice.
        min_clicks: held-out clicks below which the gate does not judge at all ("insufficient evidence": one
            click's recall is 0 or 1); training grows its held-out window back to reach them
            (``RetrievalTrainConfig.min_validation_clicks``).
    """

    k: int = 500
    min_recall: float = 0.05
    min_lift_over_popularity: float = 0.8
    min_oracle_recall: float = 0.0
    max_recall_drop_incremental: float = 0.01
    max_recall_drop_full: float = 0.0
    max_ndcg_drop: float = 0.01
    z: float = 1.96
    max_slice_recall_drop: float = 0.05
    min_slice_clicks: int = 200
    min_clicks: int = 100


def per_click(ranks: np.ndarray, k: int, metric: Literal["recall", "ndcg"]) -> np.ndarray:
    """Each click's contribution to recall@k (hit: 1) or NDCG@k (1 / log2(rank + 2))."""
    ranks = np.asarray(ranks)
    hit = (ranks >= 0) & (ranks < k)
    if metric == "recall":
        return hit.astype(np.float64)
    return np.where(hit, 1.0 / np.log2(np.where(hit, ranks, 0) + 2.0), 0.0)


def paired_drop(champion_ranks: np.ndarray, candidate_ranks: np.ndarray, k: int,
                metric: Literal["recall", "ndcg"] = "recall") -> tuple[float, float]:
    """Champion's minus candidate's metric@k on the same clicks, and its paired standard error."""
    difference = per_click(champion_ranks, k, metric) - per_click(candidate_ranks, k, metric)
    n = len(difference)
    if n < 2:
        return float(difference.mean()) if n else math.nan, math.inf
    return float(difference.mean()), float(difference.std(ddof=1) / math.sqrt(n))


def decide(candidate: RetrievalScores, champion: RetrievalScores | None, thresholds: RetrievalThresholds,
           mode: Literal["full", "incremental"]) -> GateDecision:
    """Pass or fail, with every reason and the figures compared (see the module docstring)."""
    k = thresholds.k
    recall, ndcg, oracle = f"recall@{k}", f"ndcg@{k}", f"oracle_recall@{k}"
    ours = candidate.overall
    reasons: list[str] = []
    figures: dict[str, dict[str, float | None]] = {
        name: {"candidate": ours.get(name), "champion": champion.overall.get(name) if champion else None}
        for name in (recall, ndcg, oracle, "clicks")
    }
    clicks = int(ours.get("clicks", len(candidate.ranks)) or 0)
    if clicks < thresholds.min_clicks:
        figures["evidence"] = {"clicks": clicks, "min_clicks": thresholds.min_clicks}
        reasons.append(f"insufficient evidence: {clicks} held-out click{'s' if clicks != 1 else ''}, the gate judges on "
                       f"at least {thresholds.min_clicks} (train with a longer held-out window, or bring it up by "
                       "hand: recloop promote VERSION --model recloop-retriever)")
        return GateDecision(passed=False, reasons=tuple(reasons), figures=figures, first_model=champion is None)
    value = ours.get(recall, math.nan)
    if not math.isfinite(value):
        reasons.append(f"{recall} is {value} (no held-out clicks to judge on?)")
    elif value < thresholds.min_recall:
        reasons.append(f"{recall} {value:.4f} below the floor {thresholds.min_recall}")
    if candidate.popularity is not None and math.isfinite(value):
        baseline = candidate.popularity.get(recall, math.nan)
        figures[recall]["popularity"] = baseline
        if math.isfinite(baseline) and value < thresholds.min_lift_over_popularity * baseline:
            reasons.append(f"{recall} {value:.4f} is below {thresholds.min_lift_over_popularity}x the popularity "
                           f"baseline's {baseline:.4f}")
    if candidate.popularity is not None and oracle in candidate.popularity:
        figures[oracle]["popularity"] = candidate.popularity[oracle]
    if oracle in ours and math.isfinite(ours[oracle]) and ours[oracle] < thresholds.min_oracle_recall:
        reasons.append(f"{oracle} {ours[oracle]:.4f} below the floor {thresholds.min_oracle_recall}")

    if champion is not None:
        allowed = thresholds.max_recall_drop_incremental if mode == "incremental" else thresholds.max_recall_drop_full
        same_clicks = len(candidate.ranks) == len(champion.ranks)
        for name, metric, tolerance in ((recall, "recall", allowed), (ndcg, "ndcg", thresholds.max_ndcg_drop)):
            drop, error = (paired_drop(champion.ranks, candidate.ranks, k, metric) if same_clicks else
                           (champion.overall.get(name, math.nan) - ours.get(name, math.nan), 0.0))
            figures[name].update(allowed_drop=tolerance, drop=drop, paired_se=error)
            if math.isfinite(drop) and drop > tolerance and drop - tolerance > thresholds.z * error:
                reasons.append(f"{name} dropped {drop:.4f} below the champion's (a {mode} candidate may drop at "
                               f"most {tolerance}; paired standard error {error:.4f})")
        for name, scores in sorted(candidate.slices.items()):
            theirs = champion.slices.get(name)
            if theirs is None or min(scores.get("clicks", 0), theirs.get("clicks", 0)) < thresholds.min_slice_clicks:
                continue
            slice_drop = theirs.get(recall, math.nan) - scores.get(recall, math.nan)
            figures[f"slice {name}"] = {"candidate": scores.get(recall), "champion": theirs.get(recall),
                                        "clicks": scores.get("clicks")}
            if math.isfinite(slice_drop) and slice_drop > thresholds.max_slice_recall_drop:
                reasons.append(f"slice {name}: {recall} dropped {slice_drop:.4f} (at most "
                               f"{thresholds.max_slice_recall_drop} per slice)")
    return GateDecision(passed=not reasons, reasons=tuple(reasons), figures=figures, first_model=champion is None)


def report_markdown(decision: GateDecision, candidate: RetrievalScores, champion: RetrievalScores | None,
                    version: str, champion_version: str | None, mode: str) -> str:
    """The review table: candidate vs champion (and popularity) per metric and slice, the decision."""
    verdict = "PASSED" if decision.passed else "FAILED"
    lines = [f"# Retriever gate: version {version} ({mode}) vs champion {champion_version or '(none: first model)'}",
             "", f"**{verdict}**", ""]
    lines += [f"- {reason}" for reason in decision.reasons] or ["- every check passed"]
    lines += ["", "| metric | candidate | champion | popularity |", "| --- | --- | --- | --- |"]
    for name in sorted(candidate.overall):
        theirs = champion.overall.get(name) if champion else None
        popular = candidate.popularity.get(name) if candidate.popularity else None
        lines.append(f"| {name} | {_fmt(candidate.overall[name])} | {_fmt(theirs)} | {_fmt(popular)} |")
    lines += ["", "| slice | clicks | candidate | champion |", "| --- | --- | --- | --- |"]
    for name, scores in sorted(candidate.slices.items()):
        key = next((k for k in scores if k.startswith("recall@")), None)
        theirs = champion.slices.get(name, {}).get(key) if champion and key else None
        lines.append(f"| {name} | {int(scores.get('clicks', 0))} | {_fmt(scores.get(key))} | {_fmt(theirs)} |")
    return "\n".join(lines) + "\n"


def _fmt(value) -> str:
    """A cell: ``-`` for nothing (None, NaN: MLflow's page showed ``nan``), 4 decimals for a float."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    return f"{value:.4f}" if isinstance(value, float) else str(value)
