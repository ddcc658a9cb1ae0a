"""One scored request on the embedded defaults (CPU): the online read, the feature rows, the model's score.

    python benchmarks/request_path.py [--home DIR] [--requests 200] [--candidates 50] [--json out.json]

What serving does per `/rank` request with the embedded SQLite online store, timed per request (median
and p90 over ``--requests`` panel requests of the demo's world), each fast path beside its baseline in the
same run, rounds interleaved:

- online read: ``SqliteOnline`` (Feast's SQLite tables read directly) against ``FeastOnline`` (Feast's SDK,
  ``get_online_features``), both on the same store, the same requests;
- the ranker's forward: the reference embedding bags with the bounds check of every id first (what ships)
  against the per-table masks it skips (``all_in_range`` made to answer no);
- the whole request (read, rows, score) with each reader.

Without ``--home`` it first runs the demo's bootstrap (day 0: 10,000 events, features, Feast, a trained
champion) in a temporary ``RECLOOP_HOME`` (~1.5 minutes); ``--home`` reuses a demo's home.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import datetime
from pathlib import Path

from common import machine, report, use_source_tree

use_source_tree()


def timed(calls) -> list[float]:
    """Milliseconds of each call."""
    out = []
    for call in calls:
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1000)
    return out


def summary(name: str, baseline: str, fast: list[float], slow: list[float]) -> dict:
    def p90(values: list[float]) -> float:
        return sorted(values)[int(0.9 * (len(values) - 1))]

    return {"stage": name, "baseline": baseline, "ms median": round(statistics.median(fast), 2),
            "ms p90": round(p90(fast), 2), "baseline ms median": round(statistics.median(slow), 2),
            "baseline ms p90": round(p90(slow), 2),
            "speed-up (medians)": round(statistics.median(slow) / statistics.median(fast), 2)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--home", type=Path)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--candidates", type=int, default=50)
    parser.add_argument("--json")
    args = parser.parse_args()

    from recloop import registry
    from recloop.demo import DemoConfig, run_demo
    from recloop.features.config import FeatureConfig
    from recloop.features.online import FeastOnline, RequestFeatures, SqliteOnline
    from recloop.panel import draw_panel, request_bodies
    from recloop.schema import load_spec
    from recloop.scoring import load_version, score
    from recloop.settings import Settings
    from recloop.simulate import World, WorldConfig
    from recloop_kernels import reference

    with tempfile.TemporaryDirectory() as scratch:
        config = DemoConfig(days=1, events_per_day=10_000, drift="none", twin=False, daily_full=False)  # day 0 alone
        if args.home is None:
            settings = Settings(home=Path(scratch) / "home", frame_backend="pandas")
            run_demo(settings, config)
        else:
            settings = Settings(home=args.home, frame_backend="pandas")
        world = World(WorldConfig(seed=config.seed, days=2, events_per_day=config.events_per_day)).replay(1)
        bodies = request_bodies(world, draw_panel(world, 1.5, args.requests, args.candidates, seed=1))
        spec = load_spec("synthetic")
        readers = {"sqlite": SqliteOnline(settings), "feast": FeastOnline(settings)}
        features = {name: RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), reader)
                    for name, reader in readers.items()}
        model = load_version(settings, registry.version_by_alias(settings, "champion"))
        stamp = {id(b): int(datetime.fromisoformat(b["ts"]).timestamp() * 1_000_000) for b in bodies}

        def rows(name: str, body: dict):
            return features[name].rows(body["user_id"], body["item_ids"], body["context"], stamp[id(body)])[0]

        for body in bodies[:5]:  # warm: connections, vocabularies' lookup tables
            for name in readers:
                score(model, rows(name, body))
        times: dict[str, list[float]] = {}
        for body in bodies:  # interleaved: a request at a time, every variant
            for name, reader in readers.items():
                times.setdefault(f"read {name}", []).extend(
                    timed([lambda r=reader, b=body: r.read(b["user_id"], b["item_ids"])]))
                times.setdefault(f"request {name}", []).extend(
                    timed([lambda n=name, b=body: score(model, rows(n, b))]))
            built = rows("sqlite", body)
            times.setdefault("score checked", []).extend(timed([lambda r=built: score(model, r)]))
            checked = reference.all_in_range
            reference.all_in_range = lambda *_: False  # the per-table masks, as before the bounds check
            try:
                times.setdefault("score masked", []).extend(timed([lambda r=built: score(model, r)]))
            finally:
                reference.all_in_range = checked
    table = [
        summary("online read (user + candidates)", "Feast SDK get_online_features", times["read sqlite"],
                times["read feast"]),
        summary("ranker score (reference embedding bags)", "per-table masks", times["score checked"],
                times["score masked"]),
        summary("whole request: read, rows, score", "with the Feast SDK read", times["request sqlite"],
                times["request feast"]),
    ]
    info = {**machine(), "requests": str(args.requests), "candidates": str(args.candidates)}
    report("One scored request on the embedded defaults (CPU), per request", table, info, args.json)


if __name__ == "__main__":
    main()
