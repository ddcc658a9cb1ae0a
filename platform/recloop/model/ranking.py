"""The ranking model: DLRM-style, with a DCNv2 cross network as an option.

::

    dense (B, n_dense) ──DenseArch (MLP)──▶ (B, D) ─┐
                                                    ├─ InteractionArch ──▶ OverArch (MLP) ──▶ logit (B,)
    values, offsets ──SparseArch (EBC)──▶ (B, T, D) ┘   dot: pairwise dot products of the T+1 vectors
                                                        dcn: a DCNv2 cross network over their concatenation

The embeddings are ``recloop_kernels.EmbeddingBagCollection`` tables (one per categorical or multi-hot
column, all of width D), updated by their fused sparse optimizer during ``backward()``; the MLPs are
ordinary parameters for a dense optimizer.

Example::

    model = RankingModel(ModelConfig(embedding_dim=16), n_dense=18, tables=[("c_user_id", 5000), ...])
    logits = model(batch.dense, batch.values, batch.offsets)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Literal

import torch
from torch import nn

from recloop_kernels import (
    DynamicEmbeddingBagCollection,
    DynamicTableConfig,
    EmbeddingBagCollection,
    TableConfig,
)


@dataclass(frozen=True)
class TableBudgets:
    """Row budgets of id tables, the ranker's (``ModelConfig``) and the retriever's (``RetrievalConfig``) alike.

    Args:
        max_rows: (table, row budget) pairs: those tables are dynamic (``recloop_kernels.dynamic``): keyed
            by the ids the features give (vocabulary indices or hashes, any non-negative int64), holding at
            most that many rows, admitting an id after ``admit_after`` sightings (until then, and after it is
            evicted, it shares one of ``fallback_rows`` hashed rows) and evicting by ``eviction`` (``lru``, or
            ``lfu`` halving every ``lfu_half_life`` steps). Other tables are unchanged: a row per vocabulary index.
        count_half_life: training steps after which the admission counts are halved (0: never).
        sketch_width: counters a row of the admission sketch (a power of two); None: the total budget rounded
            up to a power of two, at least 1024. It has to tell apart the ids seen within a ``count_half_life``,
            not only the admitted ones: far narrower than those, collisions lift every new id's count to
            ``admit_after`` and ids are admitted at first sight (benchmarks/RESULTS.md, issue 42's bound).
    """

    max_rows: tuple[tuple[str, int], ...] = ()
    admit_after: int = 2
    fallback_rows: int = 1024
    eviction: Literal["lru", "lfu"] = "lru"
    lfu_half_life: float = 2000.0
    count_half_life: int = 2000
    sketch_width: int | None = None

    def dynamic_tables(self) -> dict[str, DynamicTableConfig]:
        """The budgeted tables' configurations (empty: every table has a row per vocabulary index)."""
        return {name: DynamicTableConfig(int(rows), self.admit_after, self.fallback_rows, self.eviction,
                                         self.lfu_half_life) for name, rows in self.max_rows}


@dataclass(frozen=True)
class ModelConfig(TableBudgets):
    """Shape of the model and of its embedding optimizer.

    Args:
        embedding_dim: D, the width of every table and of the dense arch's output.
        bottom_mlp, top_mlp: hidden layer sizes.
        interaction: ``dot`` (DLRM) or ``dcn`` (DCNv2 cross network).
        cross_layers: layers of the cross network.
        embedding_optimizer, embedding_lr: the fused sparse optimizer of the tables.
        multi_hot_pooling: pooling of list columns (one-hot columns pool a single id).
        embedding_backend: ``auto`` (the Triton kernels on a GPU, the PyTorch reference on a CPU),
            ``triton`` or ``reference`` (see ``EmbeddingBagCollection``).
        max_rows, admit_after, fallback_rows, eviction, lfu_half_life, count_half_life, sketch_width: the
            tables' row budgets (``TableBudgets``).
        dropout: the over arch's hidden layers drop this share of their units while training (0: none).
        wide: add a linear part to the logit (Wide & Deep's "wide" side, DeepFM's first-order term): a weight
            on each standardized dense input and on each table's pooled vector (a learned scalar per id). DLRM's
            top MLP sees the ids only through dot products, so an id's own click rate is learnt indirectly;
            a logistic regression on the same inputs learns it directly and beat the ranker on small logs. On
            by default (with ``TrainConfig``'s full-run rate 0.02): level or ahead on every log measured.
    """

    embedding_dim: int = 16
    bottom_mlp: tuple[int, ...] = (64, 32)
    top_mlp: tuple[int, ...] = (128, 64)
    interaction: Literal["dot", "dcn"] = "dot"
    cross_layers: int = 2
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float = 0.05
    multi_hot_pooling: Literal["sum", "mean"] = "mean"
    multi_hot_columns: tuple[str, ...] = field(default=())
    embedding_backend: str = "auto"
    dropout: float = 0.0
    wide: bool = True

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        raw = dict(raw)
        for key in ("bottom_mlp", "top_mlp", "multi_hot_columns"):
            raw[key] = tuple(raw.get(key, ()))
        raw["max_rows"] = tuple((str(name), int(rows)) for name, rows in raw.get("max_rows", ()))
        raw.setdefault("wide", False)  # checkpoints written before the wide part have none
        return cls(**raw)


def mlp(sizes: list[int], last_activation: bool, dropout: float = 0.0) -> nn.Sequential:
    """Linear layers with ReLUs between them (and after the last with ``last_activation``); with ``dropout``,
    a dropout after each hidden ReLU (none without: the parameters keep their names either way)."""
    layers: list[nn.Module] = []
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
        layers.append(nn.Linear(a, b))
        hidden = i < len(sizes) - 2
        if hidden or last_activation:
            layers.append(nn.ReLU())
        if hidden and dropout > 0:
            layers.append(nn.Dropout(dropout))
    return nn.Sequential(*layers)


# Below this standard deviation over the training rows a dense feature counts as constant (``standardize_from``).
CONSTANT_SPREAD = 1e-3


class DenseArch(nn.Module):
    """Dense features → one D-wide vector, each feature first standardized by the shift and scale of the rows
    the model was first trained on (``standardize_from``; kept as buffers, so a checkpoint carries them).

    Counts and recencies arrive on log scales up to ~15 next to click rates in [0, 1]: unstandardized, the MLP
    learns them slowly while the id embeddings (a sparse optimizer at a high rate) memorize the training
    users, and the model lost to a logistic regression on the same inputs."""

    def __init__(self, n_dense: int, hidden: tuple[int, ...], dim: int):
        super().__init__()
        self.layers = mlp([max(n_dense, 1), *hidden, dim], last_activation=True)
        self.register_buffer("shift", torch.zeros(n_dense))
        self.register_buffer("scale", torch.ones(n_dense))

    @torch.no_grad()
    def standardize_from(self, dense: torch.Tensor) -> None:
        """Set the shift and scale from a sample of training rows (N, n_dense).

        A feature (near) constant over those rows is centred and not stretched (scale 1, as scikit-learn's
        ``StandardScaler`` does): its spread says nothing about the values it takes later. Stretched by 1 / 1e-3,
        the day-of-week cosine of a two-day window (Thursday and Friday: both -0.901) met Saturday's -0.223 as
        an input of 678, and the held-out log loss of the dynamic-table test's model went from 0.33 to 1.13."""
        if dense.shape[0] < 2 or dense.shape[1] == 0:
            return
        dense = torch.nan_to_num(dense.float())
        spread = dense.std(dim=0)
        self.shift.copy_(dense.mean(dim=0))
        self.scale.copy_(torch.where(spread > CONSTANT_SPREAD, 1.0 / spread, torch.ones_like(spread)))

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # checkpoints written before standardization carry no shift/scale: identity, as they were trained
        for name, value in (("shift", self.shift), ("scale", self.scale)):
            state_dict.setdefault(prefix + name, torch.zeros_like(value) if name == "shift" else
                                  torch.ones_like(value))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def standardized(self, dense: torch.Tensor) -> torch.Tensor:
        """The inputs shifted and scaled as the first layer sees them."""
        return (dense - self.shift) * self.scale

    def forward(self, dense: torch.Tensor) -> torch.Tensor:
        if dense.shape[1] == 0:
            return self.layers(dense.new_zeros(dense.shape[0], 1))
        return self.layers(self.standardized(dense))


def table_configs(tables: list[tuple[str, int]], config: ModelConfig) -> list[TableConfig]:
    """The ``TableConfig`` of each (name, rows) table under ``config`` (list columns pool by its pooling)."""
    return [TableConfig(name, rows, config.embedding_dim,
                        pooling=config.multi_hot_pooling if name in config.multi_hot_columns else "sum")
            for name, rows in tables]


class SparseArch(nn.Module):
    """Categorical and multi-hot ids → one D-wide pooled vector per table, (B, T, D).

    ``embeddings``: a module that pools like the collection would (``recloop.model.sharded.ShardedEmbeddings``:
    this process's shards of the tables); None: the whole collection, built here."""

    def __init__(self, tables: list[tuple[str, int]], config: ModelConfig, device, seed: int,
                 embeddings: nn.Module | None = None):
        super().__init__()
        configs = table_configs(tables, config)
        common = dict(optimizer=config.embedding_optimizer, lr=config.embedding_lr, device=device, seed=seed,
                      backend=config.embedding_backend)
        dynamic = {name: table for name, table in config.dynamic_tables().items() if name in dict(tables)}
        self.embeddings: EmbeddingBagCollection | DynamicEmbeddingBagCollection = embeddings if embeddings is not None \
            else (DynamicEmbeddingBagCollection(configs, dynamic, count_half_life=config.count_half_life,
                                                sketch_width=config.sketch_width, **common)
                  if dynamic else EmbeddingBagCollection(configs, **common))
        self.num_tables, self.dim = len(configs), config.embedding_dim

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = self.embeddings(values, offsets)  # (B, T*D)
        return pooled.view(pooled.shape[0], self.num_tables, self.dim)


class InteractionArch(nn.Module):
    """DLRM's pairwise dot products of the dense vector and every table's vector, plus the dense vector."""

    def __init__(self, num_tables: int, dim: int):
        super().__init__()
        n = num_tables + 1
        rows, cols = torch.triu_indices(n, n, offset=1)
        self.register_buffer("rows", rows, persistent=False)
        self.register_buffer("cols", cols, persistent=False)
        self.output_dim = dim + n * (n - 1) // 2

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        stacked = torch.cat([dense.unsqueeze(1), sparse], dim=1)  # (B, T+1, D)
        products = torch.bmm(stacked, stacked.transpose(1, 2))  # (B, T+1, T+1)
        return torch.cat([dense, products[:, self.rows, self.cols]], dim=1)


class CrossInteractionArch(nn.Module):
    """DCNv2: x_{l+1} = x0 ⊙ (W_l x_l + b_l) + x_l over the concatenated vectors."""

    def __init__(self, num_tables: int, dim: int, layers: int):
        super().__init__()
        width = (num_tables + 1) * dim
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
        self.output_dim = width

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        x0 = torch.cat([dense, sparse.flatten(1)], dim=1)
        x = x0
        for layer in self.layers:
            x = x0 * layer(x) + x
        return x


class WideArch(nn.Module):
    """The linear part of the logit (``ModelConfig.wide``): w·dense + Σ_t v_t·e_t over the standardized dense
    inputs and each table's pooled vector e_t. Starts at zero, so a model begins as the DLRM it extends."""

    def __init__(self, n_dense: int, num_tables: int, dim: int):
        super().__init__()
        self.linear = nn.Linear(n_dense + num_tables * dim, 1)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.cat([dense.float(), sparse.flatten(1).float()], dim=1)).squeeze(-1)


