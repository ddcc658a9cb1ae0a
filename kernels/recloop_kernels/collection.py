"""``EmbeddingBagCollection``: many embedding tables in one flat buffer, with a fused sparse optimizer.

Input layout (FBGEMM TBE / TorchRec KJT): ``values`` are int64 row ids; ``offsets`` (int64, T*B+1)
delimit the bags table-major::

    offsets:  0     2  3        6     7 ...            (T*B + 1 entries)
    values:  [4, 9][1][7, 7, 2][5] ...
              t0b0 t0b1  t0b2  t1b0 ...               bag (t, b) = values[offsets[t*B+b] : offsets[t*B+b+1]]

Output: (B, ΣD) fp32, table t in columns ``col_offsets[t] : col_offsets[t] + dim[t]``.

With ``optimizer`` set, the weights are buffers updated in place during ``backward()`` (no gradient is
materialized, and a separate torch optimizer is not needed for them). With ``optimizer=None`` the flat
weight is a ``Parameter`` that receives an ordinary gradient (dense, or sparse COO with ``sparse=True``).

Example::

    ebc = EmbeddingBagCollection([TableConfig("user", 1000, 16), TableConfig("item", 500, 32, "mean")],
                                 optimizer="rowwise_adagrad", lr=0.05)
    pooled = ebc(values, offsets)              # (B, 48)
    loss(pooled).backward()                    # rows touched by the batch are updated here
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from recloop_kernels import reference
from recloop_kernels.config import POOLING_CODES, Layout, OptimizerConfig, TableConfig
from recloop_kernels.embedding_bag import FusedEmbeddingBags, choose_triton, embedding_bags

GROWTH = 1.5  # capacity reserved when a table outgrows its buffer


class EmbeddingBagCollection(nn.Module):
    """Embedding tables with pooled lookups and an optional fused sparse optimizer.

    Args:
        tables: the tables (unique names).
        optimizer: None, ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (lazy).
        lr, eps, weight_decay, betas: optimizer hyperparameters.
        dtype: weight dtype (fp32, fp16 or bf16; optimizer state and accumulation stay fp32).
        device: where the buffers live.
        sparse: with ``optimizer=None``, give the weight a sparse COO gradient instead of a dense one.
        check_ids: raise on ids outside a table (costs one host synchronization per call on a GPU).
        seed: seed of the initialization.
        backend: ``auto`` (Triton kernels on CUDA, the PyTorch reference elsewhere), ``triton`` (also on
            CPU under ``TRITON_INTERPRET=1``, for tests) or ``reference``.
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: str | None = None, lr: float = 0.01,
                 eps: float = 1e-8, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, sparse: bool = False,
                 check_ids: bool = True, seed: int = 0, backend: str = "auto"):
        super().__init__()
        names = [t.name for t in tables]
        if not tables or len(set(names)) != len(names):
            raise ValueError(f"tables must be a non-empty list with unique names, got {names}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype}")
        self.tables = list(tables)
        self.optimizer = OptimizerConfig(optimizer, lr=lr, eps=eps, weight_decay=weight_decay, beta1=betas[0],
                                         beta2=betas[1]) if optimizer else None
        self.sparse = sparse
        self.check_ids = check_ids
        self.backend = backend
        self._generator = torch.Generator().manual_seed(seed)
        self._layout = Layout(tuple(t.dim for t in tables), tuple(t.num_embeddings for t in tables),
                              tuple(t.num_embeddings for t in tables), tuple(POOLING_CODES[t.pooling] for t in tables))
        device = torch.device(device) if device is not None else torch.device("cpu")
        weight = torch.empty(self._layout.total_elems, dtype=dtype, device=device)
        for t, table in enumerate(self.tables):
            rows = torch.empty(table.num_embeddings, table.dim)
            table.initialize(rows, self._generator)
            reference.table_view(weight, self._layout, t).copy_(rows)
        self._set_weight(weight)
        state1, state2 = self._new_state(self._layout, device)
        self.register_buffer("state1", state1)
        self.register_buffer("state2", state2)
        self.register_buffer("step", torch.zeros(1, dtype=torch.int64, device=device))
        self.register_buffer("num_embeddings", torch.tensor(self._layout.rows, dtype=torch.int64))
        self.register_buffer("capacities", torch.tensor(self._layout.capacities, dtype=torch.int64))
        self.register_buffer("dims", torch.tensor(self._layout.dims, dtype=torch.int64))
        # Empty, but requires grad: makes autograd run the fused backward (the weights are buffers then).
        self._trigger = torch.zeros(0, requires_grad=True)

    # --- buffers -------------------------------------------------------------------------------------------

    def _set_weight(self, weight: torch.Tensor) -> None:
        if "weights" in self._parameters:
            del self._parameters["weights"]
        if "weights" in self._buffers:
            del self._buffers["weights"]
        if self.optimizer is None:
            self.weights = nn.Parameter(weight)
        else:
            self.register_buffer("weights", weight)

    def _new_state(self, layout: Layout, device) -> tuple[torch.Tensor, torch.Tensor]:
        def zeros(n: int) -> torch.Tensor:
            return torch.zeros(n, dtype=torch.float32, device=device)

        name = self.optimizer.name if self.optimizer else None
        if name == "adagrad":
            return zeros(layout.total_elems), zeros(0)
        if name == "rowwise_adagrad":
            return zeros(layout.total_rows), zeros(0)
        if name == "adam":
            return zeros(layout.total_elems), zeros(layout.total_elems)
        return zeros(0), zeros(0)

    @property
    def layout(self) -> Layout:
        return self._layout

    @property
    def embedding_dim(self) -> int:
        """Width of the output: the sum of the tables' dims."""
        return self._layout.total_dim

    def _index(self, name: str) -> int:
        for t, table in enumerate(self.tables):
            if table.name == name:
                return t
        raise KeyError(f"no table named {name!r}; tables: {[t.name for t in self.tables]}")

    def weight(self, name: str) -> torch.Tensor:
        """Table ``name`` as a (num_embeddings, dim) view of the flat weight."""
        t = self._index(name)
        return reference.table_view(self.weights, self._layout, t)[: self._layout.rows[t]]

    # --- forward -------------------------------------------------------------------------------------------

    def forward(self, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings (B, ΣD) for table-major bags (see the module docstring)."""
        batch_size = self._validate(values, offsets, per_sample_weights)
        layout_args = (list(self._layout.dims), list(self._layout.capacities), list(self._layout.rows),
                       list(self._layout.poolings), batch_size, choose_triton(self.backend, self.weights.device))
        if self.optimizer is not None:
            trigger = self._trigger if torch.is_grad_enabled() else self._trigger.detach()
            return FusedEmbeddingBags.apply(trigger, self.weights, self.state1, self.state2, self.step, values,
                                            offsets, per_sample_weights, layout_args, self.optimizer)
        if self.sparse:
            return _SparseGradientEmbeddingBags.apply(self.weights, values, offsets, per_sample_weights,
                                                      self._layout, layout_args)
        return embedding_bags(self.weights, values, offsets, per_sample_weights, *layout_args)

    def _validate(self, values, offsets, per_sample_weights) -> int:
        tables = self._layout.num_tables
        if values.dtype != torch.int64 or offsets.dtype != torch.int64:
            raise TypeError(f"values and offsets must be int64, got {values.dtype} and {offsets.dtype}")
        if values.dim() != 1 or offsets.dim() != 1 or (offsets.numel() - 1) % tables:
            raise ValueError(f"offsets must be 1-D with T*B+1 entries for T={tables} tables, got {offsets.numel()}")
        if per_sample_weights is not None and per_sample_weights.shape != values.shape:
            raise ValueError("per_sample_weights must have one weight per value")
        batch_size = (offsets.numel() - 1) // tables
        if self.check_ids and values.numel():
            self._check_ids(values, offsets, batch_size)
        return batch_size

    def _check_ids(self, values: torch.Tensor, offsets: torch.Tensor, batch_size: int) -> None:
        table_starts = offsets[:: batch_size][: self._layout.num_tables + 1] if batch_size else offsets[:1]
        bounds = table_starts.tolist()
        if bounds[0] != 0 or bounds[-1] != values.numel():
            raise ValueError(f"offsets must start at 0 and end at len(values)={values.numel()}")
        for t, table in enumerate(self.tables):
            chunk = values[bounds[t]:bounds[t + 1]]
            if chunk.numel():
                low, high = int(chunk.min()), int(chunk.max())
                if low < 0 or high >= self._layout.rows[t]:
                    raise IndexError(f"table {table.name!r} has {self._layout.rows[t]} rows; got ids in [{low}, {high}]")

    # --- growth and checkpoints ----------------------------------------------------------------------------

    def grow(self, name: str, new_num_embeddings: int) -> None:
        """Give table ``name`` more rows (new rows initialized by its init); existing rows and state stay."""
        t = self._index(name)
        old_rows = self._layout.rows[t]
        if new_num_embeddings < old_rows:
            raise ValueError(f"table {name!r} has {old_rows} rows; tables only grow")
        if new_num_embeddings == old_rows:
            return
        if new_num_embeddings > self._layout.capacities[t]:
            capacities = list(self._layout.capacities)
            capacities[t] = max(new_num_embeddings, math.ceil(capacities[t] * GROWTH))
            self._reallocate(tuple(capacities))
        fresh = torch.empty(new_num_embeddings - old_rows, self._layout.dims[t])
        self.tables[t].initialize(fresh, self._generator)
        with torch.no_grad():
            reference.table_view(self.weights, self._layout, t)[old_rows:new_num_embeddings] = fresh.to(self.weights)
        rows = list(self._layout.rows)
        rows[t] = new_num_embeddings
        self._layout = Layout(self._layout.dims, self._layout.capacities, tuple(rows), self._layout.poolings)
        self.num_embeddings[t] = new_num_embeddings

    def _reallocate(self, capacities: tuple[int, ...]) -> None:
        """Move every table into buffers of the given capacities (rows and state copied)."""
        old = self._layout
        new = Layout(old.dims, capacities, old.rows, old.poolings)
        device, dtype = self.weights.device, self.weights.dtype
        weight = torch.zeros(new.total_elems, dtype=dtype, device=device)
        state1, state2 = self._new_state(new, device)
        with torch.no_grad():
            for t in range(old.num_tables):
                n = min(old.capacities[t], capacities[t])
                reference.table_view(weight, new, t)[:n] = reference.table_view(self.weights, old, t)[:n]
                for src, dst in ((self.state1, state1), (self.state2, state2)):
                    if dst.numel() == new.total_rows:  # per-row state
                        dst[new.row_offsets[t]:new.row_offsets[t] + n] = src[old.row_offsets[t]:old.row_offsets[t] + n]
                    elif dst.numel():
                        reference.table_view(dst, new, t)[:n] = reference.table_view(src, old, t)[:n]
        self._layout = new
        self._set_weight(weight)
        self.state1, self.state2 = state1, state2
        self.capacities = torch.tensor(capacities, dtype=torch.int64)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        dims = state_dict.get(prefix + "dims")
        if dims is not None and tuple(dims.tolist()) != self._layout.dims:
            error_msgs.append(f"table dims differ: checkpoint {tuple(dims.tolist())}, module {self._layout.dims}")
            return
        capacities = state_dict.get(prefix + "capacities")
        if capacities is not None and tuple(capacities.tolist()) != self._layout.capacities:
            self._reallocate(tuple(capacities.tolist()))
        rows = state_dict.get(prefix + "num_embeddings")
        if rows is not None:
            self._layout = Layout(self._layout.dims, self._layout.capacities, tuple(rows.tolist()),
                                  self._layout.poolings)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        tables = ", ".join(f"{t.name}({self._layout.rows[i]}x{t.dim},{t.pooling})" for i, t in enumerate(self.tables))
        return f"tables=[{tables}], optimizer={self.optimizer.name if self.optimizer else None}"


class _SparseGradientEmbeddingBags(torch.autograd.Function):
    """``optimizer=None, sparse=True``: the flat weight receives a coalesced sparse COO gradient."""

    @staticmethod
    def forward(ctx, weight, values, offsets, per_sample_weights, layout: Layout, layout_args):
        ctx.save_for_backward(values, offsets, per_sample_weights)
        ctx.layout, ctx.batch_size, ctx.shape, ctx.dtype = layout, layout_args[-2], weight.shape, weight.dtype
        return embedding_bags(weight, values, offsets, per_sample_weights, *layout_args)

    @staticmethod
    def backward(ctx, grad_output):
        values, offsets, per_sample_weights = ctx.saved_tensors
        layout = ctx.layout
        indices, grads = [], []
        for t, (rows, g) in enumerate(reference.sparse_gradients(grad_output, values, offsets, per_sample_weights,
                                                                 layout, ctx.batch_size)):
            dim = layout.dims[t]
            cols = torch.arange(dim, device=rows.device)
            indices.append((layout.elem_offsets[t] + rows[:, None] * dim + cols).reshape(-1))
            grads.append(g.reshape(-1))
        index = torch.cat(indices)[None] if indices else torch.zeros(1, 0, dtype=torch.int64)
        grad = torch.sparse_coo_tensor(index, torch.cat(grads).to(ctx.dtype), ctx.shape,
                                       check_invariants=False).coalesce()
        return grad, None, None, None, None, None
