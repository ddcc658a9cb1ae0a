"""Fused multi-table embedding bags: Triton kernels, their torch.library ops, and autograd.

Forward (one launch for all tables): one program per bag (t, b); it loads ``BLOCK_N`` ids at a time,
gathers their rows as a (BLOCK_N, BLOCK_D) tile, accumulates in fp32 and writes the pooled row once
into the concatenated (B, ΣD) output.

Backward with a fused optimizer (no dense gradient, no atomics, deterministic):

1. each occurrence → its global row id (table row offset + id) and its bag;
2. a stable sort by row id; segment starts where the row changes; each segment's end from a reverse
   running minimum (all on the device: no host synchronization);
3. one program per occurrence position; the program at a segment start reduces its segment serially
   (in sorted order, so the sum is the same on every run), applies the optimizer to that row, and
   writes the row back (stochastic rounding for fp16/bf16 weights). Other programs exit at once.

The ops are registered with ``torch.library`` (with fake implementations) so modules using them work
under autograd, ``torch.compile`` and ``torch.export``. Each op runs the Triton kernels when the
tensors are on CUDA (or under ``TRITON_INTERPRET=1`` on CPU) and the reference otherwise.
"""

from __future__ import annotations

import math
import os
from functools import lru_cache

import torch

from recloop_kernels import reference
from recloop_kernels.config import Layout, OptimizerConfig

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is optional on CPU machines
    triton = None

OPT_CODES = {"gradient": 0, "sgd": 1, "adagrad": 2, "rowwise_adagrad": 3, "adam": 4}


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


