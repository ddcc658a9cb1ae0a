"""How fast the synthetic world writes events, against the floor of writing the same rows as parquet.

    python benchmarks/simulate.py [--events 1000000] [--repeats 3] [--json out.json]

Target (issue: foundation): at least 1M events in 10 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

import pyarrow.dataset as ds
import pyarrow.parquet as pq
from common import best_of, machine, report

from recloop.simulate import WorldConfig, simulate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--events", type=int, default=1_000_000, help="events in one simulated day")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="recloop-bench-sim-"))
    config = WorldConfig(seed=0, days=1, events_per_day=args.events)
    try:
        # Correct first: the right number of events, deterministic for the seed.
        first = simulate(config, work / "check-a")
        again = simulate(config, work / "check-b")
        assert first.events == args.events and first.files == 24
        assert all(Path(a).read_bytes() == Path(b).read_bytes() for a, b in zip(first.paths, again.paths, strict=True))
        table = ds.dataset(work / "check-a", format="parquet").to_table()

        out = work / "timed"
        seconds = best_of(args.repeats, lambda: simulate(config, out), setup=lambda: shutil.rmtree(out, True))
        floor_dir = work / "floor"
        floor_dir.mkdir()
        per_hour = [table.slice(i * len(table) // 24, len(table) // 24) for i in range(24)]
        floor = best_of(args.repeats, lambda: [pq.write_table(t, floor_dir / f"{i}.parquet")
                                               for i, t in enumerate(per_hour)])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = [
        {"what": "recloop simulate (24 hourly files)", "events": args.events, "seconds": f"{seconds:.2f}",
         "events_per_s": f"{args.events / seconds:,.0f}", "vs_floor": f"{seconds / floor:.1f}x the floor",
         "target": "<= 10 s per 1M"},
        {"what": "floor: write the same rows as parquet", "events": args.events, "seconds": f"{floor:.2f}",
         "events_per_s": f"{args.events / floor:,.0f}", "vs_floor": "1.0x", "target": "-"},
    ]
    report("synthetic world: events written per second", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
