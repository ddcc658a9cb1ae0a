"""``EmbeddingBagCollection``: many embedding tables in one flat buffer, with a fused sparse optimizer.

Input layout (FBGEMM TBE / TorchRec KJT): ``values`` are row ids (int32 or int64); ``offsets`` (int32 or
int64, T*B+1) delimit the bags table-major; ``values`` may be longer than ``offsets[-1]`` (padding to a
bucketed length, so that shapes repeat), the rest is ignored::

    offsets:  0     2  3        6     7 ...            (T*B + 1 entries)
    values:  [4, 9][1][7, 7, 2][5] ...
              t0b0 t0b1  t0b2  t1b0 ...               bag (t, b) = values[offsets[t*B+b] : offsets[t*B+b+1]]

Output: (B, ΣD) fp32, table t in columns ``col_offsets[t] : col_offsets[t] + dim[t]``.

With ``optimizer`` set, the weights are buffers updated in place during ``backward()`` (no gradient is
materialized, and a separate torch optimizer is not needed for them). With ``optimizer=None`` the flat
weight is a ``Parameter`` that receives an ordinary gradient (dense, or sparse COO with ``sparse=True``).

Ids outside a table never read or write another table's rows: they pool as zeros, update nothing, and
are recorded on the device. ``check_ids`` says when the module raises them: ``"deferred"`` (default)
every ``id_check_interval`` calls and at ``raise_id_errors()`` (one host synchronization each time; a
compiled training step calls it between steps), ``"sync"`` (or True) on the call that saw them (a host
synchronization per call: a debug mode), ``"off"`` (or False) never.

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
from recloop_kernels.config import POOLING_CODES, Layout, OptimizerConfig, TableConfig, alignment
from recloop_kernels.embedding_bag import (
    DenseGradientEmbeddingBags,
    FusedEmbeddingBags,
    choose_triton,
    device_layout,
    layout_args,
    pool,
)

GROWTH = 1.5  # capacity reserved when a table outgrows its buffer
CHECK_MODES = {True: "sync", False: "off", "sync": "sync", "deferred": "deferred", "off": "off"}


class EmbeddingBagCollection(nn.Module):
    """Embedding tables with pooled lookups and an optional fused sparse optimizer.

    Args:
        tables: the tables (unique names).
        optimizer: None, ``sgd``, ``adagrad``, ``rowwise_adagrad`` or ``adam`` (lazy).
        lr, eps, weight_decay, betas: optimizer hyperparameters.
        dtype: weight dtype (fp32, fp16 or bf16; optimizer state and accumulation stay fp32).
        device: where the buffers live.
        sparse: with ``optimizer=None``, give the weight a sparse COO gradient instead of a dense one.
        check_ids: when ids outside a table raise (module docstring): ``deferred``, ``sync`` or ``off``.
        id_check_interval: calls between two deferred checks.
        seed: seed of the initialization.
        backend: ``auto`` (Triton kernels on CUDA, the PyTorch reference elsewhere), ``triton`` (also on
            CPU under ``TRITON_INTERPRET=1``, for tests) or ``reference``.
    """

    def __init__(self, tables: Sequence[TableConfig], optimizer: str | None = None, lr: float = 0.01,
                 eps: float = 1e-8, weight_decay: float = 0.0, betas: tuple[float, float] = (0.9, 0.999),
                 dtype: torch.dtype = torch.float32, device: torch.device | str | None = None, sparse: bool = False,
                 check_ids: bool | str = "deferred", id_check_interval: int = 100, seed: int = 0,
                 backend: str = "auto"):
        super().__init__()
        names = [t.name for t in tables]
        if not tables or len(set(names)) != len(names):
            raise ValueError(f"tables must be a non-empty list with unique names, got {names}")
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, not {dtype}")
        if check_ids not in CHECK_MODES:
            raise ValueError(f"check_ids must be 'deferred', 'sync' (True) or 'off' (False), not {check_ids!r}")
        self.tables = list(tables)
        self.optimizer = OptimizerConfig(optimizer, lr=lr, eps=eps, weight_decay=weight_decay, beta1=betas[0],
                                         beta2=betas[1]) if optimizer else None
        self.sparse = sparse
        self.check_ids = CHECK_MODES[check_ids]
        self.id_check_interval = max(1, id_check_interval)
        self._calls = 0
        self.backend = backend
        self._layout = Layout(tuple(t.dim for t in tables), tuple(t.num_embeddings for t in tables),
                              tuple(t.num_embeddings for t in tables), tuple(POOLING_CODES[t.pooling] for t in tables),
                              alignment(dtype))
        device = torch.device(device) if device is not None else torch.device("cpu")
        # Initial rows are drawn where the table lives: on a GPU, drawing 10M x 128 values on the host (one
        # thread) and copying them over took over a minute for a Criteo-sized model (H100, 2026-11-25).
        self._generator = torch.Generator(device=device).manual_seed(seed)
        weight = torch.zeros(self._layout.total_elems, dtype=dtype, device=device)  # padding stays zero
        for t, table in enumerate(self.tables):
            if table.init == "zeros":  # zero already (and no draw from the generator): no temporary of its size
                continue
            rows = torch.empty(table.num_embeddings, table.dim, device=device)
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
        self.register_buffer("id_errors", reference.new_errors(len(tables), device), persistent=False)
        # Empty, but requires grad: makes autograd run the fused backward (the weights are buffers then).
        self._trigger = torch.zeros(0, requires_grad=True)

    # --- buffers -------------------------------------------------------------------------------------------

    def _set_weight(self, weight: torch.Tensor) -> None:
        if self.optimizer is None and isinstance(self._parameters.get("weights"), nn.Parameter):
            self.weights.data = weight  # the same Parameter: a torch optimizer holding it keeps working
        elif self.optimizer is None:
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
    def _row_state(self) -> bool:
        """Whether ``state1`` holds one value per row (row-wise Adagrad) rather than one per element."""
        return self.optimizer is not None and self.optimizer.name == "rowwise_adagrad"

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

    def prepare_for_graphs(self) -> None:
        """Build the kernels' device-side copy of the table layout now (it is cached per layout and device).

        Call before a step that CUDA graphs capture (inductor's ``reduce-overhead``): built during the
        capture's warm-up, those small tensors would live in the graph's private memory pool without being
        its outputs, which the graph trees refuse ("tensors in the cudagraph pool not tracked as outputs").
        """
        if self.weights.is_cuda:  # held here too: replayed graphs read them, whatever the cache evicts
            self._graph_layout = device_layout(self._layout, self.weights.device)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings (B, ΣD) for table-major bags (see the module docstring)."""
        batch_size = self._validate(values, offsets, per_sample_weights)
        args = (*layout_args(self._layout), batch_size, choose_triton(self.backend, self.weights.device))
        if self.optimizer is not None:
            trigger = self._trigger if torch.is_grad_enabled() else self._trigger.detach()
            out = FusedEmbeddingBags.apply(trigger, self.weights, self.state1, self.state2, self.step, self.id_errors,
                                           values, offsets, per_sample_weights, args, self.optimizer)
        elif self.sparse:
            out = _SparseGradientEmbeddingBags.apply(self.weights, self.id_errors, values, offsets,
                                                     per_sample_weights, self._layout, args)
        else:
            out = DenseGradientEmbeddingBags.apply(self.weights, self.id_errors, values, offsets, per_sample_weights,
                                                   args)
        if not torch.compiler.is_compiling():  # a compiled step leaves the checks to its caller
            self._calls += 1
            if self.check_ids == "sync" or (self.check_ids == "deferred" and self._calls % self.id_check_interval == 0):
                self.raise_id_errors()
        return out

    def _validate(self, values, offsets, per_sample_weights) -> int:
        tables = self._layout.num_tables
        if values.dtype not in (torch.int32, torch.int64) or offsets.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"values and offsets must be int32 or int64, got {values.dtype} and {offsets.dtype}")
        if values.dim() != 1 or offsets.dim() != 1 or (offsets.numel() - 1) % tables:
            raise ValueError(f"offsets must be 1-D with T*B+1 entries for T={tables} tables, got {offsets.numel()}")
        if per_sample_weights is not None and per_sample_weights.shape != values.shape:
            raise ValueError("per_sample_weights must have one weight per value")
        if self.check_ids == "sync" and offsets.numel() and not torch.compiler.is_compiling():
            first, last = int(offsets[0]), int(offsets[-1])
            if first != 0 or last > values.numel():
                raise ValueError(f"offsets must start at 0 and end within values (len {values.numel()}), "
                                 f"got {first}..{last}")
        return (offsets.numel() - 1) // tables

    def id_errors_seen(self) -> dict[str, tuple[int, int, int]]:
        """Per table with bad ids since the last check: (count, smallest, largest). One host synchronization."""
        errors = self.id_errors.cpu()
        return {table.name: (int(errors[0, t]), int(errors[2, t]), int(errors[1, t]))
                for t, table in enumerate(self.tables) if errors[0, t] > 0}

    def raise_id_errors(self) -> None:
        """Raise ``IndexError`` if any call since the last check met ids outside a table, and reset."""
        seen = self.id_errors_seen()
        if not seen:
            return
        self.id_errors.copy_(reference.new_errors(self._layout.num_tables, self.id_errors.device))
        name, (count, low, high) = next(iter(seen.items()))
        rows = self._layout.rows[self._index(name)]
        others = f"; other tables too: {sorted(seen)[1:]}" if len(seen) > 1 else ""
        raise IndexError(f"table {name!r} has {rows} rows; got ids in [{low}, {high}] ({count} out of range since "
                         f"the last check: they pooled as zeros and updated nothing){others}")

    # --- layout: growth, dtype, checkpoints ---------------------------------------------------------------

    def grow(self, name: str, new_num_embeddings: int, dense_optimizer: torch.optim.Optimizer | None = None) -> None:
        """Give table ``name`` more rows (new rows initialized by its init); existing rows and state stay.

        With ``optimizer=None`` the weight stays the same ``Parameter``; pass the torch optimizer that
        holds it as ``dense_optimizer`` so that its per-element state (momentum, Adam's moments...)
        moves with the rows when the buffer is reallocated.
        """
        t = self._index(name)
        old_rows = self._layout.rows[t]
        if new_num_embeddings < old_rows:
            raise ValueError(f"table {name!r} has {old_rows} rows; tables only grow")
        if new_num_embeddings == old_rows:
            return
        if new_num_embeddings > self._layout.capacities[t]:
            capacities = list(self._layout.capacities)
            capacities[t] = max(new_num_embeddings, math.ceil(capacities[t] * GROWTH))
            self._relayout(Layout(self._layout.dims, tuple(capacities), self._layout.rows, self._layout.poolings,
                                  self._layout.align), dense_optimizer)
        fresh = torch.empty(new_num_embeddings - old_rows, self._layout.dims[t], device=self._generator.device)
        self.tables[t].initialize(fresh, self._generator)
        with torch.no_grad():
            reference.table_view(self.weights, self._layout, t)[old_rows:new_num_embeddings] = fresh.to(self.weights)
        rows = list(self._layout.rows)
        rows[t] = new_num_embeddings
        self._layout = Layout(self._layout.dims, self._layout.capacities, tuple(rows), self._layout.poolings,
                              self._layout.align)
        self.num_embeddings[t] = new_num_embeddings

    def _relayout(self, new: Layout, dense_optimizer: torch.optim.Optimizer | None = None) -> None:
        """Move every table (rows and optimizer state) into buffers of layout ``new``."""
        old = self._layout
        state1, state2 = self._new_state(new, self.weights.device)
        with torch.no_grad():
            weight = _moved(self.weights.detach(), old, new)
            for src, dst in ((self.state1, state1), (self.state2, state2)):
                if dst.numel() and self._row_state:
                    dst.copy_(_moved_rows(src, old, new))
                elif dst.numel():
                    dst.copy_(_moved(src, old, new))
            if dense_optimizer is not None and self.optimizer is None:
                state = dense_optimizer.state.get(self.weights, {})
                for key, value in state.items():
                    if torch.is_tensor(value) and value.shape == self.weights.shape:
                        state[key] = _moved(value, old, new)
        self._layout = new
        self._set_weight(weight)
        self.state1, self.state2 = state1, state2
        self.capacities = torch.tensor(new.capacities, dtype=torch.int64)

    def _apply(self, fn, recurse=True):
        """``.to()``, ``.half()``...: the weight follows; optimizer state stays fp32 on the new device."""
        states, dtype = (self.state1, self.state2), self.weights.dtype
        super()._apply(fn, recurse)
        for name, old in zip(("state1", "state2"), states, strict=True):
            if getattr(self, name).dtype != torch.float32:
                setattr(self, name, old.to(device=getattr(self, name).device))
        if self.weights.dtype != dtype and alignment(self.weights.dtype) != self._layout.align:
            layout = self._layout
            self._relayout(Layout(layout.dims, layout.capacities, layout.rows, layout.poolings,
                                  alignment(self.weights.dtype)))
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        dims = state_dict.get(prefix + "dims")
        if dims is not None and tuple(dims.tolist()) != self._layout.dims:
            error_msgs.append(f"table dims differ: checkpoint {tuple(dims.tolist())}, module {self._layout.dims}")
            return
        capacities = state_dict.get(prefix + "capacities")
        layout = self._layout
        if capacities is not None and tuple(capacities.tolist()) != layout.capacities:
            self._relayout(Layout(layout.dims, tuple(capacities.tolist()), layout.rows, layout.poolings, layout.align))
        rows = state_dict.get(prefix + "num_embeddings")
        if rows is not None:
            self._layout = Layout(self._layout.dims, self._layout.capacities, tuple(rows.tolist()),
                                  self._layout.poolings, self._layout.align)
        # A checkpoint written before rows were padded to 16 bytes: repack its flat tensors.
        unpadded = Layout(self._layout.dims, self._layout.capacities, self._layout.rows, self._layout.poolings, 1)
        weights = state_dict.get(prefix + "weights")
        if weights is not None and weights.numel() == unpadded.total_elems != self._layout.total_elems:
            state_dict = dict(state_dict)
            for key in ("weights", "state2") if self._row_state else ("weights", "state1", "state2"):
                value = state_dict.get(prefix + key)
                if value is not None and value.numel() == unpadded.total_elems:
                    state_dict[prefix + key] = _moved(value, unpadded, self._layout)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def extra_repr(self) -> str:
        tables = ", ".join(f"{t.name}({self._layout.rows[i]}x{t.dim},{t.pooling})" for i, t in enumerate(self.tables))
        return f"tables=[{tables}], optimizer={self.optimizer.name if self.optimizer else None}"


