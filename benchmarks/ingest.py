"""How fast ingestion lands a 1M-row parquet file, against the floor of reading and writing it unchecked.

    python benchmarks/ingest.py [--events 1000000] [--repeats 3] [--json out.json]

Two inputs: one 1M-row parquet file, and the same events as 24 hourly files (the simulator's layout).
Target (issue: foundation): a 1M-row parquet file in under 10 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
from common import best_of, machine, report

from recloop.ingest import ingest
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate

NOW = datetime(2026, 2, 1, tzinfo=UTC)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    spec = load_spec("synthetic")
    work = Path(tempfile.mkdtemp(prefix="recloop-bench-ingest-"))
    try:
        hourly = work / "hourly"
        simulate(WorldConfig(seed=0, days=1, events_per_day=args.events), hourly)
        single = work / "single.parquet"
        table = ds.dataset(hourly, format="parquet").to_table()
        pq.write_table(table, single)

        home = work / "home"
        settings = Settings(home=home)

        def fresh() -> None:
            shutil.rmtree(home, ignore_errors=True)

        # Correct first: every row lands once, the accounting identity holds, a rerun is a no-op.
        for source in (single, hourly):
            fresh()
            summary = ingest(source, spec, settings, now=NOW)
            assert summary.rows_landed == args.events and summary.rows_quarantined == 0
            assert all(r.rows_in == r.rows_landed + r.rows_quarantined for r in summary.results)
            assert ingest(source, spec, settings, now=NOW).rows_in == 0
            assert ds.dataset(settings.lake_events_dir, partitioning="hive").count_rows() == args.events

        timed = {name: best_of(args.repeats, lambda s=source: ingest(s, spec, settings, now=NOW), setup=fresh)
                 for name, source in (("one 1M-row file", single), ("24 hourly files", hourly))}
        floor_out = work / "floor.parquet"
        floor = best_of(args.repeats, lambda: pq.write_table(pq.read_table(single), floor_out))
    finally:
        shutil.rmtree(work, ignore_errors=True)

    rows = [
        {"what": f"recloop ingest, {name}", "rows": args.events, "seconds": f"{seconds:.2f}",
         "rows_per_s": f"{args.events / seconds:,.0f}", "vs_floor": f"{seconds / floor:.1f}x",
         "target": "< 10 s per 1M-row file"}
        for name, seconds in timed.items()
    ]
    rows.append({"what": "floor: read + write the file, no checks", "rows": args.events, "seconds": f"{floor:.2f}",
                 "rows_per_s": f"{args.events / floor:,.0f}", "vs_floor": "1.0x", "target": "-"})
    report("ingestion: rows landed per second", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