if triton is not None:

    @triton.jit
    def _forward_kernel(weight_ptr, values_ptr, offsets_ptr, psw_ptr, out_ptr, dims_ptr, elem_offsets_ptr,
                        col_offsets_ptr, poolings_ptr, batch_size, out_stride,
                        HAS_PSW: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
        bag = tl.program_id(0)
        t = bag // batch_size
        b = bag % batch_size
        start = tl.load(offsets_ptr + bag)
        end = tl.load(offsets_ptr + bag + 1)
        dim = tl.load(dims_ptr + t)
        base = tl.load(elem_offsets_ptr + t)
        col = tl.load(col_offsets_ptr + t)
        d = tl.arange(0, BLOCK_D)
        d_mask = d < dim
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for i in range(start, end, BLOCK_N):
            n = i + tl.arange(0, BLOCK_N)
            n_mask = n < end
            ids = tl.load(values_ptr + n, mask=n_mask, other=0)
            rows = tl.load(weight_ptr + base + ids[:, None] * dim + d[None, :],
                           mask=n_mask[:, None] & d_mask[None, :], other=0.0).to(tl.float32)
            if HAS_PSW:
                scale = tl.load(psw_ptr + n, mask=n_mask, other=0.0).to(tl.float32)
                rows = rows * scale[:, None]
            acc += tl.sum(rows, axis=0)
        if tl.load(poolings_ptr + t) == 1:
            acc = acc / tl.maximum(end - start, 1).to(tl.float32)
        tl.store(out_ptr + b * out_stride + col + d, acc, mask=d_mask)

    @triton.jit
    def _segment_update_kernel(
        weight_ptr, state1_ptr, state2_ptr, grad_out_ptr, sorted_rows_ptr, perm_ptr, bag_ptr, seg_end_ptr,
        offsets_ptr, psw_ptr, row_table_ptr, dims_ptr, elem_offsets_ptr, row_offsets_ptr, col_offsets_ptr,
        poolings_ptr, step_ptr, nnz, batch_size, grad_stride, lr, eps, weight_decay, beta1, beta2, log_beta1,
        log_beta2, OPT: tl.constexpr, HAS_PSW: tl.constexpr, ROUNDING_BITS: tl.constexpr, BLOCK_D: tl.constexpr,
    ):
        j = tl.program_id(0)
        row = tl.load(sorted_rows_ptr + j)
        previous = tl.load(sorted_rows_ptr + tl.maximum(j - 1, 0))
        if (j == 0) | (row != previous):  # only segment starts work; the others exit
            seg_end = tl.load(seg_end_ptr + j)
            t = tl.load(row_table_ptr + j)
            dim = tl.load(dims_ptr + t)
            col = tl.load(col_offsets_ptr + t)
            pooling = tl.load(poolings_ptr + t)
            local = row - tl.load(row_offsets_ptr + t)
            elem = tl.load(elem_offsets_ptr + t) + local * dim
            d = tl.arange(0, BLOCK_D)
            d_mask = d < dim
            g = tl.zeros([BLOCK_D], dtype=tl.float32)
            for k in range(j, seg_end):
                p = tl.load(perm_ptr + k)
                bag = tl.load(bag_ptr + p)
                scale = 1.0
                if HAS_PSW:
                    scale = tl.load(psw_ptr + p).to(tl.float32)
                if pooling == 1:
                    length = tl.load(offsets_ptr + bag + 1) - tl.load(offsets_ptr + bag)
                    scale = scale / tl.maximum(length, 1).to(tl.float32)
                b = bag % batch_size
                g += scale * tl.load(grad_out_ptr + b * grad_stride + col + d, mask=d_mask, other=0.0).to(tl.float32)
            if OPT == 0:  # plain gradient into a dense fp32 buffer
                tl.store(state1_ptr + elem + d, g, mask=d_mask)
            else:
                w = tl.load(weight_ptr + elem + d, mask=d_mask, other=0.0).to(tl.float32)
                g = g + weight_decay * w
                if OPT == 1:  # sgd
                    w = w - lr * g
                elif OPT == 2:  # adagrad
                    s = tl.load(state1_ptr + elem + d, mask=d_mask, other=0.0) + g * g
                    tl.store(state1_ptr + elem + d, s, mask=d_mask)
                    w = w - lr * g / (tl.sqrt(s) + eps)
                elif OPT == 3:  # rowwise_adagrad
                    m = tl.load(state1_ptr + row) + tl.sum(tl.where(d_mask, g * g, 0.0), axis=0) / dim.to(tl.float32)
                    tl.store(state1_ptr + row, m)
                    w = w - lr * g / (tl.sqrt(m) + eps)
                else:  # adam, lazy: touched rows only; bias correction by the global step
                    step = tl.load(step_ptr).to(tl.float64)  # fp64: beta**step loses digits in fp32
                    bias1 = (1 - tl.exp(step * log_beta1)).to(tl.float32)
                    bias2 = (1 - tl.exp(step * log_beta2)).to(tl.float32)
                    m = beta1 * tl.load(state1_ptr + elem + d, mask=d_mask, other=0.0) + (1 - beta1) * g
                    v = beta2 * tl.load(state2_ptr + elem + d, mask=d_mask, other=0.0) + (1 - beta2) * g * g
                    tl.store(state1_ptr + elem + d, m, mask=d_mask)
                    tl.store(state2_ptr + elem + d, v, mask=d_mask)
                    w = w - lr * (m / bias1) / (tl.sqrt(v / bias2) + eps)
                if ROUNDING_BITS > 0:
                    # Stochastic rounding to a half type: add random low bits to the fp32 pattern, then
                    # truncate them (toward zero in magnitude); the result converts to the half type exactly.
                    mask = (1 << ROUNDING_BITS) - 1
                    noise = tl.randint(tl.load(step_ptr), elem + d).to(tl.int32) & mask
                    bits = w.to(tl.int32, bitcast=True)
                    w = ((bits + noise) & ~mask).to(tl.float32, bitcast=True)
                tl.store(weight_ptr + elem + d, w.to(weight_ptr.dtype.element_ty), mask=d_mask)


@lru_cache(maxsize=64)
def _device_layout(layout: Layout, device: torch.device) -> dict[str, torch.Tensor]:
    def tensor(values) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    return {"dims": tensor(layout.dims), "elem_offsets": tensor(layout.elem_offsets),
            "row_offsets": tensor(layout.row_offsets), "col_offsets": tensor(layout.col_offsets),
            "poolings": tensor(layout.poolings)}


def _block(n: int) -> int:
    return max(16, triton.next_power_of_2(n)) if triton is not None else n


def _layout(dims, capacities, rows, poolings) -> Layout:
    return Layout(tuple(dims), tuple(capacities), tuple(rows), tuple(poolings))


# --- ops -------------------------------------------------------------------------------------------------


@torch.library.custom_op("recloop::embedding_bags", mutates_args=())
def embedding_bags(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                   per_sample_weights: torch.Tensor | None, dims: list[int], capacities: list[int],
                   rows: list[int], poolings: list[int], batch_size: int, use_triton: bool) -> torch.Tensor:
    """Pooled embeddings (B, ΣD), fp32. See the module docstring for the layout."""
    layout = _layout(dims, capacities, rows, poolings)
    if not use_triton:
        return reference.forward(weight, values, offsets, per_sample_weights, layout, batch_size)
    out = torch.empty(batch_size, layout.total_dim, device=weight.device, dtype=torch.float32)
    if batch_size == 0:
        return out
    meta = _device_layout(layout, weight.device)
    _forward_kernel[(layout.num_tables * batch_size,)](
        weight, values, offsets, per_sample_weights if per_sample_weights is not None else values, out,
        meta["dims"], meta["elem_offsets"], meta["col_offsets"], meta["poolings"], batch_size, out.stride(0),
        HAS_PSW=per_sample_weights is not None, BLOCK_N=16, BLOCK_D=_block(max(dims)),
    )
    return out


@embedding_bags.register_fake
def _(weight, values, offsets, per_sample_weights, dims, capacities, rows, poolings, batch_size, use_triton):
    return weight.new_empty((batch_size, sum(dims)), dtype=torch.float32)


def _segments(values: torch.Tensor, offsets: torch.Tensor, layout: Layout, batch_size: int, device):
    """Sorted global row ids, the permutation, each occurrence's bag, segment ends and row tables."""
    nnz = values.numel()
    meta = _device_layout(layout, device)
    positions = torch.arange(nnz, device=device)
    bag = torch.searchsorted(offsets[1:], positions, right=True)  # the bag each occurrence belongs to
    table = bag // batch_size
    rows = meta["row_offsets"][table] + values
    sorted_rows, perm = torch.sort(rows, stable=True)
    is_start = torch.ones(nnz, dtype=torch.bool, device=device)
    is_start[1:] = sorted_rows[1:] != sorted_rows[:-1]
    start_or_end = torch.where(is_start, positions, torch.full_like(positions, nnz))
    next_start = torch.flip(torch.cummin(torch.flip(start_or_end, [0]), 0).values, [0])  # min over k >= j
    seg_end = torch.cat([next_start[1:], torch.full((1,), nnz, device=device, dtype=next_start.dtype)])
    return sorted_rows, perm, bag, seg_end, table[perm], meta


def _launch_segments(opt_code: int, weight, state1, state2, grad_output, values, offsets, per_sample_weights,
                     layout: Layout, batch_size: int, config: tuple, step: torch.Tensor) -> None:
    nnz = values.numel()
    if nnz == 0:
        return
    sorted_rows, perm, bag, seg_end, row_table, meta = _segments(values, offsets, layout, batch_size, weight.device)
    lr, eps, weight_decay, beta1, beta2 = config
    log_beta1, log_beta2 = math.log(beta1) if beta1 > 0 else -1e30, math.log(beta2) if beta2 > 0 else -1e30
    rounding = {torch.float16: 13, torch.bfloat16: 16}.get(weight.dtype, 0) if opt_code else 0
    grad_output = grad_output.contiguous()
    _segment_update_kernel[(nnz,)](
        weight, state1, state2, grad_output, sorted_rows, perm, bag, seg_end, offsets,
        per_sample_weights if per_sample_weights is not None else grad_output, row_table, meta["dims"],
        meta["elem_offsets"], meta["row_offsets"], meta["col_offsets"], meta["poolings"], step, nnz, batch_size,
        grad_output.stride(0), lr, eps, weight_decay, beta1, beta2, log_beta1, log_beta2,
        OPT=opt_code, HAS_PSW=per_sample_weights is not None, ROUNDING_BITS=rounding,
        BLOCK_D=_block(max(layout.dims)),
    )


@torch.library.custom_op("recloop::embedding_bags_weight_grad", mutates_args=())
def embedding_bags_weight_grad(grad_output: torch.Tensor, weight: torch.Tensor, values: torch.Tensor,
                               offsets: torch.Tensor, per_sample_weights: torch.Tensor | None, dims: list[int],
                               capacities: list[int], rows: list[int], poolings: list[int],
                               batch_size: int, use_triton: bool) -> torch.Tensor:
    """The dense gradient of the flat weight (for ``optimizer=None``)."""
    layout = _layout(dims, capacities, rows, poolings)
    if not use_triton:
        return reference.dense_gradient(grad_output, values, offsets, per_sample_weights, layout, batch_size,
                                        weight.dtype)
    grad = torch.zeros(layout.total_elems, device=weight.device, dtype=torch.float32)
    _launch_segments(OPT_CODES["gradient"], weight, grad, grad, grad_output, values, offsets, per_sample_weights,
                     layout, batch_size, (0.0, 0.0, 0.0, 0.5, 0.5), offsets)
    return grad.to(weight.dtype)


@embedding_bags_weight_grad.register_fake
def _(grad_output, weight, values, offsets, per_sample_weights, dims, capacities, rows, poolings, batch_size,
      use_triton):
    return torch.empty_like(weight)


@torch.library.custom_op("recloop::embedding_bags_sparse_update",
                         mutates_args=("weight", "state1", "state2", "step"))
def embedding_bags_sparse_update(grad_output: torch.Tensor, weight: torch.Tensor, state1: torch.Tensor,
                                 state2: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                                 per_sample_weights: torch.Tensor | None, dims: list[int], capacities: list[int],
                                 rows: list[int], poolings: list[int], batch_size: int, use_triton: bool,
                                 optimizer: str, lr: float,
                                 eps: float, weight_decay: float, beta1: float, beta2: float,
                                 step: torch.Tensor) -> None:
    """Apply the fused sparse optimizer to every row the batch touched, in place.

    ``state1``/``state2``: adagrad → (sum, unused); rowwise_adagrad → (per-row sums, unused);
    adam → (exp_avg, exp_avg_sq); sgd → unused. ``step`` (int64, one element, on the weight's device)
    counts updates: it is incremented first, then used for Adam's bias correction and as the seed of
    stochastic rounding, without a host synchronization.
    """
    layout = _layout(dims, capacities, rows, poolings)
    step.add_(1)
    if not use_triton:
        config = OptimizerConfig(optimizer, lr=lr, eps=eps, weight_decay=weight_decay, beta1=beta1, beta2=beta2)
        state = {"sum": state1, "row_sum": state1, "exp_avg": state1, "exp_avg_sq": state2}
        gradients = reference.sparse_gradients(grad_output, values, offsets, per_sample_weights, layout, batch_size)
        reference.apply_optimizer(weight, state, layout, gradients, config, int(step.item()))
        return
    _launch_segments(OPT_CODES[optimizer], weight, state1, state2, grad_output, values, offsets, per_sample_weights,
                     layout, batch_size, (lr, eps, weight_decay, beta1, beta2), step)


@embedding_bags_sparse_update.register_fake
def _(grad_output, weight, state1, state2, values, offsets, per_sample_weights, dims, capacities, rows, poolings,
      batch_size, use_triton, optimizer, lr, eps, weight_decay, beta1, beta2, step):
    return None


# --- autograd --------------------------------------------------------------------------------------------


def _setup_context(ctx, inputs, output) -> None:
    weight, values, offsets, per_sample_weights, dims, capacities, rows, poolings, batch_size, use_triton = inputs
    ctx.save_for_backward(weight, values, offsets, per_sample_weights)
    ctx.layout = (dims, capacities, rows, poolings, batch_size, use_triton)


def _backward(ctx, grad_output):
    weight, values, offsets, per_sample_weights = ctx.saved_tensors
    grad_weight = embedding_bags_weight_grad(grad_output, weight, values, offsets, per_sample_weights, *ctx.layout)
    return grad_weight, None, None, None, None, None, None, None, None, None


torch.library.register_autograd("recloop::embedding_bags", _backward, setup_context=_setup_context)


class FusedEmbeddingBags(torch.autograd.Function):
    """Forward pooling; backward applies the fused optimizer to the weight and returns no weight gradient.

    ``trigger`` is an empty tensor that requires grad: it makes autograd call this backward even though
    the weight itself is not a leaf that receives a gradient (as FBGEMM's TBE does).
    """

    @staticmethod
    def forward(ctx, trigger, weight, state1, state2, step, values, offsets, per_sample_weights, layout_args,
                config):
        ctx.save_for_backward(values, offsets, per_sample_weights)
        ctx.weight, ctx.state1, ctx.state2, ctx.step = weight, state1, state2, step
        ctx.layout_args, ctx.config = layout_args, config
        return embedding_bags(weight, values, offsets, per_sample_weights, *layout_args)

    @staticmethod
    def backward(ctx, grad_output):
        values, offsets, per_sample_weights = ctx.saved_tensors
        config = ctx.config
        embedding_bags_sparse_update(grad_output, ctx.weight, ctx.state1, ctx.state2, values, offsets,
                                     per_sample_weights, *ctx.layout_args, config.name, config.lr, config.eps,
                                     config.weight_decay, config.beta1, config.beta2, ctx.step)
        return (None,) * 10
