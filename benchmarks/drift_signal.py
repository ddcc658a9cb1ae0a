"""How visible a drift scenario is in the world's own events, before any model is trained on them.

    python benchmarks/drift_signal.py [--seeds 5] [--events-per-day 10000] [--days 5] [--json out.json]

Issue 36 asks the loop to act on gradual drift (user tastes rotating a quarter turn over five days) within
two days. The loop's models barely learn those tastes at 10,000 events a day (benchmarks/RESULTS.md, "Gradual
drift as the loop's models see it"), so this measures the drift where no model stands between it and the
figure: per day, how much more a clicked item shares the categories of the user's recent clicks (the event's
``history``) than a shown item does (the "history lift"). Tastes that rotate make users click outside what they
clicked before, so the lift falls; on a world without drift it moves only by chance. Both worlds of a seed
are identical until the drift day (days count from 0), so the table gives, per day after it, gradual − none
paired by seed (t interval over seeds) beside the day-to-day spread of ``none`` itself.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
from common import machine, use_source_tree

use_source_tree()

from recloop.simulate import World, WorldConfig  # noqa: E402


def history_lift(world: World, day: int) -> tuple[float, int]:
    """(clicked − shown mean share of the history's items in the event item's category, clicks that day)."""
    clicked, shown = [], []
    categories = world.item_category
    for hour in range(24):
        events = world.hour_events(day, hour)
        items = events["item_id"].to_numpy()
        labels = events["label"].to_numpy()
        for item, label, history in zip(items, labels, events["history"].to_pylist(), strict=True):
            if history:
                share = float(np.mean(categories[np.asarray(history)] == categories[item]))
                (clicked if label else shown).append(share)
    return float(np.mean(clicked) - np.mean(shown)), len(clicked)


def main() -> None:
    from scipy import stats

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument("--events-per-day", type=int, default=10_000)
    parser.add_argument("--days", type=int, default=5)
    parser.add_argument("--drift-day", type=int, default=2)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    lifts: dict[str, list[list[float]]] = {"none": [], "gradual": []}
    for seed in range(args.seeds):
        for drift in lifts:
            world = World(WorldConfig(seed=seed, days=args.days, events_per_day=args.events_per_day, drift=drift,
                                      drift_day=args.drift_day))
            lifts[drift].append([history_lift(world, day)[0] for day in range(args.days)])
        print(f"seed {seed}: none {np.round(lifts['none'][-1], 3).tolist()}, "
              f"gradual {np.round(lifts['gradual'][-1], 3).tolist()}", flush=True)
    none, gradual = np.asarray(lifts["none"]), np.asarray(lifts["gradual"])
    rows = []
    spread = np.diff(none, axis=1).std(ddof=1)  # how much a day's lift moves from the day before with no drift
    for day in range(args.drift_day, args.days):
        gap = gradual[:, day] - none[:, day]
        half = stats.t.ppf(0.975, len(gap) - 1) * gap.std(ddof=1) / np.sqrt(len(gap)) if len(gap) > 1 else np.nan
        drop = gradual[:, day] - gradual[:, args.drift_day - 1]  # what a monitor sees: against the day before drift
        rows.append({"day": day, "gradual − none": float(gap.mean()), "low": float(gap.mean() - half),
                     "high": float(gap.mean() + half), "gradual: day − pre-drift day": float(drop.mean()),
                     "none: day-to-day spread (sd)": float(spread)})
        print(f"day {day}: gradual − none {gap.mean():+.3f} [{gap.mean() - half:+.3f}, {gap.mean() + half:+.3f}]; "
              f"gradual against its day {args.drift_day - 1} {drop.mean():+.3f} (per seed "
              f"{np.round(drop, 3).tolist()}); none's day-to-day sd {spread:.3f}", flush=True)
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"machine": machine(), "arguments": vars(args), "none": none.tolist(),
                       "gradual": gradual.tolist(), "days": rows}, out, indent=2)


if __name__ == "__main__":
    main()
