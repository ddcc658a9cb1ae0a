"""Retrieval: the item index at catalog scale, and the two-tower model's quality against popularity.

    python benchmarks/retrieval.py [--items 100000] [--queries 200] [--k 500] [--skip-quality] [--json out.json]

1. **Index** on ``--items`` unit vectors of the model's width, clustered as trained item vectors are
   (around category centres): build time, one-query search time and recall of the exact top ``--k``
   for each index kind, beside the exact search (a brute-force product, torch) in the same run; recall
   also for queries far from every item cluster (the hard case for IVF's lists).
   Checked first: the exact reference equals numpy's full sort.
2. **Quality** on a simulated world: a full retriever trained on its lake; oracle recall@K (the share of
   each user's K best items by true click probability that retrieval returns) and held-out click
   recall@K, against the popularity baseline (the most clicked items) on the same users and clicks.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
from common import machine, report

from recloop.features.config import FeatureConfig
from recloop.features.job import build_features
from recloop.ingest import ingest
from recloop.model.retrieval import RetrievalConfig
from recloop.retrieval.evaluate import WorldOracle
from recloop.retrieval.index import IndexConfig, ItemIndex
from recloop.retrieval.train import RetrievalTrainConfig, train_retriever
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig, simulate


def clustered(n: int, dim: int, rng: np.random.Generator, centres: np.ndarray) -> np.ndarray:
    vectors = centres[rng.integers(0, len(centres), n)] + 0.7 * rng.normal(size=(n, dim))
    return (vectors / np.linalg.norm(vectors, axis=1, keepdims=True)).astype(np.float32)


def index_rows(items: int, queries: int, k: int) -> list[dict]:
    dim = RetrievalConfig().output_dim
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(24, dim))
    vectors, probes = clustered(items, dim, rng, centres), clustered(queries, dim, rng, centres)
    # The hard case: queries in directions no item cluster is near (a user unlike any category).
    strangers = clustered(queries, dim, rng, rng.normal(size=(24, dim)))
    ids = np.arange(items, dtype=np.int64)
    reference = ItemIndex.build(vectors, ids, IndexConfig(kind="flat"))
    exact, _ = reference.exact_search(probes, k)
    exact_strangers, _ = reference.exact_search(strangers, k)
    brute = np.argsort(-(probes[:8] @ vectors.T), axis=1, kind="stable")[:, :k]
    if not all(len(np.intersect1d(a, b)) >= k - 1 for a, b in zip(exact[:8], brute, strict=True)):  # ties aside
        raise SystemExit("the exact reference disagrees with numpy's sort: no timings reported")
    torch.set_num_threads(1)
    rows = []

    def one_query_ms(search) -> float:
        for q in probes[:5]:
            search(q[None], k)  # warm up
        times = []
        for q in probes:
            started = time.perf_counter()
            search(q[None], k)
            times.append(time.perf_counter() - started)
        return float(np.median(times) * 1000)

    exact_ms = one_query_ms(reference.exact_search)
    rows.append({"what": f"exact (torch product + topk), {items:,} items", "build_s": "-",
                 f"recall@{k}_vs_exact": 1.0, "recall_far_queries": 1.0, "query_ms_p50": round(exact_ms, 3),
                 "vs_exact": "1.00x"})
    for config in (IndexConfig(kind="ivf"), IndexConfig(kind="ivf", ivf_probe=32), IndexConfig(kind="hnsw"),
                   IndexConfig(kind="flat")):
        started = time.perf_counter()
        index = ItemIndex.build(vectors, ids, IndexConfig(**{**config.to_dict(), "threads": 1}))
        build = time.perf_counter() - started
        found, _ = index.search(probes, k)
        recall = float(np.mean([len(np.intersect1d(a, e)) / k for a, e in zip(found, exact, strict=True)]))
        far, _ = index.search(strangers, k)
        far_recall = float(np.mean([len(np.intersect1d(a, e)) / k for a, e in zip(far, exact_strangers,
                                                                                  strict=True)]))
        ms = one_query_ms(index.search)
        label = {"ivf": f"faiss ivf (lists sqrt(N), probe {config.ivf_probe})",
                 "hnsw": f"faiss hnsw (M {config.hnsw_neighbors}, ef {config.ef_search})",
                 "flat": "faiss flat (exact)"}[config.kind]
        rows.append({"what": label, "build_s": round(build, 2), f"recall@{k}_vs_exact": round(recall, 4),
                     "recall_far_queries": round(far_recall, 4), "query_ms_p50": round(ms, 3), "vs_exact": f"{exact_ms / ms:.2f}x"})
    return rows


def quality_rows(days: int, events: int, items: int, ks: tuple[int, ...]) -> list[dict]:
    world = WorldConfig(seed=1, days=days, events_per_day=events, num_items=items)
    spec = load_spec("synthetic")
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        simulate(world, root / "landing")
        settings = Settings(home=root / "home", frame_backend="pandas")
        ingest(root / "landing", spec, settings, now=datetime(2026, 2, 1, tzinfo=UTC))
        build_features(settings, spec, FeatureConfig.for_spec(spec))
        started = time.perf_counter()
        summary = train_retriever(settings, RetrievalTrainConfig(days=days, validation_hours=12, eval_ks=ks,
                                                                 device="cpu"), oracle=WorldOracle(World(world)))
        seconds = time.perf_counter() - started
    model, popular = summary.scores["overall"], summary.scores["popularity"]
    rows = []
    for name, figures in (("two-tower retriever", model), ("popularity baseline", popular)):
        row = {"what": name}
        for k in ks:
            row[f"oracle_recall@{k}"] = round(figures[f"oracle_recall@{k}"], 4)
        for k in ks:
            row[f"click_recall@{k}"] = round(figures[f"recall@{k}"], 4)
        row["train_s"] = round(seconds, 1) if name.startswith("two") else "-"
        rows.append(row)
    rows[0]["what"] += (f" ({summary.clicks:,} clicks, {summary.catalog_items:,} items, "
                        f"{model['oracle_users']} users, {model['clicks']:,} held-out clicks)")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--k", type=int, default=500)
    parser.add_argument("--world-days", type=int, default=5)
    parser.add_argument("--world-events", type=int, default=40_000)
    parser.add_argument("--world-items", type=int, default=4000)
    parser.add_argument("--skip-quality", action="store_true", help="only the index part")
    parser.add_argument("--json")
    args = parser.parse_args()
    info = machine()
    if not args.skip_quality:
        quality = quality_rows(args.world_days, args.world_events, args.world_items, (100, args.k))
        report(f"Retrieval quality: {args.world_days} simulated days x {args.world_events:,} events, "
               f"{args.world_items:,} items", quality, info, None)
    rows = index_rows(args.items, args.queries, args.k)
    report(f"Item index: {args.items:,} items, top {args.k}, one query at a time, 1 thread", rows, info,
           args.json)


if __name__ == "__main__":
    main()
