"""The retrieval model: two towers that map users and items into one vector space.

::

    user tower:  user id ─┐                                           ┌──────────────┐
                 context ─┼─ EBC (B, T_u·d) ─▶ MLP ─▶ L2-normalize ─▶ │ u (B, D)     │
                 history ─┘  (history: mean of its items' rows)       │              │  score = u·v / τ
    item tower:  item id ─┐                                           │              │
                 category ┼─ EBC (B, T_i·d) ┬▶ MLP ─▶ L2-normalize ─▶ │ v (B, D)     │
                 dense ───┴─────────────────┘                         └──────────────┘

Both towers' tables are ``recloop_kernels.EmbeddingBagCollection`` tables updated by their fused sparse
optimizer during ``backward()``; the MLPs are ordinary parameters for a dense optimizer. Tables named in
``RetrievalConfig.max_rows`` are dynamic instead (``recloop_kernels.DynamicEmbeddingBagCollection``, as the
ranker's under ``ModelConfig.max_rows``): keyed by id, at most that many rows, admitting and evicting ids as
they come and go, an id without a row of its own pooling a shared, hashed fallback row. Because the
towers only meet in a dot product, every item's vector can be computed once after training and put in a
nearest-neighbour index: retrieving for a user is one user-tower pass and one index search.

Training uses clicked events only, with the other items of the batch as negatives. Popular items are
negatives more often than their share of the catalog, which would push their scores down; the log-Q
correction (Yi et al., RecSys 2019) subtracts the log of each item's sampling probability from its logit
so the softmax estimates the full-catalog one. An item that is another row's positive *and* this row's
positive (the same item clicked twice in a batch) is not a negative for this row.

Example::

    model = TwoTowerModel(RetrievalConfig(), user_tables=[("c_user_id", 500), ("c_device", 5),
                          ("m_history", 800)], item_tables=[("c_item_id", 800), ("c_category", 26)],
                          item_dense=1, multi_hot={"m_history"})
    u = model.user_tower(user_values, user_offsets)          # (B, D)
    v = model.item_tower(item_values, item_offsets, dense)   # (B, D)
    loss = in_batch_softmax_loss(u, v, item_ids, log_q, temperature=0.05)
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from recloop.model.ranking import TableBudgets, mlp
from recloop_kernels import (
    DynamicEmbeddingBagCollection,
    EmbeddingBagCollection,
    TableConfig,
)


@dataclass(frozen=True)
class RetrievalConfig(TableBudgets):
    """Shape of the two towers and of their embedding optimizer.

    Args:
        table_dim: width of every embedding table.
        hidden: hidden layer sizes of both towers' MLPs.
        output_dim: D, the width of the user and item vectors (and of the index).
        temperature: τ, dividing the cosine similarities before the softmax.
        logq_correction: subtract log(sampling probability) from the in-batch logits.
        embedding_optimizer, embedding_lr: the fused sparse optimizer of the tables.
        max_rows, admit_after, fallback_rows, eviction, lfu_half_life, count_half_life, sketch_width: row
            budgets of tables in either tower (``recloop.model.ranking.TableBudgets``, as the ranker's).
    """

    table_dim: int = 32
    hidden: tuple[int, ...] = (64,)
    output_dim: int = 32
    temperature: float = 0.1
    logq_correction: bool = True
    embedding_optimizer: str = "rowwise_adagrad"
    embedding_lr: float = 0.05

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> RetrievalConfig:
        raw = dict(raw)
        raw["hidden"] = tuple(raw.get("hidden", ()))
        raw["max_rows"] = tuple((str(name), int(rows)) for name, rows in raw.get("max_rows", ()))
        return cls(**raw)


class Tower(nn.Module):
    """Embedding tables (one-hot and multi-hot, table-major bags) plus optional dense inputs → unit vectors.

    Args:
        tables: (name, num_embeddings) in the order of the bags' jagged layout.
        dense: number of dense inputs concatenated to the pooled embeddings.
        config: the shape.
        multi_hot: names of the tables whose bags are lists (mean-pooled); others pool one id.
        device, seed: where it lives, and its initialization.
    """

    def __init__(self, tables: list[tuple[str, int]], dense: int, config: RetrievalConfig,
                 multi_hot: Collection[str] = (), device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        configs = [TableConfig(name, rows, config.table_dim, pooling="mean" if name in multi_hot else "sum",
                               init="normal", init_scale=0.05) for name, rows in tables]
        common = dict(optimizer=config.embedding_optimizer, lr=config.embedding_lr, device=device, seed=seed)
        dynamic = {name: table for name, table in config.dynamic_tables().items() if name in dict(tables)}
        self.embeddings: EmbeddingBagCollection | DynamicEmbeddingBagCollection = (
            DynamicEmbeddingBagCollection(configs, dynamic, count_half_life=config.count_half_life,
                                          sketch_width=config.sketch_width, **common)
            if dynamic else EmbeddingBagCollection(configs, **common))
        self.table_names = [name for name, _ in tables]
        self.num_dense = dense
        self.layers = mlp([len(tables) * config.table_dim + dense, *config.hidden, config.output_dim],
                          last_activation=False)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor, dense: torch.Tensor | None = None
                ) -> torch.Tensor:
        pooled = self.embeddings(values, offsets)  # (B, T·d)
        if self.num_dense:
            pooled = torch.cat([pooled, dense], dim=1)  # (B, T·d + n_dense)
        return F.normalize(self.layers(pooled), dim=1)  # (B, D)

    @property
    def dynamic_tables(self) -> tuple[str, ...]:
        """Tables keyed by id under a row budget (``RetrievalConfig.max_rows``)."""
        embeddings = self.embeddings
        return tuple(embeddings.dynamic) if isinstance(embeddings, DynamicEmbeddingBagCollection) else ()

    def known_ids(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """``values`` with ids beyond a table's rows mapped to the out-of-vocabulary row (1).

        A served or evaluated model meets ids admitted to the vocabularies after it was trained; for it
        they are unknown, as they were in its training data. Dynamic tables take any id (one without a row
        of its own pools its hashed fallback row).
        """
        tables = len(self.table_names)
        batch = (offsets.numel() - 1) // tables
        if batch == 0 or values.numel() == 0:
            return values
        bounds = offsets[::batch][1:tables].contiguous()
        table_of_value = torch.searchsorted(bounds, torch.arange(values.numel(), device=values.device), right=True)
        dynamic = set(self.dynamic_tables)
        limits = [2**63 - 1 if name in dynamic else rows
                  for name, rows in zip(self.table_names, self.embeddings.layout.rows, strict=True)]
        rows = torch.tensor(limits, device=values.device)[table_of_value]
        return torch.where(values < rows, values, torch.ones_like(values))

    def has_row(self, name: str, ids: torch.Tensor) -> torch.Tensor:
        """Whether each id of table ``name`` has a row of its own: below the table's rows, or (dynamic) admitted
        and not evicted."""
        if name in self.dynamic_tables:
            return self.embeddings.slot_of(name, ids) >= 0
        return (ids >= 0) & (ids < self.embeddings.layout.rows[self.table_names.index(name)])


class TwoTowerModel(nn.Module):
    """A user tower and an item tower (see the module docstring).

    Args:
        config: the shape.
        user_tables, item_tables: (name, num_embeddings) per table of each tower, in bag order.
        item_dense: number of dense item attributes.
        multi_hot: names of list-valued tables (in either tower).
        device, seed: where it lives, and its initialization.
    """

    def __init__(self, config: RetrievalConfig, user_tables: list[tuple[str, int]],
                 item_tables: list[tuple[str, int]], item_dense: int, multi_hot: Collection[str] = (),
                 device: str | torch.device = "cpu", seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.config = config
        self.user_tower = Tower(user_tables, 0, config, multi_hot, device, seed)
        self.item_tower = Tower(item_tables, item_dense, config, multi_hot, device, seed + 1)
        self.to(device)

    @property
    def towers(self) -> dict[str, Tower]:
        return {"user": self.user_tower, "item": self.item_tower}

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters for the dense optimizer (the embedding tables update themselves)."""
        return [p for name, p in self.named_parameters() if ".embeddings." not in name]

    def forward(self, user_values: torch.Tensor, user_offsets: torch.Tensor, item_values: torch.Tensor,
                item_offsets: torch.Tensor, item_dense: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """User and item vectors of a batch of (user, clicked item) pairs: (B, D) and (B, D)."""
        return (self.user_tower(user_values, user_offsets),
                self.item_tower(item_values, item_offsets, item_dense))


def in_batch_softmax_loss(user_vectors: torch.Tensor, item_vectors: torch.Tensor, item_ids: torch.Tensor,
                          log_q: torch.Tensor | None, temperature: float) -> torch.Tensor:
    """Sampled softmax over the batch's items, with the log-Q correction and accidental hits removed.

    Row i's positive is item i; every other item j of the batch is a negative unless it is the same item
    as row i's positive::

        logit[i, j] = u_i · v_j / τ − log q_j          (log_q None: no correction)
        logit[i, j] = −inf  where item_ids[j] == item_ids[i] and j ≠ i
        loss        = mean_i ( −log softmax(logit[i])[i] )

    Args:
        user_vectors, item_vectors: (B, D) each.
        item_ids: (B,) the positives' ids (only compared for equality).
        log_q: (B,) log sampling probability of each row's item, or None.
        temperature: τ.
    """
    logits = user_vectors @ item_vectors.T / temperature  # (B, B)
    if log_q is not None:
        logits = logits - log_q[None, :]
    same = item_ids[:, None] == item_ids[None, :]  # (B, B)
    accidental = same & ~torch.eye(len(item_ids), dtype=torch.bool, device=same.device)
    logits = logits.masked_fill(accidental, float("-inf"))
    targets = torch.arange(len(item_ids), device=logits.device)
    return F.cross_entropy(logits, targets)
