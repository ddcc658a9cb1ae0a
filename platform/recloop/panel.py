"""The simulator's evaluation panel: a fixed set of requests per simulated day, drawn independently of
serving, on which every policy is scored against the ground truth.

A request is a user (drawn by the day's activity), a device and ``candidates`` items (drawn by the
day's exposure); a policy ranks the candidates, and its expected reward is the sum of the true click
probabilities of its top ``k`` at their positions. Against the oracle (ranking by true probability) and a
random ranking on the same requests:

- normalized reward ``(E - E_random) / (E_oracle - E_random)`` (0: random, 1: the oracle);
- regret per request ``E_oracle - E``;
- NDCG@k with the true click probability (at position 1) as the gain.

Intervals are a bootstrap over users (clusters): a heavy user's many panel requests are one unit.

``SimulatedModel`` is a ranker of known quality for the decision benchmarks: the true logit plus a
low-rank error of size ``noise`` (0: the oracle), fixed for a seed, so two draws of one model agree.

Example::

    panel = draw_panel(world, day=4, requests=2000, seed=1)
    report = score_panel(world, panel, {"champion": champion_scores, "candidate": candidate_scores})
    report["candidate"]["normalized_reward"]
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from recloop.simulate import DEVICE_MIX, DEVICE_MIX_AFTER_COVARIATE_DRIFT, World


@dataclass(frozen=True)
class Panel:
    day: float
    users: np.ndarray  # (requests,)
    devices: np.ndarray  # (requests,)
    items: np.ndarray  # (requests, candidates)


def draw_panel(world: World, day: float, requests: int, candidates: int = 50, seed: int = 0) -> Panel:
    """The day's panel: its own random stream (``seed``), independent of every served or logged request."""
    rng = np.random.default_rng(np.random.SeedSequence([world.config.seed, 7, int(day * 24), seed]))
    drifted, drift = world.drifted(int(day)), world.config.drift
    activity = world.activity_after if drifted and drift == "covariate" else world.activity_before
    popularity = world.popularity_after if drifted and drift == "sudden" else world.popularity_before
    users = rng.choice(len(activity), requests, p=activity / activity.sum())
    mix = DEVICE_MIX_AFTER_COVARIATE_DRIFT if drifted and drift == "covariate" else DEVICE_MIX
    devices = rng.choice(len(mix), requests, p=mix)
    p = popularity / popularity.sum()
    # candidates without repeats within a request (Gumbel top-k over log popularity)
    keys = np.log(np.maximum(p, 1e-300))[None, :] + rng.gumbel(size=(requests, len(p)))
    items = np.argpartition(-keys, candidates - 1, axis=1)[:, :candidates]
    return Panel(day, users, devices, items)


def true_logits(world: World, panel: Panel) -> np.ndarray:
    """The ground truth's logit of each candidate at position 1."""
    n, m = panel.items.shape
    p = world.click_probability(
        panel.day, np.repeat(panel.users, m), panel.items.ravel(), np.repeat(panel.devices, m), np.ones(n * m)
    ).reshape(n, m)
    return np.log(p) - np.log1p(-p)


def expected_reward(logits: np.ndarray, order: np.ndarray, k: int = 10) -> np.ndarray:
    """Expected clicks per request of showing ``order``'s top ``k`` (the position effect of the world)."""
    top = np.take_along_axis(logits, order[:, :k], axis=1) - 0.35 * np.log(np.arange(1, k + 1))[None, :]
    return (1.0 / (1.0 + np.exp(-top))).sum(axis=1)


def per_request(
    world: World, panel: Panel, scores: dict[str, np.ndarray], k: int = 10, seed: int = 0
) -> dict[str, dict[str, np.ndarray]]:
    """Per request and policy: expected reward, NDCG@k; with ``oracle`` and ``random`` added."""
    logits = true_logits(world, panel)
    gain = 1.0 / (1.0 + np.exp(-logits))
    rng = np.random.default_rng(seed)
    orders = {"oracle": np.argsort(-logits, axis=1), "random": np.argsort(rng.random(logits.shape), axis=1)}
    orders.update({name: np.argsort(-s, axis=1, kind="stable") for name, s in scores.items()})
    discount = 1.0 / np.log2(np.arange(2, k + 2))
    ideal = (np.take_along_axis(gain, orders["oracle"][:, :k], axis=1) * discount).sum(axis=1)
    out = {}
    for name, order in orders.items():
        dcg = (np.take_along_axis(gain, order[:, :k], axis=1) * discount).sum(axis=1)
        out[name] = {"reward": expected_reward(logits, order, k), "ndcg": dcg / ideal}
    return out


def score_panel(
    world: World,
    panel: Panel,
    scores: dict[str, np.ndarray],
    k: int = 10,
    resamples: int = 500,
    seed: int = 0,
) -> dict[str, dict[str, float]]:
    """Normalized reward (with a user-cluster bootstrap 95 % interval), regret and NDCG@k per policy."""
    rows = per_request(world, panel, scores, k, seed)
    _, users = np.unique(panel.users, return_inverse=True)
    g = users.max() + 1
    draws = np.random.default_rng(seed).poisson(1.0, (resamples, g)).astype(np.float64)

    def totals(values):
        return np.bincount(users, weights=values, minlength=g)

    oracle, random = totals(rows["oracle"]["reward"]), totals(rows["random"]["reward"])
    out = {}
    for name, r in rows.items():
        mine = totals(r["reward"])
        point = (mine.sum() - random.sum()) / (oracle.sum() - random.sum())
        boot = (draws @ mine - draws @ random) / (draws @ oracle - draws @ random)
        low, high = np.quantile(boot, [0.025, 0.975])
        out[name] = {
            "normalized_reward": float(point),
            "low": float(low),
            "high": float(high),
            "reward": float(r["reward"].mean()),
            "regret": float((rows["oracle"]["reward"] - r["reward"]).mean()),
            "ndcg": float(r["ndcg"].mean()),
        }
    return out


@dataclass(frozen=True)
class SimulatedModel:
    """A ranker of known quality: true logit + ``noise`` × a fixed low-rank error (its ``seed``) + ``bias``."""

    noise: float
    seed: int = 0
    rank: int = 8

    def scores(self, world: World, users: np.ndarray, items: np.ndarray, truth: np.ndarray) -> np.ndarray:
        u, v, b = _errors(
            world.config.seed, self.seed, self.rank, len(world.user_taste), len(world.item_vector)
        )
        error = np.einsum(
            "...r,...r->...", u[users][..., None, :] if items.ndim == 2 else u[users], v[items]
        ) / np.sqrt(2 * self.rank) + b[items] / np.sqrt(2)
        return truth + self.noise * error


@lru_cache(maxsize=32)
def _errors(world_seed: int, seed: int, rank: int, users: int, items: int):
    rng = np.random.default_rng(np.random.SeedSequence([world_seed, 11, seed]))
    return rng.normal(0, 1, (users, rank)), rng.normal(0, 1, (items, rank)), rng.normal(0, 1, items)
