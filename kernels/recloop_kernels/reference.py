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

  with g += weight_decay·w first when weight decay is set.

Bags are table-major: bag (t, b) is ``values[offsets[t*B + b] : offsets[t*B + b + 1]]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from recloop_kernels.config import Layout, OptimizerConfig


def table_view(flat: torch.Tensor, layout: Layout, t: int) -> torch.Tensor:
    """Table t of a flat buffer as (capacity, dim)."""
    start = layout.elem_offsets[t]
    return flat[start:start + layout.capacities[t] * layout.dims[t]].view(layout.capacities[t], layout.dims[t])


def forward(weight: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
            per_sample_weights: torch.Tensor | None, layout: Layout, batch_size: int) -> torch.Tensor:
    """Pooled embeddings (B, ΣD) in fp32."""
    pooled = []
    for t in range(layout.num_tables):
        bounds = offsets[t * batch_size:(t + 1) * batch_size + 1]
        start, end = int(bounds[0]), int(bounds[-1])
        table = table_view(weight, layout, t).float()
        weights = per_sample_weights[start:end].float() if per_sample_weights is not None else None
        out = F.embedding_bag(values[start:end], table, bounds[:-1] - start, mode="sum", per_sample_weights=weights)
        if layout.poolings[t] == 1:  # mean
            lengths = (bounds[1:] - bounds[:-1]).clamp(min=1).to(out.dtype)
            out = out / lengths[:, None]
        pooled.append(out)
    return torch.cat(pooled, dim=1)


def sparse_gradients(grad_output: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor,
                     per_sample_weights: torch.Tensor | None, layout: Layout,
                     batch_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per table: (unique local row ids (U,), their summed gradients (U, dim) in fp32)."""
    result = []
    grad_output = grad_output.float()
    for t in range(layout.num_tables):
        bounds = offsets[t * batch_size:(t + 1) * batch_size + 1]
        start, end = int(bounds[0]), int(bounds[-1])
        lengths = bounds[1:] - bounds[:-1]
        bag = torch.repeat_interleave(torch.arange(batch_size, device=values.device), lengths)
        cols = slice(layout.col_offsets[t], layout.col_offsets[t + 1])
        occurrence = grad_output[bag, cols]  # (n, dim)
        scale = torch.ones(end - start, device=values.device, dtype=torch.float32)
        if per_sample_weights is not None:
            scale = scale * per_sample_weights[start:end].float()
        if layout.poolings[t] == 1:
            scale = scale / lengths[bag].clamp(min=1).float()
        rows, inverse = torch.unique(values[start:end], return_inverse=True)
        summed = torch.zeros(len(rows), layout.dims[t], device=values.device, dtype=torch.float32)
        summed.index_add_(0, inverse, occurrence * scale[:, None])
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
