"""One pass of the fused embedding bags for Nsight Compute: forward, then backward + fused row-wise Adagrad.

    ncu --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats \
        --section WarpStateStats -k 'regex:_(forward|segment|split|linearize)_kernel' --csv --page details \
        python benchmarks/profile_embedding.py [--shape criteo|wide|long64|long32] [--dtype float32|bfloat16] [--ids uniform|zipf]
        [--set KNOB=VALUE ...]

It builds one of benchmarks/embedding.py's shapes (``criteo``: 26 tables at dim 128, one-hot, batch 64K, the
tables capped at 1M rows here so that Nsight's kernel replay, which saves and restores what a kernel writes,
stays quick; ``wide``: 100 features × 10-hot over 8192 rows at dim 64), runs one untimed warm-up pass (Triton
compiles) and then the profiled pass. ``--set`` assigns one of ``recloop_kernels.embedding_bag``'s launch
knobs first (``--set SEGMENT_RUNS=1 --set SEGMENT_WAVES=0 --set SEGMENT_LONG_N=0``: the segment pass as measured on 2026-11-26), so that two settings can be
profiled side by side (benchmarks/tune_embedding.py names them). Nothing is timed here: the figures are the profiler's counters
(achieved DRAM throughput, registers, occupancy, warp stall reasons). Without ncu it runs as a plain script.
"""

from __future__ import annotations

import argparse

import torch
from common import use_source_tree

use_source_tree()
from embedding import CRITEO_ROWS, Shape, make_ids  # noqa: E402

from recloop_kernels import EmbeddingBagCollection, TableConfig, embedding_bag  # noqa: E402

SHAPES = {
    "criteo": Shape("Criteo-like: 26 tables (capped at 1M rows), dim 128, one-hot, batch 64K",
                    tuple(min(r, 1_000_000) for r in CRITEO_ROWS), 128, 1, 65536),
    "wide": Shape("100 features x 10-hot, vocab 8192, dim 64, batch 8K", (8192,) * 100, 64, 10, 8192),
    # long bags at small D, where the timed forward (benchmarks/tune_embedding.py) swung 2x between repeats
    **{f"long{d}": Shape(f"1 table 1M rows, dim {d}, 64-hot, batch 8K", (1_000_000,), d, 64, 8192) for d in (64, 32)},
}


KNOBS = embedding_bag.KNOBS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="criteo")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--ids", choices=("uniform", "zipf"), default="uniform")
    parser.add_argument("--set", action="append", default=[], metavar="KNOB=VALUE",
                        help="a launch knob of recloop_kernels.embedding_bag (TILE, FORWARD_WARPS, SEGMENT_RUNS...)")
    args = parser.parse_args()
    for assignment in args.set:
        name, _, value = assignment.partition("=")
        if name not in KNOBS:
            parser.error(f"--set {assignment}: the knobs are {', '.join(KNOBS)}")
        words = {"None": None, "True": True, "False": False}
        setattr(embedding_bag, name, words[value] if value in words else int(value))
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shape = SHAPES[args.shape]
    tables = [TableConfig(f"t{i}", rows, shape.dim) for i, rows in enumerate(shape.rows)]
    ebc = EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", lr=0.01, device=device,
                                 dtype=getattr(torch, args.dtype), check_ids="off")
    values, offsets = make_ids(shape, args.ids, seed=1)
    upstream = torch.randn(shape.batch, len(tables) * shape.dim, device=device)
    for _ in range(2):  # the first pass compiles; the second is the one to read
        torch.autograd.backward(ebc(values, offsets), upstream)
    if device.type == "cuda":
        torch.cuda.synchronize()
    print(f"profiled: {shape.name}, {args.dtype}, {args.ids} ids, {values.numel():,} ids"
          + (f"; {', '.join(args.set)}" if args.set else ""))


if __name__ == "__main__":
    main()
