"""Exploration with logged propensities, and off-policy estimates of a candidate's CTR from those logs.

A small share of requests is served by a randomized policy whose probabilities are logged. For the
top slot of a ranking (the item the user sees first), with logging propensity ``p`` of the shown item,
reward ``r`` (clicked or not), and the candidate policy's probability ``pi`` of showing that same item:

- IPS: ``mean(r * pi / p)`` — unbiased when ``p > 0`` wherever ``pi > 0``, high variance;
- SNIPS: ``sum(r * pi / p) / sum(pi / p)`` — self-normalized, a little biased, far less variance;
- DR (doubly robust): ``mean(q_pi + pi / p * (r - q_shown))`` with a reward model ``q`` (e.g. a model's
  click probabilities): ``q_pi`` is the model's expected reward under ``pi``, ``q_shown`` its reward for the
  shown item — unbiased when either the propensities or the reward model are right.

Policies: ``epsilon_greedy`` (the top item with ``1 - eps + eps/m``, any other with ``eps/m``) and
``plackett_luce`` (a softmax draw without replacement; each position's propensity given those before).

Example::

    order, propensity = plackett_luce(scores, k=10, temperature=0.5, rng=rng)   # serve + log propensity[0]
    snips(rewards, logged_p, target_p)
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np


def epsilon_greedy(scores: np.ndarray, epsilon: float) -> np.ndarray:
    """Top-slot probabilities of each candidate under epsilon-greedy over ``scores`` (last axis)."""
    scores = np.asarray(scores, dtype=np.float64)
    m = scores.shape[-1]
    probs = np.full(scores.shape, epsilon / m)
    best = np.argmax(scores, axis=-1)
    np.put_along_axis(probs, best[..., None], 1.0 - epsilon + epsilon / m, axis=-1)
    return probs


def softmax(scores: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(scores, dtype=np.float64) / max(temperature, 1e-12)
    z = z - z.max(axis=-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=-1, keepdims=True)


def plackett_luce(
    scores, k: int, temperature: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A ranking of ``k`` candidates drawn without replacement from softmax(scores / temperature), and the
    propensity of each drawn item at its position (given the items above it)."""
    weights = softmax(np.asarray(scores, dtype=np.float64), temperature)
    k = min(k, len(weights))
    # Gumbel top-k: the order of log w + Gumbel noise is a Plackett-Luce draw.
    keys = np.log(np.maximum(weights, 1e-300)) + rng.gumbel(size=len(weights))
    order = np.argsort(-keys, kind="stable")[:k]
    remaining = weights.sum() - np.concatenate([[0.0], np.cumsum(weights[order])[:-1]])
    return order, weights[order] / remaining


@dataclass(frozen=True)
class OffPolicyEstimate:
    ips: float
    snips: float
    dr: float | None
    logged: int
    effective_samples: float  # (sum w)^2 / sum w^2: how many logged decisions the estimate is worth
    snips_se: float

    def to_dict(self) -> dict:
        return {
            "ips": self.ips,
            "snips": self.snips,
            "dr": self.dr,
            "logged": self.logged,
            "effective_samples": self.effective_samples,
            "snips_se": self.snips_se,
        }


def ips(rewards, logged_propensity, target_probability) -> float:
    w = np.asarray(target_probability, dtype=np.float64) / np.asarray(logged_propensity, dtype=np.float64)
    return float((np.asarray(rewards, dtype=np.float64) * w).mean())


def snips(rewards, logged_propensity, target_probability) -> float:
    w = np.asarray(target_probability, dtype=np.float64) / np.asarray(logged_propensity, dtype=np.float64)
    return float((np.asarray(rewards, dtype=np.float64) * w).sum() / max(w.sum(), 1e-300))


def doubly_robust(rewards, logged_propensity, target_probability, reward_shown, reward_under_target) -> float:
    """DR with a reward model: ``reward_shown`` = q(x, shown item), ``reward_under_target`` = sum_a pi(a|x) q(x, a)."""
    w = np.asarray(target_probability, dtype=np.float64) / np.asarray(logged_propensity, dtype=np.float64)
    r = np.asarray(rewards, dtype=np.float64)
    return float(
        (
            np.asarray(reward_under_target, dtype=np.float64)
            + w * (r - np.asarray(reward_shown, dtype=np.float64))
        ).mean()
    )


def estimate(
    rewards, logged_propensity, target_probability, reward_shown=None, reward_under_target=None
) -> OffPolicyEstimate:
    """IPS, SNIPS (with its delta-method standard error) and, given a reward model, DR."""
    r = np.asarray(rewards, dtype=np.float64)
    w = np.asarray(target_probability, dtype=np.float64) / np.asarray(logged_propensity, dtype=np.float64)
    if not len(r):
        return OffPolicyEstimate(float("nan"), float("nan"), None, 0, 0.0, float("nan"))
    sn = snips(r, logged_propensity, target_probability)
    mean_w = max(w.mean(), 1e-300)
    se = float(np.sqrt(((w * (r - sn)) ** 2).mean() / len(r)) / mean_w)
    dr = None
    if reward_shown is not None and reward_under_target is not None:
        dr = doubly_robust(r, logged_propensity, target_probability, reward_shown, reward_under_target)
    ess = float(w.sum() ** 2 / max((w**2).sum(), 1e-300))
    return OffPolicyEstimate(ips(r, logged_propensity, target_probability), sn, dr, len(r), ess, se)
