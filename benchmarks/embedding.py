"""Fused embedding bags: forward, and backward + fused row-wise Adagrad, against the physical limit.

    python benchmarks/embedding.py [--quick] [--smoke] [--json out.json]

Per shape (BENCHMARKS.md: one 10M-row table at dims 32/64/128, 64-hot; 100 features × 10-hot over 8192
rows; Criteo-like 26 tables at dim 128, one-hot, batch 64K), weight dtype (fp32, bf16) and id law
(uniform, Zipf α = 1.05), side by side in one run on the same inputs:

- recloop ``EmbeddingBagCollection`` (Triton on a GPU), ``rowwise_adagrad`` fused into the backward;
- baseline: one ``nn.EmbeddingBag`` per table + ``torch.optim.Adagrad``, dense gradients, then sparse
  gradients. Table bounds are host integers (no host synchronization in the baselines either).
- FBGEMM (issue 39), where ``fbgemm_gpu`` imports (a GPU; ``benchmarks/gpu_wheels.py fbgemm`` carries it):
  ``SplitTableBatchedEmbeddingBagsCodegen``, what TorchRec runs, with the same tables, initial weights,
  ids, sum pooling, exact row-wise Adagrad (lr 0.01, eps 1e-8), weight dtype (stochastic rounding on both
  sides for bf16) and fp32 output, bounds checks off on both sides. Before it is timed, its forward and
  one fused update are checked equal to recloop's on the whole shape (the rows the batch touches).

Timing: CUDA events around the pass alone (the forward feeding a backward runs untimed), with the GPU's
queue held so that they time the device's work, not the host's (``timed``), median of ``--repeats``; the
forward is also timed with the host's time per call included (``forward_host_s``). The backward is
``torch.autograd.backward(out, grad)`` (+ ``optimizer.step()`` for the baselines). Models are freed between measurements; row counts are capped at 5M per table so that recloop
and a dense baseline (weight, gradient, Adagrad state) fit in 80 GB together. Achieved GB/s count the
fewest bytes a pass must move (RESULTS.md: byte accounting), next to the device-to-device copy bandwidth
measured in the same run. Also reported: the longest run (occurrences of the most used row of a
table: the work one backward program would serialize without the split) and the kernel launches of
each pass (the profiler's count on a GPU; Triton launches in the interpreter).

Targets (one H100): forward >= 75 % and backward + fused row-wise Adagrad >= 50 % of copy bandwidth;
on the Criteo-like shape >= 20x the dense baseline and >= 5x the sparse one. ``--smoke``: tiny shapes
on the CPU through Triton's interpreter (correctness and plumbing only; no figure is a speed).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time
from dataclasses import dataclass

import torch
from common import machine, report, use_source_tree
from torch import nn

use_source_tree()
from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = torch.device("cuda" if CUDA else "cpu")
ROW_CAP = 5_000_000  # rows per table: recloop + a dense baseline (weight, grad, state) fit in 80 GB
# Criteo Kaggle cardinalities (the 26 categorical features).
CRITEO_ROWS = [1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194, 27, 14992,
               5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572]
TARGETS = {"forward": 0.75, "backward": 0.50}


@dataclass(frozen=True)
class Shape:
    name: str
    rows: tuple[int, ...]
    dim: int
    hotness: int
    batch: int

    @property
    def key(self) -> str:
        """A short name: tables × dim, hotness, batch (``criteo`` for the Criteo-like shape)."""
        batch = f"{self.batch // 1024}K" if self.batch >= 1024 else str(self.batch)
        prefix = "criteo " if self.name.startswith("Criteo") else ""
        return f"{prefix}{len(self.rows)}x{max(self.rows):,}r d{self.dim} {self.hotness}-hot b{batch}"


def gpu_shapes(quick: bool = False) -> list[Shape]:
    shapes = [Shape("Criteo-like: 26 tables (capped at 5M rows), dim 128, one-hot, batch 64K",
                    tuple(min(r, ROW_CAP) for r in CRITEO_ROWS), 128, 1, 65536),
              # issue 39: the dataset's real cardinalities (33.8M rows, the largest 10.1M); with Zipf ids the
              # heavy tail of the real logs. The dense baseline needs 3 x 17.3 GB (weight, gradient, state).
              Shape("Criteo uncapped: 26 tables at Criteo's cardinalities (largest 10.1M rows), dim 128, one-hot, "
                    "batch 64K", tuple(CRITEO_ROWS), 128, 1, 65536)]
    shapes += [Shape(f"1 table 10M rows, dim {d}, 64-hot, batch 8K", (10_000_000,), d, 64, 8192) for d in (128, 64, 32)]
    shapes.append(Shape("100 features x 10-hot, vocab 8192, dim 64, batch 8K", (8192,) * 100, 64, 10, 8192))
    return [shapes[0], shapes[-1]] if quick else shapes


def smoke_shapes() -> list[Shape]:
    return [Shape("smoke: 5 tables (one of 3 rows), dim 16, one-hot, batch 32", (3, 20, 50, 7, 30), 16, 1, 32),
            Shape("smoke: 1 table 100 rows, dim 8, 6-hot, batch 16", (100,), 8, 6, 16)]


def make_ids(shape: Shape, ids: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed-hotness bags, table-major; ``uniform`` or ``zipf`` (P(rank k) ∝ k^-1.05, ranks shuffled)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    per_table = shape.batch * shape.hotness
    parts = []
    for rows in shape.rows:
        if ids == "zipf":
            cdf = torch.cumsum(torch.arange(1, rows + 1, device=DEVICE, dtype=torch.float64) ** -1.05, 0)
            ranks = torch.searchsorted(cdf, torch.rand(per_table, generator=g, device=DEVICE, dtype=torch.float64)
                                       * cdf[-1]).clamp(max=rows - 1)
            parts.append(torch.randperm(rows, generator=g, device=DEVICE)[ranks])
        else:
            parts.append(torch.randint(0, rows, (per_table,), generator=g, device=DEVICE))
    values = torch.cat(parts)
    offsets = torch.arange(len(shape.rows) * shape.batch + 1, device=DEVICE) * shape.hotness
    return values, offsets


def fbgemm_missing() -> str | None:
    """Why FBGEMM's TBE cannot be measured here (None when it can): it needs CUDA and ``fbgemm_gpu``."""
    if not CUDA:
        return "no GPU"
    try:
        import fbgemm_gpu.split_table_batched_embeddings_ops_training  # noqa: F401
    except Exception as err:  # noqa: BLE001 - the reason is reported, not raised
        return f"fbgemm_gpu does not import: {type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    return None


