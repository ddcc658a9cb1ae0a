"""The model against the simple baselines, period by period, on a replayed rating log (``recloop replay``).

Generates a MovieLens-shaped explicit-rating log (``tests/ratings_log.py``: users, items with one to three of
twenty genres, ratings thresholded at 4 stars, keys ``customer``/``product``, epoch-second timestamps), replays
its last periods through the loop (ingest → features → train → gate → drift) with the default model and
training settings, and prints, per period, the held-out AUC / log loss / NDCG@10 of the champion, the newest
incremental and full models and the baselines (base rate, user + item CTR, logistic regression), each scored
on the period before any model trained on it.

    python benchmarks/replay_ratings.py [--events 30000] [--weeks 20] [--periods 4] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / "platform"), str(ROOT / "kernels"), str(ROOT / "tests")]

from ratings_log import SPEC, write_log  # noqa: E402

from recloop import datasets  # noqa: E402
from recloop.replay import ReplayConfig, run_replay  # noqa: E402
from recloop.settings import Settings  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=30_000)
    parser.add_argument("--weeks", type=int, default=20)
    parser.add_argument("--periods", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        spec_file = root / "ratings.yaml"
        spec_file.write_text(SPEC)
        settings = Settings(home=root / "home", frame_backend="pandas")
        spec = datasets.resolve(settings, str(spec_file))
        data = write_log(
            root / "log",
            events=args.events,
            users=args.events // 25,
            items=args.events // 30,
            weeks=args.weeks,
        )
        config = ReplayConfig(
            period="week", periods=args.periods, epochs=args.epochs, device=args.device, materialize=False
        )
        summary = run_replay(settings, spec, data, config)
    names = ["model", "incremental", "full", "baseline:base_rate", "baseline:ctr", "baseline:logistic"]
    print(
        f"{args.events:,} events over {args.weeks} weeks; first model on {summary['bootstrap_rows']:,}; "
        f"{summary['seconds']} s"
    )
    print("| period | rows | " + " | ".join(f"{n} AUC / NDCG" for n in names) + " | gate | drift |")
    print("|" + " --- |" * (len(names) + 4))
    for period in summary["periods"]:
        cells = []
        for name in names:
            scores = period["scores"].get(name, {})
            auc, ndcg = scores.get("auc"), scores.get("ndcg")
            cells.append(
                "-"
                if auc is None
                else f"{auc:.4f} / {ndcg:.4f}"
                if ndcg == ndcg and ndcg is not None
                else f"{auc:.4f}"
            )
        rows = period["scores"].get("model", {}).get("rows", 0)
        print(
            f"| {period['period']} ({period['start'][:10]}) | {rows} | "
            + " | ".join(cells)
            + f" | v{period['incremental_version']} {period['gate']} | {period['drift']} |"
        )
    if args.json:
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
