"""``benchmarks/gpu_suite.py --smoke`` runs here as it will on a GPU machine: without recloop's services."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

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
    widths = [f for f in figures if f["step"] == "ptx" and f["name"].endswith("16-byte loads")]
    assert widths and all(f["met"] for f in widths), "row loads are not 16-byte vectors"
    registers = [f for f in figures if f["step"] == "ptx" and f["name"].endswith("registers")]
    assert {f["name"].split()[0] for f in registers} == {"forward_kernel", "segment_kernel"}
    assert all(0 < f["value"] <= 255 and "occupancy" in f["note"] for f in registers)
    assert any("longest run" in f["name"] for f in figures)
    assert "| met" in result.stdout  # the table, printed last


def test_a_step_stopped_midway_keeps_its_figures(tmp_path: Path, monkeypatch):
    # A GPU session's command can be stopped at its time limit in the middle of a step: the figures measured
    # so far must already be on disk, with the step marked as still running.
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import gpu_suite

    def stopped_after_one_figure(figures, smoke, quick):
        figures.add("loader", "first figure", 1.5, "x")
        raise KeyboardInterrupt  # what a kill looks like from inside: not an Exception, nothing after it runs

    monkeypatch.setattr(gpu_suite, "step_loader", stopped_after_one_figure)
    out = tmp_path / "suite.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_suite.run(["loader"], smoke=True, quick=False, out=out)
    saved = json.loads(out.read_text())
    assert [f["name"] for f in saved["figures"]] == ["first figure"]
    assert [(s["name"], s["status"]) for s in saved["steps"]] == [("loader", "running")]
