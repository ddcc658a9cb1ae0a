"""The fused embedding kernels' launch settings, swept on one shape: forward and backward time per setting.

    python benchmarks/tune_embedding.py [--shape criteo|wide] [--dtype float32|bfloat16] [--ids uniform|zipf]
                                        [--json out.json]

Why: on an H100 (2026-11-25, Nsight Compute, Criteo-like fp32) the forward used 147 registers a thread
(occupancy 18.75 %) at 63 % of DRAM peak, and the backward's segment pass 107 registers (occupancy 25 %,
one warp a row, 16 occurrences gathered a step although one-hot runs hold one) at 22 %. Both are limited
by registers; the settings below trade work per program for occupancy. Each setting is one assignment to
``recloop_kernels.embedding_bag``'s module-level knobs (``KNOBS``: TILE, FORWARD_WARPS, FORWARD_BLOCK_N,
FORWARD_NARROW, FORWARD_PIPELINE, SEGMENT_BLOCK_N, SEGMENT_WARPS, SEGMENT_RUNS, SEGMENT_LONG_N, SEGMENT_WAVES); the defaults run first, in the middle and last (their spread
is the noise).

Correct first: from the same starting weights, each setting's forward output and its weights after one
backward + fused row-wise Adagrad must match the defaults' (relative error under 1e-5 in fp32: the same
sums in another order), or the setting is reported as wrong and not timed. Times: CUDA events around the
pass, median of 10 (benchmarks/embedding.py's ``timed``); GB/s count the fewest bytes, as there.
It needs a GPU; on a CPU it runs the same checks through Triton's interpreter on a tiny shape (``--smoke``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch

CUDA = torch.cuda.is_available()
if not CUDA and "--smoke" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before the kernels are first imported

from common import machine, report, use_source_tree  # noqa: E402

use_source_tree()
from embedding import CRITEO_ROWS, ROW_CAP, Shape, copy_bandwidth, make_ids, run_statistics, timed  # noqa: E402

from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag, reference  # noqa: E402

SHAPES = {
    "criteo": Shape("Criteo-like: 26 tables (capped at 5M rows), dim 128, one-hot, batch 64K",
                    tuple(min(r, ROW_CAP) for r in CRITEO_ROWS), 128, 1, 65536),
    "wide": Shape("100 features x 10-hot, vocab 8192, dim 64, batch 8K", (8192,) * 100, 64, 10, 8192),
    # long bags (BENCHMARKS.md's 64-hot shapes): H200, 2026-11-26, the forward at D=32 ran at 341 GB/s against
    # nn.EmbeddingBag's 834, at D=64 760 against 1,254
    **{f"long{d}": Shape(f"1 table 10M rows, dim {d}, 64-hot, batch 8K", (10_000_000,), d, 64, 8192)
       for d in (128, 64, 32)},
    "smoke": Shape("smoke: 3 tables, dim 16, 2-hot, batch 64", (50, 7, 300), 16, 2, 64),
}
KNOBS = embedding_bag.KNOBS
DEFAULTS = {name: getattr(embedding_bag, name) for name in KNOBS}
SETTINGS = [
    ("defaults", {}),
    # TILE also sizes the backward's linearize pass (forward_tiles at D=16); its share of the backward is small
    # 32-bit index arithmetic (the default where it fits) against 64-bit: ptx_check, fp32 D 128 one-hot,
    # 126 against 128 registers; bf16 72 against 95; 64-hot D 32 71 against 84
    ("forward: 64-bit indices", {"FORWARD_NARROW": False}),
    # blocks of bags a program, each block's rows in flight with the next block's ids (FORWARD_PIPELINE):
    # ptx_check, fp32 D 128 one-hot: 125 registers (25 %), 82 (31 %) and 64 (50 %)
    ("forward: 2 blocks pipelined, tile 2048", {"FORWARD_PIPELINE": 2, "TILE": 2048}),
    ("forward: 4 blocks pipelined, tile 1024", {"FORWARD_PIPELINE": 4, "TILE": 1024}),
    ("forward: 2 blocks pipelined, tile 1024", {"FORWARD_PIPELINE": 2, "TILE": 1024}),
    ("forward: tile 2048", {"TILE": 2048}),
    ("forward: tile 1024", {"TILE": 1024}),
    ("forward: tile 8192, 8 warps", {"TILE": 8192, "FORWARD_WARPS": 8}),
    ("forward: 8 warps", {"FORWARD_WARPS": 8}),
    ("forward: 8 ids a step", {"FORWARD_BLOCK_N": 8}),
    ("forward: 16 ids a step", {"FORWARD_BLOCK_N": 16}),
    ("defaults, in the middle", {}),
    # the segment pass's occurrences a step: 2 by default (backward_tiles; before 2026-11-26's H100 sweep, the
    # mean run the batch can have: 1 for Criteo-like one-hot, 16 for the wide shape)
    ("segment: 1 occurrence a step", {"SEGMENT_BLOCK_N": 1}),
    ("segment: 2 a step", {"SEGMENT_BLOCK_N": 2}),
    ("segment: 4 a step", {"SEGMENT_BLOCK_N": 4}),
    ("segment: 8 a step", {"SEGMENT_BLOCK_N": 8}),
    ("segment: 16 a step", {"SEGMENT_BLOCK_N": 16}),
    ("segment: 4 a step, 2 warps", {"SEGMENT_BLOCK_N": 4, "SEGMENT_WARPS": 2}),
    # runs side by side in one program (backward_tiles: 4 where runs are short, 1 where long); one a program, a
    # program per item and no long-item path is the setting the H200 measured on 2026-11-26 (ptx_check, Criteo
    # fp32: 38 registers, 1 warp, occupancy capped at 50 % by the 32 blocks an SM; 4 a program: 39, 4 warps, 75 %)
    # (the kernel's code is today's: a grid-stride loop that runs once a program, 40 registers against 38)
    ("segment: as measured 2026-11-26 (1 run a program, a program per item, no long-item path)",
     {"SEGMENT_RUNS": 1, "SEGMENT_WAVES": 0, "SEGMENT_LONG_N": 0}),
    ("segment: 1 run a program", {"SEGMENT_RUNS": 1}),
    ("segment: 2 runs a program", {"SEGMENT_RUNS": 2}),
    ("segment: 8 runs a program", {"SEGMENT_RUNS": 8}),
    ("segment: 16 runs a program, 8 warps", {"SEGMENT_RUNS": 16, "SEGMENT_WARPS": 8}),
    # the grid: a program per RUNS items (most exit at once: Criteo's 0.53M items against a bound of 1.7M), or
    # SEGMENT_WAVES full SMs' worth of programs, each taking every grid-th group of items (default 16; 4 before the H100 sweep)
    ("segment: a program per RUNS items", {"SEGMENT_WAVES": 0}),
    ("segment: 1 wave of programs", {"SEGMENT_WAVES": 1}),
    ("segment: 4 waves of programs", {"SEGMENT_WAVES": 4}),
    # items longer than BLOCK_N alone, SEGMENT_LONG_N occurrences a step (default 8; ptx_check, Criteo fp32:
    # 0 → 40 registers, 4 → 48, 8 → 56, 16 → 72 with spills)
    ("segment: no long-item path", {"SEGMENT_LONG_N": 0}),
    ("segment: long items 4 a step", {"SEGMENT_LONG_N": 4}),
    ("segment: long items 16 a step", {"SEGMENT_LONG_N": 16}),
    # H100, 2026-11-26 (c7a6b86): 8 a step (so one item a program, no long-item path) was the best single change
    # on the Criteo-like shape, uniform 1.07 ms against 1.11 and Zipf 0.884 against 1.02; its neighbours:
    ("segment: 8 a step, 16 waves", {"SEGMENT_BLOCK_N": 8, "SEGMENT_WAVES": 16}),
    ("segment: 8 a step, 1 wave", {"SEGMENT_BLOCK_N": 8, "SEGMENT_WAVES": 1}),
    ("segment: 8 a step, a program per item", {"SEGMENT_BLOCK_N": 8, "SEGMENT_WAVES": 0}),
    ("segment: 8 a step, 2 runs a program", {"SEGMENT_BLOCK_N": 8, "SEGMENT_RUNS": 2}),
    ("segment: 8 a step, 2 warps", {"SEGMENT_BLOCK_N": 8, "SEGMENT_WARPS": 2}),
    ("segment: 8 a step, long items 16 a step", {"SEGMENT_BLOCK_N": 8, "SEGMENT_LONG_N": 16}),
    ("segment: 4 a step, long items 8 a step", {"SEGMENT_BLOCK_N": 4, "SEGMENT_RUNS": 1}),
    ("segment: 2 a step, 16 waves", {"SEGMENT_BLOCK_N": 2, "SEGMENT_WAVES": 16}),
    ("segment: 2 a step, 1 run a program", {"SEGMENT_BLOCK_N": 2, "SEGMENT_RUNS": 1}),
    ("defaults, again", {}),
]


def relative_error(expected: torch.Tensor, actual: torch.Tensor) -> float:
    expected, actual = expected.double(), actual.double()
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def sweep(shape: Shape, dtype: torch.dtype, ids: str, repeats: int, settings=SETTINGS,
          on_row: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """One row per setting; ``on_row(rows so far)`` after each (a run stopped midway keeps its rows)."""
    device = torch.device("cuda" if CUDA else "cpu")
    tables = [TableConfig(f"t{i}", rows, shape.dim) for i, rows in enumerate(shape.rows)]
    ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.01, device=device, dtype=dtype,
                                 check_ids="off", backend="triton")
    values, offsets = make_ids(shape, ids, seed=1)
    upstream = torch.randn(shape.batch, len(tables) * shape.dim, device=device)
    unique, _ = run_statistics(shape, values)
    # Only the rows the batch touches change (and their row-wise Adagrad state): those are saved, restored and
    # compared, not whole copies of the tables (the Criteo shape's fp32 weights are 21.7 GiB: three copies did
    # not fit an H100's 80 GB, 2026-11-26). Rows outside the batch are the kernels' tests' business.
    layout, per_table = ebc._layout, shape.batch * shape.hotness
    touched = [torch.unique(values[t * per_table:(t + 1) * per_table]).long() for t in range(len(tables))]
    state_rows = torch.cat([layout.row_offsets[t] + ids for t, ids in enumerate(touched)])

    def touched_weights() -> torch.Tensor:
        return torch.cat([reference.table_view(ebc.weights, layout, t)[ids].reshape(-1)
                          for t, ids in enumerate(touched)])

    start_weights, start_state, start_step = touched_weights(), ebc.state1[state_rows].clone(), ebc.step.clone()

    def restore() -> None:
        with torch.no_grad():
            at = 0
            for t, ids in enumerate(touched):
                table = reference.table_view(ebc.weights, layout, t)
                table[ids] = start_weights[at:at + ids.numel() * shape.dim].view(-1, shape.dim)
                at += ids.numel() * shape.dim
            ebc.state1[state_rows] = start_state
            ebc.step.copy_(start_step)

    def one_step() -> tuple[torch.Tensor, torch.Tensor]:
        restore()
        with torch.no_grad():
            out = ebc(values, offsets)
        torch.autograd.backward(ebc(values, offsets), upstream)
        return out, touched_weights()

    elem = torch.empty(0, dtype=dtype).element_size()
    nnz = values.numel()
    forward_bytes = nnz * 8 + offsets.numel() * 8 + nnz * shape.dim * elem + upstream.numel() * 4
    backward_bytes = upstream.numel() * 4 + nnz * 8 + unique * (2 * shape.dim * elem + 2 * 4)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    rows, expected = [], None
    for label, knobs in settings:
        for name, value in {**DEFAULTS, **knobs}.items():
            setattr(embedding_bag, name, value)
        try:
            out, weights = one_step()
            if expected is None:
                expected = (out, weights)
                errors = (0.0, 0.0)
            else:
                errors = (relative_error(expected[0], out), relative_error(expected[1], weights))
            row = {"setting": label, "forward_error": errors[0], "weights_error": errors[1]}
            if max(errors) > tolerance:
                rows.append({**row, "status": f"wrong: relative error {max(errors):.1e} > {tolerance:.0e}"})
                continue
            restore()

            def forward(_):
                with torch.no_grad():
                    ebc(values, offsets)

            forward_s = timed(forward, repeats=repeats)
            backward_s = timed(lambda out: torch.autograd.backward(out, upstream), setup=lambda: ebc(values, offsets),
                               repeats=repeats)
            rows.append({**row, "status": "ok", "forward_ms": forward_s * 1e3, "backward_ms": backward_s * 1e3,
                         "forward_GB/s": forward_bytes / forward_s / 1e9, "backward_GB/s": backward_bytes / backward_s / 1e9})
        except Exception as err:  # noqa: BLE001 - a setting that does not compile is a finding, the rest still run
            rows.append({"setting": label, "status": f"failed: {type(err).__name__}: {str(err).splitlines()[0][:200]}"})
        finally:
            for name, value in DEFAULTS.items():
                setattr(embedding_bag, name, value)
            if on_row:
                on_row(rows)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="criteo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--only", help="only the settings whose name starts with this (the defaults always run)")
    parser.add_argument("--smoke", action="store_true", help="the smoke shape through Triton's interpreter (CPU)")
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    shape = SHAPES["smoke" if args.smoke else args.shape]
    info = machine()
    if CUDA:
        info["copy_bandwidth_GB/s"] = f"{copy_bandwidth() / 1e9:.0f}"
    def on_row(rows: list[dict]) -> None:
        print(f"[tune] {rows[-1]}", flush=True)
        if args.json_path:  # replaced by the full report at the end
            Path(args.json_path).write_text(json.dumps({"partial": True, "machine": info, "rows": rows}, indent=2))

    settings = [(label, knobs) for label, knobs in SETTINGS
                if not args.only or not knobs or label.startswith(args.only)]
    rows = sweep(shape, getattr(torch, args.dtype), args.ids, repeats=10 if CUDA else 1, settings=settings,
                 on_row=on_row)
    table = [{k: (f"{v:.3g}" if isinstance(v, float) else v) for k, v in row.items()} for row in rows]
    columns = ("setting", "status", "forward_ms", "forward_GB/s", "backward_ms", "backward_GB/s", "forward_error",
               "weights_error")
    table = [{c: row.get(c, "-") for c in columns} for row in table]
    report(f"embedding kernel settings: {shape.name}, {args.dtype}, {args.ids} ids", table, info, args.json_path)


if __name__ == "__main__":
    main()