class OverArch(nn.Module):
    """Interaction features → one logit."""

    def __init__(self, input_dim: int, hidden: tuple[int, ...], dropout: float = 0.0):
        super().__init__()
        self.layers = mlp([input_dim, *hidden, 1], last_activation=False, dropout=dropout)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.layers(features).squeeze(-1)


class RankingModel(nn.Module):
    """Click-probability model over dense features and embedding tables (see the module docstring).

    Args:
        config: the model's shape.
        n_dense: number of dense features.
        tables: (name, num_embeddings) per table, in the order of the batches' jagged layout.
        device: where it lives.
        seed: seeds the initialization (embeddings and MLPs).
        embeddings: the tables, when they are not built here: a process of a sharded training passes its
            shards (``recloop.model.sharded.ShardedEmbeddings``); the dense arches are the same either way.
    """

    def __init__(self, config: ModelConfig, n_dense: int, tables: list[tuple[str, int]],
                 device: str | torch.device = "cpu", seed: int = 0, embeddings: nn.Module | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.n_dense = n_dense
        self.table_names = [name for name, _ in tables]
        self.dense_arch = DenseArch(n_dense, config.bottom_mlp, config.embedding_dim)
        self.sparse_arch = SparseArch(tables, config, device, seed, embeddings)
        if config.interaction == "dcn":
            self.interaction_arch: nn.Module = CrossInteractionArch(len(tables), config.embedding_dim,
                                                                    config.cross_layers)
        else:
            self.interaction_arch = InteractionArch(len(tables), config.embedding_dim)
        self.over_arch = OverArch(self.interaction_arch.output_dim, config.top_mlp, config.dropout)
        self.wide_arch = WideArch(n_dense, len(tables), config.embedding_dim) if config.wide else None
        self.to(device)

    @property
    def embeddings(self) -> EmbeddingBagCollection | DynamicEmbeddingBagCollection:
        return self.sparse_arch.embeddings

    @property
    def dynamic_tables(self) -> tuple[str, ...]:
        """Tables keyed by id under a row budget (``ModelConfig.max_rows``)."""
        embeddings = self.embeddings
        return tuple(embeddings.dynamic) if isinstance(embeddings, DynamicEmbeddingBagCollection) else ()

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters for the dense optimizer (the embeddings update themselves)."""
        return [p for name, p in self.named_parameters() if not name.startswith("sparse_arch.")]

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return self.logits_and_penalty(dense, values, offsets)[0]

    def logits_and_penalty(self, dense: torch.Tensor, values: torch.Tensor,
                           offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The logits (B,) and the batch's embedding penalty: the mean over rows of the squared norms of the
        pooled vectors they looked up (an L2 on the rows a batch touches, as sparse CTR models regularize:
        a rare id's row is pulled toward zero by its own few rows, not by every step)."""
        if self.map_unknown_ids:
            values = self.known_ids(values, offsets)
        sparse = self.sparse_arch(values, offsets)  # (B, T, D)
        logits = self.over_arch(self.interaction_arch(self.dense_arch(dense), sparse))
        if self.wide_arch is not None:
            logits = logits + self.wide_arch(self.dense_arch.standardized(dense), sparse)
        if self.calibration is not None:  # Platt scaling fitted on rows held aside: the order is unchanged
            logits = logits * self.calibration[0] + self.calibration[1]
        return logits, sparse.float().pow(2).sum(dim=(1, 2)).mean()

    # (a, b) of Platt scaling, set after training and kept with the checkpoint's JSON (``train._fit_calibration``):
    # fitted on the early-stopping rows the model was not trained on; None while training.
    calibration: tuple[float, float] | None = None

    # A served model meets ids admitted to the vocabularies after it was trained; for it they are
    # out of vocabulary, as they were in its training data. Training keeps the hard error instead.
    map_unknown_ids = False

    def known_ids(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``values`` with ids beyond a table's rows replaced by the out-of-vocabulary row (1). Dynamic tables
        take any id (one without a row pools its hashed fallback row)."""
        tables = len(self.table_names)
        batch = (offsets.numel() - 1) // tables
        table_of_value = torch.searchsorted(offsets[::batch][1:tables].contiguous(), torch.arange(values.numel(),
                                            device=values.device), right=True)
        dynamic = set(self.dynamic_tables)
        limits = [2**63 - 1 if name in dynamic else rows
                  for name, rows in zip(self.table_names, self.embeddings.layout.rows, strict=True)]
        rows = torch.tensor(limits, device=values.device)[table_of_value]
        return torch.where(values < rows, values, torch.ones_like(values))
