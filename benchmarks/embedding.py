"""Fused embedding bags: forward, and backward + fused row-wise Adagrad, against the physical limit.

    python benchmarks/embedding.py [--quick] [--json out.json]

Per shape, side by side in one run on the same inputs (ids uniform and power-law):

- recloop ``EmbeddingBagCollection`` (Triton on a GPU; the PyTorch reference on a CPU), optimizer
  ``rowwise_adagrad`` fused into the backward;
- baseline: one ``nn.EmbeddingBag`` per table + ``torch.optim.Adagrad``, with dense gradients and with
  sparse gradients.

On a GPU each figure is also reported as achieved GB/s (the fewest bytes the pass must move) next to the
device-to-device copy bandwidth measured in the same run. Targets (recloop_kernels issue, one H100):
forward >= 75 % and backward + fused row-wise Adagrad >= 50 % of copy bandwidth; on the Criteo-like
shape >= 20x the dense baseline and >= 5x the sparse one. Without a GPU the script runs small shapes on
the CPU, reports ratios only, and says that no GPU was present.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from common import machine, report
from torch import nn

from recloop_kernels import EmbeddingBagCollection, TableConfig

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
# Criteo Kaggle cardinalities (the 26 categorical features), capped for the dense baseline's memory.
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]


@dataclass(frozen=True)
class Shape:
    name: str
    rows: tuple[int, ...]
    dim: int
    hotness: int
    batch: int


def gpu_shapes(quick: bool) -> list[Shape]:
    shapes = [Shape(f"1 table 10M rows, dim {d}, 64-hot, batch 8K", (10_000_000,), d, 64, 8192) for d in (32, 64, 128)]
    shapes.append(Shape("100 features x 10-hot, vocab 8192, dim 64, batch 8K", (8192,) * 100, 64, 10, 8192))
    shapes.append(Shape("Criteo-like: 26 tables, dim 128, one-hot, batch 64K", tuple(CRITEO_ROWS), 128, 1, 65536))
    return shapes[-2:] if quick else shapes


def cpu_shapes() -> list[Shape]:
    return [Shape("CPU: 1 table 200k rows, dim 64, 16-hot, batch 1K", (200_000,), 64, 16, 1024),
            Shape("CPU: 26 tables up to 200k rows, dim 32, one-hot, batch 4K",
                  tuple(min(r, 200_000) for r in CRITEO_ROWS), 32, 1, 4096)]


def make_ids(shape: Shape, power_law: bool, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    per_table = shape.batch * shape.hotness
    ids = []
    for rows in shape.rows:
        u = torch.rand(per_table, generator=g)
        ids.append(((u ** 8 if power_law else u) * rows).long().clamp(max=rows - 1))
    values = torch.cat(ids).to(DEVICE)
    offsets = (torch.arange(len(shape.rows) * shape.batch + 1) * shape.hotness).to(DEVICE)
    return values, offsets


def timeit(fn, repeats: int) -> float:
    """Median seconds of ``fn`` (CUDA events on a GPU), after warm-up."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            fn()
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes/s): read + write of a 1 GiB buffer."""
    src = torch.empty(1 << 28, dtype=torch.float32, device=DEVICE)
    dst = torch.empty_like(src)
    seconds = timeit(lambda: dst.copy_(src), 20)
    return 2 * src.numel() * 4 / seconds


class Baseline(nn.Module):
    """One nn.EmbeddingBag per table, as a model built on stock PyTorch would have it."""

    def __init__(self, ebc: EmbeddingBagCollection, sparse: bool):
        super().__init__()
        self.bags = nn.ModuleList()
        for table in ebc.tables:
            bag = nn.EmbeddingBag(table.num_embeddings, table.dim, mode="sum", sparse=sparse, device=DEVICE)
            bag.weight.data.copy_(ebc.weight(table.name).float())
            self.bags.append(bag)

    def forward(self, values, offsets, batch):
        outs = []
        for t, bag in enumerate(self.bags):
            bounds = offsets[t * batch:(t + 1) * batch + 1]
            start = bounds[0]
            outs.append(bag(values[start:bounds[-1]], bounds[:-1] - start))
        return torch.cat(outs, dim=1)


def measure(shape: Shape, power_law: bool, bandwidth: float | None, repeats: int) -> list[dict]:
    tables = [TableConfig(f"t{i}", rows, shape.dim) for i, rows in enumerate(shape.rows)]
    ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.01, device=DEVICE, check_ids=False)
    values, offsets = make_ids(shape, power_law, seed=1)
    upstream = torch.randn(shape.batch, len(tables) * shape.dim, device=DEVICE)

    # Correct first: the forward against nn.EmbeddingBag, and one fused step against the reference.
    dense = Baseline(ebc, sparse=False)
    expected = dense(values, offsets, shape.batch)
    out = ebc(values, offsets)
    error = ((out - expected).norm() / expected.norm()).item()
    if not error < 1e-5 or torch.isnan(out).any():
        raise SystemExit(f"{shape.name}: forward relative error {error:.2e}; refusing to report a time")
    if CUDA:
        small = [TableConfig(f"t{i}", min(r, 50_000), shape.dim) for i, r in enumerate(shape.rows[:4])]
        check = [EmbeddingBagCollection(small, optimizer="rowwise_adagrad", lr=0.01, device=DEVICE, backend=b, seed=1)
                 for b in ("reference", "triton")]
        v, o = make_ids(Shape("check", tuple(t.num_embeddings for t in small), shape.dim, shape.hotness, 512),
                        power_law, seed=2)
        for m in check:
            (m(v, o) * 0.1).sum().backward()
        w_error = ((check[0].weights - check[1].weights).norm() / check[0].weights.norm()).item()
        if not w_error < 1e-5:
            raise SystemExit(f"{shape.name}: fused update relative error {w_error:.2e}; refusing to report a time")

    def recloop_forward():
        with torch.no_grad():
            ebc(values, offsets)

    def recloop_step():
        (ebc(values, offsets) * upstream).sum().backward()

    forward_s = timeit(recloop_forward, repeats)
    backward_s = max(timeit(recloop_step, repeats) - forward_s, 1e-9)

    nnz, elem = values.numel(), 4
    unique_rows = sum(int(torch.unique(values[offsets[t * shape.batch]:offsets[(t + 1) * shape.batch]]).numel())
                      for t in range(len(tables)))
    forward_bytes = nnz * 8 + offsets.numel() * 8 + nnz * shape.dim * elem + upstream.numel() * 4
    backward_bytes = upstream.numel() * 4 + nnz * 8 + unique_rows * (2 * shape.dim * elem + 2 * 4)

    baselines = {}
    for sparse in (False, True):
        model = Baseline(ebc, sparse=sparse)
        optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)

        def step(model=model, optimizer=optimizer):
            optimizer.zero_grad(set_to_none=True)
            (model(values, offsets, shape.batch) * upstream).sum().backward()
            optimizer.step()

        def forward_only(model=model):
            with torch.no_grad():
                model(values, offsets, shape.batch)

        base_forward = timeit(forward_only, repeats)
        baselines[sparse] = (base_forward, max(timeit(step, max(3, repeats // 4)) - base_forward, 1e-9))

    ids = "power-law" if power_law else "uniform"

    def row(what: str, seconds: float, moved: int, base: tuple[float, float], which: int) -> dict:
        achieved = moved / seconds
        return {
            "shape": shape.name, "ids": ids, "pass": what, "ms": f"{seconds * 1e3:.3f}",
            "GB/s": f"{achieved / 1e9:.0f}" if CUDA else "-",
            "of copy BW": f"{achieved / bandwidth:.0%}" if bandwidth else "-",
            "vs dense": f"{baselines[False][which] / seconds:.1f}x",
            "vs sparse": f"{baselines[True][which] / seconds:.1f}x",
        }

    return [row("forward", forward_s, forward_bytes, baselines[False], 0),
            row("backward + rowwise adagrad", backward_s, backward_bytes, baselines[False], 1)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer shapes")
    parser.add_argument("--repeats", type=int, default=20 if CUDA else 5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    info = machine()
    bandwidth = None
    if CUDA:
        bandwidth = copy_bandwidth()
        info["copy_bandwidth_GB/s"] = f"{bandwidth / 1e9:.0f}"
        info["triton"] = __import__("triton").__version__
    else:
        info["note"] = ("no GPU present: recloop runs its PyTorch reference on the CPU; no bandwidth figures, "
                        "and the targets apply to a GPU only")
    rows = []
    for shape in gpu_shapes(args.quick) if CUDA else cpu_shapes():
        for power_law in (False, True):
            rows.extend(measure(shape, power_law, bandwidth, args.repeats))
    report("embedding bags: recloop vs nn.EmbeddingBag + torch.optim.Adagrad", rows, info, args.json_path)


if __name__ == "__main__":
    main()
