"""Every ranker version of a loop's home scored on every day's logged world rows (served feedback left out).

    python benchmarks/loop_models.py HOME [--json out.json]

``HOME`` is a ``recloop demo`` home, e.g. one of ``benchmarks/loop.py --loop-root DIR``'s runs
(``DIR/<scenario>-<seed>/home``). Per version and day: AUC, log loss, calibration (mean prediction / mean
label), the calibration slope (logistic fit of the label on the score's logit, with its standard error) and
the oracle's AUC on the same rows. Rows a version trained on are in-sample for it (its own days).

What it is for: whether a drift shows in the models' own performance on the logged days, which is what a
concept check on logged rows could see (issue 36: gradual drift in the real loop). Compare a drifted run
with its no-drift run of the same seed (identical until the drift day).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
from common import use_source_tree

use_source_tree()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("home", type=Path)
    parser.add_argument("--json")
    args = parser.parse_args()

    import statsmodels.api as sm

    from recloop import registry
    from recloop.data.loader import training_files
    from recloop.features.definition import FeatureLayout
    from recloop.gate.runner import _held_out_inputs, score_version
    from recloop.settings import Settings

    settings = Settings(home=args.home, frame_backend="pandas")
    registry.configure(settings)
    files = training_files(FeatureLayout.for_settings(settings).training)
    days = sorted({f.stem[:10] for f in files})
    versions = sorted(int(v.version) for v in registry.mlflow_client(settings).search_model_versions(
        f"name='{registry.MODEL_NAME}'"))
    out: dict[str, dict] = {}
    for version in map(str, versions):
        out[version] = {}
        for day in days:
            day_files = [f for f in files if f.stem.startswith(day)]
            schema, _, keep = _held_out_inputs(settings, day_files)
            arrays: dict = {}
            overall = score_version(settings, version, day_files, schema, keep, arrays).overall
            scores = np.clip(arrays["scores"], 1e-6, 1 - 1e-6)
            fit = sm.GLM(arrays["labels"], sm.add_constant(np.log(scores / (1 - scores))),
                         family=sm.families.Binomial()).fit()
            out[version][day] = {"auc": round(overall["auc"], 4), "logloss": round(overall["logloss"], 4),
                                 "calibration": round(overall["calibration"], 3),
                                 "slope": round(float(fit.params[1]), 3), "slope_se": round(float(fit.bse[1]), 3),
                                 "oracle_auc": round(overall.get("oracle_auc", float("nan")), 4),
                                 "rows": overall["rows"]}
        print(f"v{version}: " + "  ".join(f"{day[5:]} AUC {m['auc']:.3f} slope {m['slope']:.2f} cal "
                                          f"{m['calibration']:.2f}" for day, m in out[version].items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"home": str(args.home), "versions": out}, indent=2) + "\n")


if __name__ == "__main__":
    main()