# FBGEMM's weights for recloop's: the released fbgemm_gpu 1.6.0 has no bf16 training kernel ("batched_embedding_
# forward_kernel_2 not implemented for emb_t 'BFloat16'", H200, 2026-11-28), so recloop's bf16 tables are set
# beside FBGEMM's fp16 ones: the same two bytes a weight, the nearest type FBGEMM ships (fp16 against fp16 is
# measured too).
FBGEMM_DTYPE = {torch.float32: torch.float32, torch.float16: torch.float16, torch.bfloat16: torch.float16}


def fbgemm_tbe(tables: list[TableConfig], dtype: torch.dtype):
    """FBGEMM's training TBE configured as recloop's benchmark collection: device tables, sum pooling, exact
    row-wise Adagrad (lr 0.01, eps 1e-8, FBGEMM's stochastic rounding for half weights, as recloop's), fp32
    output, no bounds check (recloop runs with ``check_ids="off"``); weights of ``FBGEMM_DTYPE[dtype]``."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType, SparseType
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
        BoundsCheckMode,
        ComputeDevice,
        EmbeddingLocation,
        PoolingMode,
    )
    from fbgemm_gpu.split_table_batched_embeddings_ops_training import SplitTableBatchedEmbeddingBagsCodegen

    precision = {torch.float32: SparseType.FP32, torch.float16: SparseType.FP16}[FBGEMM_DTYPE[dtype]]
    return SplitTableBatchedEmbeddingBagsCodegen(
        [(t.num_embeddings, t.dim, EmbeddingLocation.DEVICE, ComputeDevice.CUDA) for t in tables],
        optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=0.01, eps=1e-8,
        # cache_precision: FBGEMM's default is the weights' (bf16: "cache_precision bf16 not supported!",
        # H200, 2026-11-28); the tables live on the device here, so no cache row is ever used
        weights_precision=precision, cache_precision=SparseType.FP32, output_dtype=SparseType.FP32,
        pooling_mode=PoolingMode.SUM,
        bounds_check_mode=BoundsCheckMode.NONE, stochastic_rounding=True, device=DEVICE)


def check_against_fbgemm(ebc: EmbeddingBagCollection, tbe, shape: Shape, values: torch.Tensor,
                         offsets: torch.Tensor, upstream: torch.Tensor) -> tuple[float, float]:
    """Give FBGEMM recloop's weights (both optimizers fresh), then one forward and one fused step on each:
    (forward relative error, updated-rows relative error), over the rows the batch touches."""
    per_table = shape.batch * shape.hotness
    weights = tbe.split_embedding_weights()  # views of FBGEMM's device buffer, one per table
    touched = [torch.unique(values[t * per_table:(t + 1) * per_table]) for t in range(len(ebc.tables))]
    with torch.no_grad():
        for table, w in zip(ebc.tables, weights, strict=True):
            w.copy_(ebc.weight(table.name))
        ours, theirs = ebc(values, offsets).float(), tbe(values, offsets).float()
        forward_error = ((ours - theirs).norm() / ours.norm()).item()
    del ours, theirs
    torch.autograd.backward(ebc(values, offsets), upstream)
    torch.autograd.backward(tbe(values, offsets), upstream)
    with torch.no_grad():
        ours = torch.cat([ebc.weight(t.name)[rows].float().flatten() for t, rows in zip(ebc.tables, touched, strict=True)])
        theirs = torch.cat([w[rows].float().flatten() for w, rows in zip(weights, touched, strict=True)])
        update_error = ((ours - theirs).norm() / ours.norm()).item()
    return forward_error, update_error


def run_statistics(shape: Shape, values: torch.Tensor) -> tuple[int, int]:
    """(unique rows touched, longest run: occurrences of the most used row of any table)."""
    per_table = shape.batch * shape.hotness
    unique, longest = 0, 0
    for t in range(len(shape.rows)):
        _, counts = torch.unique(values[t * per_table:(t + 1) * per_table], return_counts=True)
        unique += counts.numel()
        longest = max(longest, int(counts.max()))
    return unique, longest


def timed(run, setup=None, repeats: int = 10, hold_queue: bool = True) -> float:
    """Median seconds of ``run`` (CUDA events around it alone on a GPU); ``setup`` before each, untimed.

    ``hold_queue`` (GPU): before each timed call the GPU is kept busy (``torch.cuda._sleep``) for about twice
    the host time of one call, so that the call's launches queue up behind it and the events time the device
    work alone, not the host's Python and dispatch in between (H200, 2026-11-26: without it the same forward
    kernel timed 0.61 to 0.72 ms across one sweep, and a 34 µs long-bag kernel 150 to 360 µs). A call that
    synchronizes with the host inside still pays for it. ``hold_queue=False``: the host time is included.
    """
    host_s = 0.0
    for _ in range(2 if CUDA else 1):
        state = setup() if setup else None
        if CUDA:
            torch.cuda.synchronize()
        begin = time.perf_counter()
        run(state)
        host_s = time.perf_counter() - begin
    times = []
    for _ in range(repeats):
        state = setup() if setup else None
        if CUDA:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            if hold_queue:
                torch.cuda._sleep(int(_sleep_cycles_per_second() * min(0.05, 2 * host_s + 50e-6)))
            start.record()
            run(state)
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1000)
        else:
            begin = time.perf_counter()
            run(state)
            times.append(time.perf_counter() - begin)
    return statistics.median(times)


_SLEEP_RATE: list[float] = []


def _sleep_cycles_per_second() -> float:
    """``torch.cuda._sleep``'s cycles per second on this GPU (measured once)."""
    if not _SLEEP_RATE:
        torch.cuda._sleep(1_000_000)  # warm
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(10_000_000)
        end.record()
        torch.cuda.synchronize()
        _SLEEP_RATE.append(10_000_000 / (start.elapsed_time(end) / 1000))
    return _SLEEP_RATE[0]


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth (bytes/s): read + write of a 1 GiB buffer."""
    buffers = [torch.empty(1 << 28, dtype=torch.float32, device=DEVICE) for _ in range(2)]
    seconds = timed(lambda _: buffers[1].copy_(buffers[0]), repeats=20)
    buffers.clear()
    free()
    return 2 * (1 << 28) * 4 / seconds


class Baseline(nn.Module):
    """One nn.EmbeddingBag per table, as a model built on stock PyTorch would have it; bounds on the host."""

    def __init__(self, ebc: EmbeddingBagCollection, shape: Shape, sparse: bool):
        super().__init__()
        self.bags = nn.ModuleList()
        for table in ebc.tables:
            bag = nn.EmbeddingBag(table.num_embeddings, table.dim, mode="sum", sparse=sparse, device=DEVICE,
                                  dtype=ebc.weights.dtype)
            with torch.no_grad():
                bag.weight.copy_(ebc.weight(table.name))
            self.bags.append(bag)
        self.per_table = shape.batch * shape.hotness
        self.bag_offsets = torch.arange(shape.batch, device=DEVICE) * shape.hotness

    def forward(self, values: torch.Tensor) -> torch.Tensor:
        return torch.cat([bag(values[t * self.per_table:(t + 1) * self.per_table], self.bag_offsets).float()
                          for t, bag in enumerate(self.bags)], dim=1)


class LaunchCounter:
    """Kernel launches of a pass: CUDA kernels in the profiler on a GPU; Triton launches in the interpreter."""

    NAMES = ("_forward_kernel", "_linearize_kernel", "_mark_kernel", "_scatter_kernel", "_segment_kernel",
             "_split_kernel")

    def __init__(self):
        self.count = 0

    def __enter__(self):
        if CUDA:
            torch.cuda.synchronize()
            self.profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            self.profiler.__enter__()
        else:
            self.saved = {name: getattr(embedding_bag, name) for name in self.NAMES}
            for name, kernel in self.saved.items():
                setattr(embedding_bag, name, _Counting(kernel, self))
        return self

    def __exit__(self, *exc):
        if CUDA:
            torch.cuda.synchronize()
            self.profiler.__exit__(*exc)
            self.count = sum(1 for e in self.profiler.events() if e.device_type == torch.autograd.DeviceType.CUDA)
        else:
            for name, kernel in self.saved.items():
                setattr(embedding_bag, name, kernel)


class _Counting:
    def __init__(self, kernel, counter: LaunchCounter):
        self.kernel, self.counter = kernel, counter

    def __getitem__(self, grid):
        self.counter.count += 1
        return self.kernel[grid]


def free() -> None:
    gc.collect()
    if CUDA:
        torch.cuda.empty_cache()


def measure(shape: Shape, dtype: torch.dtype, ids: str, bandwidth: float | None, repeats: int,
            backend: str = "auto") -> dict:
    """One shape × dtype × id law: times, bytes, launches, baselines; raises if recloop is not correct."""
    tables = [TableConfig(f"t{i}", rows, shape.dim) for i, rows in enumerate(shape.rows)]
    values, offsets = make_ids(shape, ids, seed=1)
    upstream = torch.randn(shape.batch, len(tables) * shape.dim, device=DEVICE)
    unique, longest = run_statistics(shape, values)
    ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.01, device=DEVICE, dtype=dtype,
                                 check_ids="off", backend=backend)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2  # bf16 rows: 8 mantissa bits

    # Correct first: the forward against nn.EmbeddingBag on the same weights, one fused step against the
    # reference on a small copy of the tables.
    dense = Baseline(ebc, shape, sparse=False)
    with torch.no_grad():
        expected, out = dense(values), ebc(values, offsets)
    error = ((out - expected).norm() / expected.norm()).item()
    if not error < tolerance or torch.isnan(out).any():
        raise RuntimeError(f"{shape.name}: forward relative error {error:.2e}; refusing to report a time")
    del dense, expected, out
    free()
    fbgemm = {"missing": fbgemm_missing(), "dtype": str(FBGEMM_DTYPE[dtype]).replace("torch.", "")}
    if fbgemm["missing"] is None:  # side by side on the same GPU (issue 39): correct first, then timed below
        try:
            tbe = fbgemm_tbe(tables, dtype)
            fbgemm["forward_error"], fbgemm["update_error"] = check_against_fbgemm(ebc, tbe, shape, values, offsets,
                                                                                 upstream)
            if not (fbgemm["forward_error"] < tolerance and fbgemm["update_error"] < tolerance):
                raise RuntimeError(f"FBGEMM and recloop differ: forward {fbgemm['forward_error']:.2e}, updated rows "
                                   f"{fbgemm['update_error']:.2e} (tolerance {tolerance:g}); no time reported")
        except Exception as err:  # noqa: BLE001 - recorded beside the figures; recloop's own still run
            fbgemm["error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
        tbe = None
        free()
    small = [TableConfig(f"t{i}", min(r, 50_000), shape.dim) for i, r in enumerate(shape.rows[:4])]
    check = [EmbeddingBagCollection(small, optimizer="rowwise_adagrad", lr=0.01, device=DEVICE, dtype=dtype,
                                    backend=b, seed=1) for b in ("reference", backend)]
    check_batch = min(256, shape.batch)
    v, o = make_ids(Shape("check", tuple(t.num_embeddings for t in small), shape.dim, shape.hotness, check_batch),
                    ids, 2)
    check_upstream = torch.randn(check_batch, len(small) * shape.dim, device=DEVICE)
    for m in check:
        torch.autograd.backward(m(v, o), check_upstream)
    w_error = ((check[0].weights.float() - check[1].weights.float()).norm() / check[0].weights.float().norm()).item()
    if not w_error < tolerance:
        raise RuntimeError(f"{shape.name}: fused update relative error {w_error:.2e}; refusing to report a time")
    del check
    free()

    def forward(_):
        with torch.no_grad():
            ebc(values, offsets)

    def backward(out):
        torch.autograd.backward(out, upstream)

    forward_s = timed(forward, repeats=repeats)
    forward_host_s = timed(forward, repeats=repeats, hold_queue=False)  # with the host's time per call
    backward_s = timed(backward, setup=lambda: ebc(values, offsets), repeats=repeats)
    with LaunchCounter() as forward_launches:
        forward(None)
    out = ebc(values, offsets)
    with LaunchCounter() as backward_launches:
        backward(out)
    ebc = out = None  # freed before the baselines take their memory
    free()

    if fbgemm["missing"] is None and "error" not in fbgemm:
        tbe = fbgemm_tbe(tables, dtype)

        def tbe_forward(_):
            with torch.no_grad():
                tbe(values, offsets)

        fbgemm["forward_s"] = timed(tbe_forward, repeats=repeats)
        fbgemm["backward_s"] = timed(backward, setup=lambda: tbe(values, offsets), repeats=repeats)
        with LaunchCounter() as launches:
            tbe_forward(None)
        fbgemm["forward_launches"] = launches.count
        out = tbe(values, offsets)
        with LaunchCounter() as launches:
            backward(out)
        fbgemm["backward_launches"] = launches.count
        tbe = out = None
        free()

    baselines = {}
    for sparse in (False, True):
        name = "sparse" if sparse else "dense"
        try:
            model = baseline_for(tables, shape, dtype, sparse)
            optimizer = torch.optim.Adagrad(model.parameters(), lr=0.01)

            def base_forward(_, model=model):
                with torch.no_grad():
                    model(values)

            def base_setup(model=model, optimizer=optimizer):
                optimizer.zero_grad(set_to_none=True)
                return model(values)

            def base_backward(out, optimizer=optimizer):
                torch.autograd.backward(out, upstream)
                optimizer.step()

            baselines[name] = (timed(base_forward, repeats=repeats),
                               timed(base_backward, setup=base_setup, repeats=max(3, repeats // 2)))
        except (RuntimeError, NotImplementedError) as err:  # e.g. a sparse bf16 kernel missing: say so
            baselines[name] = (float("nan"), float("nan"))
            baselines[f"{name}_error"] = f"{type(err).__name__}: {str(err).splitlines()[0]}"
        finally:
            model = optimizer = None
            free()

    elem = torch.empty(0, dtype=dtype).element_size()
    nnz = values.numel()
    forward_bytes = nnz * values.element_size() + offsets.numel() * offsets.element_size() + \
        nnz * shape.dim * elem + upstream.numel() * 4
    backward_bytes = upstream.numel() * 4 + nnz * values.element_size() + unique * (2 * shape.dim * elem + 2 * 4)
    return {
        "shape": shape.name, "key": shape.key, "dtype": str(dtype).replace("torch.", ""), "ids": ids, "nnz": nnz, "unique_rows": unique,
        "longest_run": longest, "forward_s": forward_s, "forward_host_s": forward_host_s, "backward_s": backward_s,
        "forward_bytes": forward_bytes,
        "backward_bytes": backward_bytes, "forward_launches": forward_launches.count,
        "backward_launches": backward_launches.count, "bandwidth": bandwidth, "baselines": baselines,
        "fbgemm": fbgemm, "criteo": shape.name.startswith("Criteo"),
    }


def baseline_for(tables, shape: Shape, dtype: torch.dtype, sparse: bool) -> Baseline:
    """The baseline over the same initial weights as recloop's (same seed), built without keeping recloop's."""
    ebc = EmbeddingBagCollection(tables, device=DEVICE, dtype=dtype, check_ids="off")
    model = Baseline(ebc, shape, sparse)
    del ebc
    return model


def rows_of(result: dict) -> list[dict]:
    """The two table rows (forward, backward) of one measurement."""
    out = []
    for index, (what, key) in enumerate((("forward", "forward"), ("backward + rowwise adagrad", "backward"))):
        seconds, moved = result[f"{key}_s"], result[f"{key}_bytes"]
        achieved = moved / seconds
        dense, sparse = result["baselines"]["dense"][index], result["baselines"]["sparse"][index]
        out.append({
            "shape": result["shape"], "dtype": result["dtype"], "ids": result["ids"], "pass": what,
            "ms": f"{seconds * 1e3:.3f}", "GB/s": f"{achieved / 1e9:.0f}" if CUDA else "-",
            "of copy BW": f"{achieved / result['bandwidth']:.0%}" if result["bandwidth"] else "-",
            "vs dense": f"{dense / seconds:.1f}x", "vs sparse": f"{sparse / seconds:.1f}x",
            "vs FBGEMM": (f"{result['fbgemm'][f'{key}_s'] / seconds:.2f}x" if f"{key}_s" in result["fbgemm"]
                          else "-"),
            "with host ms": f"{result['forward_host_s'] * 1e3:.3f}" if key == "forward" else "-",
            "launches": result[f"{key}_launches"], "longest run": result["longest_run"],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes through Triton's interpreter (CPU)")
    parser.add_argument("--repeats", type=int, default=10 if CUDA else 3)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    if args.smoke and not CUDA and os.environ.get("TRITON_INTERPRET") != "1":
        raise SystemExit("--smoke on a CPU needs TRITON_INTERPRET=1 (set before the kernels are imported)")
    info = machine()
    bandwidth = copy_bandwidth() if CUDA else None
    if bandwidth:
        info["copy_bandwidth_GB/s"] = f"{bandwidth / 1e9:.0f}"
    else:
        info["note"] = "no GPU present: no bandwidth figures; the targets apply to a GPU only"
    shapes = smoke_shapes() if args.smoke else gpu_shapes(args.quick)
    backend = "triton" if args.smoke else "auto"
    rows = []
    for shape in shapes:
        for dtype in (torch.float32, torch.bfloat16) if CUDA else (torch.float32,):
            for ids in ("uniform", "zipf"):
                rows.extend(rows_of(measure(shape, dtype, ids, bandwidth, args.repeats, backend)))
    report("embedding bags: recloop vs nn.EmbeddingBag + torch.optim.Adagrad", rows, info, args.json_path)


if __name__ == "__main__":
    main()
