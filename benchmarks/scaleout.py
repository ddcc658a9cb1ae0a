"""Scale-out engines against the single-process path, on the same data, in one run.

    python benchmarks/scaleout.py features [--events 400000]         # local job vs Dask with 1 and 2 workers
    python benchmarks/scaleout.py train [--events-per-day 100000]    # 1 process vs 2 torchrun ranks (gloo)
    python benchmarks/scaleout.py serve [--rates 50,75,100]          # 1 vs 2 replicas on a PostgreSQL journal

Correct first: the Dask job's training rows must equal the local job's, and the 2-rank model must equal
the 1-process model on the same data shards before any time is reported: within three times the drift
that a 1e-6 relative change of the learning rate causes in the 1-process run (measured in the same run:
fp32 sums in another order are that kind of change, and row-wise Adagrad's first steps amplify them), and
AUC within 1e-3.
Communication share (train): wall time inside the blocking collectives of the sharded step (the
embedding all-to-alls and the per-step all-reduce of batch sizes), measured by wrapping
``torch.distributed``'s functions in the rank processes, over the training seconds; DDP's dense-gradient
all-reduce runs asynchronously inside the backward and is measured apart (the same bytes, all-reduced
alone as often as there were steps).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow.dataset as ds
from common import machine, report

from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.ingest import ingest
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import WorldConfig, simulate

CHECKOUT = Path(__file__).resolve().parents[1]
SPEC = load_spec("synthetic")
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(str(CHECKOUT / p) for p in ("platform", "kernels", ""))}


def lake(root: Path, world: WorldConfig, features: bool) -> Settings:
    simulate(world, root / "landing")
    settings = Settings(home=root / "home", frame_backend="pandas")
    ingest(root / "landing", SPEC, settings, now=datetime(2026, 6, 1, tzinfo=UTC))
    if features:
        build_features(settings, SPEC, FeatureConfig.for_spec(SPEC))
    return settings


def copy(settings: Settings, target: Path, **overrides) -> Settings:
    shutil.copytree(settings.home, target)
    return Settings(**{"home": target, "frame_backend": "pandas", **overrides})


# --- features -------------------------------------------------------------------------------------------------


def features(args, work: Path) -> list[dict]:
    from distributed import LocalCluster

    base = lake(work / "lake", WorldConfig(seed=1, days=2, events_per_day=args.events // 2), features=False)
    rows, reference, local_seconds = [], None, None
    for engine, workers in (("local", 0), ("dask", 1), ("dask", 2)):
        cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                               dashboard_address=None) if workers else None
        try:
            extra = {"features_engine": "dask", "dask_scheduler": cluster.scheduler_address} if cluster else {}
            settings = copy(base, work / f"{engine}-{workers}", **extra)
            started = time.perf_counter()
            summary = build_features(settings, SPEC, FeatureConfig.for_spec(SPEC))
            seconds = time.perf_counter() - started
        finally:
            if cluster:
                cluster.close()
        table = ds.dataset(FeatureLayout.for_settings(settings).training, format="parquet").to_table()
        if reference is None:
            reference, local_seconds = table, seconds
        assert table.equals(reference), f"{engine} with {workers} workers: training rows differ"  # correct first
        rows.append({"engine": engine, "workers": workers or "-", "events": summary.rows, "seconds": f"{seconds:.2f}",
                     "events_per_s": f"{summary.rows / seconds:,.0f}", "vs_local": f"{local_seconds / seconds:.2f}x"})
    return rows


# --- training -------------------------------------------------------------------------------------------------

RANK = """
import json, math, os, sys, time
import torch
import torch.distributed as dist
from recloop.model import ModelConfig
from recloop.settings import Settings
from recloop.train import TrainConfig, train

spent = {"seconds": 0.0, "calls": 0}
def timed(function):
    def wrapper(*args, **kwargs):
        began = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            spent["seconds"] += time.perf_counter() - began
            spent["calls"] += 1
    return wrapper
dist.all_to_all_single, dist.all_reduce = timed(dist.all_to_all_single), timed(dist.all_reduce)
torch.set_num_threads(int(sys.argv[3]))
raw = json.loads(sys.argv[2])
config = TrainConfig(**{**raw, "model": ModelConfig.from_dict(raw["model"])})
summary = train(Settings(home=sys.argv[1], frame_backend="pandas"), config)
dense = 0
if dist.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
    dist.init_process_group("gloo")
    from safetensors import safe_open
    with safe_open(f"{summary.checkpoint}/model.safetensors", framework="pt") as f:  # the dense parameters' size
        size = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                   if k.endswith((".weight", ".bias")) and not k.startswith("sparse_arch."))
    grads = torch.zeros(size)
    began = time.perf_counter()
    for _ in range(summary.steps):
        dist.all_reduce(grads)
    dense = time.perf_counter() - began
    dist.destroy_process_group()
print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "summary": summary.to_dict(), "collectives": spent,
                  "dense_allreduce_seconds": dense}))
