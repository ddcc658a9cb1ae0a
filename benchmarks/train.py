"""End-to-end training: recloop (chunked loader + fused kernels + compiled step) vs the same model on stock PyTorch.

    python benchmarks/train.py [--rows N | --events N --world] [--batch-size B] [--json out.json]

Both train the same DLRM (same MLPs, same tables, same initial weights) on the same training rows for
one epoch with the same optimizers — Adam for the MLPs and element-wise Adagrad for the embeddings:
recloop's ``TrainStep`` (forward + loss compiled as one graph on a GPU, fused Adam, the embeddings'
optimizer fused in the backward, no host synchronization per step) fed by ``ChunkLoader``; the
baseline's ``torch.optim.Adagrad`` on sparse gradients of one ``nn.EmbeddingBag`` per table, twice: fed
by a row-by-row ``DataLoader`` (the script a user writes), and fed the same batches already on the device
(``stock_preloaded``: the model's own speed, no loader in the way; issue 39 asks both, and a headline must
name which). Reported: samples/s over the whole epoch and after its first steps (the
steady rate: compilation and CUDA-graph capture left out, the ratio taken on it), and the validation AUC
of each at equal samples seen.

Rows: by default synthetic rows with a planted click model (``recloop.data.synthetic``: 13 dense
columns, 26 Zipf-distributed categorical columns, 2 multi-hot lists), which need nothing but torch and
pyarrow; ``--world`` builds them from the simulated world through ingestion and the feature job instead
(needs recloop's services installed). Targets (one H100): >= 8x the baseline and >= 6M samples/s, AUC
within 0.001.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from common import machine, report, use_source_tree
from torch import nn

use_source_tree()
from recloop.data import ChunkLoader, FeatureSchema  # noqa: E402
from recloop.data.synthetic import write_training_rows  # noqa: E402
from recloop.evaluate import metrics, predict  # noqa: E402
from recloop.model import ModelConfig, RankingModel, StepConfig, TrainStep, dense_optimizer, fit  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
EMBEDDING_LR = 0.05


class StockSparseArch(nn.Module):
    """One nn.EmbeddingBag per table over the same jagged batch layout."""

    def __init__(self, tables: list[tuple[str, int]], dim: int, mean_tables: set[str], initial: RankingModel):
        super().__init__()
        self.bags = nn.ModuleList(nn.EmbeddingBag(rows, dim, mode="mean" if name in mean_tables else "sum",
                                                  sparse=True) for name, rows in tables)
        for bag, (name, _) in zip(self.bags, tables, strict=True):
            bag.weight.data.copy_(initial.embeddings.weight(name).float())
        self.dim = dim

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        batch = (offsets.numel() - 1) // len(self.bags)
        pooled = []
        for t, bag in enumerate(self.bags):
            bounds = offsets[t * batch:(t + 1) * batch + 1]
            pooled.append(bag(values[bounds[0]:bounds[-1]], bounds[:-1] - bounds[0]))
        return torch.stack(pooled, dim=1)


class RowDataset(torch.utils.data.Dataset):
    def __init__(self, files: list[Path], schema: FeatureSchema):
        table = pa.concat_tables([pq.read_table(f) for f in files])
        self.dense = np.stack([table[c].to_numpy() for c in schema.dense], axis=1).astype(np.float32)
        self.categorical = np.stack([table[c].to_numpy() for c in schema.categorical], axis=1)
        self.lists = [table[c].to_pylist() for c in schema.multi_hot]
        self.label = table[schema.label].to_numpy().astype(np.float32)

    def __len__(self) -> int:
        return len(self.label)

    def __getitem__(self, i: int):
        return self.dense[i], self.categorical[i], [lst[i] for lst in self.lists], self.label[i]


def collate(rows):
    dense = torch.from_numpy(np.stack([r[0] for r in rows]))
    categorical = torch.from_numpy(np.stack([r[1] for r in rows]))
    label = torch.tensor([r[3] for r in rows])
    parts, lengths = [categorical.t().reshape(-1)], [torch.ones(categorical.numel(), dtype=torch.int64)]
    for k in range(len(rows[0][2])):
        lists = [r[2][k] for r in rows]
        parts.append(torch.tensor([v for lst in lists for v in lst], dtype=torch.int64))
        lengths.append(torch.tensor([len(lst) for lst in lists], dtype=torch.int64))
    all_lengths = torch.cat(lengths)
    return dense, label, torch.cat(parts), torch.cat([torch.zeros(1, dtype=torch.int64), all_lengths.cumsum(0)])


WARM_STEPS = 3  # steps left out of the steady rate: compilation, CUDA-graph capture, allocator warm-up


class SteadyClock:
    """Times an epoch's steady part: from the end of step ``warm_steps`` (compilation, CUDA-graph capture and
    allocator warm-up done) to the end of its last full batch (the partial one after it runs eagerly),
    synchronizing the GPU at both marks."""

    def __init__(self, rows: int, batch_size: int, warm_steps: int = WARM_STEPS):
        self.warm = warm_steps
        self.last = rows // batch_size  # the last full batch (shuffle buffers hold whole epochs here)
        if self.last <= warm_steps:
            raise ValueError(f"{rows} rows at batch {batch_size}: no full batch after the first {warm_steps}")
        self.marks: dict[int, tuple[float, int]] = {}

    def __call__(self, step: int, samples: int) -> None:
        if step in (self.warm, self.last):
            if CUDA:
                torch.cuda.synchronize()
            self.marks[step] = (time.perf_counter(), samples)

    def steady(self) -> tuple[int, float]:
        """(samples, seconds) between the two marks."""
        (began, first), (ended, last) = self.marks[self.warm], self.marks[self.last]
        return last - first, ended - began


def train_stock(model: nn.Module, batches, dense_lr: float, clock: SteadyClock | None = None) -> tuple[int, float]:
    """The baseline's epoch: plain eager PyTorch, as a stock training script has it."""
    dense_optimizer_ = torch.optim.Adam([p for n, p in model.named_parameters() if not n.startswith("sparse")],
                                        lr=dense_lr)
    sparse_optimizer = torch.optim.Adagrad(model.sparse_arch.parameters(), lr=EMBEDDING_LR, eps=1e-8)
    loss_fn = nn.BCEWithLogitsLoss()
    started, samples = time.perf_counter(), 0
    for steps, (dense, label, values, offsets) in enumerate(batches, start=1):
        dense, label = dense.to(DEVICE, non_blocking=True), label.to(DEVICE, non_blocking=True)
        values, offsets = values.to(DEVICE, non_blocking=True), offsets.to(DEVICE, non_blocking=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16, enabled=CUDA):
            logits = model(dense, values, offsets)
        loss = loss_fn(logits.float(), label)
        dense_optimizer_.zero_grad(set_to_none=True)
        sparse_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        dense_optimizer_.step()
        sparse_optimizer.step()
        samples += label.shape[0]
        if clock:
            clock(steps, samples)
    if CUDA:
        torch.cuda.synchronize()
    return samples, time.perf_counter() - started