def _moved(flat: torch.Tensor, old: Layout, new: Layout) -> torch.Tensor:
    """A flat per-element buffer in layout ``old`` copied into a new zeroed one in layout ``new``."""
    out = torch.zeros(new.total_elems, dtype=flat.dtype, device=flat.device)
    for t in range(old.num_tables):
        n = min(old.capacities[t], new.capacities[t])
        reference.table_view(out, new, t)[:n] = reference.table_view(flat, old, t)[:n]
    return out


def _moved_rows(per_row: torch.Tensor, old: Layout, new: Layout) -> torch.Tensor:
    """A per-row buffer (one value per row of every table) moved to layout ``new``."""
    out = torch.zeros(new.total_rows, dtype=per_row.dtype, device=per_row.device)
    for t in range(old.num_tables):
        n = min(old.capacities[t], new.capacities[t])
        out[new.row_offsets[t]:new.row_offsets[t] + n] = per_row[old.row_offsets[t]:old.row_offsets[t] + n]
    return out


class _SparseGradientEmbeddingBags(torch.autograd.Function):
    """``optimizer=None, sparse=True``: the flat weight receives a coalesced sparse COO gradient."""

    @staticmethod
    def forward(ctx, weight, errors, values, offsets, per_sample_weights, layout: Layout, args):
        ctx.save_for_backward(values, offsets, per_sample_weights)
        ctx.layout, ctx.batch_size, ctx.shape, ctx.dtype = layout, args[-2], weight.shape, weight.dtype
        return pool(weight, values, offsets, per_sample_weights, errors, *args)

    @staticmethod
    def backward(ctx, grad_output):
        values, offsets, per_sample_weights = ctx.saved_tensors
        layout = ctx.layout
        indices, grads = [], []
        for t, (rows, g) in enumerate(reference.sparse_gradients(grad_output, values, offsets, per_sample_weights,
                                                                 layout, ctx.batch_size)):
            cols = torch.arange(layout.dims[t], device=rows.device)
            indices.append((layout.elem_offsets[t] + rows[:, None] * layout.strides[t] + cols).reshape(-1))
            grads.append(g.reshape(-1))
        index = torch.cat(indices)[None] if indices else torch.zeros(1, 0, dtype=torch.int64)
        grad = torch.sparse_coo_tensor(index, torch.cat(grads).to(ctx.dtype), ctx.shape,
                                       check_invariants=False).coalesce()
        return grad, None, None, None, None, None, None
