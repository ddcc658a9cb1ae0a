"""Fused multi-table embedding bags: Triton kernels, their torch.library ops, and autograd.

Forward (one launch per distinct table dim; one in the usual case where all tables share it): each
program pools ``BAGS`` consecutive bags of one table. It walks their ids ``BLOCK_N`` at a time, gathering
a (BAGS, BLOCK_N, D) tile of rows per step (many row loads in flight), accumulates in fp32 and writes the
pooled rows once into the concatenated (B, ΣD) output (with ``FORWARD_PIPELINE`` > 1, several such blocks of
bags one after the other, each block's rows loaded while the next block's ids arrive). Rows are padded to 16
bytes and the dim is a compile-time constant, so every row load is a 16-byte vector. Ids outside a table pool as zeros and are
recorded in a small error tensor on the device (no host synchronization; the module raises).

Backward with a fused optimizer, in the structure of FBGEMM's table-batched embedding backward (no dense
gradient, no atomics on weights, deterministic), with no host synchronization::

    linearize   each occurrence → key = global row id (int32 when the rows fit; bad ids → a sentinel
                that sorts last) and info = its bag                                     (1 launch)
    sort        keys, stably (torch.sort: a radix sort on the GPU)                      (torch)
    mark        per sorted position: does a work item start here? (a new row, or a CHUNK boundary
                inside a row's run) does a split run start here? — packed in one int64  (1 launch)
    scan        inclusive cumsum of those flags: item and split ids, and their counts   (torch)
    scatter     item starts and split starts into dense lists                           (1 launch)
    segment     RUNS items at a time per program (grid-stride over the items, a grid sized to the
                GPU): gathers up to CHUNK occurrences' gradient rows as (RUNS, BLOCK_N, D) tiles, and
                an item longer than BLOCK_N alone in (LONG_N, D) tiles, scaled once per occurrence
                (per-sample weight, 1/length for mean pooling); a run that fits in one item is reduced
                and updated right here, a longer one writes an fp32 partial sum per item (1 launch)
    split       one program per long run: sums its partials in order (deterministic), updates (1 launch)

Grids are bounded by host-known numbers (occurrences, table rows) and programs past the device-side
counts exit at once. The ops are registered with ``torch.library`` (with fake implementations) so
modules using them work under autograd, ``torch.compile`` (one graph) and ``torch.export``. Each op runs
the Triton kernels when the tensors are on CUDA (or under ``TRITON_INTERPRET=1`` on CPU) and the
reference otherwise.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from recloop_kernels import reference
from recloop_kernels.config import Layout, OptimizerConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None

OPT_CODES = {"gradient": 0, "sgd": 1, "adagrad": 2, "rowwise_adagrad": 3, "adam": 4}
CHUNK = 256  # occurrences per backward work item: a row's run longer than this is split across programs
SCAN_BLOCK = 1024  # sorted positions per program in the mark and scatter passes
TILE = 4096  # fp32 elements of a forward tile (BAGS × BLOCK_N × BLOCK_D): 32 registers a thread at 4 warps
# Launch settings that benchmarks/tune_embedding.py sweeps on a GPU (module-level so that it can set them).
# H100, Criteo-like fp32 (Nsight Compute, 2026-11-25): the forward used 147 registers a thread (occupancy
# 18.75 %, 63 % of DRAM peak); the segment pass 107 (25 %), one warp a row, 22 % of DRAM peak.
FORWARD_WARPS = 4
FORWARD_BLOCK_N: int | None = None  # ids a bag per step of the forward (None: forward_tiles, from the pooling)
FORWARD_NARROW = True  # 32-bit index arithmetic in the forward where it fits (narrow_indices)
FORWARD_PIPELINE = 1  # blocks of bags a forward program pools one after the other, loads pipelined across them
SEGMENT_BLOCK_N: int | None = None  # occurrences gathered per step of the segment pass (None: backward_tiles)
SEGMENT_WARPS: int | None = None  # warps a segment program (None: backward_tiles)
SEGMENT_RUNS: int | None = None  # work items side by side in one segment program (None: backward_tiles)
SEGMENT_LONG_N = 8  # occurrences a step for an item longer than BLOCK_N, one item at a time (≤ BLOCK_N: off)
SEGMENT_WAVES = 16  # segment programs launched: this many full SMs' worth of warps a SM (0: one per RUNS items)
# The knobs above, by name: what benchmarks/tune_embedding.py sweeps and profile_embedding.py --set assigns.
KNOBS = ("TILE", "FORWARD_WARPS", "FORWARD_BLOCK_N", "FORWARD_NARROW", "FORWARD_PIPELINE", "SEGMENT_BLOCK_N",
         "SEGMENT_WARPS", "SEGMENT_RUNS", "SEGMENT_LONG_N", "SEGMENT_WAVES")


def triton_usable(device: torch.device) -> bool:
    """Whether the Triton kernels can run on ``device``: CUDA, or CPU in interpreter mode."""
    if triton is None:
        return False
    return device.type == "cuda" or (device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def choose_triton(backend: str, device: torch.device) -> bool:
    """``auto``: Triton on CUDA, the reference elsewhere; ``triton``: Triton or an error; ``reference``."""
    if backend == "reference":
        return False
    if backend == "triton":
        if not triton_usable(device):
            raise RuntimeError(f"backend='triton' needs triton and a CUDA device, or TRITON_INTERPRET=1 on CPU "
                               f"(set before recloop_kernels is imported); tensors are on {device}")
        return True
    if backend != "auto":
        raise ValueError(f"backend must be auto, triton or reference, not {backend!r}")
    return triton is not None and device.type == "cuda"


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def forward_tiles(block_d: int, average_pooling: float) -> tuple[int, int]:
    """(BAGS, BLOCK_N) of the forward: bags per program and ids per bag per step, from D and the pooling.

    One-hot bags take many bags per program (a row each per step); long bags take more ids per bag.
    """
    block_n = FORWARD_BLOCK_N or min(_next_power_of_2(math.ceil(max(average_pooling, 1.0))), 32)
    bags = max(1, min(64, TILE // (block_n * block_d)))
    return bags, block_n


def backward_tiles(block_d: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, RUNS) of the segment pass: occurrences gathered per step, warps and runs a program.

    A warp per row up to D=128 (as FBGEMM's short-run kernel), so that a row is 16 bytes a thread. BLOCK_N is
    2 whatever the batch: items longer than that take the long-item path (``SEGMENT_LONG_N`` a step), so a
    wide tile only costs registers on the many short items. RUNS: where rows are at most 256 wide, four work
    items side by side in one program (four warps at D 128): one-warp programs hold a Hopper SM to 32 blocks,
    50 % occupancy, however few registers they use.

    Measured (benchmarks/tune_embedding.py, RESULTS.md): H200, 2026-11-26, Criteo-like fp32, 16 a step 2.2 ms,
    1 a step 1.71 ms (one run a program, no long-item path). H100, 2026-11-26 (4ae66c4), backward ms, defaults
    then (BLOCK_N from the mean run the batch can have, 16 waves against 4) → now: Criteo-like uniform
    1.11 → 1.07, Zipf 1.02 → 0.905; 64-hot D 128 Zipf 0.455 → 0.405, D 64 uniform 0.300 → 0.294; 100 x
    10-hot (BLOCK_N 16 then) 2.06 → 1.68. No other setting of the sweep was better on all five.
    """
    block_n = SEGMENT_BLOCK_N or max(1, min(2, 2048 // block_d))
    runs = SEGMENT_RUNS or (4 if block_n <= 2 and block_d <= 256 else 1)  # wide rows fill a program alone
    warps = max(1, runs * block_d // 128)  # a warp per 128 elements of D, over the program's runs
    return block_n, SEGMENT_WARPS or warps, runs


@lru_cache(maxsize=8)
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1


def segment_programs(device: torch.device, max_items: int, runs: int, warps: int) -> int:
    """Programs the segment pass launches: enough for every item (``max_items`` bounds their count, which only
    the device knows), at most ``SEGMENT_WAVES`` times what fills every SM (64 warps an SM on Hopper).

    The bound is loose: a Criteo-like batch (1.7M ids, 26 tables of up to 5M rows) holds 0.53M items against
    a bound of 1.7M, so a program per item left about 1.2M programs (69 % of the grid) to start, load one
    count and exit; H200, 2026-11-26: achieved occupancy 26.5 % of a theoretical 50 %. Each program now
    takes every ``programs``-th group of ``runs`` items (grid-stride); a few waves balance the tail."""
    wanted = triton.cdiv(max_items, runs)
    if not SEGMENT_WAVES:
        return max(1, wanted)
    return max(1, min(wanted, _multiprocessors(device) * SEGMENT_WAVES * max(1, 64 // warps)))


def narrow_indices(layout: Layout, nnz: int) -> bool:
    """Whether every position in ``values`` and every element offset within a table fits in int32."""
    return nnz < 2**31 and all(c * s < 2**31 for c, s in zip(layout.capacities, layout.strides, strict=True))


def column_alignment(layout: Layout) -> int:
    """The largest power of two (≤ 16) dividing every table's first output column and the output width."""
    return min(16, math.gcd(*layout.col_offsets) & -math.gcd(*layout.col_offsets)) if layout.total_dim else 1


if triton is not None:

    @triton.jit
    def _bag_bounds(offsets_ptr, bag, mask, NARROW: tl.constexpr):
        """Where each bag's ids start in ``values`` and how many it has (int32 when NARROW)."""
        start = tl.load(offsets_ptr + bag, mask=mask, other=0)
        length = tl.load(offsets_ptr + bag + 1, mask=mask, other=0) - start
        return start.to(tl.int32 if NARROW else tl.int64), length.to(tl.int32 if NARROW else tl.int64)

    @triton.jit
    def _ids_at(values_ptr, psw_ptr, start, length, k, HAS_PSW: tl.constexpr):
        """Step ``k`` (BLOCK_N positions) of each bag: ids, which are inside the bag, per-sample weights."""
        valid = k[None, :] < length[:, None]  # (BAGS, BLOCK_N)
        position = start[:, None] + k[None, :]
        ids = tl.load(values_ptr + position, mask=valid, other=0)
        if HAS_PSW:
            scale = tl.load(psw_ptr + position, mask=valid, other=0.0).to(tl.float32)
        else:
            scale = valid.to(tl.float32)  # unused: compiled away
        return ids, valid, scale

    @triton.jit
    def _pool_rows(table_ptr, ids, valid, scale, num_rows, d, d_load, STRIDE: tl.constexpr, HAS_PSW: tl.constexpr,
                   NARROW: tl.constexpr):
        """The rows of one step's ids summed per bag (fp32; ids outside the table add nothing) and how many
        ids were outside."""
        ok = valid & (ids >= 0) & (ids < num_rows)
        element = ids.to(tl.int32 if NARROW else tl.int64) * STRIDE
        rows = tl.load(table_ptr + element[:, :, None] + d[None, None, :],
                       mask=ok[:, :, None] & d_load[None, None, :], other=0.0).to(tl.float32)
        if HAS_PSW:  # the weight of an id outside the table is not read into the sum (0 × inf would be NaN)
            rows = rows * tl.where(ok, scale, 0.0)[:, :, None]
        return tl.sum(rows, axis=1), tl.sum((valid & ~ok).to(tl.int32), axis=1)

    @triton.jit
    def _forward_kernel(weight_ptr, values_ptr, offsets_ptr, psw_ptr, out_ptr, errors_ptr, group_tables_ptr,
                        rows_ptr, elem_offsets_ptr, col_offsets_ptr, poolings_ptr, batch_size, blocks_per_table,
                        num_tables, out_stride, DIM: tl.constexpr, STRIDE: tl.constexpr, ALIGN: tl.constexpr,
                        COL_ALIGN: tl.constexpr, BAGS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                        HAS_PSW: tl.constexpr, NARROW: tl.constexpr, PIPELINE: tl.constexpr):
        # NARROW: positions in ``values`` and element offsets within one table fit in int32, so per-bag and
        # per-id index arithmetic is 32-bit (the table's base stays a 64-bit scalar): half the registers for
        # starts, lengths, ids and addresses (H200, 2026-11-26: 147 registers a thread held the SM to 3 blocks).
        # PIPELINE: blocks of BAGS bags a program, one after the other, each block's row loads in flight with
        # the next block's first ids and the bounds of the one after (a bag's offsets → its ids → their rows
        # is a chain of three dependent loads; pipelined, a block waits on about one). 1: no pipelining.
        pid = tl.program_id(0)
        programs_per_table = tl.cdiv(blocks_per_table, PIPELINE)
        t = tl.load(group_tables_ptr + pid // programs_per_table)
        num_rows = tl.load(rows_ptr + t)
        table_ptr = weight_ptr + tl.multiple_of(tl.load(elem_offsets_ptr + t), ALIGN)  # a scalar: the table's row 0
        d = tl.arange(0, BLOCK_D)
        d_load = d < STRIDE  # the padded width: constant over each 16 bytes, so loads stay vectors
        n = tl.arange(0, BLOCK_N)
        b = (pid % programs_per_table) * (PIPELINE * BAGS) + tl.arange(0, BAGS)  # (BAGS,) rows of the batch
        start, length = _bag_bounds(offsets_ptr, t * batch_size + b, b < batch_size, NARROW)
        if PIPELINE > 1:  # the first block's first ids, the second block's bounds
            ids, valid, scale = _ids_at(values_ptr, psw_ptr, start, length, n, HAS_PSW)
            after = b + BAGS
            next_start, next_length = _bag_bounds(offsets_ptr, t * batch_size + after, after < batch_size, NARROW)
        for q in tl.static_range(PIPELINE):
            if q + 1 < PIPELINE:  # issued before this block's rows are waited on
                next_ids, next_valid, next_scale = _ids_at(values_ptr, psw_ptr, next_start, next_length, n, HAS_PSW)
            if q + 2 < PIPELINE:
                later = b + 2 * BAGS
                later_start, later_length = _bag_bounds(offsets_ptr, t * batch_size + later, later < batch_size,
                                                        NARROW)
            if PIPELINE > 1:  # the step whose ids came with the previous block
                acc, bad_count = _pool_rows(table_ptr, ids, valid, scale, num_rows, d, d_load, STRIDE, HAS_PSW,
                                            NARROW)
            else:
                acc = tl.zeros([BAGS, BLOCK_D], dtype=tl.float32)
                bad_count = tl.zeros([BAGS], dtype=tl.int32)
            # the (remaining) steps of BLOCK_N ids: every step unpipelined, the bags longer than one step pipelined
            for i in range(BLOCK_N if PIPELINE > 1 else 0, tl.max(length, axis=0), BLOCK_N):
                step_ids, step_valid, step_scale = _ids_at(values_ptr, psw_ptr, start, length, i + n, HAS_PSW)
                part, bad = _pool_rows(table_ptr, step_ids, step_valid, step_scale, num_rows, d, d_load, STRIDE,
                                       HAS_PSW, NARROW)
                acc += part
                bad_count += bad
            if tl.load(poolings_ptr + t) == 1:  # mean (loaded here, not held in a register through the loop)
                acc = acc / tl.maximum(length, 1).to(tl.float32)[:, None]
            col = tl.multiple_of(tl.load(col_offsets_ptr + t), COL_ALIGN)
            tl.store(out_ptr + b[:, None] * tl.multiple_of(out_stride, COL_ALIGN) + col + d[None, :], acc,
                     mask=(b < batch_size)[:, None] & (d < DIM)[None, :])
            count = tl.sum(bad_count, axis=0)
            if count > 0:  # rare: walk the bags again for the extremes of their bad ids, for the module to raise
                bad_high = tl.full([BAGS], -2147483648, tl.int64)
                bad_low = tl.full([BAGS], 2147483647, tl.int64)
                for i in range(0, tl.max(length, axis=0), BLOCK_N):
                    k = i + n
                    inside = k[None, :] < length[:, None]
                    found = tl.load(values_ptr + start[:, None] + k[None, :], mask=inside, other=0).to(tl.int64)
                    bad = inside & ((found < 0) | (found >= num_rows))
                    bad_high = tl.maximum(bad_high, tl.max(tl.where(bad, found, -2147483648), axis=1))
                    bad_low = tl.minimum(bad_low, tl.min(tl.where(bad, found, 2147483647), axis=1))
                tl.atomic_add(errors_ptr + t, count)
                tl.atomic_max(errors_ptr + num_tables + t,
                              tl.minimum(tl.max(bad_high, axis=0), 2147483647).to(tl.int32))
                tl.atomic_min(errors_ptr + 2 * num_tables + t,
                              tl.maximum(tl.min(bad_low, axis=0), -2147483648).to(tl.int32))
            if q + 1 < PIPELINE:  # the next block's bags become this block's
                b = b + BAGS
                start, length = next_start, next_length
                ids, valid, scale = next_ids, next_valid, next_scale
            if q + 2 < PIPELINE:
                next_start, next_length = later_start, later_length

    @triton.jit
    def _linearize_kernel(values_ptr, offsets_ptr, keys_ptr, info_ptr, rows_ptr, row_offsets_ptr, batch_size,
                          num_bags, nnz, sentinel, BAGS: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_TAIL: tl.constexpr):
        pid = tl.program_id(0)
        if pid < tl.cdiv(num_bags, BAGS):
            bag = pid * BAGS + tl.arange(0, BAGS)
            b_mask = bag < num_bags
            t = bag // batch_size
            start = tl.load(offsets_ptr + bag, mask=b_mask, other=0).to(tl.int64)
            length = tl.load(offsets_ptr + bag + 1, mask=b_mask, other=0).to(tl.int64) - start
            num_rows = tl.load(rows_ptr + t, mask=b_mask, other=0)
            row_offset = tl.load(row_offsets_ptr + t, mask=b_mask, other=0)
            bag_tile = tl.broadcast_to(bag[:, None], (BAGS, BLOCK_N)).to(tl.int32)
            n = tl.arange(0, BLOCK_N)
            for i in range(0, tl.max(length, axis=0), BLOCK_N):
                k = i + n
                valid = k[None, :] < length[:, None]
                position = start[:, None] + k[None, :]
                ids = tl.load(values_ptr + position, mask=valid, other=0).to(tl.int64)
                ok = (ids >= 0) & (ids < num_rows[:, None])
                key = tl.where(ok, row_offset[:, None] + ids, sentinel)
                tl.store(keys_ptr + position, key.to(keys_ptr.dtype.element_ty), mask=valid)
                tl.store(info_ptr + position, bag_tile, mask=valid)
        else:  # positions past the last bag (values padded to a bucketed length): sort last, update nothing
            first = tl.load(offsets_ptr + num_bags).to(tl.int64)
            for p0 in range(first, nnz, BLOCK_TAIL):
                p = p0 + tl.arange(0, BLOCK_TAIL)
                tl.store(keys_ptr + p, (tl.zeros([BLOCK_TAIL], tl.int64) + sentinel).to(keys_ptr.dtype.element_ty), mask=p < nnz)
                tl.store(info_ptr + p, tl.zeros([BLOCK_TAIL], tl.int32), mask=p < nnz)

    @triton.jit
    def _mark_kernel(sorted_ptr, flags_ptr, nnz, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < nnz
        key = tl.load(sorted_ptr + j, mask=m, other=0)
        previous = tl.load(sorted_ptr + j - 1, mask=m & (j > 0), other=-1)
        run_first = m & ((j == 0) | (key != previous))
        item_first = run_first | (m & (j % CHUNK == 0))
        boundary = (j // CHUNK + 1) * CHUNK
        after = tl.load(sorted_ptr + boundary, mask=run_first & (boundary < nnz), other=-1)
        split_first = run_first & (boundary < nnz) & (after == key)
        tl.store(flags_ptr + j, item_first.to(tl.int64) + (split_first.to(tl.int64) << 32), mask=m)

    @triton.jit
    def _scatter_kernel(flags_ptr, scan_ptr, item_start_ptr, split_start_ptr, nnz, BLOCK: tl.constexpr):
        j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = j < nnz
        flags = tl.load(flags_ptr + j, mask=m, other=0)
        scan = tl.load(scan_ptr + j, mask=m, other=0)
        items = scan & 0xFFFFFFFF
        tl.store(item_start_ptr + items - 1, j.to(tl.int32), mask=m & ((flags & 0xFFFFFFFF) != 0))
        tl.store(split_start_ptr + (scan >> 32) - 1, j.to(tl.int32), mask=m & ((flags >> 32) != 0))
        tl.store(item_start_ptr + items, (tl.zeros([BLOCK], tl.int64) + nnz).to(tl.int32), mask=m & (j == nnz - 1))

    @triton.jit
    def _rows_of(sorted_ptr, perm_ptr, info_ptr, dims_ptr, strides_ptr, elem_offsets_ptr, row_offsets_ptr, j0, active,
                 batch_size, d, DIM: tl.constexpr, STRIDE: tl.constexpr, ALIGN: tl.constexpr):
        """Per run starting at sorted position ``j0`` (a vector; ``active`` masks it): its global row, table,
        first element, the mask of its dim (runs × BLOCK_D, false on inactive runs) and 1/dim."""
        key = tl.load(sorted_ptr + j0, mask=active, other=0).to(tl.int64)
        t = tl.load(info_ptr + tl.load(perm_ptr + j0, mask=active, other=0), mask=active, other=0) // batch_size
        if DIM > 0:  # one dim for all tables: a compile-time constant
            stride = STRIDE
            d_mask = (d[None, :] < DIM) & active[:, None]
            inv_dim = 1.0 / DIM
        else:
            stride = tl.multiple_of(tl.load(strides_ptr + t, mask=active, other=ALIGN), ALIGN)
            dim = tl.load(dims_ptr + t, mask=active, other=1)
            d_mask = (d[None, :] < dim[:, None]) & active[:, None]
            inv_dim = 1.0 / dim.to(tl.float32)
        first = tl.load(elem_offsets_ptr + t, mask=active, other=0) + \
            (key - tl.load(row_offsets_ptr + t, mask=active, other=0)) * stride
        return key, t, tl.multiple_of(first, ALIGN), d_mask, inv_dim

    @triton.jit
    def _apply_update(weight_ptr, state1_ptr, state2_ptr, step_ptr, g, row, elem, d, d_mask, row_mask, inv_dim, lr,
                      eps, weight_decay, beta1, beta2, rest1, rest2, log_beta1, log_beta2, OPT: tl.constexpr,
                      ROUNDING_BITS: tl.constexpr):
        """Apply the optimizer to rows given their summed gradients ``g`` (runs × BLOCK_D, fp32) and write them
        back; ``row_mask`` (runs) says which rows to update, ``d_mask`` (runs × BLOCK_D) their elements."""
        at = elem[:, None] + d[None, :]
        if OPT == 0:  # plain gradient into a dense fp32 buffer
            tl.store(state1_ptr + at, g, mask=d_mask)
        else:
            w = tl.load(weight_ptr + at, mask=d_mask, other=0.0).to(tl.float32)
            g = g + weight_decay * w
            if OPT == 1:  # sgd
                w = w - lr * g
            elif OPT == 2:  # adagrad
                s = tl.load(state1_ptr + at, mask=d_mask, other=0.0) + g * g
                tl.store(state1_ptr + at, s, mask=d_mask)
                w = w - lr * g / (tl.sqrt(s) + eps)
            elif OPT == 3:  # rowwise_adagrad
                m = tl.load(state1_ptr + row, mask=row_mask, other=0.0) + \
                    tl.sum(tl.where(d_mask, g * g, 0.0), axis=1) * inv_dim
                tl.store(state1_ptr + row, m, mask=row_mask)
                w = w - lr * g / (tl.sqrt(m)[:, None] + eps)
            else:  # adam, lazy: touched rows only; bias correction by the global step
                step = tl.load(step_ptr).to(tl.float64)  # fp64: beta**step loses digits in fp32
                bias1 = (1 - tl.exp(step * log_beta1)).to(tl.float32)
                bias2 = (1 - tl.exp(step * log_beta2)).to(tl.float32)
                m = beta1 * tl.load(state1_ptr + at, mask=d_mask, other=0.0) + rest1 * g
                v = beta2 * tl.load(state2_ptr + at, mask=d_mask, other=0.0) + rest2 * g * g
                tl.store(state1_ptr + at, m, mask=d_mask)
                tl.store(state2_ptr + at, v, mask=d_mask)
                w = w - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
            if ROUNDING_BITS > 0:
                # Stochastic rounding to a half type: add random low bits to the fp32 pattern, then
                # truncate them; the result converts to the half type exactly (reference.stochastic_round).
                mask = (1 << ROUNDING_BITS) - 1
                noise = tl.randint(tl.load(step_ptr), at.to(tl.uint32)).to(tl.int32) & mask
                bits = w.to(tl.int32, bitcast=True)
                w = ((bits + noise) & ~mask).to(tl.float32, bitcast=True)
            tl.store(weight_ptr + at, w.to(weight_ptr.dtype.element_ty), mask=d_mask)

    @triton.jit
    def _segment_kernel(
        weight_ptr, state1_ptr, state2_ptr, step_ptr, grad_ptr, sorted_ptr, perm_ptr, info_ptr, item_start_ptr,
        scan_ptr, partials_ptr, offsets_ptr, psw_ptr, dims_ptr, strides_ptr, elem_offsets_ptr, row_offsets_ptr,
        col_offsets_ptr, poolings_ptr, nnz, batch_size, grad_stride, sentinel, lr, eps, weight_decay, beta1, beta2,
        rest1, rest2, log_beta1, log_beta2, OPT: tl.constexpr, HAS_PSW: tl.constexpr, ROUNDING_BITS: tl.constexpr,
        DIM: tl.constexpr, STRIDE: tl.constexpr, ALIGN: tl.constexpr, COL_ALIGN: tl.constexpr, CHUNK: tl.constexpr,
        RUNS: tl.constexpr, BLOCK_N: tl.constexpr, LONG_N: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        # RUNS work items a program, side by side (one warp each at D 128 fp32): several independent rows in
        # flight per program (FBGEMM's short-run kernel: a warp per run, several warps a block). The grid is
        # sized to the GPU, not to the items (their count is on the device): each program takes every
        # num_programs-th group of RUNS items, so no program is launched only to find nothing to do.
        num_items = tl.load(scan_ptr + nnz - 1) & 0xFFFFFFFF
        lane = tl.arange(0, RUNS)
        d = tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        for first in range(tl.program_id(0) * RUNS, num_items, tl.num_programs(0) * RUNS):
            i = first + lane
            live = i < num_items
            j0 = tl.load(item_start_ptr + i, mask=live, other=0)
            j1 = tl.load(item_start_ptr + i + 1, mask=live, other=0)
            active = live & (tl.load(sorted_ptr + j0, mask=live, other=sentinel) != sentinel)
            row, t, elem, d_mask, inv_dim = _rows_of(sorted_ptr, perm_ptr, info_ptr, dims_ptr, strides_ptr,
                                                     elem_offsets_ptr, row_offsets_ptr, j0, active, batch_size, d,
                                                     DIM, STRIDE, ALIGN)
            col = tl.multiple_of(tl.load(col_offsets_ptr + t, mask=active, other=0), COL_ALIGN)
            mean = tl.load(poolings_ptr + t, mask=active, other=0) == 1
            count = tl.where(active, j1 - j0, 0)
            g = tl.zeros([RUNS, BLOCK_D], dtype=tl.float32)
            # The items' occurrences BLOCK_N at a time, all RUNS items together: with a wide tile for long
            # items (LONG_N > BLOCK_N), only their first BLOCK_N here, the rest below.
            longest = tl.max(count, axis=0)
            stop = tl.minimum(longest, BLOCK_N) if LONG_N > BLOCK_N else longest
            for k0 in range(0, stop, BLOCK_N):  # at most CHUNK occurrences, BLOCK_N at a time
                step = k0 + n
                k_mask = step[None, :] < count[:, None]  # (RUNS, BLOCK_N)
                k = j0[:, None] + step[None, :]
                p = tl.load(perm_ptr + k, mask=k_mask, other=0)
                bag = tl.load(info_ptr + p, mask=k_mask, other=0)
                scale = tl.where(k_mask, 1.0, 0.0)
                if HAS_PSW:
                    scale = scale * tl.load(psw_ptr + p, mask=k_mask, other=0.0).to(tl.float32)
                averaged = k_mask & mean[:, None]
                length = tl.load(offsets_ptr + bag + 1, mask=averaged, other=1) - \
                    tl.load(offsets_ptr + bag, mask=averaged, other=0)
                scale = scale / tl.maximum(length, 1).to(tl.float32)
                b = (bag - t[:, None] * batch_size).to(tl.int64)
                rows = tl.load(grad_ptr + b[:, :, None] * tl.multiple_of(grad_stride, COL_ALIGN) + col[:, None, None]
                               + d[None, None, :], mask=k_mask[:, :, None] & d_mask[:, None, :], other=0.0)
                g += tl.sum(rows.to(tl.float32) * scale[:, :, None], axis=1)
            if LONG_N > BLOCK_N:  # noqa: SIM102 - compiled away when off (a constexpr); the inner test runs
                if longest > BLOCK_N:  # some item is longer: each such one alone, LONG_N occurrences a step
                    for r in range(0, RUNS):  # a loop: unrolled, the copies cost registers (spills at bf16)
                        g = _long_item(g, lane == r, first + r, num_items, grad_ptr, item_start_ptr, sorted_ptr,
                                       perm_ptr, info_ptr, offsets_ptr, psw_ptr, dims_ptr, col_offsets_ptr,
                                       poolings_ptr, batch_size, grad_stride, sentinel, d, HAS_PSW, DIM, COL_ALIGN,
                                       BLOCK_N, LONG_N, BLOCK_D)
            run_first = (j0 == 0) | (tl.load(sorted_ptr + tl.maximum(j0 - 1, 0), mask=active, other=0) != row)
            continues = (j1 < nnz) & (tl.load(sorted_ptr + tl.minimum(j1, nnz - 1), mask=active, other=0) == row)
            whole = active & run_first & (continues == 0)  # the whole run: update the row now
            _apply_update(weight_ptr, state1_ptr, state2_ptr, step_ptr, g, row, elem, d, d_mask & whole[:, None],
                          whole, inv_dim, lr, eps, weight_decay, beta1, beta2, rest1, rest2, log_beta1, log_beta2, OPT,
                          ROUNDING_BITS)
            # part of a split run: slot 1 = its first item, slot 0 = an item at a chunk start
            slot = tl.where(run_first, 1, 0)
            tl.store(partials_ptr + ((j0 // CHUNK).to(tl.int64) * 2 + slot)[:, None] * BLOCK_D + d[None, :], g,
                     mask=(active & (whole == 0))[:, None])

    @triton.jit
    def _long_item(g, pick, i, num_items, grad_ptr, item_start_ptr, sorted_ptr, perm_ptr, info_ptr, offsets_ptr,
                   psw_ptr, dims_ptr, col_offsets_ptr, poolings_ptr, batch_size, grad_stride, sentinel, d,
                   HAS_PSW: tl.constexpr, DIM: tl.constexpr, COL_ALIGN: tl.constexpr, BLOCK_N: tl.constexpr,
                   LONG_N: tl.constexpr, BLOCK_D: tl.constexpr):
        """``g`` with item ``i``'s occurrences past its first BLOCK_N added to its row (``pick``), LONG_N a step.

        A long item (a hot row: Criteo's tables of 3 to 30 rows take a 64K batch in runs of thousands) would
        otherwise take one dependent gather a step at the BLOCK_N of short ones; its scalars are loaded
        again here (cached) rather than picked out of the program's vectors across warps."""
        j0 = tl.load(item_start_ptr + i, mask=i < num_items, other=0)
        j1 = tl.load(item_start_ptr + i + 1, mask=i < num_items, other=0)
        count = tl.where((i < num_items) & (tl.load(sorted_ptr + j0) != sentinel), j1 - j0, 0)
        if count > BLOCK_N:
            t = tl.load(info_ptr + tl.load(perm_ptr + j0)) // batch_size
            col = tl.multiple_of(tl.load(col_offsets_ptr + t), COL_ALIGN)
            d_mask = d < (DIM if DIM > 0 else tl.load(dims_ptr + t))
            m = tl.arange(0, LONG_N)
            mean = (tl.load(poolings_ptr + t) + tl.zeros_like(m)) == 1  # (a vector: a mask of the tile's rows)
            acc = tl.zeros([LONG_N, BLOCK_D], dtype=tl.float32)
            for k0 in range(BLOCK_N, count, LONG_N):
                step = k0 + m
                k_mask = step < count
                p = tl.load(perm_ptr + j0 + step, mask=k_mask, other=0)
                bag = tl.load(info_ptr + p, mask=k_mask, other=0)
                scale = tl.where(k_mask, 1.0, 0.0)
                if HAS_PSW:
                    scale = scale * tl.load(psw_ptr + p, mask=k_mask, other=0.0).to(tl.float32)
                averaged = k_mask & mean
                length = tl.load(offsets_ptr + bag + 1, mask=averaged, other=1) - \
                    tl.load(offsets_ptr + bag, mask=averaged, other=0)
                scale = scale / tl.maximum(length, 1).to(tl.float32)
                b = (bag - t * batch_size).to(tl.int64)
                rows = tl.load(grad_ptr + b[:, None] * tl.multiple_of(grad_stride, COL_ALIGN) + col + d[None, :],
                               mask=k_mask[:, None] & d_mask[None, :], other=0.0)
                acc += rows.to(tl.float32) * scale[:, None]
            g += tl.where(pick[:, None], tl.sum(acc, axis=0)[None, :], 0.0)
        return g

    @triton.jit
    def _split_kernel(
        weight_ptr, state1_ptr, state2_ptr, step_ptr, sorted_ptr, perm_ptr, info_ptr, split_start_ptr, scan_ptr,
        partials_ptr, dims_ptr, strides_ptr, elem_offsets_ptr, row_offsets_ptr, nnz, batch_size, sentinel, lr, eps,
        weight_decay, beta1, beta2, rest1, rest2, log_beta1, log_beta2, OPT: tl.constexpr, ROUNDING_BITS: tl.constexpr,
        DIM: tl.constexpr, STRIDE: tl.constexpr, ALIGN: tl.constexpr, CHUNK: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        s = tl.program_id(0)
        num_splits = tl.load(scan_ptr + nnz - 1) >> 32
        if s < num_splits:
            j0 = tl.load(split_start_ptr + s)
            row = tl.load(sorted_ptr + j0)
            if row != sentinel:
                d = tl.arange(0, BLOCK_D)
                one = tl.full([1], 1, tl.int1)  # the helpers take vectors of runs: here, one
                key, t, elem, d_mask, inv_dim = _rows_of(sorted_ptr, perm_ptr, info_ptr, dims_ptr, strides_ptr,
                                                         elem_offsets_ptr, row_offsets_ptr, j0 + tl.zeros([1], tl.int32),
                                                         one, batch_size, d, DIM, STRIDE, ALIGN)
                chunk = (j0 // CHUNK).to(tl.int64)  # partials index: int64 past 2^31 elements
                g = tl.load(partials_ptr + (chunk * 2 + 1) * BLOCK_D + d)
                chunk += 1
                more = (chunk * CHUNK < nnz) & (tl.load(sorted_ptr + tl.minimum(chunk * CHUNK, nnz - 1)) == row)
                while more:  # the run's later items, in order: the same sum on every run
                    g += tl.load(partials_ptr + chunk * 2 * BLOCK_D + d)
                    chunk += 1
                    more = (chunk * CHUNK < nnz) & (tl.load(sorted_ptr + tl.minimum(chunk * CHUNK, nnz - 1)) == row)
                _apply_update(weight_ptr, state1_ptr, state2_ptr, step_ptr, g[None, :], key, elem, d, d_mask, one,
                              inv_dim, lr, eps, weight_decay, beta1, beta2, rest1, rest2, log_beta1, log_beta2, OPT,
                              ROUNDING_BITS)


@lru_cache(maxsize=64)
def device_layout(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    def tensor(values, dtype=torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    groups = {dim: tensor([t for t, d in enumerate(layout.dims) if d == dim], torch.int32)
              for dim in sorted(set(layout.dims))}
    return {"dims": tensor(layout.dims), "strides": tensor(layout.strides), "rows": tensor(layout.rows),
            "elem_offsets": tensor(layout.elem_offsets), "row_offsets": tensor(layout.row_offsets),
            "col_offsets": tensor(layout.col_offsets), "poolings": tensor(layout.poolings), "groups": groups}


def _layout(dims, capacities, rows, poolings, align) -> Layout:
    return Layout(tuple(dims), tuple(capacities), tuple(rows), tuple(poolings), align)


def layout_args(layout: Layout) -> tuple[list[int], list[int], list[int], list[int], int]:
    """The layout as the ops take it (lists of ints: torch.library schemas have no dataclasses)."""
    return list(layout.dims), list(layout.capacities), list(layout.rows), list(layout.poolings), layout.align


# --- ops -------------------------------------------------------------------------------------------------


def _pooled(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, errors: torch.Tensor, dims: list[int],
            capacities: list[int], rows: list[int], poolings: list[int], align: int, batch_size: int,
            use_triton: bool) -> torch.Tensor:
    """Pooled embeddings (B, ΣD), fp32. Ids outside a table pool as zeros and are counted in ``errors``."""
    layout = _layout(dims, capacities, rows, poolings, align)
    values, offsets = values.contiguous(), offsets.contiguous()
    per_sample_weights = per_sample_weights.contiguous() if per_sample_weights is not None else None
    if not use_triton:
        return reference.forward(weight, values, offsets, per_sample_weights, layout, batch_size, errors)
    out = torch.empty(batch_size, layout.total_dim, device=weight.device, dtype=torch.float32)
    if batch_size == 0:
        return out
    meta = device_layout(layout, weight.device)
    average_pooling = values.numel() / (layout.num_tables * batch_size)
    for dim, tables in meta["groups"].items():
        stride = -(-dim // align) * align
        block_d = _next_power_of_2(stride)
        bags, block_n = forward_tiles(block_d, average_pooling)
        blocks = triton.cdiv(batch_size, bags)
        pipeline = max(1, min(FORWARD_PIPELINE, blocks))
        _forward_kernel[(tables.numel() * triton.cdiv(blocks, pipeline),)](
            weight.contiguous(), values, offsets, per_sample_weights if per_sample_weights is not None else values,
            out, errors, tables, meta["rows"], meta["elem_offsets"], meta["col_offsets"], meta["poolings"],
            batch_size, blocks, layout.num_tables, out.stride(0), DIM=dim, STRIDE=stride, ALIGN=align,
            COL_ALIGN=column_alignment(layout), BAGS=bags,
            BLOCK_N=block_n, BLOCK_D=block_d, HAS_PSW=per_sample_weights is not None,
            NARROW=FORWARD_NARROW and narrow_indices(layout, values.numel()), PIPELINE=pipeline,
            num_warps=FORWARD_WARPS,
        )
    return out


# The op: what compiled and exported graphs hold (opaque to the compiler; the fake kernel gives its shape).
embedding_bags = torch.library.custom_op("recloop::embedding_bags", mutates_args=("errors",))(_pooled)


@embedding_bags.register_fake
def _(weight, values, offsets, per_sample_weights, errors, dims, capacities, rows, poolings, align, batch_size,
      use_triton):
    return weight.new_empty((batch_size, sum(dims)), dtype=torch.float32)


def pool(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
         errors: torch.Tensor, *layout: int | list[int] | bool) -> torch.Tensor:
    """``embedding_bags``, through the op only where it must be (``_dispatch``)."""
    return _dispatch(embedding_bags, _pooled, weight, values, offsets, per_sample_weights, errors, *layout)


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def _dispatch(op, function, *args):
    """``op`` when a compiler, an exporter or a tracing mode is around the call or a tensor argument is not a plain
    one (fake, functional); else ``function``, the op's own implementation, called directly. A custom op's first
    eager call imports ``torch._dynamo`` (torch wraps every op implementation in a lazy dynamo-disable): 2.3 s of
    a fresh process that only scores (the gate's serving check, a serving replica) or trains eagerly (on a CPU),
    for a call that runs the same function either way (benchmarks/fresh_score.py)."""
    if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None or \
            any(isinstance(a, torch.Tensor) and type(a) not in _PLAIN for a in args):
        return op(*args)
    return function(*args)


def _backward(opt_code: int, weight, state1, state2, step, grad_output, values, offsets, per_sample_weights,
              layout: Layout, batch_size: int, config: tuple) -> None:
    """The sort-and-reduce backward (module docstring): fused update, or the gradient into ``state1``."""
    nnz = values.numel()
    if nnz == 0 or batch_size == 0:
        return
    if nnz >= 2**31 - CHUNK:
        raise ValueError(f"{nnz} ids in one batch: the backward indexes occurrences with int32")
    device = weight.device
    meta = device_layout(layout, device)
    values, offsets, grad_output = values.contiguous(), offsets.contiguous(), grad_output.contiguous()
    per_sample_weights = per_sample_weights.contiguous() if per_sample_weights is not None else None
    total_rows = layout.total_rows
    sentinel = total_rows  # the key of ids outside their table: sorts after every real row
    keys = torch.empty(nnz, device=device, dtype=torch.int32 if total_rows < 2**31 - 1 else torch.int64)
    info = torch.empty(nnz, device=device, dtype=torch.int32)
    num_bags = layout.num_tables * batch_size
    bags, block_n = forward_tiles(16, nnz / num_bags)
    _linearize_kernel[(triton.cdiv(num_bags, bags) + 1,)](
        values, offsets, keys, info, meta["rows"], meta["row_offsets"], batch_size, num_bags, nnz, sentinel,
        BAGS=bags, BLOCK_N=block_n, BLOCK_TAIL=1024)
    sorted_keys, perm = torch.sort(keys, stable=True)

    flags = torch.empty(nnz, device=device, dtype=torch.int64)
    grid = (triton.cdiv(nnz, SCAN_BLOCK),)
    _mark_kernel[grid](sorted_keys, flags, nnz, CHUNK=CHUNK, BLOCK=SCAN_BLOCK)
    scan = torch.cumsum(flags, 0)  # low 32 bits: item ids; high 32 bits: split-run ids
    chunks = triton.cdiv(nnz, CHUNK)
    item_start = torch.empty(nnz + 1, device=device, dtype=torch.int32)
    split_start = torch.empty(chunks, device=device, dtype=torch.int32)
    _scatter_kernel[grid](flags, scan, item_start, split_start, nnz, BLOCK=SCAN_BLOCK)

    uniform = len(set(layout.dims)) == 1
    dim = layout.dims[0] if uniform else 0
    block_d = _next_power_of_2(max(layout.strides))
    partials = torch.empty(chunks * 2 * block_d, device=device, dtype=torch.float32)
    lr, eps, weight_decay, beta1, beta2 = config
    log_beta1, log_beta2 = math.log(beta1) if beta1 > 0 else -1e30, math.log(beta2) if beta2 > 0 else -1e30
    rounding = reference.ROUNDING_BITS.get(weight.dtype, 0) if opt_code else 0
    shape = dict(DIM=dim, STRIDE=layout.strides[0] if uniform else 0, ALIGN=layout.align, CHUNK=CHUNK, BLOCK_D=block_d)
    rest1, rest2 = 1 - beta1, 1 - beta2  # in fp64 here: the kernel's fp32 beta2 = 0.999 leaves 1 - beta2 1.3e-5 off
    hyper = (lr, eps, weight_decay, beta1, beta2, rest1, rest2, log_beta1, log_beta2)
    segment_n, warps, runs = backward_tiles(block_d)
    max_items = min(nnz, total_rows + 1 + chunks)  # runs (≤ distinct keys) plus chunk boundaries
    _segment_kernel[(segment_programs(device, max_items, runs, warps),)](
        weight, state1, state2, step, grad_output, sorted_keys, perm, info, item_start, scan, partials, offsets,
        per_sample_weights if per_sample_weights is not None else grad_output, meta["dims"], meta["strides"],
        meta["elem_offsets"], meta["row_offsets"], meta["col_offsets"], meta["poolings"], nnz, batch_size,
        grad_output.stride(0), sentinel, *hyper, OPT=opt_code, HAS_PSW=per_sample_weights is not None,
        ROUNDING_BITS=rounding, COL_ALIGN=column_alignment(layout), RUNS=runs, BLOCK_N=segment_n,
        LONG_N=SEGMENT_LONG_N, num_warps=warps, **shape)
    _split_kernel[(max(1, min(chunks, total_rows + 1)),)](
        weight, state1, state2, step, sorted_keys, perm, info, split_start, scan, partials, meta["dims"],
        meta["strides"], meta["elem_offsets"], meta["row_offsets"], nnz, batch_size, sentinel, *hyper,
        OPT=opt_code, ROUNDING_BITS=rounding, num_warps=max(1, block_d // 128), **shape)


def _weight_grad(grad_output: torch.Tensor, weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                 per_sample_weights: torch.Tensor | None, dims: list[int], capacities: list[int], rows: list[int],
                 poolings: list[int], align: int, batch_size: int, use_triton: bool) -> torch.Tensor:
    """The dense gradient of the flat weight (for ``optimizer=None``)."""
    layout = _layout(dims, capacities, rows, poolings, align)
    if not use_triton:
        return reference.dense_gradient(grad_output, values.contiguous(), offsets.contiguous(),
                                        per_sample_weights, layout, batch_size, weight.dtype)
    grad = torch.zeros(layout.total_elems, device=weight.device, dtype=torch.float32)
    _backward(OPT_CODES["gradient"], weight, grad, grad, offsets, grad_output, values, offsets, per_sample_weights,
              layout, batch_size, (0.0, 0.0, 0.0, 0.5, 0.5))
    return grad.to(weight.dtype)


embedding_bags_weight_grad = torch.library.custom_op("recloop::embedding_bags_weight_grad", mutates_args=())(
    _weight_grad)


@embedding_bags_weight_grad.register_fake
def _(grad_output, weight, values, offsets, per_sample_weights, dims, capacities, rows, poolings, align, batch_size,
      use_triton):
    return torch.empty_like(weight)


def _sparse_update(grad_output: torch.Tensor, weight: torch.Tensor, state1: torch.Tensor, state2: torch.Tensor,
                   values: torch.Tensor, offsets: torch.Tensor, per_sample_weights: torch.Tensor | None,
                   dims: list[int], capacities: list[int], rows: list[int], poolings: list[int], align: int,
                   batch_size: int, use_triton: bool, optimizer: str, lr: float, eps: float, weight_decay: float,
                   beta1: float, beta2: float, step: torch.Tensor) -> None:
    """Apply the fused sparse optimizer to every row the batch touched, in place.

    ``state1``/``state2``: adagrad → (sum, unused); rowwise_adagrad → (per-row sums, unused);
    adam → (exp_avg, exp_avg_sq); sgd → unused. ``step`` (int64, one element, on the weight's device)
    counts updates: it is incremented first, then used for Adam's bias correction and as the seed of
    stochastic rounding, without a host synchronization.
    """
    layout = _layout(dims, capacities, rows, poolings, align)
    step.add_(1)
    if not use_triton:
        config = OptimizerConfig(optimizer, lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        state = {"sum": state1, "row_sum": state1, "exp_avg": state1, "exp_avg_sq": state2}
        gradients = reference.sparse_gradients(grad_output, values.contiguous(), offsets.contiguous(),
                                               per_sample_weights, layout, batch_size)
        reference.apply_optimizer(weight, state, layout, gradients, config, int(step.item()))
        return
    _backward(OPT_CODES[optimizer], weight, state1, state2, step, grad_output, values, offsets, per_sample_weights,
              layout, batch_size, (lr, eps, weight_decay, beta1, beta2))


embedding_bags_sparse_update = torch.library.custom_op(
    "recloop::embedding_bags_sparse_update", mutates_args=("weight", "state1", "state2", "step"))(_sparse_update)


@embedding_bags_sparse_update.register_fake
def _(grad_output, weight, state1, state2, values, offsets, per_sample_weights, dims, capacities, rows, poolings,
      align, batch_size, use_triton, optimizer, lr, eps, weight_decay, beta1, beta2, step):
    return None


# --- autograd --------------------------------------------------------------------------------------------


class DenseGradientEmbeddingBags(torch.autograd.Function):
    """``optimizer=None``: the flat weight receives an ordinary dense gradient."""

    @staticmethod
    def forward(ctx, weight, errors, values, offsets, per_sample_weights, layout_args):
        ctx.save_for_backward(weight, values, offsets, per_sample_weights)
        ctx.layout_args = layout_args
        return pool(weight, values, offsets, per_sample_weights, errors, *layout_args)

    @staticmethod
    def backward(ctx, grad_output):
        weight, values, offsets, per_sample_weights = ctx.saved_tensors
        grad = _dispatch(embedding_bags_weight_grad, _weight_grad, grad_output, weight, values, offsets,
                         per_sample_weights, *ctx.layout_args)
        return grad, None, None, None, None, None


class FusedEmbeddingBags(torch.autograd.Function):
    """Forward pooling; backward applies the fused optimizer to the weight and returns no weight gradient.

    ``trigger`` is an empty tensor that requires grad: it makes autograd call this backward even though
    the weight itself is not a leaf that receives a gradient (as FBGEMM's TBE does).
    """

    @staticmethod
    def forward(ctx, trigger, weight, state1, state2, step, errors, values, offsets, per_sample_weights, layout_args,
                config):
        ctx.save_for_backward(values, offsets, per_sample_weights)
        ctx.weight, ctx.state1, ctx.state2, ctx.step = weight, state1, state2, step
        ctx.layout_args, ctx.config = layout_args, config
        return pool(weight, values, offsets, per_sample_weights, errors, *layout_args)

    @staticmethod
    def backward(ctx, grad_output):
        values, offsets, per_sample_weights = ctx.saved_tensors
        config = ctx.config
        _dispatch(embedding_bags_sparse_update, _sparse_update, grad_output, ctx.weight, ctx.state1, ctx.state2,
                  values, offsets, per_sample_weights, *ctx.layout_args, config.name, config.lr, config.eps,
                  config.weight_decay, config.beta1, config.beta2, ctx.step)
        return (None,) * 11
