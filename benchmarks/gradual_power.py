"""How much a one-day-old model decays under the `gradual` world's drift: the best case for any monitor check.

The loop retrains every day, so its champion always knows the tastes of the day before. Whether a monitor can
see gradual drift through that champion is a question of signal and noise, and the world answers it without
training anything: its ground truth ``click_probability`` is the best model there is. For each day after the
drift starts this script scores the day's impressions with

- the **fresh oracle** (tastes of that moment: what nobody has),
- the **one-day-old oracle** (tastes of 24 hours earlier: the best a daily-retrained champion can know),
- the **pre-drift oracle** (tastes before the drift: the best a champion frozen since then can know),

and measures each stale oracle's log loss **decay**: its log loss on the day against the same oracle's log loss
on its own day, when it was fresh (a check has no fresh oracle to pair with; it can only compare a model with
itself across windows). z is the decay over its user-cluster standard error (both windows). On the `none`
world the same statistic is pure noise; a check that fires at z > ``--z`` (one-sided; 2.05 is 2 % false alarms)
would detect gradual drift on a day with the probability printed. Real champions are worse than the oracle in
ways that add noise, not signal, so these rates are upper bounds for a decay check at that traffic.

    python benchmarks/gradual_power.py --seeds 20 --events-per-day 10000,60000 --out results/gradual-power.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "platform")]

from recloop.evidence.sequential import cluster_mean  # noqa: E402 - the monitor's concept check's estimator
from recloop.simulate import DEVICES, World, WorldConfig  # noqa: E402

EPS = 1e-7


def day_rows(world: World, day: int) -> dict[str, np.ndarray]:
    """The day's impressions: users, items, device index, position, hour fraction, label, true p."""
    parts: dict[str, list] = {k: [] for k in ("users", "items", "device", "position", "when", "label")}
    for hour in range(24):
        table = world.hour_events(day, hour)
        parts["users"].append(table["user_id"].to_numpy())
        parts["items"].append(table["item_id"].to_numpy())
        device = np.asarray(table["device"].to_pylist())
        parts["device"].append(np.array([DEVICES.index(d) for d in device], dtype=np.int64))
        parts["position"].append(table["position"].to_numpy())
        parts["when"].append(np.full(table.num_rows, day + hour / 24.0))
        parts["label"].append(table["label"].to_numpy().astype(np.float64))
    return {k: np.concatenate(v) for k, v in parts.items()}


def log_loss(p: np.ndarray, y: np.ndarray) -> np.ndarray:
    p = np.clip(p, EPS, 1 - EPS)
    return -(y * np.log(p) + (1 - y) * np.log(1 - p))


def score(world: World, rows: dict, shift_days: float | None, pre_drift: bool) -> np.ndarray:
    """Per-row log loss of an oracle whose tastes are ``shift_days`` old (or before the drift)."""
    when = np.full(len(rows["users"]), world.config.drift_day - 1.0) if pre_drift else rows["when"] - shift_days
    p = np.empty(len(rows["users"]))
    for value in np.unique(when):
        mask = when == value
        p[mask] = world.click_probability(value, rows["users"][mask], rows["items"][mask], rows["device"][mask],
                                          rows["position"][mask])
    return log_loss(p, rows["label"])


def decay_z(now: tuple[np.ndarray, np.ndarray], then: tuple[np.ndarray, np.ndarray]) -> tuple[float, float]:
    """(decay, z): mean log loss now − then, over its user-cluster standard error."""
    mean_now, var_now = cluster_mean(*now)
    mean_then, var_then = cluster_mean(*then)
    decay = mean_now - mean_then
    return decay, decay / np.sqrt(var_now + var_then)


def run(seed: int, scenario: str, events: int, drift_day: int, checks: int) -> list[dict]:
    world = World(WorldConfig(seed=seed, days=drift_day + checks, events_per_day=events, drift=scenario,
                              drift_day=drift_day))
    days = {day: day_rows(world, day) for day in range(drift_day + checks)}
    out = []
    for day in range(drift_day, drift_day + checks):
        rows, before = days[day], days[day - 1]
        # one-day-old oracle: on day d with tastes of d−1; "when it was fresh": on day d−1 with tastes of d−1
        stale = decay_z((score(world, rows, 1.0, False), rows["users"]),
                        (score(world, before, 0.0, False), before["users"]))
        # pre-drift oracle: on day d, against itself on the day before the drift
        first = days[drift_day - 1]
        frozen = decay_z((score(world, rows, None, True), rows["users"]),
                         (score(world, first, 0.0, False), first["users"]))
        out.append({"seed": seed, "scenario": scenario, "events_per_day": events, "day": day,
                    "days_since_drift": day - drift_day,
                    "one_day_old": {"decay": stale[0], "z": stale[1]},
                    "pre_drift": {"decay": frozen[0], "z": frozen[1]}})
    return out


def summarize(rows: list[dict], z: float) -> list[dict]:
    table = []
    for events in sorted({r["events_per_day"] for r in rows}):
        for model in ("one_day_old", "pre_drift"):
            for since in sorted({r["days_since_drift"] for r in rows}):
                pick = [r for r in rows if r["events_per_day"] == events and r["days_since_drift"] == since]
                entry = {"events_per_day": events, "model": model, "days_since_drift": since}
                for scenario in ("none", "gradual"):
                    cells = [r[model] for r in pick if r["scenario"] == scenario]
                    entry[scenario] = {"fires": sum(c["z"] > z for c in cells), "of": len(cells),
                                       "mean_decay": float(np.mean([c["decay"] for c in cells])),
                                       "mean_z": float(np.mean([c["z"] for c in cells]))}
                table.append(entry)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--events-per-day", default="10000,60000")
    parser.add_argument("--drift-day", type=int, default=2)
    parser.add_argument("--checks", type=int, default=2, help="days after the drift starts (within 2 days: 2)")
    parser.add_argument("--z", type=float, default=2.054, help="one-sided threshold (2.054: 2 %% false alarms)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    rows = []
    for events in (int(v) for v in args.events_per_day.split(",")):
        for seed in range(args.seeds):
            for scenario in ("none", "gradual"):
                rows += run(1000 + seed, scenario, events, args.drift_day, args.checks)
    table = summarize(rows, args.z)
    print(f"| events/day | oracle | days since drift | gradual: fires (z > {args.z}) | mean decay | mean z "
          f"| none: fires | mean z |")
    print("|---|---|---|---|---|---|---|---|")
    for e in table:
        g, n = e["gradual"], e["none"]
        print(f"| {e['events_per_day']:,} | {e['model']} | {e['days_since_drift']} | {g['fires']} of {g['of']} "
              f"| {g['mean_decay']:+.4f} | {g['mean_z']:.2f} | {n['fires']} of {n['of']} | {n['mean_z']:.2f} |")
    if args.out:
        args.out.write_text(json.dumps({"config": vars(args) | {"out": str(args.out)}, "table": table,
                                        "rows": rows}, indent=1, default=str))


if __name__ == "__main__":
    main()
