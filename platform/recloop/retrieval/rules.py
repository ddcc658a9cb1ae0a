"""Filtering and ordering: the recommendation path's business rules, as pure configured functions.

::

    retrieve (~500 ids) ──filter──▶ valid candidates ──rank (the ranker)──▶ scores ──order──▶ top k

**Filter** drops, in this order, and counts what each rule dropped:

- ``excluded``: ids the request itself excludes;
- ``unavailable``: ids the catalog marks unavailable (out of stock, withdrawn);
- ``seen``: ids the user was shown or clicked within the last ``seen_hours`` (serving's journal);
  a shown-but-not-clicked item is dropped only when ``drop_shown`` (clicked ones always are);
- ``seen_history``: ids the user interacted with in the lake (``recloop.features.seen``: the feature job's
  file in serving, ``seen_items`` in the replay), counted only when ``seen`` had not dropped them already.

**Order** sorts by the ranker's score times the boost of the item's category, then walks down the list
taking an item unless its category already has ``category_cap`` items; when the capped list is shorter
than k and ``backfill`` is on, the best of the skipped items fill the rest (a user with one taste still
gets k items).

Example::

    kept, dropped = filter_candidates(ids, FilterConfig(seen_hours=24), now_s=now,
                                      recent={17: (now - 60, True)}, history=np.array([21, 30]),
                                      unavailable={4}, excluded={9})
    top = order_items(kept, scores, categories, OrderConfig(category_cap=3, boosts={5: 1.2}), k=10)
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class FilterConfig:
    """What the filter drops.

    Args:
        seen_hours: look-back of the "already seen" rule (0 turns it off).
        drop_shown: also drop items shown (not only clicked) within the look-back.
    """

    seen_hours: float = 24.0
    drop_shown: bool = True


@dataclass(frozen=True)
class Dropped:
    """How many candidates each rule removed."""

    excluded: int = 0
    unavailable: int = 0
    seen: int = 0
    seen_history: int = 0

    @property
    def total(self) -> int:
        return self.excluded + self.unavailable + self.seen + self.seen_history


def filter_candidates(candidates: np.ndarray, config: FilterConfig, *, now_s: float,
                      recent: Mapping[int, tuple[float, bool]] | None = None,
                      history: np.ndarray | None = None,
                      unavailable: Collection[int] = (), excluded: Collection[int] = ()
                      ) -> tuple[np.ndarray, Dropped]:
    """The candidates that pass every rule (order kept), and what each rule dropped.

    Args:
        candidates: (N,) raw item ids, best first; ids < 0 (index padding) are dropped uncounted.
        now_s: the request time (UTC seconds).
        recent: the user's recent items: id → (last time shown or clicked, clicked?).
        history: (n,) ids the user interacted with in the lake, dropped whatever their time (the bounds
            were applied when the history was built: ``recloop.features.seen``).
        unavailable: ids the catalog marks unavailable.
        excluded: ids the request excludes.
    """
    candidates = np.asarray(candidates, dtype=np.int64)
    candidates = candidates[candidates >= 0]
    keep = ~np.isin(candidates, np.fromiter(excluded, np.int64, len(excluded)))
    counts = {"excluded": int((~keep).sum())}
    available = ~np.isin(candidates, np.fromiter(unavailable, np.int64, len(unavailable)))
    counts["unavailable"] = int((keep & ~available).sum())
    keep &= available
    fresh = np.ones(len(candidates), dtype=bool)
    if recent and config.seen_hours > 0:
        since = now_s - config.seen_hours * 3600.0
        seen = {item for item, (when, clicked) in recent.items() if when >= since and (clicked or config.drop_shown)}
        fresh = ~np.isin(candidates, np.fromiter(seen, np.int64, len(seen)))
    counts["seen"] = int((keep & ~fresh).sum())
    keep &= fresh
    if history is not None and len(history):
        new = ~np.isin(candidates, np.asarray(history, dtype=np.int64))
        counts["seen_history"] = int((keep & ~new).sum())
        keep &= new
    return candidates[keep], Dropped(**counts)


@dataclass(frozen=True)
class OrderConfig:
    """How the ranked list is ordered.

    Args:
        category_cap: most items of one category in the answer (None: no cap).
        boosts: category → multiplier of the ranker's score (a promotion above 1, a demotion below).
        backfill: fill up to k with capped-out items when the cap leaves fewer than k.
    """

    category_cap: int | None = 3
    boosts: Mapping[int, float] = field(default_factory=dict)
    backfill: bool = True

    def __post_init__(self) -> None:
        if self.category_cap is not None and self.category_cap < 1:
            raise ValueError("category_cap must be at least 1 (or None for no cap)")
        if any(b < 0 for b in self.boosts.values()):
            raise ValueError("boosts multiply scores and must not be negative")


def order_items(items: np.ndarray, scores: np.ndarray, categories: np.ndarray, config: OrderConfig, k: int
                ) -> tuple[np.ndarray, np.ndarray]:
    """The top ``k`` items by boosted score under the category cap: (ids, boosted scores), best first.

    Args:
        items, scores, categories: (N,) each; scores are the ranker's (higher is better).
    """
    items, boosted = np.asarray(items), boosted_scores(scores, categories, config)
    order = np.lexsort((items, -boosted))  # best first; ties by id, so the answer is deterministic
    chosen = capped(order, categories, config, k)
    return items[chosen], boosted[chosen]


def boosted_scores(scores: np.ndarray, categories: np.ndarray, config: OrderConfig) -> np.ndarray:
    """The ranker's scores times their category's boost."""
    boost = np.array([config.boosts.get(int(c), 1.0) for c in np.asarray(categories)], dtype=np.float64)
    return np.asarray(scores, dtype=np.float64) * boost


def capped(order, categories: np.ndarray, config: OrderConfig, k: int) -> np.ndarray:
    """The first ``k`` of ``order`` (positions, best first) under the per-category cap; capped-out ones fill
    what is left up to ``k`` when ``config.backfill``."""
    order = np.asarray(order, dtype=np.int64)
    if config.category_cap is None:
        return order[:k]
    categories = np.asarray(categories)
    taken, skipped, per_category = [], [], {}
    for position in order:
        category = int(categories[position])
        if per_category.get(category, 0) < config.category_cap:
            per_category[category] = per_category.get(category, 0) + 1
            taken.append(position)
            if len(taken) == k:
                break
        else:
            skipped.append(position)
    if len(taken) < k and config.backfill:
        taken += skipped[:k - len(taken)]
    return np.asarray(taken, dtype=np.int64)


def order_interleaved(items: np.ndarray, champion_scores: np.ndarray, challenger_scores: np.ndarray,
                      categories: np.ndarray, config: OrderConfig, k: int, rng: np.random.Generator
                      ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The ranker's interleaved canary under the same rules as ``order_items``: each ranker orders the items
    by its boosted scores, team-draft interleaving (``evidence.interleaving.team_draft``) merges the two
    orders, and the category cap walks the merged list (an item the cap leaves out goes whichever team
    drafted it, so the rule favours neither).

    Returns positions into ``items`` (best first), each one's team (``interleaving.CHAMPION`` or
    ``CHALLENGER``) and its boosted score by its own team's ranker.
    """
    from recloop.evidence.interleaving import CHALLENGER, team_draft

    items = np.asarray(items)
    boosted = [boosted_scores(s, categories, config) for s in (champion_scores, challenger_scores)]
    merged, teams = team_draft(*(np.lexsort((items, -b)).tolist() for b in boosted), len(items), rng)
    team_of = dict(zip(merged, teams, strict=True))
    chosen = capped(merged, categories, config, k)
    chosen_teams = np.array([team_of[int(p)] for p in chosen], dtype=np.int64)
    return chosen, chosen_teams, np.where(chosen_teams == CHALLENGER, boosted[1][chosen], boosted[0][chosen])

