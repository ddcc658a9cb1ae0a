"""Configuration of embedding tables and of the fused sparse optimizer, and the flat-buffer layout.

All tables live in one flat 1-D weight buffer. Table t holds ``capacity[t]`` rows of ``stride[t]``
elements starting at element ``elem_offsets[t]``, of which the first ``dim[t]`` are the embedding and
the rest zero padding: ``stride`` is ``dim`` rounded up to 16 bytes (``align`` elements: 4 in fp32, 8 in
fp16/bf16), so every row starts on a 16-byte boundary and the kernels load rows as 16-byte vectors. Its
rows have global row ids starting at ``row_offsets[t]`` (used for per-row optimizer state and as the
backward's sort keys). Capacity can exceed ``num_embeddings`` so that tables grow without reallocating
every time::

    flat weight:  | table 0: capacity0 × stride0 | table 1: capacity1 × stride1 | ...
                  ^ elem_offsets[0]              ^ elem_offsets[1]
    a row:        | dim[t] values | stride[t] - dim[t] zeros |
    output (B, ΣD): columns col_offsets[t] : col_offsets[t] + dim[t] hold table t's pooled bags
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch

Pooling = Literal["sum", "mean"]
OptimizerName = Literal["sgd", "adagrad", "rowwise_adagrad", "adam"]
OPTIMIZERS: tuple[str, ...] = ("sgd", "adagrad", "rowwise_adagrad", "adam")
POOLING_CODES = {"sum": 0, "mean": 1}


@dataclass(frozen=True)
class TableConfig:
    """One embedding table.

    Args:
        name: unique name (``ebc.weight(name)``, ``ebc.grow(name, n)``).
        num_embeddings: rows.
        dim: embedding size.
        pooling: ``sum`` or ``mean`` over a bag.
        init: ``uniform`` (±``init_scale``, default 1/sqrt(num_embeddings)), ``normal`` (std
            ``init_scale``, default 1/sqrt(dim)), ``zeros``, or a callable filling a (rows, dim) tensor.
        init_scale: see ``init``.

    Example::

        TableConfig("item_id", num_embeddings=1_000_000, dim=64, pooling="sum")
    """

    name: str
    num_embeddings: int
    dim: int
    pooling: Pooling = "sum"
    init: Literal["uniform", "normal", "zeros"] | Callable[[torch.Tensor], None] = "uniform"
    init_scale: float | None = None

    def __post_init__(self) -> None:
        if self.num_embeddings < 1 or self.dim < 1:
            raise ValueError(f"table {self.name!r}: num_embeddings and dim must be positive")
        if self.pooling not in POOLING_CODES:
            raise ValueError(f"table {self.name!r}: pooling must be 'sum' or 'mean', not {self.pooling!r}")

    def initialize(self, rows: torch.Tensor, generator: torch.Generator | None = None) -> None:
        """Fill ``rows`` (n, dim), in place, with this table's initial values (drawn on ``generator``'s device,
        which is ``rows``'s when a collection calls it).

        The same seed gives other values on a GPU than on a CPU (each device has its own generator); a
        callable ``init`` gets ``rows`` on the collection's device."""
        where = generator.device if generator is not None else rows.device
        if callable(self.init):
            self.init(rows)
        elif self.init == "zeros":
            rows.zero_()
        elif self.init == "normal":
            scale = self.init_scale if self.init_scale is not None else self.dim ** -0.5
            rows.copy_(torch.randn(rows.shape, generator=generator, dtype=torch.float32, device=where).mul_(scale))
        elif self.init == "uniform":
            scale = self.init_scale if self.init_scale is not None else self.num_embeddings ** -0.5
            # in place: the same values as (u * 2 - 1) * scale, without three temporaries of the table's size
            rows.copy_(torch.rand(rows.shape, generator=generator, dtype=torch.float32, device=where).mul_(2).sub_(1)
                       .mul_(scale))
        else:
            raise ValueError(f"table {self.name!r}: unknown init {self.init!r}")


@dataclass(frozen=True)
class OptimizerConfig:
    """The fused sparse optimizer applied in the backward pass (see reference.apply_optimizer)."""

    name: OptimizerName
    lr: float = 0.01
    eps: float = 1e-8
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999

    def __post_init__(self) -> None:
        if self.name not in OPTIMIZERS:
            raise ValueError(f"unknown optimizer {self.name!r}; choose one of {OPTIMIZERS} or None")


@dataclass(frozen=True)
class Layout:
    """Where each table lives in the flat buffers (host-side lists; see the module docstring).

    ``align``: elements per 16 bytes of the weight's dtype (1 turns padding off, as in old checkpoints).
    """

    dims: tuple[int, ...]
    capacities: tuple[int, ...]
    rows: tuple[int, ...]
    poolings: tuple[int, ...]
    align: int = 4

    @property
    def num_tables(self) -> int:
        return len(self.dims)

    @property
    def strides(self) -> tuple[int, ...]:
        """Elements from one row to the next: ``dim`` rounded up to a multiple of ``align``."""
        return tuple(-(-d // self.align) * self.align for d in self.dims)

    @property
    def elem_offsets(self) -> tuple[int, ...]:
        return _starts(c * s for c, s in zip(self.capacities, self.strides, strict=True))

    @property
    def total_elems(self) -> int:
        return sum(c * s for c, s in zip(self.capacities, self.strides, strict=True))

    @property
    def row_offsets(self) -> tuple[int, ...]:
        return _starts(self.capacities)

    @property
    def total_rows(self) -> int:
        return sum(self.capacities)

    @property
    def col_offsets(self) -> tuple[int, ...]:
        """Output column where each table starts, then the total width."""
        return (*_starts(self.dims), self.total_dim)

    @property
    def total_dim(self) -> int:
        return sum(self.dims)


def alignment(dtype: torch.dtype) -> int:
    """Elements of ``dtype`` in 16 bytes: the row padding that lets the kernels load 16-byte vectors."""
    return 16 // torch.empty(0, dtype=dtype).element_size()


def _starts(sizes) -> tuple[int, ...]:
    """Where each of consecutive blocks of these sizes starts: 0, s0, s0+s1, ..."""
    out, total = [], 0
    for size in sizes:
        out.append(total)
        total += size
    return tuple(out)
