"""Readable pure-PyTorch references of the fused embedding-bag ops (the CPU path, and the test oracle).

- ``forward``: ``F.embedding_bag`` per table over the flat weight, concatenated into (B, ΣD).
- ``sparse_gradients``: for each table, the summed gradient of every unique row touched by the batch.
- ``apply_optimizer``: the update of those rows, in fp32, written back into the weight:

  ====================  ===============================================================
  sgd                   w -= lr·g
  adagrad               s += g²;            w -= lr·g / (sqrt(s) + eps)
  rowwise_adagrad       m += mean(g²);      w -= lr·g / (sqrt(m) + eps)     (one m per row)
  adam (lazy)           m = β1·m + (1-β1)·g;  v = β2·v + (1-β2)·g²;  bias correction by the
                        global step;  w -= lr·m̂ / (sqrt(v̂) + eps)          (touched rows only)
  ====================  ===============================================================

  with g += weight_decay·w first when weight decay is set. fp16/bf16 weights are written back with
  the kernels' stochastic rounding (same random bits: Philox keyed by the step, one draw per element).

Bags are table-major: bag (t, b) is ``values[offsets[t*B + b] : offsets[t*B + b + 1]]``. Ids outside
``[0, num_embeddings)`` pool as zeros, update nothing and are counted in ``errors`` (see ``record_errors``);
``values`` may be longer than ``offsets[-1]`` (padding to a bucketed length), the rest is ignored.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recloop_kernels.config import Layout, OptimizerConfig

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


def table_view(flat: torch.Tensor, layout: Layout, t: int) -> torch.Tensor:
    """Table t of a flat buffer as (capacity, dim) (a strided view when rows are padded)."""
    start, stride = layout.elem_offsets[t], layout.strides[t]
    rows = flat[start:start + layout.capacities[t] * stride].view(layout.capacities[t], stride)
    return rows[:, :layout.dims[t]]


def new_errors(num_tables: int, device=None) -> torch.Tensor:
    """The id-error record (3, T) int32: bad-id count, largest and smallest bad id (clamped to int32)."""
    errors = torch.zeros(3, num_tables, dtype=torch.int32, device=device)
    errors[1].fill_(INT32_MIN)
    errors[2].fill_(INT32_MAX)
    return errors


def record_errors(errors: torch.Tensor, t: int, ids: torch.Tensor, rows: int) -> torch.Tensor:
    """Count table t's ids outside [0, rows) into ``errors`` (no host synchronization); returns the ok mask."""
    bad = (ids < 0) | (ids >= rows)
    errors[0, t] += bad.sum().to(torch.int32)
    if ids.numel():
        clamped = ids.clamp(INT32_MIN, INT32_MAX)
        errors[1, t] = torch.maximum(errors[1, t], torch.where(bad, clamped, INT32_MIN).max().to(torch.int32))
        errors[2, t] = torch.minimum(errors[2, t], torch.where(bad, clamped, INT32_MAX).min().to(torch.int32))
    return ~bad


def _bags(values: torch.Tensor, offsets: torch.Tensor, layout: Layout, batch_size: int, t: int):
    bounds = offsets[t * batch_size:(t + 1) * batch_size + 1].long()
    start, end = int(bounds[0]), int(bounds[-1])
    return values[start:end].long(), bounds - start, start, end