"""


def _train_run(home: Path, config, processes: int, threads: int, work: Path) -> list[dict]:
    script = work / "rank.py"
    script.write_text(RANK)
    launcher = [sys.executable] if processes == 1 else [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                                        f"--nproc-per-node={processes}"]
    env = {**ENV, "OMP_NUM_THREADS": str(threads)}
    done = subprocess.run([*launcher, str(script), str(home), json.dumps(config.to_dict()), str(threads)], env=env,
                          capture_output=True, text=True, timeout=1800)
    if done.returncode:
        raise RuntimeError(done.stderr[-3000:])
    ranks = sorted((json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")),
                   key=lambda r: r["rank"])
    if processes > 1:  # the ranks trained; this process completes the run, as `recloop train --nproc` does
        from recloop.settings import Settings
        from recloop.train import complete

        completed = complete(Settings(home=home, frame_backend="pandas"), ranks[0]["summary"]["checkpoint"])
        for rank in ranks:
            rank["summary"] = completed.to_dict()
    return ranks


def training(args, work: Path) -> list[dict]:
    from safetensors.torch import load_file

    from recloop.model import ModelConfig
    from recloop.train import TrainConfig

    base = lake(work / "lake", WorldConfig(seed=2, days=3, events_per_day=args.events_per_day), features=True)
    config = TrainConfig(days=3, epochs=1, batch_size=args.batch_size, validation_hours=6, device="cpu",
                         deterministic=True, checkpoint_every=10**9, model=ModelConfig())
    from dataclasses import replace

    runs = [("1 process, 1 thread", 1, 1, 1, 1.0), ("1 process, 2 threads", 1, 2, 1, 1.0),
            ("1 process, 2 data shards (reference)", 1, 1, 2, 1.0), ("2 processes (gloo), 1 thread each", 2, 1, 2, 1.0),
            ("1 process, 2 data shards, lr x (1 + 1e-6) (noise yardstick)", 1, 1, 2, 1 + 1e-6)]
    rows, results = [], {}
    for name, processes, threads, shards, lr_factor in runs:
        home = copy(base, work / f"run-{len(results)}").home
        results[name] = _train_run(home, replace(config, data_shards=shards, lr=config.lr * lr_factor), processes,
                                   threads, work)

    def weights(run: int) -> dict:
        return load_file(Path(results[runs[run][0]][0]["summary"]["checkpoint"]) / "model.safetensors")

    def drift(a: dict, b: dict, dense: bool) -> float:
        keys = [k for k in a if a[k].is_floating_point() and a[k].numel() and k.startswith("sparse_arch") != dense]
        return float(sum((a[k] - b[k]).double().norm() ** 2 for k in keys) ** 0.5
                     / sum(a[k].double().norm() ** 2 for k in keys) ** 0.5)

    reference, two, noise = weights(2), weights(3), weights(4)
    ranks_drift = {part: drift(reference, two, part == "dense") for part in ("dense", "tables")}
    noise_drift = {part: drift(reference, noise, part == "dense") for part in ("dense", "tables")}
    auc_gap = abs(results[runs[3][0]][0]["summary"]["auc"] - results[runs[2][0]][0]["summary"]["auc"])
    assert all(ranks_drift[p] <= 3 * noise_drift[p] + 1e-6 for p in ranks_drift) and auc_gap < 1e-3, \
        (ranks_drift, noise_drift, auc_gap)  # correct first
    first = results[runs[0][0]][0]["summary"]["samples_per_s"]
    for name, *_ in runs[:4]:
        ranks = results[name]
        summary = ranks[0]["summary"]
        collective = max(r["collectives"]["seconds"] for r in ranks)
        dense = max(r["dense_allreduce_seconds"] for r in ranks)
        rows.append({"run": name, "samples": summary["samples"], "steps": summary["steps"],
                     "seconds": summary["seconds"], "samples_per_s": f"{summary['samples_per_s']:,.0f}",
                     "vs_1x1": f"{summary['samples_per_s'] / first:.2f}x", "auc": f"{summary['auc']:.4f}",
                     "communication": f"{collective / summary['seconds']:.0%} (+{dense / summary['seconds']:.0%} dense)"
                     if len(ranks) > 1 else "-"})
    rows.append({"run": "check: relative drift from the reference, 2 ranks | lr x (1 + 1e-6)",
                 "samples": "", "steps": "", "seconds": "",
                 "samples_per_s": f"dense {ranks_drift['dense']:.1e} | {noise_drift['dense']:.1e}",
                 "vs_1x1": f"tables {ranks_drift['tables']:.1e} | {noise_drift['tables']:.1e}",
                 "auc": f"gap {auc_gap:.1e}", "communication": ""})
    return rows


# --- serving --------------------------------------------------------------------------------------------------


def serving(args, work: Path) -> list[dict]:
    import uuid

    import psycopg2
    from serve import REDIS_URL, TOKEN, offer

    from recloop.serve.traffic import SimulatedUsers
    from recloop.simulate import World

    world_config = WorldConfig(seed=21, days=4, events_per_day=args.events_per_day)
    settings = _serving_setup(work, world_config, REDIS_URL)
    world = World(world_config).replay()
    users = SimulatedUsers(world, day=world_config.days + 0.1, candidates=100, seed=3)
    bodies = [users.request()[0] for _ in range(2000)]
    name = f"recloop_bench_{uuid.uuid4().hex[:8]}"
    admin = psycopg2.connect("postgresql://postgres@127.0.0.1:5432/postgres")
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    rows = []
    try:
        env = {**ENV, "RECLOOP_HOME": str(settings.home), "RECLOOP_FEAST_ONLINE_STORE": "redis",
               "RECLOOP_REDIS_URL": REDIS_URL, "RECLOOP_ADMIN_TOKEN": TOKEN, "RECLOOP_FRAME_BACKEND": "pandas",
               "RECLOOP_JOURNAL": "postgres", "RECLOOP_POSTGRES_DSN": f"postgresql://postgres@127.0.0.1:5432/{name}"}
        for replicas in (1, 2):
            ports = [args.port + i for i in range(replicas)]
            servers = [subprocess.Popen([sys.executable, "-m", "recloop.cli", "serve", "--port", str(p)], env=env,
                                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) for p in ports]
            try:
                urls = [f"http://127.0.0.1:{p}" for p in ports]
                _wait_ready(urls)
                for rate in (float(r) for r in args.rates.split(",")):
                    # Round-robin: each replica gets every other request, at rate / replicas.
                    parts = asyncio.run(_offer_all(offer, urls, bodies, rate, args.seconds))
                    p99 = max(p["p99_ms"] for p in parts)
                    errors = sum(p["errors"] for p in parts)
                    rows.append({"replicas": replicas, "offered_rps": rate,
                                 "achieved_rps": round(sum(p["achieved_rps"] for p in parts), 1),
                                 "p50_ms": max(p["p50_ms"] for p in parts), "p99_ms": p99, "errors": errors,
                                 "met (p99 <= 30 ms)": "yes" if p99 <= 30 and errors == 0 else "no"})
            finally:
                for server in servers:
                    server.terminate()
                for server in servers:
                    server.wait(timeout=30)
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
    return rows


def _serving_setup(root: Path, world: WorldConfig, redis_url: str) -> Settings:
    """Lake, features in Redis (its database flushed first), a trained champion v1."""
    from datetime import timedelta

    import redis

    from recloop import pipeline
    from recloop.features import store
    from recloop.gate import GateThresholds, run_gate
    from recloop.train import TrainConfig, train

    redis.Redis.from_url(redis_url).flushdb()
    settings = Settings(home=root / "home", frame_backend="pandas", feast_online_store="redis", redis_url=redis_url)
    simulate(world, root / "landing")
    ingest(root / "landing", SPEC, settings, now=datetime(2026, 6, 1, tzinfo=UTC))
    build_features(settings, SPEC, FeatureConfig.for_spec(SPEC))
    store.apply_repo(settings)
    store.materialize(settings, world.start + timedelta(days=world.days), timedelta(days=7))
    summary = train(settings, TrainConfig(days=world.days, epochs=1, batch_size=2048, validation_hours=12,
                                          device="cpu"))
    logged = pipeline.register_training(settings, summary)
    outcome = run_gate(settings, logged.version, GateThresholds(calibration_range=(0.5, 2.0)), smoke_check=False)
    assert outcome.passed, outcome.reasons
    return settings


async def _offer_all(offer, urls: list[str], bodies: list[dict], rate: float, seconds: float) -> list[dict]:
    share = rate / len(urls)
    return await asyncio.gather(*(offer(url, bodies[i::len(urls)], share, seconds) for i, url in enumerate(urls)))


def _wait_ready(urls: list[str]) -> None:
    import httpx

    deadline = time.time() + 180
    for url in urls:
        while True:
            try:
                if httpx.get(f"{url}/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{url} did not become ready")
            time.sleep(0.5)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("part", choices=["features", "train", "serve"])
    parser.add_argument("--events", type=int, default=400_000, help="features: events in the lake (two days)")
    parser.add_argument("--events-per-day", type=int, default=None, help="train: 100k/day; serve: 20k/day")
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--rates", default="50,75,100")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--port", type=int, default=8775)
    parser.add_argument("--json")
    args = parser.parse_args()
    args.events_per_day = args.events_per_day or (100_000 if args.part == "train" else 20_000)
    work = Path(tempfile.mkdtemp(prefix=f"recloop-bench-scaleout-{args.part}-"))
    try:
        rows = {"features": features, "train": training, "serve": serving}[args.part](args, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    np.set_printoptions(precision=3)
    report(f"scale-out: {args.part}, single process vs several (2 cores, shared)", rows, machine(), args.json)


if __name__ == "__main__":
    main()
