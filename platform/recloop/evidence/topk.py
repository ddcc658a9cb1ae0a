"""Top-k quality of recommendation lists against what each user went on to like, with paired intervals.

One query per user: the list recommended at a point in time, and the items the user liked after it (and had
not interacted with before it: an item they already had is not a discovery, and the seen filter removes it
from every list). Binary relevance:

- ``recall@k``: hits in the top k over ``min(relevant, k)`` (a user with 30 liked items can reach 1.0);
- ``ndcg@k``: DCG of the hits over the ideal DCG of ``min(relevant, k)`` hits.

Two recommenders on the same users compare per user (``paired_difference``): the mean difference with a
95 % bootstrap interval over users.

Example::

    recall, ndcg = per_user(lists, relevant, k=10)            # (U,) each, users in ``relevant``'s order
    low, high = paired_difference(recall_a, recall_b)[1:]
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np


def per_user(lists: Mapping[int, Sequence[int]], relevant: Mapping[int, Sequence[int]], k: int
             ) -> tuple[np.ndarray, np.ndarray]:
    """Recall@k and NDCG@k of each user in ``relevant`` (a user with no list scores 0)."""
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    recall, ndcg = np.zeros(len(relevant)), np.zeros(len(relevant))
    for i, (user, liked) in enumerate(relevant.items()):
        liked = set(int(x) for x in liked)
        if not liked:
            continue
        top = [int(x) for x in list(lists.get(user, ()))[:k]]
        hits = np.array([item in liked for item in top], dtype=bool)
        ideal = min(len(liked), k)
        recall[i] = hits.sum() / ideal
        ndcg[i] = float(discounts[: len(hits)][hits].sum() / discounts[:ideal].sum())
    return recall, ndcg


def paired_difference(a: np.ndarray, b: np.ndarray, resamples: int = 2000, seed: int = 0
                      ) -> tuple[float, float, float]:
    """Mean of ``a - b`` (per user, paired) and its 95 % percentile-bootstrap interval over users."""
    difference = np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
    if len(difference) == 0:
        return float("nan"), float("nan"), float("nan")
    rng = np.random.default_rng(seed)
    means = difference[rng.integers(0, len(difference), (resamples, len(difference)))].mean(axis=1)
    return float(difference.mean()), float(np.quantile(means, 0.025)), float(np.quantile(means, 0.975))