def forward(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, layout: Layout, batch_size: int,
            errors: torch.Tensor | None = None) -> torch.Tensor:
    """Pooled embeddings (B, ΣD) in fp32."""
    pooled = []
    # On the host, one bounds check of every id first: when all are in range (the usual case) the per-table
    # masks and error records are skipped. A scored request is a small batch, where those masks' dozen small
    # ops a table were most of the forward's time (3.8 ms of a 12-table, 60-row request).
    in_range = not values.is_cuda and batch_size > 0 and all_in_range(values, offsets, layout, batch_size)
    for t in range(layout.num_tables):
        ids, bounds, start, end = _bags(values, offsets, layout, batch_size, t)
        table = table_view(weight, layout, t).float()
        if in_range:
            weights = per_sample_weights[start:end].float() if per_sample_weights is not None else None
            pooled.append(_pool(F.embedding_bag(ids, table, bounds[:-1], mode="sum", per_sample_weights=weights),
                                bounds, layout.poolings[t]))
            continue
        ok = record_errors(errors, t, ids, layout.rows[t]) if errors is not None else \
            (ids >= 0) & (ids < layout.rows[t])
        weights = ok.float()
        if per_sample_weights is not None:
            weights = weights * per_sample_weights[start:end].float()
        out = F.embedding_bag(torch.where(ok, ids, 0), table, bounds[:-1], mode="sum", per_sample_weights=weights)
        pooled.append(_pool(out, bounds, layout.poolings[t]))
    return torch.cat(pooled, dim=1)


def _pool(summed: torch.Tensor, bounds: torch.Tensor, pooling: int) -> torch.Tensor:
    """Bag sums → the table's pooling (0 sum, 1 mean)."""
    if pooling == 1:
        return summed / (bounds[1:] - bounds[:-1]).clamp(min=1).to(summed.dtype)[:, None]
    return summed


def all_in_range(values: torch.Tensor, offsets: torch.Tensor, layout: Layout, batch_size: int) -> bool:
    """Whether every id of every bag is in ``[0, rows)`` of its table (one pass; reads the answer on the host)."""
    starts = offsets[::batch_size][:layout.num_tables + 1].long()  # where each table's ids begin (table-major)
    if len(starts) != layout.num_tables + 1:
        return False
    ids = values[int(starts[0]):int(starts[-1])]
    limits = torch.repeat_interleave(torch.tensor(layout.rows, device=values.device), starts.diff())
    return bool(((ids >= 0) & (ids < limits)).all())


