"""How far apart two full retrains on the same rows land on the evaluation panel: the loop grid's reference noise.

    python benchmarks/reference_noise.py [--scenarios none,sudden] [--worlds 6] [--seeds 5] [--average-checks]
        [--json out.json]

The loop grid (``loop.py``) judges the loop's champion against "the daily full retrain": one model trained
from scratch on days 0..D with the trainer's default seed. A trained model is one draw: per world (``--days`` D,
``--events-per-day`` as the shipped loop's, the scenario's drift from ``--drift-day``), this trains ``--seeds``
full retrains on the same days 0..D, differing only in ``TrainConfig.seed`` (the demo's batch size and epochs),
and scores each on the next day's evaluation panel (the world's truth, as the loop's "loop − daily full"). Per
scenario: the spread of one world's retrains (sd over seeds; its mean over worlds with a t interval), the range,
and the sd of the difference of two single retrains (what "loop − daily full" carries from training noise alone
when both sides are one draw each), beside the AUC's sd on the trainer's own held-out hours, and the panel of
the seeds' ensemble (their click probabilities averaged: how much of the spread is lost quality, not only noise).
``--average-checks``: each seed is also trained with ``TrainConfig.average_checks`` (the mean of the weights at
its early-stopping checks), scored beside its plain twin; averaged − plain is paired by world.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from datetime import timedelta
from pathlib import Path
from types import SimpleNamespace

import numpy as np
from common import machine, report
from incremental import START, _cold_baselines, _landed_world, _world_interval

from recloop import pipeline
from recloop.train import TrainConfig, train


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scenarios", default="none,sudden")
    parser.add_argument("--worlds", type=int, default=6)
    parser.add_argument("--first-world", type=int, default=0)
    parser.add_argument("--seeds", type=int, default=5, help="full retrains per world, TrainConfig.seed 0..N-1")
    parser.add_argument("--days", type=int, default=3, help="D: the retrains train on days 0..D")
    parser.add_argument("--drift-day", type=int, default=2)
    parser.add_argument("--events-per-day", type=int, default=10_000)
    parser.add_argument("--epochs", type=int, default=3, help="as the demo's full_epochs")
    parser.add_argument("--batch-size", type=int, default=312, help="as the demo's at 10,000 events a day")
    parser.add_argument("--panel-requests", type=int, default=2000)
    parser.add_argument("--average-checks", action="store_true",
                        help="each seed also with TrainConfig.average_checks, paired with its plain run")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    worlds: list[dict] = []
    for scenario in args.scenarios.split(","):
        for world_seed in range(args.first_world, args.first_world + args.worlds):
            worlds.append(one_world(scenario, world_seed, args))
            print(json.dumps(worlds[-1]), flush=True)
    rows = []
    for scenario in dict.fromkeys(w["scenario"] for w in worlds):
        mine = [w for w in worlds if w["scenario"] == scenario]
        sd_mean, sd_low, sd_high = _world_interval([{"world": w["world"], "sd": w["panel_sd"]} for w in mine], "sd")
        rows.append({
            "scenario": scenario,
            "worlds x seeds": f"{len(mine)} x {args.seeds}",
            "panel of one retrain, mean": f"{np.mean([np.mean(list(w['panel'].values())) for w in mine]):.4f}",
            "sd over seeds in a world [t 95 % over worlds]": f"{sd_mean:.4f} [{sd_low:.4f}, {sd_high:.4f}]",
            "range in a world, mean (max)": f"{np.mean([w['panel_range'] for w in mine]):.4f} "
                                            f"({max(w['panel_range'] for w in mine):.4f})",
            "sd of one retrain − another": f"{np.sqrt(2 * np.mean([w['panel_sd'] ** 2 for w in mine])):.4f}",
            "held-out AUC sd over seeds": f"{np.mean([w['auc_sd'] for w in mine]):.4f}",
            "ensemble of the seeds − one retrain [t 95 %]": _paired(mine, "ensemble_gain"),
        })
        if args.average_checks:
            rows[-1]["averaged − plain, panel [t 95 %]"] = _paired(mine, "averaged_gain")
            rows[-1]["averaged − plain, held-out AUC [t 95 %]"] = _paired(mine, "averaged_auc_gain")
            rows[-1]["sd over seeds, averaged"] = f"{np.mean([w['averaged_panel_sd'] for w in mine]):.4f}"
    report(f"full retrains on the same rows, seeds 0..{args.seeds - 1}: their spread on the next day's panel "
           f"({args.days + 1} days x {args.events_per_day} events, drift from day {args.drift_day})",
           rows, {**machine(), "worlds": json.dumps(worlds)}, args.json_path)


def _paired(worlds: list[dict], key: str) -> str:
    mean, low, high = _world_interval([{"world": w["world"], key: w[key]} for w in worlds], key)
    return f"{mean:+.4f} [{low:+.4f}, {high:+.4f}]"


def one_world(scenario: str, world_seed: int, args) -> dict:
    """``--seeds`` full retrains on days 0..D of one world (and their averaged twins), each scored on day D+1's
    panel, with the plain seeds' ensemble."""
    from recloop.demo import rank_panel
    from recloop.features.config import FeatureConfig
    from recloop.features.online import RequestFeatures, online_reader
    from recloop.panel import draw_panel, score_panel
    from recloop.schema import load_spec
    from recloop.scoring import load_checkpoint

    world_args = SimpleNamespace(days=args.days + 1, events_per_day=args.events_per_day, scenario=scenario,
                                 drift_day=args.drift_day, panel_requests=args.panel_requests)
    work = Path(tempfile.mkdtemp(prefix="recloop-bench-reference-noise-"))
    try:
        settings, _, world = _landed_world(work, world_seed, world_args)
        pipeline.build_features(settings, "synthetic", {"end": START + timedelta(days=args.days + 1)})
        runs, averaged = {}, {}
        for seed in range(args.seeds):
            for average, into in ((False, runs), (True, averaged)) if args.average_checks else ((False, runs),):
                _cold_baselines(settings)
                into[seed] = train(settings, TrainConfig(
                    mode="full", days=args.days + 1, epochs=args.epochs, seed=seed, batch_size=args.batch_size,
                    validation_hours=6, checkpoint_every=10_000, average_checks=average))
        spec = load_spec("synthetic")
        panel = draw_panel(world, args.days + 1.5, args.panel_requests, 50, seed=0)  # as _panel_rewards draws it
        features = RequestFeatures(settings, spec, FeatureConfig.for_spec(spec), online_reader(settings))
        models = {f"plain{s}": load_checkpoint(r.checkpoint, f"plain{s}") for s, r in runs.items()}
        models.update({f"averaged{s}": load_checkpoint(r.checkpoint, f"averaged{s}") for s, r in averaged.items()})
        scores = rank_panel(features, world, panel, models)
        scores["ensemble"] = np.mean([scores[f"plain{s}"] for s in runs], axis=0)
        figures = {name: f["normalized_reward"] for name, f in score_panel(world, panel, scores, k=10).items()}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    values = np.array([figures[f"plain{s}"] for s in runs])
    aucs = np.array([runs[s].auc for s in runs])
    out = {"scenario": scenario, "world": world_seed, "panel": {str(s): float(figures[f"plain{s}"]) for s in runs},
           "auc": {str(s): float(runs[s].auc) for s in runs}, "panel_sd": float(values.std(ddof=1)),
           "panel_range": float(values.max() - values.min()), "auc_sd": float(aucs.std(ddof=1)),
           "ensemble": float(figures["ensemble"]), "ensemble_gain": float(figures["ensemble"] - values.mean())}
    if averaged:
        mine = np.array([figures[f"averaged{s}"] for s in averaged])
        out.update(averaged_panel={str(s): float(figures[f"averaged{s}"]) for s in averaged},
                   averaged_auc={str(s): float(averaged[s].auc) for s in averaged},
                   averaged_checks={str(s): (averaged[s].early_stopping or {}).get("averaged_checks") for s in averaged},
                   averaged_panel_sd=float(mine.std(ddof=1)), averaged_gain=float((mine - values).mean()),
                   averaged_auc_gain=float(np.mean([averaged[s].auc - runs[s].auc for s in runs])))
    return out


if __name__ == "__main__":
    main()
