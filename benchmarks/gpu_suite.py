"""Everything that needs a GPU, in one command, in order of value; JSON under benchmarks/results/.

    python benchmarks/gpu_suite.py [--quick] [--only tests,ptx,embedding,loader,train,cudf] [--out PATH]
    python benchmarks/gpu_suite.py --smoke      # the same suite on a CPU: tiny shapes, Triton's interpreter

Steps, each recorded whether it succeeds or fails (a failing step records its error and the suite goes on):

1. ``tests``      the ``gpu`` tests of the kernels, the loader and the training step (pytest -m gpu);
2. ``ptx``        what the kernels compile to for sm_90: 16-byte row accesses (benchmarks/ptx_check.py);
3. ``embedding``  forward and backward + fused row-wise Adagrad on BENCHMARKS.md's shapes, fp32 and
                  bf16, uniform and Zipf ids, against copy bandwidth and nn.EmbeddingBag + torch.optim
                  (benchmarks/embedding.py); longest run and kernel launches per pass;
4. ``loader``     ChunkLoader vs a row-by-row DataLoader, next to host→device bandwidth;
5. ``train``      one epoch of the DLRM: recloop's compiled step vs the same model on stock PyTorch, on
                  synthetic rows with a planted click model (no feature job: no services needed); then
                  recloop's alone at batch 64K (bf16 autocast, StepConfig's default);
6. ``cudf``       entity statistics on cuDF vs pandas (only where cuDF imports).
                  The GPU machine has no cuDF and no network: carry its wheels in parts (each call carries
                  at most 64 MiB). Here, ``python benchmarks/gpu_wheels.py prepare`` (downloads ~363 MB into
                  the ignored .whl-cudf/, 6 parts of <= 61 MiB), then ``python benchmarks/gpu_wheels.py
                  commands`` prints the device calls, one per part, each within 30 s of the last (the
                  machine keeps /tmp only while warm); the last installs into /tmp/site and runs this step.
                  H200 machine, 2026-11-26: the six calls took ~80 s of device time (a start ~30 s, each warm call ~5 s).

Every figure carries: name, value, unit, baseline, ratio (value / baseline), limit (the physical one
where there is one), target, met (None where not measurable, e.g. speed on a CPU), device, driver,
torch and triton versions, commit. It needs Python with torch, triton, numpy, pandas and pyarrow only:
none of recloop's service packages (prefect, mlflow, feast, evidently, pandera, pydantic-settings, typer).
The table of figures is printed last; ``--out`` (default ``benchmarks/results/gpu_suite.json``, or
``gpu_suite_smoke.json`` with ``--smoke``) gets the JSON. With ``--only`` the named steps replace theirs
in an existing JSON file, so a GPU session can run the suite a step per command.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA and "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported

from common import ROOT, machine, use_source_tree  # noqa: E402

use_source_tree()
STEPS = ("tests", "ptx", "embedding", "loader", "train", "cudf")
RESULTS = ROOT / "benchmarks" / "results"


class Figures:
    """The figures of one run, each stamped with what it was measured on."""

    def __init__(self, info: dict, on_add: Callable[[], None] | None = None):
        self.info = info
        self.items: list[dict] = []
        self.on_add = on_add  # run() saves the JSON after every figure: a step stopped midway keeps its figures

    def add(self, step: str, name: str, value, unit: str, *, baseline=None, limit=None, target: str = "",
            met: bool | None = None, note: str = "") -> None:
        ratio = value / baseline if isinstance(value, (int, float)) and baseline else None
        self.items.append({
            "step": step, "name": name, "value": _round(value), "unit": unit, "baseline": _round(baseline),
            "ratio": _round(ratio), "limit": _round(limit), "target": target, "met": met, "note": note,
            "device": self.info["gpu"], "driver": self.info["driver"], "torch": self.info["torch"],
            "triton": self.info["triton"], "commit": self.info["commit"],
        })
        if self.on_add:
            self.on_add()


def _round(value):
    return float(f"{value:.4g}") if isinstance(value, float) else value


def _environment() -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "platform"), str(ROOT / "kernels"),
                                                        os.environ.get("PYTHONPATH", "")])}
    return env


# --- steps ------------------------------------------------------------------------------------------------


def step_tests(figures: Figures, smoke: bool, quick: bool) -> None:
    files = ["tests/test_kernels.py", "tests/test_loader.py", "tests/test_fit.py"]
    result = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *files],
                            capture_output=True, text=True, cwd=ROOT, env=_environment(), timeout=1800)
    tail = result.stdout.strip().splitlines()[-1] if result.stdout.strip() else result.stderr[-500:]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|error|errors)", tail)}
    passed, failed = counts.get("passed", 0), counts.get("failed", 0) + counts.get("error", 0) + counts.get("errors", 0)
    if result.returncode not in (0, 5):  # 5: nothing collected
        figures.add("tests", "gpu tests failed", failed, "tests", target="0", met=False, note=tail)
        raise RuntimeError(f"gpu tests: {tail}\n{result.stdout[-3000:]}")
    figures.add("tests", "gpu tests passed", passed, "tests", target="all pass",
                met=(failed == 0) if passed else None, note=tail)


def step_ptx(figures: Figures, smoke: bool, quick: bool) -> None:
    with tempfile.TemporaryDirectory() as work:
        out = Path(work) / "ptx.json"
        env = {k: v for k, v in _environment().items() if k != "TRITON_INTERPRET"}
        env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
        args = ["--first"] if smoke or quick else []
        result = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ptx_check.py"), "--json", str(out), *args],
                                capture_output=True, text=True, cwd=ROOT, env=env, timeout=900)
        if result.returncode:
            raise RuntimeError(result.stderr[-3000:])
        rows = json.loads(out.read_text())
    for row in rows:
        if row["kernel"] not in ("forward_kernel", "segment_kernel"):
            continue
        wide = sum(n for form, n in row["loads"].items() if ".v4." in form or ".v8." in form)
        figures.add("ptx", f"{row['kernel']} {row['dtype']} dim {row['dim']} {row['hotness']}-hot: 16-byte loads",
                    wide, "instructions", target="> 0 (rows loaded as 16-byte vectors)", met=wide > 0,
                    note=f"loads {row['loads']} stores {row['stores']}")
        if "registers" in row:
            figures.add("ptx", f"{row['kernel']} {row['dtype']} dim {row['dim']} {row['hotness']}-hot: registers",
                        row["registers"], "a thread", note=f"{row['num_warps']} warps; theoretical occupancy "
                        f"{row['occupancy']:.1%} (Hopper); spills {row['spill_bytes']} bytes")


def step_embedding(figures: Figures, smoke: bool, quick: bool) -> None:
    import embedding

    bandwidth = embedding.copy_bandwidth() if CUDA else None
    if bandwidth:
        figures.add("embedding", "device-to-device copy bandwidth", bandwidth / 1e9, "GB/s")
    shapes = embedding.smoke_shapes()[:1] if smoke else embedding.gpu_shapes(quick)
    # fp16 too on a GPU: FBGEMM's released training kernels take fp32 and fp16 weights, not bf16 (issue 39).
    # RECLOOP_EMBEDDING_DTYPES=bfloat16,float16 narrows a run to some of them.
    names = os.environ.get("RECLOOP_EMBEDDING_DTYPES", "float32,bfloat16,float16" if CUDA else "float32")
    dtypes = tuple(getattr(torch, name.strip()) for name in names.split(","))
    failures = []
    for shape in shapes:
        for dtype in dtypes:
            for ids in ("uniform", "zipf"):
                label = f"{shape.key} {str(dtype)[6:]} {ids}"
                try:
                    r = embedding.measure(shape, dtype, ids, bandwidth, repeats=1 if smoke else 10,
                                          backend="triton" if smoke else "auto")
                except Exception as err:  # noqa: BLE001 - recorded, the other shapes still run
                    figures.add("embedding", f"{label}: error", None, "", met=False, note=repr(err)[:500])
                    failures.append(label)
                    continue
                _embedding_figures(figures, label, r, bandwidth)
                dense, sparse = r["baselines"]["dense"], r["baselines"]["sparse"]
                print(f"[embedding] {label}: forward {r['forward_s'] * 1e3:.3f} ms ({r['forward_bytes'] / r['forward_s'] / 1e9:.0f}"
                      f" GB/s), backward {r['backward_s'] * 1e3:.3f} ms ({r['backward_bytes'] / r['backward_s'] / 1e9:.0f} GB/s);"
                      f" dense {dense[0] * 1e3:.3f}/{dense[1] * 1e3:.3f} ms, sparse {sparse[0] * 1e3:.3f}/{sparse[1] * 1e3:.3f} ms"
                      + (f", FBGEMM {r['fbgemm']['forward_s'] * 1e3:.3f}/{r['fbgemm']['backward_s'] * 1e3:.3f} ms"
                         if "forward_s" in r["fbgemm"] else f", FBGEMM: {r['fbgemm'].get('error') or r['fbgemm']['missing']}"),
                      flush=True)
    if failures:
        raise RuntimeError(f"{len(failures)} embedding measurements failed: {failures}")


def _embedding_figures(figures: Figures, label: str, r: dict, bandwidth: float | None) -> None:
    for index, key in enumerate(("forward", "backward")):  # backward: + fused rowwise Adagrad
        seconds, moved = r[f"{key}_s"], r[f"{key}_bytes"]
        dense, sparse = r["baselines"]["dense"][index], r["baselines"]["sparse"][index]
        achieved = moved / seconds / 1e9
        share = TARGET_SHARE[key]
        figures.add("embedding", f"{label} {key}: achieved", achieved, "GB/s",
                    baseline=moved / dense / 1e9 if dense == dense else None,
                    limit=bandwidth / 1e9 if bandwidth else None, target=f">= {share:.0%} of copy bandwidth",
                    met=achieved >= share * bandwidth / 1e9 if bandwidth else None,
                    note=f"{seconds * 1e3:.3f} ms (device time); {moved / 1e6:.1f} MB (the fewest bytes, RESULTS.md)"
                         + (f"; {r['forward_host_s'] * 1e3:.3f} ms with the host's time per call"
                            if key == "forward" and "forward_host_s" in r else ""))
        for name, base, target in (("dense", dense, 20), ("sparse", sparse, 5)):
            error = r["baselines"].get(f"{name}_error", "")
            figures.add("embedding", f"{label} {key}: vs {name}-gradient baseline",
                        base / seconds if base == base else None, "x",
                        target=f">= {target}x (Criteo-like)" if r["criteo"] else "",
                        met=(base / seconds >= target) if (CUDA and r["criteo"] and base == base) else None,
                        note=error)
        figures.add("embedding", f"{label} {key}: kernel launches", r[f"{key}_launches"], "launches",
                    target=f"<= {PREDICTED_LAUNCHES[key]} (RESULTS.md)" if CUDA else "",
                    met=(r[f"{key}_launches"] <= PREDICTED_LAUNCHES[key]) if CUDA else None,
                    note="CUDA kernels in the profiler" if CUDA else "Triton launches (interpreter)")
    figures.add("embedding", f"{label}: longest run", r["longest_run"], "occurrences of one row",
                note=f"{r['nnz']} ids, {r['unique_rows']} distinct rows")
    _fbgemm_figures(figures, label, r)


def _fbgemm_figures(figures: Figures, label: str, r: dict) -> None:
    """Issue 39: recloop's speed over FBGEMM's TBE on the same GPU, inputs and optimizer (a ratio > 1: faster)."""
    fb = r.get("fbgemm", {})
    if fb.get("missing") or fb.get("error"):
        figures.add("embedding", f"{label}: vs FBGEMM TBE", None, "x", met=None if fb.get("missing") else False,
                    note=fb.get("missing") or fb["error"])
        return
    for key in ("forward", "backward"):
        seconds, theirs = r[f"{key}_s"], fb[f"{key}_s"]
        target = 1.3 if r["criteo"] and key == "backward" else 1.0
        figures.add("embedding", f"{label} {key}: vs FBGEMM TBE", theirs / seconds, "x", baseline=None,
                    target=f">= {target}x FBGEMM's speed", met=theirs / seconds >= target,
                    note=f"recloop {seconds * 1e3:.3f} ms, FBGEMM ({fb['dtype']} weights) {theirs * 1e3:.3f} ms "
                         f"({r[f'{key}_bytes'] / theirs / 1e9:.0f} GB/s), FBGEMM launches {fb[f'{key}_launches']}; "
                         f"checked equal first: forward {fb['forward_error']:.1e}, updated rows {fb['update_error']:.1e}")


TARGET_SHARE = {"forward": 0.75, "backward": 0.50}
# Predicted CUDA kernels per pass on a GPU (RESULTS.md, "launches"): the forward is one Triton kernel per
# distinct dim (one here); the backward five Triton kernels, the step increment, torch.sort's radix sort
# (up to ~8 kernels with its index initialisation) and torch.cumsum (up to 2).
PREDICTED_LAUNCHES = {"forward": 1, "backward": 16}


def step_loader(figures: Figures, smoke: bool, quick: bool) -> None:
    import loader

    rows = 20_000 if smoke else (4_000_000 if quick else 8_000_000)  # 20M rows took over 70 s to write (H100 machine)
    r = loader.measure(rows, 10_000 if smoke else 400_000, 4096 if smoke else 65536)
    rate, base = r["samples_per_s"], r["baseline_samples_per_s"]
    limit = r["host_to_device"] / r["wire_bytes_per_row"] if r["host_to_device"] else None
    figures.add("loader", "ChunkLoader samples/s (Criteo-shaped rows to the device)", rate, "samples/s", baseline=base,
                limit=limit, target=">= 20M/s (H100)", met=rate >= 20e6 if CUDA else None,
                note=f"limit: host→device bandwidth / {r['wire_bytes_per_row']} bytes a row copied (int32 ids)")
    figures.add("loader", "ChunkLoader vs row-by-row DataLoader", rate / base, "x", target=">= 30x (H100)",
                met=rate / base >= 30 if CUDA else None)
    for label, variant in r["variants"].items():
        figures.add("loader", f"ChunkLoader samples/s, {label}", variant, "samples/s", baseline=rate,
                    note="the same files; baseline: the loader's defaults")
    if r["host_to_device"]:
        figures.add("loader", "host→device bandwidth (pinned)", r["host_to_device"] / 1e9, "GB/s")
    stages = r["stages"]  # where the default run's epoch went (recloop.data.LoaderStats): the slow stage
    for name, seconds in stages.items():
        if name.endswith("_s") and name != "epoch_s":
            figures.add("loader", f"loader stage {name[:-2]}, share of the epoch", seconds / stages["epoch_s"], "",
                        note=f"{seconds:.2f} s of {stages['epoch_s']:.2f} s; thread times add up across threads")


def step_train(figures: Figures, smoke: bool, quick: bool) -> None:
    import train

    from recloop.model import StepConfig

    small, large = (128, 256) if smoke else (16384, 65536)
    # smoke: 512 rows, 4 and 2 steps, the kernels' PyTorch reference ("auto" on a CPU): this step's plumbing;
    # the Triton kernels in the interpreter are the embedding step's (and tests/test_kernels.py's)
    warm = 1 if smoke else train.WARM_STEPS
    with tempfile.TemporaryDirectory() as work:
        rows = 512 if smoke else (1_000_000 if quick else 2_000_000)  # 4M rows ran past 140 s (H100 machine)
        began = time.perf_counter()
        train_files, valid_files, schema = train.synthetic_rows(Path(work), rows, 256 if smoke else 500_000, smoke)
        print(f"[train] {rows:,} synthetic rows written in {time.perf_counter() - began:.0f} s", flush=True)
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        r = train.measure(train_files, valid_files, schema, small, embedding_dim=8 if smoke else 16,
                          backend="auto", step_config=StepConfig(), warm_steps=warm)
        graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        print(f"[train] batch {small:,}: recloop {r['recloop_seconds']:.1f} s, stock {r['stock_seconds']:.1f} s "
              f"(epochs, with warm-up)", flush=True)
        ours = r["recloop_steady_samples"] / r["recloop_steady_seconds"]
        stock = r["stock_steady_samples"] / r["stock_steady_seconds"]
        epoch = (f"whole epoch (compilation included): recloop {r['recloop_samples'] / r['recloop_seconds']:,.0f}/s, "
                 f"stock {r['stock_samples'] / r['stock_seconds']:,.0f}/s")
        figures.add("train", f"recloop training samples/s (DLRM, batch {small:,}, steady)", ours,
                    "samples/s", baseline=stock, target=">= 6M/s (H100)", met=ours >= 6e6 if CUDA else None, note=epoch)
        figures.add("train", "recloop vs stock PyTorch training (stock fed by a row-by-row DataLoader)", ours / stock,
                    "x", target=">= 8x (H100)", met=ours / stock >= 8 if CUDA else None,
                    note=f"steady rates: from step {warm} to the last full batch")
        preloaded = r["stock_preloaded_steady_samples"] / r["stock_preloaded_steady_seconds"]
        figures.add("train", "recloop vs stock PyTorch fed the same batches preloaded on the device", ours / preloaded,
                    "x", baseline=None, note=f"stock preloaded {preloaded:,.0f} samples/s (steady), validation AUC "
                                             f"{r['stock_preloaded_auc']:.4f}; the model's speed without a loader")
        difference = r["recloop_auc"] - r["stock_auc"]
        figures.add("train", "validation AUC, recloop − stock", difference, "AUC", target="within ±0.001",
                    met=abs(difference) <= 0.001 if not smoke else None,
                    note=f"recloop {r['recloop_auc']:.4f}, stock {r['stock_auc']:.4f}")
        figures.add("train", "graphs compiled for the training step", graphs, "graphs", target="1 on a GPU",
                    met=graphs == 1 if CUDA else None, note="eager on a CPU" if not CUDA else "")
        # issue 16's last step: the same epoch at batch 64K (bf16 autocast: StepConfig's default), recloop alone
        torch._dynamo.reset()
        big = train.measure(train_files, valid_files, schema, large, embedding_dim=8 if smoke else 16,
                            backend="auto", step_config=StepConfig(), stock=False,
                            warm_steps=warm)
    rate = big["recloop_steady_samples"] / big["recloop_steady_seconds"]
    figures.add("train", f"recloop training samples/s at batch {large:,} (bf16 autocast on a GPU)", rate, "samples/s",
                baseline=ours, target=">= 6M/s (H100)", met=rate >= 6e6 if CUDA else None,
                note=f"baseline: recloop at batch {small:,}; steady rates; whole epoch "
                     f"{big['recloop_samples'] / big['recloop_seconds']:,.0f}/s; validation AUC {big['recloop_auc']:.4f} "
                     f"(at the smaller batch {r['recloop_auc']:.4f})")


def step_cudf(figures: Figures, smoke: bool, quick: bool) -> None:
    from gpu_wheels import restore_numpy_row_stack

    restore_numpy_row_stack()  # the device image's numba-cuda needs numpy's row_stack, gone in numpy 2.4
    try:
        import cudf  # noqa: F401
    except Exception as err:  # noqa: BLE001 - any failure to import means there is nothing to compare
        raise SkipStep(f"cuDF does not import here ({type(err).__name__})") from err
    import numpy as np
    import pandas as pd

    from recloop.features.backend import get_backend
    from recloop.features.ops import entity_states

    rows = 20_000 if smoke else 10_000_000
    rng = np.random.default_rng(0)
    events = pd.DataFrame({"user": rng.integers(0, rows // 20, rows), "ts": np.sort(rng.integers(0, 7 * 86400, rows))
                           * 1_000_000, "label": (rng.random(rows) < 0.1).astype(np.int64)})
    seconds = {}
    results = {}
    for name in ("pandas", "cudf"):
        backend = get_backend(name)
        frame = backend.frames.DataFrame(events) if name == "cudf" else events
        entity_states(backend, frame, key="user", ts="ts", label="label", prefix="user", since_us=None, base=None)
        started = time.perf_counter()
        states = entity_states(backend, frame, key="user", ts="ts", label="label", prefix="user", since_us=None,
                               base=None)
        seconds[name] = time.perf_counter() - started
        results[name] = backend.to_arrow(states.frame).to_pandas()
    pd.testing.assert_frame_equal(results["pandas"], results["cudf"], check_dtype=False)
    figures.add("cudf", f"entity statistics over {rows:,} events: cuDF vs pandas", seconds["pandas"] / seconds["cudf"],
                "x", target=">= 10x (H100)", met=seconds["pandas"] / seconds["cudf"] >= 10 if CUDA else None,
                note=f"pandas {seconds['pandas']:.2f} s, cuDF {seconds['cudf']:.2f} s")


class SkipStep(Exception):
    """A step that does not apply on this machine (recorded as skipped, not failed)."""


# --- the run ----------------------------------------------------------------------------------------------


def run(steps: list[str], smoke: bool, quick: bool, out: Path) -> dict:
    info = machine()
    records: list[dict] = []
    current: dict = {}  # the step under way, saved as "running" until it ends
    previous = json.loads(out.read_text()) if out.exists() and set(steps) != set(STEPS) else None

    def save() -> dict:
        result = {"suite": "recloop gpu_suite", "smoke": smoke, "quick": quick, "machine": info,
                  "steps": records + ([dict(current, status="running")] if current else []), "figures": figures.items}
        if previous is not None:  # --only: replace these steps' records in the file
            result["steps"] = [s for s in previous.get("steps", []) if s["name"] not in steps] + result["steps"]
            result["figures"] = [f for f in previous.get("figures", []) if f["step"] not in steps] + figures.items
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")  # a kill mid-write leaves the last whole file in place
        partial.write_text(json.dumps(result, indent=2) + "\n")
        os.replace(partial, out)
        return result

    figures = Figures(info, on_add=save)
    functions = {"tests": step_tests, "ptx": step_ptx, "embedding": step_embedding, "loader": step_loader,
                 "train": step_train, "cudf": step_cudf}
    for name in steps:
        started = time.perf_counter()
        current.update(name=name, status="running", seconds=None, error="stopped before the step ended")
        save()
        print(f"[gpu_suite] {name} ...", flush=True)
        try:
            functions[name](figures, smoke, quick)
            status, error = "ok", ""
        except SkipStep as skip:
            status, error = "skipped", str(skip)
        except Exception as err:  # noqa: BLE001 - a failing step is recorded; the suite goes on
            status, error = "failed", "".join(traceback.format_exception(err))[-4000:]
        records.append({"name": name, "status": status, "seconds": round(time.perf_counter() - started, 1),
                        "error": error})
        current.clear()
        save()
        print(f"[gpu_suite] {name}: {status} in {records[-1]['seconds']} s" + (f"\n{error}" if error else ""),
              flush=True)
    return save()


def table(result: dict) -> str:
    columns = ("name", "value", "unit", "baseline", "ratio", "limit", "target", "met")
    rows = [[_cell(f.get(c)) for c in columns] for f in result["figures"]]
    rows += [[f"step {s['name']}: {s['status']}", s["seconds"], "s", "", "", "", "", ""] for s in result["steps"]]
    rows = [[_cell(c) for c in row] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in rows)) if rows else len(c) for i, c in enumerate(columns)]
    lines = [" | ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)),
             "-|-".join("-" * w for w in widths)]
    lines += [" | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join(lines)


def _cell(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.4g}" if abs(value) < 1e6 else f"{value:,.0f}"
    return str(value)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes; on a CPU through Triton's interpreter")
    parser.add_argument("--quick", action="store_true", help="fewer shapes and rows")
    parser.add_argument("--only", help=f"comma-separated steps of {','.join(STEPS)}")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    steps = args.only.split(",") if args.only else list(STEPS)
    unknown = set(steps) - set(STEPS)
    if unknown:
        raise SystemExit(f"unknown steps {sorted(unknown)}; choose from {STEPS}")
    out = args.out or RESULTS / ("gpu_suite_smoke.json" if args.smoke else "gpu_suite.json")
    result = run(steps, args.smoke, args.quick, out)
    print(f"# recloop gpu_suite{' --smoke' if args.smoke else ''}: {result['machine']['gpu']}, "
          f"torch {result['machine']['torch']}, triton {result['machine']['triton']}, commit {result['machine']['commit']}")
    print(table(result))
    print(f"written: {out}")
    failed = [s["name"] for s in result["steps"] if s["status"] == "failed"]
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
