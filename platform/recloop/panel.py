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
from datetime import timedelta
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
    # candidates without repeats within a request (Gumbel top-k over log popularity); the drift's new items
    # get their keys from their own stream, so a world and its no-drift twin draw the same panels before it
    original = world.num_original_items
    keys = np.log(np.maximum(p[:original], 1e-300))[None, :] + rng.gumbel(size=(requests, original))
    if len(p) > original:
        wave = np.random.default_rng(np.random.SeedSequence([world.config.seed, 8, int(day * 24), seed]))
        wave_p = p[original:]
        wave_keys = np.where(wave_p > 0, np.log(np.maximum(wave_p, 1e-300)), -np.inf)[None, :] + wave.gumbel(
            size=(requests, len(wave_p))
        )
        keys = np.concatenate([keys, wave_keys], axis=1)
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
    world: World, panel: Panel, scores: dict[str, np.ndarray], k: int = 10, seed: int = 0,
    averaged: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, np.ndarray]]:
    """Per request and policy: expected reward, NDCG@k; with ``oracle`` and ``random`` added. ``averaged``: a
    policy of its own per name, each request's reward and NDCG the mean of the named policies' (models trained
    alike with different seeds: what such a training gives in expectation, not one draw of it)."""
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
    for name, members in (averaged or {}).items():
        out[name] = {key: np.mean([out[m][key] for m in members], axis=0) for key in ("reward", "ndcg")}
    return out


def score_panel(
    world: World,
    panel: Panel,
    scores: dict[str, np.ndarray],
    k: int = 10,
    resamples: int = 500,
    seed: int = 0,
    averaged: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, float]]:
    """Normalized reward (with a user-cluster bootstrap 95 % interval), regret and NDCG@k per policy
    (``averaged``: as ``per_request``'s)."""
    rows = per_request(world, panel, scores, k, seed, averaged)
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
    """Each factor from its own stream: a twin world with extra (wave) items shares the others' errors."""
    streams = [
        np.random.default_rng(np.random.SeedSequence([world_seed, 11, seed, part])) for part in range(3)
    ]
    return (
        streams[0].normal(0, 1, (users, rank)),
        streams[1].normal(0, 1, (items, rank)),
        streams[2].normal(0, 1, items),
    )


def request_bodies(world: World, panel: Panel) -> list[dict]:
    """The panel's requests as ``/rank`` bodies (context as the simulated users send it)."""
    from recloop.simulate import COUNTRIES, DEVICES

    ts = (world.config.start + timedelta(days=panel.day)).isoformat()
    bodies = []
    for user, device, items in zip(
        panel.users.tolist(), panel.devices.tolist(), panel.items.tolist(), strict=True
    ):
        bodies.append(
            {
                "user_id": user,
                "item_ids": items,
                "ts": ts,
                "context": {
                    "device": DEVICES[device],
                    "country": COUNTRIES[world.user_country[user]],
                    "history": [int(i) for i in world.history[user] if i >= 0],
                    "category": [int(c) for c in world.item_category[items]],
                    "price": [float(p) for p in world.item_price[items]],
                },
            }
        )
    return bodies


def normalized(rewards: dict[str, np.ndarray], policy: str, weights: np.ndarray | None = None):
    """Normalized reward of ``policy`` from per-request rewards (``oracle``, ``random`` included); with
    ``weights`` of shape (resamples, requests), one value per resample."""
    if weights is None:
        total = {k: v.sum() for k, v in rewards.items()}
    else:
        total = {k: weights @ v for k, v in rewards.items()}
    return (total[policy] - total["random"]) / (total["oracle"] - total["random"])


def _user_weights(users: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """User-cluster bootstrap weights per request, (resamples, requests): one Poisson(1) draw per user."""
    _, index = np.unique(users, return_inverse=True)
    per_user = np.random.default_rng(seed).poisson(1.0, (resamples, index.max() + 1)).astype(np.float64)
    return per_user[:, index]


def paired_difference(
    rewards: dict[str, np.ndarray],
    users: np.ndarray,
    policy: str,
    baseline: str,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Normalized reward of ``policy`` minus that of ``baseline`` on the same panel (the same requests, each
    ranked by both), with a 95 % user-cluster bootstrap interval: one Poisson weight per user, applied to both
    policies' requests, so the interval is that of the difference and not of two separate estimates.

    The loop's primary efficacy figure (issue 36): the same-panel difference needs no second world, and a
    weak reference does not blow it up as a ratio does.

    Example::

        paired_difference(rows, panel.users, "champion", "never_retrained")["difference"]
    """
    weights = _user_weights(users, resamples, seed)
    point = normalized(rewards, policy) - normalized(rewards, baseline)
    boot = normalized(rewards, policy, weights) - normalized(rewards, baseline, weights)
    low, high = np.quantile(boot[np.isfinite(boot)], [0.025, 0.975])
    return {"difference": float(point), "low": float(low), "high": float(high)}


def twin_recovery(
    drifted: dict[str, np.ndarray],
    twin: dict[str, np.ndarray],
    users: np.ndarray,
    policy: str,
    resamples: int = 1000,
    seed: int = 0,
) -> dict[str, float]:
    """Normalized reward of ``policy`` in the drifted world over the same in its no-drift twin, on paired
    panels (request ``i`` of both drawn by the same stream), with a 95 % user-cluster bootstrap interval
    (one Poisson weight per user of the drifted panel, applied to both worlds' requests)."""
    weights = _user_weights(users, resamples, seed)
    point = normalized(drifted, policy) / normalized(twin, policy)
    boot = normalized(drifted, policy, weights) / normalized(twin, policy, weights)
    low, high = np.quantile(boot[np.isfinite(boot)], [0.025, 0.975])
    return {"recovery": float(point), "low": float(low), "high": float(high)}
