"""The gate's off-policy check (pure): when serving explored with logged propensities, the candidate's
top-slot CTR is estimated from those logs (SNIPS, and DR with the model's own predictions) beside the
champion's on the same logs, before any user sees the candidate.

Both policies are the models' rankings smoothed epsilon-greedy (``epsilon``), so every logged top item has
a non-zero target probability. A candidate fails when its SNIPS estimate is below the champion's by more
than ``z`` standard errors (both estimates' errors, which is conservative: they share the logs), and only
when the logs are worth ``min_effective_samples`` decisions for both.

Example::

    failure = check(candidate_estimate, champion_estimate)
"""

from __future__ import annotations

import math

import numpy as np

from recloop.evidence.offpolicy import OffPolicyEstimate, epsilon_greedy, estimate


def policy_estimate(
    labels, logged_propensity, shown_index, candidate_scores: list[np.ndarray], epsilon: float = 0.1
) -> OffPolicyEstimate:
    """SNIPS / IPS / DR of the epsilon-greedy policy over ``candidate_scores`` (one array of click
    probabilities per logged request) from top-slot logs: shown index, its logging propensity, its click."""
    target, shown_q, expected_q = [], [], []
    for scores, shown in zip(candidate_scores, shown_index, strict=True):
        probs = epsilon_greedy(scores, epsilon)
        target.append(probs[shown])
        shown_q.append(scores[shown])
        expected_q.append(float((probs * scores).sum()))
    return estimate(labels, logged_propensity, target, shown_q, expected_q)


def check(
    candidate: OffPolicyEstimate,
    champion: OffPolicyEstimate,
    z: float = 2.0,
    min_effective_samples: float = 200.0,
) -> tuple[str | None, dict[str, float | None]]:
    """A reason to refuse (or None) and the figures."""
    figures = {
        "candidate_snips": candidate.snips,
        "champion_snips": champion.snips,
        "candidate_dr": candidate.dr,
        "champion_dr": champion.dr,
        "logged": float(candidate.logged),
        "effective_samples": min(candidate.effective_samples, champion.effective_samples),
    }
    if min(candidate.effective_samples, champion.effective_samples) < min_effective_samples:
        return None, figures
    spread = math.sqrt(candidate.snips_se**2 + champion.snips_se**2)
    if spread > 0 and (champion.snips - candidate.snips) / spread > z:
        return (
            f"off-policy top-slot CTR {candidate.snips:.4f} vs the champion's {champion.snips:.4f} on "
            f"{candidate.logged} explored requests (SNIPS, {z:.0f} standard errors lower)"
        ), figures
    return None, figures
