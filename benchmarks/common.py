"""Shared by the benchmark scripts: the machine description, timing, and the closing table."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable
from pathlib import Path


def machine() -> dict[str, str]:
    """CPU model and cores, GPU if any, library versions and the commit: what a figure is measured on."""
    import platform as std_platform  # the standard library module (this folder has no platform package)

    import pyarrow

    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "python": std_platform.python_version(),
        "pyarrow": pyarrow.__version__,
        "commit": _commit(),
    }
    try:
        import torch

        info["torch"] = torch.__version__
        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        info["gpu"] = "none (torch not installed)"
    return info


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True, cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def best_of(repeats: int, run: Callable[[], object], setup: Callable[[], object] | None = None) -> float:
    """Median wall time of ``run`` over ``repeats`` runs (``setup`` before each, not timed)."""
    times = []
    for _ in range(repeats):
        if setup:
            setup()
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    times.sort()
    return times[len(times) // 2]


def report(title: str, rows: list[dict], info: dict, json_path: str | None) -> None:
    """Print the machine, then the table (last, as BENCHMARKS.md asks); write JSON if asked."""
    print(f"# {title}")
    print("machine: " + ", ".join(f"{k}={v}" for k, v in info.items()))
    columns = list(rows[0])
    widths = [max(len(c), *(len(str(r[c])) for r in rows)) for c in columns]
    print(" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)))
    print("-|-".join("-" * w for w in widths))
    for row in rows:
        print(" | ".join(str(row[c]).ljust(w) for c, w in zip(columns, widths, strict=True)))
    if json_path:
        Path(json_path).write_text(json.dumps({"title": title, "machine": info, "rows": rows}, indent=2) + "\n")
