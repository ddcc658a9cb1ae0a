"""One simulated day of ``recloop demo``, per stage, with a cProfile of the whole run.

    python benchmarks/demo_stages.py [--days 2] [--events-per-day 10000] [--json out.json] [--profile out.prof]
        [--profile-from-day 1]

Runs ``demo.run_demo`` (bootstrap day 0, then ``days - 1`` simulated days, no twin, no daily full retrain)
in a temporary ``RECLOOP_HOME`` and times each stage the demo announces (``on_stage``: landing, serving
rounds with canary checks, night: ingest, features, drift check, retrain and gate), wall and CPU seconds
(this process and its children: on a shared machine the CPU figure is the steadier one), then lists the
functions with the largest cumulative time: where a day's fixed costs are. The profile starts with
``--profile-from-day`` (1: a simulated day's costs, without day 0's one-time imports, server start and bootstrap;
0: the whole run).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import tempfile
import time
from pathlib import Path

from common import machine, use_source_tree

use_source_tree()


def cpu_seconds() -> float:
    """CPU seconds of this process (every thread) and of its children that have ended (the gate's fresh
    process, multi-process training): on a shared machine a stage's CPU time says more than its wall time."""
    times = os.times()
    return times.user + times.system + times.children_user + times.children_system


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--days", type=int, default=2)
    parser.add_argument("--events-per-day", type=int, default=10_000)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--profile-from-day", type=int, default=1,
                        help="profile from this day's first stage on (0: the whole run, imports and bootstrap included)")
    args = parser.parse_args()

    from recloop.cli.base import drop_deprecation_notices
    from recloop.demo import DemoConfig, run_demo
    from recloop.settings import Settings

    drop_deprecation_notices()  # as `recloop demo` does

    stages: list[dict] = []
    last = [time.perf_counter(), cpu_seconds()]
    profiler = cProfile.Profile()
    profiling = [False]

    def on_stage(day: int, what: str) -> None:
        if day >= args.profile_from_day and not profiling[0]:
            profiler.enable()
            profiling[0] = True
        now, cpu = time.perf_counter(), cpu_seconds()
        if stages:
            stages[-1]["seconds"] = round(now - last[0], 1)
            stages[-1]["cpu_seconds"] = round(cpu - last[1], 1)
        stages.append({"day": day, "stage": what})
        last[:] = [now, cpu]

    with tempfile.TemporaryDirectory() as home:
        settings = Settings(home=Path(home) / "home", frame_backend="pandas")
        # the demo's drift on its day 2, or on the last day of a shorter run (as `recloop demo --days 2`)
        config = DemoConfig(days=args.days, events_per_day=args.events_per_day, twin=False, daily_full=False,
                            drift_day=min(DemoConfig.drift_day, args.days - 1),
                            drift=DemoConfig.drift if args.days > 1 else "none")
        began = time.perf_counter()
        summary = run_demo(settings, config, on_stage=on_stage)
        profiler.disable()
        total = time.perf_counter() - began
        stages[-1]["seconds"] = round(time.perf_counter() - last[0], 1)
        stages[-1]["cpu_seconds"] = round(cpu_seconds() - last[1], 1)
    if args.profile and profiling[0]:
        profiler.dump_stats(str(args.profile))
    print(f"total {total:.1f} s; per day: {[d.get('seconds') for d in summary['days']]}")
    for row in stages:
        print(f"  day {row['day']}: {row.get('seconds', 0):>7.1f} s wall {row.get('cpu_seconds', 0):>7.1f} s CPU  "
              f"{row['stage']}")
    if profiling[0]:
        print(f"profiled from day {args.profile_from_day}:")
        pstats.Stats(profiler).sort_stats("cumulative").print_stats(35)
    if args.json:
        args.json.write_text(json.dumps({"machine": machine(), "total_seconds": total, "stages": stages,
                                         "days": [{k: d.get(k) for k in ("day", "seconds", "retrain", "gate",
                                                                          "canary", "drift")}
                                                  for d in summary["days"]]}, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
