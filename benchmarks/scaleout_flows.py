"""The deployments' scale-out path end to end on this machine, beside the single-process path, in one run.

    python benchmarks/scaleout_flows.py [--events-per-day 50000] [--days 3] [--batch-size 256]

Two homes from one simulated, ingested lake, each through the flows the deployments run (in process, on
a Prefect test server): the ``features`` flow, then ``train_flow`` with the ``train-multi-gpu`` deployment's
parameters (prefect.yaml: ``mode: full``, ``nproc: 2``), full training on the last ``--days``.

- baseline: ``features_engine=local`` and ``nproc: 1`` (one process each);
- scale-out: ``features_engine=dask`` on a ``LocalCluster`` of 2 worker processes (the job starts it:
  ``RECLOOP_DASK_WORKERS=2``), and ``nproc: 2`` (torchrun, 2 gloo ranks).

Checked before any time is printed: the Dask job's training and entity files equal the local job's (the
workers wrote them; the driver saw names and counts), the 2-rank run's checkpoints, its last one too, hold
one table-shard file per rank (``step-*/tables/shard-*``: DCP, safetensors, none gathered), and its
completed checkpoint (put together by ``recloop train --nproc 2`` after its ranks, not by a rank) is whole.
``tables_held``: the bytes of table rows and optimizer state each rank allocated (the checkpoint's
``sharding`` record) against the whole tables' (what one process holds). Wall time is the
flow's, measured around its call (process start-up included: a Dask cluster, torchrun's ranks, and for the
first flow called the imports and the Feast registry's first apply); ``job_s`` is the feature job's own time
(``FeatureRunSummary.seconds``: the local cluster's start included for Dask).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from common import machine, report
from scaleout import copy, lake

from recloop import checkpoint
from recloop.features.definition import FeatureLayout
from recloop.settings import Settings
from recloop.simulate import WorldConfig

CHECKOUT = Path(__file__).resolve().parents[1]


def _files(home: Path) -> dict[str, object]:
    root = FeatureLayout.for_settings(Settings(home=home)).root
    return {str(p.relative_to(root)): pq.read_table(p) for p in sorted(root.glob("*_stats/*.parquet"))} | \
        {str(p.relative_to(root)): pq.read_table(p) for p in sorted(root.glob("training/*.parquet"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events-per-day", type=int, default=50_000)
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--json")
    args = parser.parse_args()
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ["OMP_NUM_THREADS"] = "1"  # two ranks on two cores
    from prefect.testing.utilities import prefect_test_harness

    from flows.features_flow import features_flow
    from flows.train_flow import train_flow
    from recloop.flow_support import in_process_runs, settings_parameter

    deployment = next(d for d in yaml.safe_load((CHECKOUT / "prefect.yaml").read_text())["deployments"]
                      if d["name"] == "train-multi-gpu")
    work = Path(tempfile.mkdtemp(prefix="scaleout-flows-"))
    base = lake(work / "lake", WorldConfig(seed=3, days=args.days + 1, events_per_day=args.events_per_day),
                features=False)
    runs = {"single process": ({"features_engine": "local"}, 1),
            "scale-out": ({"features_engine": "dask", "dask_workers": 2}, deployment["parameters"]["nproc"])}
    rows, homes, results = [], {}, {}
    with prefect_test_harness(server_startup_timeout=180), in_process_runs():
        for name, (overrides, nproc) in runs.items():
            settings = copy(base, work / name.replace(" ", "-"), **overrides)
            homes[name] = settings.home
            started = time.perf_counter()
            features = features_flow(settings=settings_parameter(settings))
            features_seconds = time.perf_counter() - started
            started = time.perf_counter()
            trained = train_flow(**{**deployment["parameters"], "nproc": nproc, "days": args.days,
                                    "validation_hours": 8, "batch_size": args.batch_size},
                                 settings=settings_parameter(settings))
            train_seconds = time.perf_counter() - started
            results[name] = (features, trained)
            rows.append({"run": name, "features": features["backend"], "rows": features["rows"],
                         "features_s": f"{features_seconds:.1f}", "job_s": f"{features['seconds']:.1f}", "train": f"{nproc} process(es)",
                         "steps": trained["steps"], "train_s": f"{train_seconds:.1f}",
                         "auc": f"{trained['auc']:.4f}", "total_s": f"{features_seconds + train_seconds:.1f}"})
    local, dask = (_files(homes[n]) for n in runs)  # correct first
    assert local.keys() == dask.keys() and all(dask[k].equals(t) for k, t in local.items()), "feature files differ"
    completed = Path(results["scale-out"][1]["checkpoint"])
    run_dir = completed.parent
    shards = sorted(p.name for p in run_dir.glob("step-*/tables/shard-*.safetensors"))
    assert len(shards) >= 2 and {s.split("-model")[0] for s in shards} == {"shard-00001", "shard-00002"}, shards
    last = [p for p in sorted(run_dir.glob("step-*")) if p != completed][-1]  # the ranks' last: sharded
    assert (last / "tables").is_dir() and not (completed / "tables").is_dir(), (last, completed)
    held = checkpoint.read(completed)["sharding"]
    assert len(held["rank_bytes"]) == 2 and all(b < held["whole_bytes"] for b in held["rank_bytes"]), held
    rows[-1]["sharded_checkpoints"] = len(list(run_dir.glob("step-*/tables")))
    rows[-1]["tables_held"] = " + ".join(f"{b / 1e6:.2f}" for b in held["rank_bytes"]) + \
        f" of {held['whole_bytes'] / 1e6:.2f} MB"
    rows[0]["sharded_checkpoints"] = 0
    rows[0]["tables_held"] = "whole"
    report("scale-out flows: the train-multi-gpu deployment's parameters and the Dask feature job, beside one "
           "process", rows, {**machine(), "load_average": " ".join(f"{x:.1f}" for x in os.getloadavg())}, args.json)


if __name__ == "__main__":
    main()
