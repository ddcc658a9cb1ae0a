"""Two recommenders every catalog-wide recommender must beat, learnt from a user log up to a point in time.

- **popularity**: the items most liked (label 1) in the ``recent`` events before that point, the same list for
  everyone, less what each user has already seen;
- **co-occurrence** (item-to-item): items liked by the same users as the items the user liked, scored by the
  sum over the user's newest ``history`` liked items of the cosine of their co-like counts
  (``count(i, j) / sqrt(count(i) count(j))``), best first; a user with no liked history gets the popular list.

Both take ``seen`` (user → item ids to leave out), the same rule serving applies, so they compete on the same
terms as ``/recommend``.

Example::

    popular = popularity_lists(users, items, labels, query_users, seen, k=10)
    cooc = cooccurrence_lists(users, items, labels, query_users, seen, k=10)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import scipy.sparse as sp


def popularity_lists(items: np.ndarray, labels: np.ndarray, query_users: Sequence[int],
                     seen: Mapping[int, np.ndarray], k: int) -> dict[int, list[int]]:
    """Each query user's top ``k`` of the most liked items in (``items``, ``labels``), their seen ones left out."""
    liked = np.asarray(items)[np.asarray(labels) > 0]
    ids, counts = np.unique(liked, return_counts=True)
    ranked = ids[np.lexsort((ids, -counts))]  # most liked first, ties by id
    head = ranked[: k + max((len(seen.get(u, ())) for u in query_users), default=0)]
    return {int(u): [int(i) for i in head[~np.isin(head, seen.get(u, np.zeros(0, np.int64)))][:k]]
            for u in query_users}


def cooccurrence_lists(users: np.ndarray, items: np.ndarray, labels: np.ndarray, query_users: Sequence[int],
                       seen: Mapping[int, np.ndarray], k: int, history: int = 50) -> dict[int, list[int]]:
    """Each query user's top ``k`` by item-to-item co-likes (module docstring); events in time order."""
    positive = np.asarray(labels) > 0
    users, items = np.asarray(users)[positive], np.asarray(items)[positive]
    popular = popularity_lists(items, np.ones(len(items)), query_users, seen, k)
    if len(items) == 0:
        return popular
    user_ids, u = np.unique(users, return_inverse=True)
    item_ids, i = np.unique(items, return_inverse=True)
    likes = sp.csr_matrix((np.ones(len(u)), (u, i)), shape=(len(user_ids), len(item_ids)))
    likes.data[:] = 1.0  # a user liking an item twice counts once
    counts = np.asarray(likes.sum(axis=0)).ravel()
    norm = 1.0 / np.sqrt(np.maximum(counts, 1.0))
    by_item = likes.T.tocsr()  # (I, U)
    out = {}
    row_of = {int(x): r for r, x in enumerate(user_ids)}
    for user in query_users:
        row = row_of.get(int(user))
        if row is None:
            out[int(user)] = popular[int(user)]
            continue
        mine = np.flatnonzero(u == row)[-history:]  # the user's newest liked items (events in time order)
        columns = np.unique(i[mine])
        # (1, I) co-like counts of the user's items with every item, cosine-normalized
        together = (by_item[columns] @ likes).multiply(norm[columns][:, None])  # (c, I) normalized co-likes
        scores = np.asarray(together.sum(axis=0)).ravel() * norm
        scores[columns] = -np.inf
        blocked = np.isin(item_ids, seen.get(int(user), np.zeros(0, np.int64)))
        scores[blocked] = -np.inf
        order = np.lexsort((item_ids, -scores))
        picked = [int(item_ids[j]) for j in order[:k] if np.isfinite(scores[j]) and scores[j] > 0]
        if len(picked) < k:  # too few co-liked items: the popular ones fill the list
            own = set(item_ids[columns].tolist())
            picked += [x for x in popular[int(user)] if x not in picked and x not in own][: k - len(picked)]
        out[int(user)] = picked
    return out
