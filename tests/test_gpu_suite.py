"""``benchmarks/gpu_suite.py --smoke`` runs here as it will on a GPU machine: without recloop's services."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SERVICES = ("prefect", "mlflow", "feast", "evidently", "pandera", "pydantic", "pydantic_settings", "typer")
SITE = '''
import importlib.abc, sys

class _NotOnTheGpuMachine(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError(f"{{name}} is not installed on the GPU machine (blocked by the test)")

sys.meta_path.insert(0, _NotOnTheGpuMachine())
'''


def test_the_smoke_suite_passes_without_service_packages(tmp_path: Path):
    # sitecustomize runs at every interpreter's start: the suite's own subprocesses (pytest, the PTX
    # check) are blocked from the service packages too.
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITE.format(blocked=set(SERVICES)))
    out = tmp_path / "smoke.json"
    env = {**os.environ, "PYTHONPATH": str(site)}
    env.pop("TRITON_INTERPRET", None)  # the suite sets it itself, before importing the kernels
    result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--smoke", "--out", str(out)],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=900)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads(out.read_text())
    status = {step["name"]: step["status"] for step in report["steps"]}
    assert status == {"tests": "ok", "ptx": "ok", "embedding": "ok", "loader": "ok", "train": "ok",
                      "cudf": "skipped"}, report["steps"]
    figures = report["figures"]
    for figure in figures:
        assert {"name", "value", "unit", "baseline", "ratio", "limit", "target", "met", "device", "driver", "torch",
                "triton", "commit"} <= set(figure)
    assert all(f["met"] for f in figures if f["step"] == "ptx"), "row loads are not 16-byte vectors"
    assert any("longest run" in f["name"] for f in figures)
    assert "| met" in result.stdout  # the table, printed last