def synthetic_rows(work: Path, rows: int, validation_rows: int, smoke: bool = False):
    """Training and validation files of synthetic Criteo-like rows (train and validation from one law)."""
    if smoke:
        categorical = {f"c_{i}": size for i, size in enumerate((3, 20, 50, 100))}
        multi_hot = {"m_0": 60}
    else:
        categorical = {f"c_{i}": min(size, 1_000_000) for i, size in enumerate(
            [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992, 5461306,
             10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572])}
        multi_hot = {"m_0": 100_000, "m_1": 20_000}
    shared = dict(categorical=categorical, multi_hot=multi_hot, hotness=3, row_group_size=1 << 15 if smoke else 1 << 17)
    train, schema = write_training_rows(work / "rows", rows, files=max(1, rows // 1_000_000), part="train", **shared)
    valid, _ = write_training_rows(work / "rows", validation_rows, files=1, part="valid", **shared)
    return train, valid, schema


def world_rows(work: Path, events: int):
    """Training rows of two simulated days through ingestion and the feature job (needs the services)."""
    from datetime import UTC, datetime

    from recloop.data import training_files
    from recloop.features.config import FeatureConfig
    from recloop.features.definition import FeatureLayout
    from recloop.features.job import build_features
    from recloop.ingest import ingest
    from recloop.schema import load_spec
    from recloop.settings import Settings
    from recloop.simulate import WorldConfig, simulate

    spec = load_spec("synthetic")
    simulate(WorldConfig(seed=0, days=2, events_per_day=events), work / "landing")
    settings = Settings(home=work / "home", frame_backend="pandas")
    ingest(work / "landing", spec, settings, now=datetime(2026, 6, 1, tzinfo=UTC))
    build_features(settings, spec, FeatureConfig.for_spec(spec))
    layout = FeatureLayout.for_settings(settings)
    files = training_files(layout.training)
    return files[:-6], files[-6:], FeatureSchema.load(layout.schema)


def measure(train_files: list[Path], valid_files: list[Path], schema: FeatureSchema, batch_size: int,
            embedding_dim: int = 16, backend: str = "auto", step_config: StepConfig | None = None,
            stock: bool = True, warm_steps: int = WARM_STEPS) -> dict:
    """One epoch of recloop and of the stock baseline on the same rows; samples/s and validation AUC
    (``stock=False``: recloop's alone)."""
    config = ModelConfig(embedding_dim=embedding_dim, embedding_optimizer="adagrad", embedding_lr=EMBEDDING_LR,
                         multi_hot_columns=tuple(schema.multi_hot), embedding_backend=backend)
    dense_lr = 1e-3 * (batch_size / 1024) ** 0.5
    step_config = step_config or StepConfig()
    results = {}

    ours = RankingModel(config, len(schema.dense), schema.tables, device=DEVICE, seed=0)
    stock = RankingModel(config, len(schema.dense), schema.tables, device=DEVICE, seed=0)
    stock.sparse_arch = StockSparseArch(schema.tables, config.embedding_dim, set(schema.multi_hot), ours).to(DEVICE)
    pad = 1 << 14 if CUDA and schema.multi_hot else None  # bucketed ids: few shapes for CUDA graphs
    loader = ChunkLoader(train_files, schema, batch_size, device=DEVICE, seed=0, pad_values_to=pad)
    step = TrainStep(ours, dense_optimizer(ours, dense_lr, DEVICE), step_config, DEVICE)
    clock = SteadyClock(loader.num_rows, batch_size, warm_steps)
    summary = fit(step, loader.epoch(0), dense_lr, on_step=clock)
    results["recloop"] = (summary["samples"], summary["seconds"], _auc(ours, valid_files, schema), *clock.steady())
    ours = step = None
    if CUDA:
        torch.cuda.empty_cache()
    if not stock:
        return {"batch_size": batch_size, **{f"recloop_{n}": v for n, v in zip(FIELDS, results["recloop"], strict=True)}}
    stock_batches = torch.utils.data.DataLoader(RowDataset(train_files, schema), batch_size=batch_size, shuffle=True,
                                                collate_fn=collate, generator=torch.Generator().manual_seed(0))
    clock = SteadyClock(loader.num_rows, batch_size, warm_steps)
    samples, seconds = train_stock(stock, stock_batches, dense_lr, clock)
    results["stock"] = (samples, seconds, _auc(stock, valid_files, schema), *clock.steady())
    if results["recloop"][0] != samples:
        raise RuntimeError(f"unequal samples seen: {results['recloop'][0]} vs {samples}")
    stock = None
    # The same model fed recloop's batches, already on the device before its clock starts: no loader cost.
    preloaded = [(b.dense, b.label, b.values, b.offsets) for b in
                 ChunkLoader(train_files, schema, batch_size, device=DEVICE, seed=0, pad_values_to=None).epoch(0)]
    fresh = RankingModel(config, len(schema.dense), schema.tables, device=DEVICE, seed=0)
    fresh.sparse_arch = StockSparseArch(schema.tables, config.embedding_dim, set(schema.multi_hot), fresh).to(DEVICE)
    clock = SteadyClock(loader.num_rows, batch_size, warm_steps)
    samples, seconds = train_stock(fresh, preloaded, dense_lr, clock)
    results["stock_preloaded"] = (samples, seconds, _auc(fresh, valid_files, schema), *clock.steady())
    if results["recloop"][0] != samples:
        raise RuntimeError(f"unequal samples seen: {results['recloop'][0]} vs {samples} (preloaded)")
    return {"batch_size": batch_size, **{f"{k}_{n}": v for k, values in results.items()
                                         for n, v in zip(FIELDS, values, strict=True)}}


# What measure() reports per trainer: the whole epoch (samples, seconds), the validation AUC, and the epoch's
# steady part (steady_samples, steady_seconds: SteadyClock, the rate without compilation).
FIELDS = ("samples", "seconds", "auc", "steady_samples", "steady_seconds")


def _auc(model: nn.Module, files: list[Path], schema: FeatureSchema) -> float:
    labels, scores, _ = predict(model, ChunkLoader(files, schema, 16384, device=DEVICE, shuffle=False).epoch(0))
    return metrics(labels, scores)["auc"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=4_000_000 if CUDA else 300_000, help="synthetic training rows")
    parser.add_argument("--world", action="store_true", help="rows from the simulated world (needs the services)")
    parser.add_argument("--events", type=int, default=2_000_000 if CUDA else 300_000, help="--world: events per day")
    parser.add_argument("--batch-size", type=int, default=16384 if CUDA else 4096)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="recloop-bench-train-"))
    try:
        if args.world:
            train_files, valid_files, schema = world_rows(work, args.events)
        else:
            train_files, valid_files, schema = synthetic_rows(work, args.rows, max(args.rows // 10, 50_000))
        result = measure(train_files, valid_files, schema, args.batch_size)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows = []
    for name, label in (("recloop", "recloop (ChunkLoader + fused kernels + TrainStep)"),
                        ("stock", "stock (nn.EmbeddingBag + row-by-row DataLoader)"),
                        ("stock_preloaded", "stock fed the same batches, preloaded on the device")):
        samples, seconds = result[f"{name}_samples"], result[f"{name}_seconds"]
        steady = result[f"{name}_steady_samples"] / result[f"{name}_steady_seconds"]
        stock_steady = result["stock_steady_samples"] / result["stock_steady_seconds"]
        recloop_steady = result["recloop_steady_samples"] / result["recloop_steady_seconds"]
        rows.append({"trainer": label, "samples": samples, "seconds": f"{seconds:.2f}",
                     "samples_per_s": f"{samples / seconds:,.0f}", f"after {WARM_STEPS} steps": f"{steady:,.0f}",
                     "vs stock": f"{steady / stock_steady:.1f}x",
                     "recloop vs it": f"{recloop_steady / steady:.1f}x",
                     "val_auc": f"{result[f'{name}_auc']:.4f}",
                     "target": ">= 8x, >= 6M/s, AUC within 0.001 (H100)"})
    rows.append({"trainer": "difference", "samples": "-", "seconds": "-", "samples_per_s": "-",
                 f"after {WARM_STEPS} steps": "-", "vs stock": "-", "recloop vs it": "-",
                 "val_auc": f"{result['recloop_auc'] - result['stock_auc']:+.4f}", "target": "-"})
    report(f"training: one epoch of DLRM, batch {args.batch_size}, on {DEVICE.type}", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
