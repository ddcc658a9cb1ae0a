"""Shared by the benchmark scripts: the machine description, timing, and the closing table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_source_tree() -> None:
    """Import ``recloop`` and ``recloop_kernels`` from this checkout (a GPU machine may have no install)."""
    for folder in (ROOT / "platform", ROOT / "kernels"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))


def machine() -> dict[str, str]:
    """CPU model and cores, GPU and driver if any, library versions and the commit: what a figure is measured on.

    Needs nothing beyond the standard library; torch, triton and pyarrow are described when importable.
    """
    import platform as std_platform  # the standard library module (this folder has no platform package)

    cpu = "unknown"
    try:
        fields = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                      if ":" in line)
        fields = {k.strip(): v.strip() for k, v in fields.items()}
        cpu = fields.get("model name", cpu)
        if "cpu family" in fields:  # a model name as bare as "AMD EPYC" hides the generation: 25 Zen 3/4, 26 Zen 5
            cpu += f" (family {fields['cpu family']}, model {fields.get('model', '?')})"
    except OSError:
        pass
    info = {"cpu": cpu, "cores": str(os.cpu_count()), "python": std_platform.python_version(), "commit": _commit()}
    for package in ("torch", "triton", "pyarrow"):
        try:
            info[package] = __import__(package).__version__
        except ImportError:
            info[package] = "not installed"
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    except ImportError:
        info["gpu"] = "none (torch not installed)"
    info["driver"] = _driver()
    return info


def _driver() -> str:
    """The NVIDIA driver version (nvidia-smi), or "none"."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20, check=True).stdout.strip()
        return out.splitlines()[0] if out else "none"
    except (OSError, subprocess.SubprocessError):
        return "none"


def _commit() -> str:
    """The checkout's short commit; ``RECLOOP_COMMIT`` where the tree was copied without git (the GPU machine)."""
    if os.environ.get("RECLOOP_COMMIT"):
        return os.environ["RECLOOP_COMMIT"]
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
