"""The drift monitor on big windows: 10M-row reference and current windows within 60 s.

    python benchmarks/monitor.py [--rows 10000000] [--baseline-rows 1000000] [--json out.json]

Simulates two days of ``--rows`` events each (a sudden drift on the second), ingests them, then times
``monitor.runner.compare_windows`` (read both windows from the lake, sample, Evidently, new-id share, data quality) on the
whole days. Baseline in the same run: Evidently's DataDriftPreset on ``--baseline-rows`` unsampled rows
per window (what the monitor would cost without sampling, on a tenth of the data).
Target (issue: drift): 10M-row windows within 60 s on this 2-core machine.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from common import machine, report

from recloop.ingest import ingest
from recloop.monitor import MonitorConfig
from recloop.monitor.drift import evidently_drift
from recloop.monitor.runner import compare_windows
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--baseline-rows", type=int, default=1_000_000)
    parser.add_argument("--json")
    args = parser.parse_args()
    spec = load_spec("synthetic")
    with tempfile.TemporaryDirectory(prefix="recloop-bench-monitor-") as tmp:
        root = Path(tmp)
        world = WorldConfig(seed=2, days=2, events_per_day=args.rows, drift="sudden", drift_day=1)
        began = time.perf_counter()
        simulate(world, root / "landing")
        settings = Settings(home=root / "home", frame_backend="pandas")
        ingest(root / "landing", spec, settings, now=datetime(2026, 6, 1, tzinfo=UTC))
        setup = time.perf_counter() - began
        start = world.start
        reference, current = (start, start + timedelta(days=1)), (start + timedelta(days=1), start + timedelta(days=2))
        began = time.perf_counter()
        decision = compare_windows(settings, spec, reference=reference, current=current)
        monitored = time.perf_counter() - began

        from recloop.ingest.lake import read_window, to_us

        columns = [c.name for c in spec.columns if c.role in ("categorical", "numeric")]
        frames = [read_window(settings, spec, to_us(a), to_us(b), columns=columns).slice(0, args.baseline_rows)
                  .to_pandas() for a, b in (reference, current)]
        began = time.perf_counter()
        evidently_drift(frames[0], frames[1], columns, MonitorConfig())
        baseline = time.perf_counter() - began
    rows = [
        {"what": f"recloop monitor, {args.rows:,} + {args.rows:,} rows (sampled to 50k)", "seconds": round(monitored, 1),
         "decision": decision.decision, "target": "<= 60 s", "met": "yes" if monitored <= 60 else "no"},
        {"what": f"Evidently DataDriftPreset unsampled, {args.baseline_rows:,} + {args.baseline_rows:,} rows",
         "seconds": round(baseline, 1), "decision": "-", "target": "baseline", "met": "-"},
    ]
    print(f"(setup: simulate + ingest {2 * args.rows:,} events in {setup:.0f} s)")
    report("drift monitor on big windows", rows, machine(), args.json)


if __name__ == "__main__":
    main()
