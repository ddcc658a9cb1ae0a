"""Incremental training vs a full retrain: quality on the same held-out hours, and cost.

    python benchmarks/incremental.py [--days 4] [--events-per-day 100000] [--json out.json]

A world of N+1 days: features and a full model for days 1..N; then day N+1's features, and
(a) an incremental run warm-started from that model over day N+1 only, vs (b) a full retrain over days
1..N+1 from scratch. Both are scored on the same newest held-out hours (never trained on).
Target (training issue): incremental AUC within 0.005 of the full retrain at <= 1/5 of its cost.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
from common import machine, report

from recloop.features.config import FeatureConfig
from recloop.features.job import build_features
from recloop.ingest import ingest
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate
from recloop.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--days", type=int, default=6, help="N: days before the incremental day")
    parser.add_argument("--events-per-day", type=int, default=100_000)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--seeds", type=int, default=3, help="independent (base, incremental, full) triples")
    parser.add_argument("--replay", type=float, default=0.0, help="older hours replayed per new hour")
    parser.add_argument("--decay", type=float, default=1.0, help="embedding optimizer state decay at warm start")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    spec = load_spec("synthetic")
    work = Path(tempfile.mkdtemp(prefix="recloop-bench-incremental-"))
    seeds = list(range(args.seeds))
    try:
        start = datetime(2026, 1, 1, tzinfo=UTC)
        simulate(WorldConfig(seed=0, days=args.days + 1, events_per_day=args.events_per_day), work / "landing")
        settings = Settings(home=work / "home", frame_backend="pandas")
        ingest(work / "landing", spec, settings, now=datetime(2026, 6, 1, tzinfo=UTC))
        features = FeatureConfig.for_spec(spec)
        build_features(settings, spec, features, end=start + timedelta(days=args.days))
        common = dict(days=args.days + 1, epochs=args.epochs, batch_size=args.batch_size, validation_hours=6,
                      checkpoint_every=10_000)
        bases = [train(settings, TrainConfig(mode="full", seed=s, **common)) for s in seeds]
        build_features(settings, spec, features)  # day N+1
        incrementals = [train(settings, TrainConfig(mode="incremental", replay_fraction=args.replay,
                                                    warm_state_decay=args.decay, seed=s, **common),
                              warm_start=Path(base.checkpoint)) for s, base in zip(seeds, bases, strict=True)]
        fulls = [train(settings, TrainConfig(mode="full", seed=s, **common)) for s in seeds]
        assert all(i.validation_hours == f.validation_hours for i, f in zip(incrementals, fulls, strict=True))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def summarize(name: str, runs: list) -> dict:
        aucs = np.array([r.auc for r in runs])
        return {"run": name, "samples": runs[0].samples, "train_s": f"{np.mean([r.seconds for r in runs]):.1f}",
                "auc (mean ± sd)": f"{aucs.mean():.4f} ± {aucs.std():.4f}", "oracle_auc": f"{runs[0].oracle_auc:.4f}",
                "calibration": f"{np.mean([r.calibration for r in runs]):.3f}"}

    label = f"incremental, day N+1 (+{args.replay:.0%} replay)" if args.replay else "incremental, day N+1"
    rows = [summarize("full, days 1..N (the warm start)", bases), summarize(label, incrementals),
            summarize("full retrain, days 1..N+1", fulls)]
    gaps = np.array([i.auc - f.auc for i, f in zip(incrementals, fulls, strict=True)])
    cost = np.mean([i.seconds for i in incrementals]) / np.mean([f.seconds for f in fulls])
    rows.append({"run": f"incremental - full retrain ({args.seeds} seeds)",
                 "samples": f"{incrementals[0].samples / fulls[0].samples:.2f}x", "train_s": f"{cost:.2f}x cost",
                 "auc (mean ± sd)": f"{gaps.mean():+.4f} ± {gaps.std():.4f}", "oracle_auc": "-",
                 "calibration": "target: >= -0.005 at <= 0.20x"})
    report(f"incremental vs full retrain ({args.days}+1 days x {args.events_per_day} events)", rows, machine(),
           args.json_path)


if __name__ == "__main__":
    main()