def sparse_gradients(grad_output: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                     per_sample_weights: torch.Tensor | None, layout: Layout,
                     batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per table: (unique local row ids (U,), their summed gradients (U, dim) in fp32); bad ids left out."""
    result = []
    grad_output = grad_output.float()
    for t in range(layout.num_tables):
        ids, bounds, start, end = _bags(values, offsets, layout, batch_size, t)
        lengths = bounds[1:] - bounds[:-1]
        bag = torch.repeat_interleave(torch.arange(batch_size, device=values.device), lengths)
        cols = slice(layout.col_offsets[t], layout.col_offsets[t + 1])
        occurrence = grad_output[bag, cols]  # (n, dim)
        scale = torch.ones(end - start, device=values.device, dtype=torch.float32)
        if per_sample_weights is not None:
            scale = scale * per_sample_weights[start:end].float()
        if layout.poolings[t] == 1:
            scale = scale / lengths[bag].clamp(min=1).float()
        ok = (ids >= 0) & (ids < layout.rows[t])
        rows, inverse = torch.unique(ids[ok], return_inverse=True)
        summed = torch.zeros(len(rows), layout.dims[t], device=values.device, dtype=torch.float32)
        summed.index_add_(0, inverse, (occurrence * scale[:, None])[ok])
        result.append((rows, summed))
    return result


def apply_optimizer(weight: torch.Tensor, state: dict[str, torch.Tensor], layout: Layout,
                    gradients: list[tuple[torch.Tensor, torch.Tensor]], config: OptimizerConfig, step: int) -> None:
    """Update the touched rows of every table in place (``step`` counts from 1, for Adam)."""
    for t, (rows, g) in enumerate(gradients):
        if len(rows) == 0:
            continue
        table = table_view(weight, layout, t)
        w = table[rows].float()
        if config.weight_decay:
            g = g + config.weight_decay * w
        if config.name == "sgd":
            w = w - config.lr * g
        elif config.name == "adagrad":
            s = table_view(state["sum"], layout, t)
            s[rows] = s[rows] + g * g
            w = w - config.lr * g / (s[rows].sqrt() + config.eps)
        elif config.name == "rowwise_adagrad":
            m = state["row_sum"][layout.row_offsets[t]:layout.row_offsets[t] + layout.capacities[t]]
            m[rows] = m[rows] + (g * g).mean(dim=1)
            w = w - config.lr * g / (m[rows].sqrt()[:, None] + config.eps)
        elif config.name == "adam":
            m, v = table_view(state["exp_avg"], layout, t), table_view(state["exp_avg_sq"], layout, t)
            m[rows] = config.beta1 * m[rows] + (1 - config.beta1) * g
            v[rows] = config.beta2 * v[rows] + (1 - config.beta2) * g * g
            m_hat = m[rows] / (1 - config.beta1 ** step)
            v_hat = v[rows] / (1 - config.beta2 ** step)
            w = w - config.lr * m_hat / (v_hat.sqrt() + config.eps)
        if table.dtype != torch.float32:
            elements = layout.elem_offsets[t] + rows[:, None] * layout.strides[t] + \
                torch.arange(layout.dims[t], device=rows.device)
            w = stochastic_round(w, table.dtype, step, elements)
        table[rows] = w.to(table.dtype)


def dense_gradient(grad_output: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                   per_sample_weights: torch.Tensor | None, layout: Layout, batch_size: int,
                   dtype: torch.dtype) -> torch.Tensor:
    """The gradient of the flat weight, materialized (for ``optimizer=None``)."""
    grad = torch.zeros(layout.total_elems, device=values.device, dtype=torch.float32)
    for t, (rows, g) in enumerate(sparse_gradients(grad_output, values, offsets, per_sample_weights, layout,
                                                   batch_size)):
        table_view(grad, layout, t)[rows] += g
    return grad.to(dtype)


# --- stochastic rounding, bit for bit as the kernels do it ----------------------------------------------

ROUNDING_BITS = {torch.float16: 13, torch.bfloat16: 16}  # fp32 mantissa bits the half type drops


def stochastic_round(w: torch.Tensor, dtype: torch.dtype, seed: int, elements: torch.Tensor) -> torch.Tensor:
    """fp32 ``w`` rounded to ``dtype`` up or down at random, in proportion to the distance.

    Adds random low bits to the fp32 pattern and truncates them (the result converts to the half type
    exactly). The bits are ``tl.randint(seed, element)``: Philox-4x32-10 with counter (element, 0, 0, 0)
    and key (seed low, seed high), as ``triton.language.random`` computes it.
    """
    bits = ROUNDING_BITS[dtype]
    mask = (1 << bits) - 1
    noise = philox_randint(seed, elements.reshape(-1).to(torch.int64) & 0xFFFFFFFF).view(w.shape) & mask
    pattern = w.float().contiguous().view(torch.int32).to(torch.int64)
    rounded = ((pattern + noise) & ~mask)
    rounded = torch.where(rounded > INT32_MAX, rounded - 2**32, rounded)  # int32 wrap-around, as in the kernel
    return rounded.to(torch.int32).view(torch.float32)


def _mul32(a: torch.Tensor, b: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(high, low) 32-bit halves of a·b for uint32 values held in int64 (16-bit limbs: no overflow)."""
    a1, a0, b1, b0 = a >> 16, a & 0xFFFF, b >> 16, b & 0xFFFF
    lo, mid, hi = a0 * b0, a1 * b0 + a0 * b1, a1 * b1
    return hi + ((mid + (lo >> 16)) >> 16), (lo + (mid << 16)) & 0xFFFFFFFF


def philox_randint(seed: int, counter: torch.Tensor) -> torch.Tensor:
    """First word of Philox-4x32-10 for each 32-bit ``counter`` (int64 tensor) under ``seed``."""
    c0, c1 = counter, torch.zeros_like(counter)
    c2, c3 = torch.zeros_like(counter), torch.zeros_like(counter)
    k0, k1 = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF
    for _ in range(10):
        hi_b, lo_b = _mul32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + 0x9E3779B9) & 0xFFFFFFFF, (k1 + 0xBB67AE85) & 0xFFFFFFFF
    return c0
