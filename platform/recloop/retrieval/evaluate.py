"""Offline quality of retrieval: recall@K and NDCG@K of held-out clicks, per slice, and the oracle recall.

Each held-out click is one query: the user as of that event (id, context, history) asks the index for
its top K items, and the click is a hit if the clicked item is among them. With one relevant item per
query, NDCG@K is ``1 / log2(rank + 2)`` for a hit at 0-based ``rank`` and 0 for a miss. Slices: clicks
of new users and of new items (the event's user or item had no feature state before it), which are the
clicks retrieval most easily loses.

In the synthetic world the true click probability of every (user, item) pair is known, so the
**oracle recall@K** says how much of what retrieval *should* return it does: the share of a user's K
best catalog items (by true click probability) that are in the retrieved K.

Pure functions over arrays; ``WorldOracle`` wraps a simulated world.

Example::

    ranks = target_ranks(retrieved_ids, clicked_ids)         # (Q,) 0-based rank, -1 = not retrieved
    scores = retrieval_scores(ranks, ks=(100, 500), slices={"user=new": is_new_user})
    oracle_recall(retrieved_ids, WorldOracle(world).best_items(users, catalog_ids, day, k=500))
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np


def target_ranks(retrieved: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """0-based rank of each query's target among its retrieved ids (Q, K), -1 when absent."""
    retrieved = np.asarray(retrieved)
    match = retrieved == np.asarray(targets)[:, None]  # (Q, K)
    return np.where(match.any(axis=1), match.argmax(axis=1), -1)


def recall_and_ndcg(ranks: np.ndarray, k: int) -> tuple[float, float]:
    """Recall@k and NDCG@k of single-target queries given each target's rank (-1 = missed)."""
    ranks = np.asarray(ranks)
    if len(ranks) == 0:
        return float("nan"), float("nan")
    hit = (ranks >= 0) & (ranks < k)
    gain = np.where(hit, 1.0 / np.log2(np.where(hit, ranks, 0) + 2.0), 0.0)
    return float(hit.mean()), float(gain.mean())


@dataclass(frozen=True)
class RetrievalScores:
    """A retriever's quality on one window.

    Args:
        overall: ``clicks``, ``recall@K`` and ``ndcg@K`` for each K, and ``oracle_recall@K`` when known.
        slices: the same per slice (``user=new``, ``item=new``...), with ``clicks``.
        ranks: (Q,) each held-out click's rank (-1 = missed), in window order: the gate pairs them.
        popularity: the same overall figures for the popularity baseline on the same clicks.
    """

    overall: dict[str, float]
    slices: dict[str, dict[str, float]] = field(default_factory=dict)
    ranks: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    popularity: dict[str, float] | None = None

    def to_dict(self) -> dict:
        return {"overall": self.overall, "slices": self.slices, "popularity": self.popularity}


def figures(ranks: np.ndarray, ks: tuple[int, ...]) -> dict[str, float]:
    out: dict[str, float] = {"clicks": int(len(ranks))}
    for k in ks:
        out[f"recall@{k}"], out[f"ndcg@{k}"] = recall_and_ndcg(ranks, k)
    return out


def retrieval_scores(ranks: np.ndarray, ks: tuple[int, ...], slices: dict[str, np.ndarray] | None = None,
                     popularity_ranks: np.ndarray | None = None, oracle: dict[str, float] | None = None
                     ) -> RetrievalScores:
    """Recall and NDCG at each K, overall and per slice (``slices``: name → boolean mask over queries)."""
    ranks = np.asarray(ranks)
    overall = figures(ranks, ks)
    overall.update(oracle or {})
    per_slice = {name: figures(ranks[np.asarray(mask, dtype=bool)], ks) for name, mask in (slices or {}).items()}
    popular = figures(np.asarray(popularity_ranks), ks) if popularity_ranks is not None else None
    return RetrievalScores(overall, per_slice, ranks, popular)


def oracle_recall(retrieved: np.ndarray, best: np.ndarray) -> float:
    """Mean over users of |retrieved ∩ best| / |best| (ids; -1 entries are ignored)."""
    shares = []
    for got, want in zip(np.asarray(retrieved), np.asarray(best), strict=True):
        want = want[want >= 0]
        if len(want):
            shares.append(len(np.intersect1d(got[got >= 0], want)) / len(want))
    return float(np.mean(shares)) if shares else float("nan")


def popularity_ranking(counts: np.ndarray, item_ids: np.ndarray, k: int) -> np.ndarray:
    """The popularity baseline's top ``k`` ids: the most clicked items first (ties by id)."""
    order = np.lexsort((item_ids, -np.asarray(counts)))[:k]
    return np.asarray(item_ids)[order]


class WorldOracle:
    """The true ranking of items for users in a simulated world (see ``recloop.simulate``).

    Within one impression the device and position terms of the click model are the same for every
    item, so the order of items by true click probability is the order of
    ``TASTE_SCALE · taste · item_vector + item_quality − 0.25 · log price``.

    Args:
        world: the simulated world.
    """

    def __init__(self, world):
        self.world = world

    @classmethod
    def from_file(cls, world_json: Path) -> WorldOracle:
        """The world described by a ``_world.json`` that ``simulate`` wrote next to its events."""
        from datetime import datetime

        from recloop.simulate import World, WorldConfig

        raw = json.loads(Path(world_json).read_text())
        raw["start"] = datetime.fromisoformat(raw["start"])
        return cls(World(WorldConfig(**raw)))

    def day_of(self, ts_us: int) -> float:
        """Fractional simulated day of a UTC time in microseconds."""
        return (ts_us / 1e6 - self.world.config.start.timestamp()) / 86400.0

    def best_items(self, users: np.ndarray, candidates: np.ndarray, day: float, k: int) -> np.ndarray:
        """Each user's ``k`` best ``candidates`` (raw item ids) by true click probability: (U, k), -1 padded.

        Candidates the world does not know (ids beyond its catalog) are never among the best.
        """
        from recloop.simulate import TASTE_SCALE

        world = self.world
        candidates = np.asarray(candidates, dtype=np.int64)
        known = (candidates >= 0) & (candidates < len(world.item_vector))
        items = candidates[known]
        item_term = world.item_quality[items] - 0.25 * np.log(world.item_price[items])  # (N,)
        tastes = world.tastes(day)[np.asarray(users, dtype=np.int64)]  # (U, k_latent)
        top = min(k, len(items))
        out = np.full((len(tastes), k), -1, dtype=np.int64)
        for start in range(0, len(tastes) if top else 0, 64):  # (64, N) scores at a time
            scores = TASTE_SCALE * tastes[start:start + 64] @ world.item_vector[items].T + item_term
            out[start:start + 64, :top] = items[np.argpartition(-scores, top - 1, axis=1)[:, :top]]
        return out
