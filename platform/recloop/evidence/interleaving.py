"""Team-draft interleaving (Radlinski et al. 2008): one list from two rankings, each shown item credited
to the ranking (team) that put it there.

Every interleaved request compares champion and challenger on the same user, at the same moment, with
the same candidates, so the heavy-user imbalance of an A/B split by user cannot favour either side:
the comparison is paired per request. Teams take turns; the team with fewer picks goes next, a coin
decides ties (so neither ranking owns the top slot), and each adds its best-ranked item not yet in the
list. A click is credited to the team of the clicked item.

Example::

    items, teams = team_draft(champion_order, challenger_order, k=10, rng=rng)
    champion_clicks, challenger_clicks = credit(teams, clicked)   # per request
"""

from __future__ import annotations

import numpy as np

CHAMPION, CHALLENGER = 0, 1
TEAM_NAMES = ("champion", "challenger")


def team_draft(a, b, k: int, rng: np.random.Generator) -> tuple[list, list[int]]:
    """Interleave rankings ``a`` (team 0) and ``b`` (team 1), best first, into at most ``k`` items.

    Returns the interleaved items and each one's team. Items only one ranking holds are fine; the list
    stops when both rankings are exhausted.
    """
    items: list = []
    teams: list[int] = []
    chosen: set = set()
    picks = [0, 0]
    cursors = [0, 0]
    rankings = (list(a), list(b))
    while len(items) < k:
        exhausted = [cursors[t] >= len(rankings[t]) for t in (0, 1)]
        # advance past items already taken
        for t in (0, 1):
            while cursors[t] < len(rankings[t]) and rankings[t][cursors[t]] in chosen:
                cursors[t] += 1
            exhausted[t] = cursors[t] >= len(rankings[t])
        if all(exhausted):
            break
        if exhausted[0] or exhausted[1]:
            team = 1 if exhausted[0] else 0
        elif picks[0] != picks[1]:
            team = 0 if picks[0] < picks[1] else 1
        else:
            team = int(rng.random() < 0.5)
        item = rankings[team][cursors[team]]
        items.append(item)
        teams.append(team)
        chosen.add(item)
        picks[team] += 1
    return items, teams


def credit(teams, clicked) -> tuple[int, int]:
    """Clicks credited to each team in one request: ``clicked[i]`` says whether shown item ``i`` was clicked."""
    teams = np.asarray(teams)
    clicked = np.asarray(clicked, dtype=bool)
    if teams.shape != clicked.shape:
        raise ValueError(f"{len(teams)} teams for {len(clicked)} shown items")
    return int((clicked & (teams == CHAMPION)).sum()), int((clicked & (teams == CHALLENGER)).sum())


def team_draft_batch(
    a: np.ndarray, b: np.ndarray, k: int, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``team_draft`` over many requests of equal candidate sets at once (the simulator's canaries).

    ``a`` and ``b``: (requests, candidates) arrays of candidate indices, best first. Returns (requests, k)
    arrays of the chosen candidate index and its team. Equivalent to ``team_draft`` per row.
    """
    n, m = a.shape
    k = min(k, m)
    taken = np.zeros((n, m), dtype=bool)
    rows = np.arange(n)
    # rank of each candidate in each ranking, to find the best untaken one fast
    items = np.empty((n, k), dtype=np.int64)
    teams = np.empty((n, k), dtype=np.int64)
    picks = np.zeros((n, 2), dtype=np.int64)
    cursors = np.zeros((n, 2), dtype=np.int64)
    orders = (a, b)
    for slot in range(k):
        for t in (0, 1):
            while True:
                at = np.minimum(cursors[:, t], m - 1)
                stuck = taken[rows, orders[t][rows, at]] & (cursors[:, t] < m)
                if not stuck.any():
                    break
                cursors[stuck, t] += 1
        coin = rng.random(n) < 0.5
        team = np.where(
            picks[:, 0] == picks[:, 1], coin.astype(np.int64), (picks[:, 0] > picks[:, 1]).astype(np.int64)
        )
        chosen = np.where(team == 0, a[rows, cursors[:, 0]], b[rows, cursors[:, 1]])
        items[:, slot], teams[:, slot] = chosen, team
        taken[rows, chosen] = True
        picks[rows, team] += 1
    return items, teams
