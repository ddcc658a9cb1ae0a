"""The feature job on pandas (and on cuDF where a GPU is present), over the same lake, side by side.

    python benchmarks/features.py [--events 1000000] [--json out.json]

Targets (issue: features): 1M synthetic events through the whole job in <= 30 s on a 2-core CPU;
cuDF >= 10x pandas on >= 10M events on one H100 (measured only where cuDF and a GPU are present).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
from common import machine, report

from recloop.features.backend import BackendUnavailable, get_backend
from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.ingest import ingest
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate


def run_job(lake: Path, work: Path, backend_name: str) -> tuple[float, Settings]:
    home = work / f"home-{backend_name}"
    shutil.rmtree(home, ignore_errors=True)
    shutil.copytree(lake, home)
    settings = Settings(home=home, frame_backend=backend_name)
    spec = load_spec("synthetic")
    started = time.perf_counter()
    summary = build_features(settings, spec, FeatureConfig.for_spec(spec), backend=get_backend(backend_name))
    seconds = time.perf_counter() - started
    assert summary.rows > 0, summary
    return seconds, settings


def training(settings: Settings):
    return ds.dataset(FeatureLayout.for_settings(settings).training, format="parquet").to_table().sort_by("event_id")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000, help="events (one simulated day)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="recloop-bench-features-"))
    rows = []
    try:
        spec = load_spec("synthetic")
        simulate(WorldConfig(seed=0, days=1, events_per_day=args.events), work / "landing")
        lake = work / "lake-home"
        ingest(work / "landing", spec, Settings(home=lake), now=datetime(2026, 2, 1, tzinfo=UTC))

        pandas_seconds, pandas_settings = run_job(lake, work, "pandas")
        reference = training(pandas_settings)
        # Correct first: every event has a row, every dense feature is finite.
        assert reference.num_rows == args.events
        dense = [c for c in reference.column_names if c.startswith("d_")]
        assert all(np.isfinite(reference[c].to_numpy()).all() for c in dense)
        rows.append({"backend": "pandas", "events": args.events, "seconds": f"{pandas_seconds:.2f}",
                     "events_per_s": f"{args.events / pandas_seconds:,.0f}", "vs_pandas": "1.0x",
                     "target": "<= 30 s per 1M on the 2-core CPU"})
        try:
            get_backend("cudf")
        except BackendUnavailable as why:
            rows.append({"backend": "cudf", "events": args.events, "seconds": "-", "events_per_s": "-",
                         "vs_pandas": "not measured", "target": f">= 10x pandas on a GPU ({why.args[0][:40]}...)"})
        else:
            run_job(lake, work, "cudf")  # warm-up: CUDA context, kernels
            cudf_seconds, cudf_settings = run_job(lake, work, "cudf")
            other = training(cudf_settings)
            for column in reference.column_names:
                if column.startswith("d_"):
                    np.testing.assert_allclose(other[column].to_numpy(), reference[column].to_numpy(), rtol=1e-4,
                                               atol=1e-5, err_msg=column)
                elif column.startswith(("c_", "label")):
                    assert other[column].equals(reference[column]), column
            rows.append({"backend": "cudf", "events": args.events, "seconds": f"{cudf_seconds:.2f}",
                         "events_per_s": f"{args.events / cudf_seconds:,.0f}",
                         "vs_pandas": f"{pandas_seconds / cudf_seconds:.1f}x", "target": ">= 10x pandas"})
    finally:
        shutil.rmtree(work, ignore_errors=True)
    report("feature job: lake events to training rows, entity tables and state", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
