"""The ranking model across processes: embedding tables sharded over ranks, lookups exchanged all-to-all.

``recloop_kernels`` stays single-device; sharding lives here. Each rank holds an ordinary
``EmbeddingBagCollection`` of its shards (with the fused optimizer, so it updates only its own rows):

- **table-wise**: a whole table on one rank (tables balanced over ranks by rows × dim);
- **row-wise**: a table larger than ``row_wise_above`` rows (default: one rank's share of all rows) is
  cut into one contiguous row range per rank; each range pools the ids that fall in it, and the partial
  sums are added on the rank that asked (mean-pooled tables are divided by the whole bag's length after).

One step, seen from rank r with a local batch of b_r rows (ids in the kernels' table-major layout)::

    ids of table t ──(row-wise: keep the ids in each range, shifted to it)──▶ per owner rank d
         all_to_all (bag lengths, ids)                 owners see the global batch (Σ b_s rows, source order)
    owner d: local EBC forward ──▶ (Σ b_s, D_d) pooled ──all_to_all──▶ each source gets its b_r rows
    rank r: blocks put back in table order (row-wise parts summed) ──▶ (b_r, T·D) as RankingModel's

Backward runs the same exchange in reverse: each owner's fused optimizer gets the gradient of every
row of the global batch for its shards, scaled by 1/world so that the step equals a single process's on
the concatenated batch (the dense layers are averaged by DistributedDataParallel in the same way).

Example::

    plan = plan_sharding(model.embeddings, world=2)
    sharded = ShardedRankingModel(model, plan, rank=dist.get_rank())
    logits = DistributedDataParallel(sharded, broadcast_buffers=False)(dense, values, offsets)
    sharded.sparse.gather_into(model.embeddings)     # rank 0: the full tables, for checkpoint.save
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from recloop.model.ranking import RankingModel
from recloop_kernels import EmbeddingBagCollection, TableConfig
from recloop_kernels.reference import new_errors, record_errors, table_view


@dataclass(frozen=True)
class Shard:
    """Rows ``[lo, hi)`` of table ``table`` (its index in the model), held by one rank."""

    table: int
    name: str
    lo: int
    hi: int
    dim: int
    pooling: str
    row_wise: bool

    @property
    def rows(self) -> int:
        return self.hi - self.lo


@dataclass(frozen=True)
class ShardingPlan:
    """Which shards each rank holds (``ranks[r]``, in that rank's local table order)."""

    world: int
    ranks: tuple[tuple[Shard, ...], ...]
    num_tables: int

    def owners(self, table: int) -> list[tuple[int, Shard]]:
        return [(r, s) for r, shards in enumerate(self.ranks) for s in shards if s.table == table]


def plan_sharding(collection: EmbeddingBagCollection, world: int, row_wise_above: int | None = None) -> ShardingPlan:
    """Row-wise for tables above ``row_wise_above`` rows (default: all rows / world), table-wise for the rest,
    balanced greedily by rows × dim (largest first). The same on every rank: a function of its inputs."""
    layout = collection.layout
    tables = [(t, c.name, layout.rows[t], layout.dims[t], c.pooling) for t, c in enumerate(collection.tables)]
    threshold = row_wise_above if row_wise_above is not None else sum(r for _, _, r, _, _ in tables) // world
    ranks: list[list[Shard]] = [[] for _ in range(world)]
    load = [0] * world
    for t, name, rows, dim, pooling in tables:
        if world > 1 and rows > threshold and rows >= world:
            step = -(-rows // world)
            for r in range(world):
                lo, hi = min(r * step, rows), min((r + 1) * step, rows)
                ranks[r].append(Shard(t, name, lo, hi, dim, pooling, True))
                load[r] += (hi - lo) * dim
    for t, name, rows, dim, pooling in sorted(tables, key=lambda x: (-x[2] * x[3], x[0])):
        if world > 1 and rows > threshold and rows >= world:
            continue
        r = min(range(world), key=lambda k: (load[k], k))
        ranks[r].append(Shard(t, name, 0, rows, dim, pooling, False))
        load[r] += rows * dim
    ordered = tuple(tuple(sorted(shards, key=lambda s: (s.table, s.lo))) for shards in ranks)
    return ShardingPlan(world, ordered, len(tables))


def _state_views(ebc: EmbeddingBagCollection, t: int) -> list[torch.Tensor]:
    """Table t's rows of each optimizer state buffer: per-row (rowwise Adagrad) or per-element (Adagrad, Adam)."""
    layout, views = ebc.layout, []
    for state in (ebc.state1, ebc.state2):
        if state.numel() == layout.total_rows:
            views.append(state[layout.row_offsets[t]:layout.row_offsets[t] + layout.capacities[t]].view(-1, 1))
        elif state.numel():
            views.append(table_view(state, layout, t))
    return [table_view(ebc.weights, layout, t), *views]


class _Exchange(torch.autograd.Function):
    """``all_to_all_single`` of a flat tensor; the backward sends gradients back, times ``grad_scale``."""

    @staticmethod
    def forward(ctx, flat, send: list[int], receive: list[int], group, grad_scale: float):
        ctx.send, ctx.receive, ctx.group, ctx.grad_scale = send, receive, group, grad_scale
        out = flat.new_empty(sum(receive))
        dist.all_to_all_single(out, flat.contiguous(), receive, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty(sum(ctx.send))
        dist.all_to_all_single(back, (grad * ctx.grad_scale).contiguous(), ctx.send, ctx.receive, group=ctx.group)
        return back, None, None, None, None


def _exchange_ints(tensor: torch.Tensor, send: list[int], receive: list[int], group) -> torch.Tensor:
    out = tensor.new_empty(sum(receive))
    dist.all_to_all_single(out, tensor.contiguous(), receive, send, group=group)
    return out


class ShardedEmbeddings(nn.Module):
    """This rank's shards of a collection, and the exchange that makes them answer like the whole.

    Args:
        full: the whole collection (same initial rows on every rank: built with the same seed, or loaded
            from one checkpoint); this rank copies its shards' rows and optimizer state from it.
        plan: ``plan_sharding`` of ``full`` for the process group's size.
        rank: this process's rank; group: the process group (None: the default one).
    """

    def __init__(self, full: EmbeddingBagCollection, plan: ShardingPlan, rank: int, group=None):
        super().__init__()
        self.plan, self.rank, self.group = plan, rank, group
        self.dims = list(full.layout.dims)
        self.table_names, self.table_rows = [c.name for c in full.tables], list(full.layout.rows)
        # Ids outside their table, counted by the rank whose batch holds them (the owners' lookups drop or
        # zero them without a word: table-wise shards pool them as zeros, row-wise ones keep none)
        # (a plain tensor, not a buffer: DistributedDataParallel would overwrite every rank's with rank 0's)
        self.id_errors = new_errors(len(full.tables), full.weights.device)
        self.mean = [c.pooling == "mean" for c in full.tables]
        mine = plan.ranks[rank]
        optimizer = full.optimizer
        configs = [TableConfig(f"{s.name}[{s.lo}:{s.hi}]", max(s.rows, 1), s.dim, "sum" if s.row_wise else s.pooling)
                   for s in mine]
        self.local = EmbeddingBagCollection(
            configs, optimizer=optimizer.name, lr=optimizer.lr, eps=optimizer.eps,
            weight_decay=optimizer.weight_decay, betas=(optimizer.beta1, optimizer.beta2), dtype=full.weights.dtype,
            device=full.weights.device, check_ids=False) if mine else None
        with torch.no_grad():
            for j, shard in enumerate(mine):
                for target, source in zip(_state_views(self.local, j), _state_views(full, shard.table), strict=True):
                    target[:shard.rows].copy_(source[shard.lo:shard.hi])
            if self.local is not None:
                self.local.step.copy_(full.step)

    def raise_id_errors(self) -> None:
        """Raise ``IndexError`` on every rank if any rank's batches since the last check held ids outside a
        table (collective: every rank calls it at the same step), and reset."""
        errors = self.id_errors.to(torch.int64)
        counts = errors[0].clone()
        if dist.is_available() and dist.is_initialized():
            dist.all_reduce(counts, group=self.group)
        if not counts.any():
            return
        self.id_errors.copy_(new_errors(len(self.table_names), self.id_errors.device))
        t = int(torch.nonzero(counts)[0])
        local = f"; on this rank ids in [{int(errors[2, t])}, {int(errors[1, t])}]" if errors[0, t] else ""
        raise IndexError(f"table {self.table_names[t]!r} has {self.table_rows[t]} rows; {int(counts[t])} ids out of "
                         f"range since the last check over every rank{local} (they updated nothing)")

    def forward(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Pooled embeddings (b, T·D) of this rank's rows, as ``EmbeddingBagCollection`` would give them."""
        plan, world, group, device = self.plan, self.plan.world, self.group, values.device
        tables = plan.num_tables
        batch = (offsets.numel() - 1) // tables
        lengths = (offsets[1:] - offsets[:-1]).view(tables, batch)  # (T, b)
        bounds = offsets[::batch].tolist() if batch else [0] * (tables + 1)

        # 1. Each owner's share of this rank's bags: per destination, its shards' lengths then ids.
        for t in range(tables):
            record_errors(self.id_errors, t, values[bounds[t]:bounds[t + 1]], self.table_rows[t])
        send_lengths, send_values, value_counts = [], [], []
        for shards in plan.ranks:
            for shard in shards:
                ids = values[bounds[shard.table]:bounds[shard.table + 1]]
                if shard.row_wise:
                    keep = (ids >= shard.lo) & (ids < shard.hi)
                    bag = torch.repeat_interleave(torch.arange(batch, device=device), lengths[shard.table],
                                                  output_size=ids.numel())
                    part = torch.zeros(batch, dtype=torch.int64, device=device).index_add_(0, bag[keep],
                                                                                          keep[keep].long())
                    send_lengths.append(part)
                    send_values.append(ids[keep] - shard.lo)
                else:
                    send_lengths.append(lengths[shard.table])
                    send_values.append(ids)
            value_counts.append(sum(v.numel() for v in send_values) - sum(value_counts))
        counts = torch.tensor([[c, batch] for c in value_counts], dtype=torch.int64, device=device).view(-1)
        received = _exchange_ints(counts, [2] * world, [2] * world, group).view(world, 2).tolist()
        batches = [b for _, b in received]  # every source's local batch size
        mine = plan.ranks[self.rank]
        got_lengths = _exchange_ints(torch.cat(send_lengths) if send_lengths else values.new_zeros(0),
                                     [len(s) * batch for s in plan.ranks], [len(mine) * b for b in batches], group)
        got_values = _exchange_ints(torch.cat(send_values) if send_values else values.new_zeros(0),
                                    value_counts, [c for c, _ in received], group)

        # 2. The owner pools the global batch (sources in rank order) for its shards in one launch.
        total = sum(batches)
        if mine:
            per_source_lengths = torch.split(got_lengths, [len(mine) * b for b in batches])
            per_source_values = torch.split(got_values, [c for c, _ in received])
            blocks_lengths, blocks_values = [], []
            for s, b in enumerate(batches):
                shard_lengths = per_source_lengths[s].view(len(mine), b)
                sizes = shard_lengths.sum(dim=1).tolist()
                blocks_lengths.append(shard_lengths)
                blocks_values.append(torch.split(per_source_values[s], sizes))
            local_lengths = torch.cat([blocks_lengths[s][j] for j in range(len(mine)) for s in range(world)])
            local_values = torch.cat([blocks_values[s][j] for j in range(len(mine)) for s in range(world)])
            local_offsets = torch.cat([local_lengths.new_zeros(1), local_lengths.cumsum(0)])
            pooled = self.local(local_values, local_offsets)  # (Σ b_s, D_local)
        else:
            pooled = torch.zeros(total, 0, device=device, requires_grad=torch.is_grad_enabled())
        width = pooled.shape[1]

        # 3. Each source gets its rows back; the backward returns their gradients (÷ world: the loss is
        #    the mean over ranks, as DistributedDataParallel averages the dense gradients).
        widths = [sum(s.dim for s in shards) for shards in plan.ranks]
        back = _Exchange.apply(pooled.reshape(-1), [b * width for b in batches], [batch * w for w in widths],
                               group, 1.0 / world)
        parts: list[list[torch.Tensor]] = [[] for _ in range(tables)]
        for (owner, shards), block in zip(enumerate(plan.ranks), torch.split(back, [batch * w for w in widths]),
                                          strict=True):
            block = block.view(batch, widths[owner])
            column = 0
            for shard in shards:
                parts[shard.table].append(block[:, column:column + shard.dim])
                column += shard.dim
        out = []
        for t in range(tables):
            pooled_t = parts[t][0] if len(parts[t]) == 1 else torch.stack(parts[t]).sum(0)
            if len(parts[t]) > 1 and self.mean[t]:
                pooled_t = pooled_t / lengths[t].clamp(min=1).unsqueeze(1).to(pooled_t.dtype)
            out.append(pooled_t)
        return torch.cat(out, dim=1)

    @torch.no_grad()
    def gather_into(self, full: EmbeddingBagCollection, dst: int = 0) -> None:
        """Every rank's shards (rows and optimizer state) copied into ``full`` on rank ``dst`` (collective:
        every rank calls it). ``full`` then holds what a single process would, for ``checkpoint.save``."""
        flats = [torch.cat([v[:s.rows].reshape(-1) for j, s in enumerate(self.plan.ranks[self.rank])
                            for v in _state_views(self.local, j)]) if self.local is not None
                 else full.weights.new_zeros(0)]
        if self.rank != dst:
            dist.send(flats[0].float().contiguous(), dst, group=self.group)
            return
        for source, shards in enumerate(self.plan.ranks):
            if source == self.rank:
                flat = flats[0].float()
            else:
                size = sum(s.rows * v.shape[1] for s in shards for v in _state_views(full, s.table))
                flat = torch.empty(size, dtype=torch.float32, device=full.weights.device)
                dist.recv(flat, source, group=self.group)
            position = 0
            for shard in shards:
                for view in _state_views(full, shard.table):
                    n = shard.rows * view.shape[1]
                    view[shard.lo:shard.hi].copy_(flat[position:position + n].view(shard.rows, view.shape[1]))
                    position += n
        if self.local is not None:
            full.step.copy_(self.local.step)


class ShardedRankingModel(nn.Module):
    """``RankingModel`` with its tables sharded: the dense arches are the full model's own modules (for
    DistributedDataParallel and the dense optimizer), the sparse arch is this rank's ``ShardedEmbeddings``."""

    def __init__(self, full: RankingModel, plan: ShardingPlan, rank: int, group=None):
        super().__init__()
        self.dense_arch, self.interaction_arch, self.over_arch = full.dense_arch, full.interaction_arch, full.over_arch
        self.sparse = ShardedEmbeddings(full.embeddings, plan, rank, group)
        self.num_tables, self.dim = len(full.table_names), full.config.embedding_dim

    def forward(self, dense: torch.Tensor, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        pooled = self.sparse(values, offsets)
        sparse = pooled.view(pooled.shape[0], self.num_tables, self.dim)
        return self.over_arch(self.interaction_arch(self.dense_arch(dense), sparse))
