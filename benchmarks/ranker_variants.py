"""Full training runs of the ranker under model/rate variants on featurized homes, against the logistic regression.

    python benchmarks/ranker_variants.py HOME [HOME ...] [--seeds 3] [--json out.json]

Each ``HOME`` is a home whose features are built (``recloop ingest`` + ``recloop features``, or a replay's home
at its end). Per home, variant and seed: ``recloop.train.train`` in full mode on the CPU (the trainer's own
held-out rows), its held-out AUC and log loss, and the logistic regression's on the same rows (the trainer's
baselines). Variants (issue 37: whether the wide part and the layers' rate should be the default):

- ``base``: no wide part, layers at 0.005 (the defaults before issue 37's second change);
- ``wide``: the wide part, layers at 0.005;
- ``fast``: no wide part, layers at 0.02;
- ``wide10``: the wide part, layers at 0.01;
- ``shipped``: the defaults as they are (the wide part, a full run's layers at 0.02);
- ``plain`` / ``averaged``: the defaults ending on their last weights, or on the mean of the weights at the
  early-stopping checks (``TrainConfig.average_checks``, the default since 2026-11-29; a one-epoch run has a
  single check, so nothing to average);
- ``plain3`` / ``averaged3``: the same two with three epochs, as the demo's and the flows' full retrains;
- ``dim4`` … ``dim32``: the defaults with every table this wide (issue 37: the embedding width by data size);
- ``no_id_dropout`` / ``no_id_dropout2`` / ``shipped2``: the defaults without dropping the key ids of training
  rows (``TrainConfig.id_dropout`` 0; by default the rate is measured on the window), and both at two epochs (the
  flows' full retrains).

The table is each variant's mean and its difference from ``--reference`` (``base`` unless told) per seed.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import use_source_tree

use_source_tree()

VARIANTS = {
    "base": ({"wide": False}, {"lr": 5e-3}),
    "wide": ({"wide": True}, {"lr": 5e-3}),
    "fast": ({"wide": False}, {"lr": 2e-2}),
    "wide10": ({"wide": True}, {"lr": 1e-2}),
    "shipped": ({}, {}),
    "plain": ({}, {"average_checks": False}),
    "averaged": ({}, {"average_checks": True}),
    "plain3": ({}, {"epochs": 3, "average_checks": False}),
    "averaged3": ({}, {"epochs": 3, "average_checks": True}),
    "dim4": ({"embedding_dim": 4}, {}),
    "dim8": ({"embedding_dim": 8}, {}),
    "dim16": ({"embedding_dim": 16}, {}),
    "dim32": ({"embedding_dim": 32}, {}),
    "no_id_dropout": ({}, {"id_dropout": 0.0}),
    "no_id_dropout2": ({}, {"id_dropout": 0.0, "epochs": 2}),
    "shipped2": ({}, {"epochs": 2}),
}


def run(home: Path, variant: str, seed: int) -> dict:
    from recloop.model import ModelConfig
    from recloop.settings import Settings
    from recloop.train import TrainConfig, train

    model, rates = VARIANTS[variant]
    summary = train(Settings(home=home), TrainConfig(mode="full", device="cpu", seed=seed,
                                                     model=ModelConfig(**model), **rates))
    logistic = summary.baselines.get("logistic", {})
    return {"home": str(home), "variant": variant, "seed": seed, "auc": summary.auc, "logloss": summary.logloss,
            "logistic_auc": logistic.get("auc"), "logistic_logloss": logistic.get("logloss"),
            "validation_rows": summary.validation_rows, "steps": summary.steps, "id_dropout": summary.id_dropout}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("homes", type=Path, nargs="+")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--reference", default="base", help="the variant the others are compared with, per seed")
    parser.add_argument("--json")
    args = parser.parse_args()
    runs = [run(home, variant, seed) for home in args.homes for seed in range(args.seeds)
            for variant in args.variants.split(",")]
    for home in args.homes:
        mine = [r for r in runs if r["home"] == str(home)]
        base = {r["seed"]: r for r in mine if r["variant"] == args.reference}
        print(f"{home}: logistic {mine[0]['logistic_auc']:.4f} / {mine[0]['logistic_logloss']:.4f}, "
              f"{mine[0]['validation_rows']} held-out rows")
        for variant in args.variants.split(","):
            found = [r for r in mine if r["variant"] == variant]
            gains = [r["auc"] - base[r["seed"]]["auc"] for r in found if r["seed"] in base]
            print(f"  {variant:8s} AUC {np.mean([r['auc'] for r in found]):.4f} log loss "
                  f"{np.mean([r['logloss'] for r in found]):.4f}"
                  + (f"  − {args.reference} {np.mean(gains):+.4f} ({' '.join(f'{g:+.3f}' for g in gains)})" if gains else ""))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=2) + "\n")


if __name__ == "__main__":
    main()
