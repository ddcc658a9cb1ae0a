"""A small, real-shaped explicit-rating log (MovieLens-like): users rate items with one to three of twenty
genres, a rating of 4 or 5 counts as liked; other key names than the synthetic world's (``customer``,
``product``), epoch-second timestamps and a release year written as ``1995.0`` (as pandas exports it).

Whether a user likes an item follows their taste for its genres, the item's quality and their own mood:
a model that learns user × genre interactions can beat the user + item CTR ranking, which cannot.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPEC = """\
# A user's own rating log (tests/ratings_log.py writes one like it).
name: ratings
description: Explicit ratings, thresholded at 4 stars, of items with several genres.
integral_floats: true          # the export writes whole numbers as 1995.0
events: chosen                 # every row is an item the user rated (not one they were shown)
columns:
  - {name: rating_id, role: event_id, dtype: string}
  - {name: rated_at, role: timestamp, dtype: timestamp, format: epoch_s}
  - {name: customer, role: user_key, dtype: int64, min: 0}
  - {name: product, role: item_key, dtype: int64, min: 0}
  - {name: liked, role: label, dtype: int8, allowed: [0, 1], description: "rating >= 4"}
  - {name: genres, role: multi_hot, dtype: list<int64>, min: 0, max: 19, separator: "|"}
  - {name: year, role: numeric, dtype: int64, min: 1900, max: 2030}
"""

START = 1_420_070_400  # 2015-01-01T00:00:00Z


def spec_for(user: str, item: str) -> str:
    """The spec with other names for the user and item keys (``userId``/``movieId``, as MovieLens writes them)."""
    return SPEC.replace("name: customer,", f"name: {user},").replace("name: product,", f"name: {item},")


def write_log(
    folder: Path,
    events: int = 6000,
    users: int = 300,
    items: int = 400,
    weeks: int = 8,
    seed: int = 0,
    files: int = 2,
    keys: tuple[str, str] = ("customer", "product"),
    start: int = START,
    name: str = "ratings",
    id_prefix: str = "r",
) -> Path:
    """Write the log as ``files`` CSV files under ``folder`` (time-ordered, split by time); returns the folder."""
    rng = np.random.default_rng(seed)
    taste = rng.normal(0, 1.2, (users, 20))
    item_genres = [rng.choice(20, rng.integers(1, 4), replace=False) for _ in range(items)]
    quality = rng.normal(0, 0.6, items)
    year = rng.integers(1960, 2015, items)
    popularity = rng.zipf(1.6, items).astype(float)
    popularity /= popularity.sum()
    activity = rng.gamma(0.8, 1.0, users)
    activity /= activity.sum()
    ts = np.sort(start + rng.uniform(0, weeks * 7 * 86400, events)).astype(np.int64)
    who = rng.choice(users, events, p=activity)
    what = rng.choice(items, events, p=popularity)
    affinity = np.array([taste[u, item_genres[i]].mean() for u, i in zip(who, what, strict=True)])
    logit = 1.4 * affinity + quality[what] + rng.normal(0, 0.5, events)
    liked = (rng.random(events) < 1 / (1 + np.exp(-logit))).astype(int)
    folder.mkdir(parents=True, exist_ok=True)
    header = f"rating_id,rated_at,{keys[0]},{keys[1]},liked,genres,year\n"
    bounds = np.linspace(0, events, files + 1).astype(int)
    for part, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        lines = [
            f"{id_prefix}{n},{ts[n]},{who[n]},{what[n]},{liked[n]},{'|'.join(map(str, item_genres[what[n]]))},"
            f"{year[what[n]]}.0\n"
            for n in range(lo, hi)
        ]
        (folder / f"{name}-{part}.csv").write_text(header + "".join(lines))
    return folder
