"""The ranking model across processes: embedding tables sharded over ranks, lookups exchanged all-to-all.

``recloop_kernels`` stays single-device; sharding lives here. Each rank holds an ordinary
``EmbeddingBagCollection`` of its shards (with the fused optimizer, so it updates only its own rows), and
only those: no process of a sharded training allocates every table, not at start-up (``draw_initial``
draws its rows of the initial values, a checkpoint gives its rows and no others) and not at the end (each
rank writes its own rows: ``sharded_checkpoint``). The tables are split so:

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

    tables = table_configs([("c_user_id", 5000), ("c_item_id", 800)], config)
    plan = plan_sharding(tables, world=2)
    shards = ShardedEmbeddings(tables, plan, dist.get_rank(), OptimizerConfig("rowwise_adagrad", lr=0.2))
    shards.draw_initial(seed=0, start=tables)             # this rank's rows of the whole initial tables
    model = RankingModel(config, n_dense, [("c_user_id", 5000), ("c_item_id", 800)], embeddings=shards)
    logits = DistributedDataParallel(model, broadcast_buffers=False)(dense, values, offsets)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch import nn

from recloop_kernels import EmbeddingBagCollection, OptimizerConfig, TableConfig
from recloop_kernels.collection import GROWTH
from recloop_kernels.config import POOLING_CODES, Layout, alignment
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


def plan_sharding(tables: EmbeddingBagCollection | ShardedEmbeddings | Sequence[TableConfig], world: int,
                  row_wise_above: int | None = None) -> ShardingPlan:
    """Row-wise for tables above ``row_wise_above`` rows (default: all rows / world), table-wise for the rest,
    balanced greedily by rows × dim (largest first). The same on every rank: a function of its inputs.

    ``tables``: a collection (whole or sharded: its current rows), or the tables' configurations."""
    if isinstance(tables, EmbeddingBagCollection | ShardedEmbeddings):
        layout = tables.layout
        tables = [(t, c.name, layout.rows[t], layout.dims[t], c.pooling) for t, c in enumerate(tables.tables)]
    else:
        tables = [(t, c.name, c.num_embeddings, c.dim, c.pooling) for t, c in enumerate(tables)]
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


def grown_layout(layout: Layout, rows: Sequence[int]) -> Layout:
    """``layout`` after ``EmbeddingBagCollection.grow`` of each table to ``rows`` (the collection's capacity rule:
    a table outgrowing its capacity reserves ``GROWTH`` times it), without a row allocated."""
    capacities = tuple(c if r <= c else max(r, math.ceil(c * GROWTH))
                       for c, r in zip(layout.capacities, rows, strict=True))
    return Layout(layout.dims, capacities, tuple(rows), layout.poolings, layout.align)


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

    Only the shards are allocated. ``tables`` and ``layout`` describe the whole collection (names, poolings,
    initialization, rows, capacities: numbers, no rows); a new model's rows come from ``draw_initial`` (this
    rank's rows of the values the whole collection would start with), a checkpoint's from
    ``sharded_checkpoint.load_tables`` or ``read_rows``; ``from_collection`` copies them from a whole one.

    In the model's ``state_dict`` it stands for the whole collection's layout (its rows, capacities and widths,
    as ``EmbeddingBagCollection`` writes them) and holds no rows: those go through ``sharded_checkpoint``, each
    rank writing its own.

    Args:
        tables: the whole collection's tables, at their current rows.
        plan: ``plan_sharding`` of the tables for the process group's size.
        rank: this process's rank.
        optimizer: the fused sparse optimizer every shard runs.
        layout: the whole collection's layout (default: as a new collection of ``tables`` would have it).
        group: the process group (None: the default one).
        dtype, device: of the shards' weights.

    Example::

        tables = [TableConfig("user", 10_000, 16), TableConfig("item", 500, 16)]
        plan = plan_sharding(tables, world=2)
        shards = ShardedEmbeddings(tables, plan, rank, OptimizerConfig("rowwise_adagrad", lr=0.2))
        shards.draw_initial(seed=0, start=tables)  # this rank's rows of EmbeddingBagCollection(tables, seed=0)
    """

    def __init__(self, tables: Sequence[TableConfig], plan: ShardingPlan, rank: int, optimizer: OptimizerConfig, *,
                 layout: Layout | None = None, group=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None):
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        self.plan, self.rank, self.group = plan, rank, group
        self.tables, self.optimizer = list(tables), optimizer
        rows = tuple(c.num_embeddings for c in self.tables)
        self.layout = layout or Layout(tuple(c.dim for c in self.tables), rows, rows,
                                       tuple(POOLING_CODES[c.pooling] for c in self.tables), alignment(dtype))
        self.dims = list(self.layout.dims)
        self.table_names, self.table_rows = [c.name for c in self.tables], list(self.layout.rows)
        # Ids outside their table, counted by the rank whose batch holds them (the owners' lookups drop or
        # zero them without a word: table-wise shards pool them as zeros, row-wise ones keep none)
        # (a plain tensor, not a buffer: DistributedDataParallel would overwrite every rank's with rank 0's)
        self.id_errors = new_errors(len(self.tables), device)
        self.mean = [c.pooling == "mean" for c in self.tables]
        mine = plan.ranks[rank]
        configs = [TableConfig(f"{s.name}[{s.lo}:{s.hi}]", max(s.rows, 1), s.dim, "sum" if s.row_wise else s.pooling,
                               init="zeros") for s in mine]  # zeros: filled by draw_initial or a checkpoint
        local = EmbeddingBagCollection(
            configs, optimizer=optimizer.name, lr=optimizer.lr, eps=optimizer.eps, weight_decay=optimizer.weight_decay,
            betas=(optimizer.beta1, optimizer.beta2), dtype=dtype, device=device, check_ids=False) if mine else None
        # Not a submodule: the model's state_dict, load_state_dict and DistributedDataParallel see the whole
        # collection's layout here (``_save_to_state_dict``), never the shards, which are this rank's alone.
        self.__dict__["local"] = local

    @classmethod
    def from_collection(cls, full: EmbeddingBagCollection, plan: ShardingPlan, rank: int,
                        group=None) -> ShardedEmbeddings:
        """This rank's shards of a whole collection: its rows, optimizer state and step copied."""
        sharded = cls([replace(c, num_embeddings=r) for c, r in zip(full.tables, full.layout.rows, strict=True)],
                      plan, rank, full.optimizer, layout=full.layout, group=group, dtype=full.weights.dtype,
                      device=full.weights.device)
        with torch.no_grad():
            for j, shard in enumerate(plan.ranks[rank]):
                for target, source in zip(_state_views(sharded.local, j), _state_views(full, shard.table),
                                          strict=True):
                    target[:shard.rows].copy_(source[shard.lo:shard.hi])
            if sharded.local is not None:
                sharded.local.step.copy_(full.step)
        return sharded

    @torch.no_grad()
    def draw_initial(self, seed: int, start: Sequence[TableConfig],
                     growth: Sequence[tuple[int, int, int]] = ()) -> None:
        """This rank's rows of the initial values ``EmbeddingBagCollection(start, seed=seed)`` would hold, after
        ``grow(t, new)`` for each ``(t, old, new)`` of ``growth`` (in that order): the same generator draws in
        the same order, and only this rank's rows are kept.

        On a CPU every table is drawn a block of rows at a time (``DRAW_BLOCK`` values: the same values as one
        draw of the whole table, ``tests/test_sharded_checkpoint.py`` checks it), so no table is ever whole
        here. Elsewhere (a GPU generator's values depend on the launch's shape) each table is drawn whole into
        a temporary, this rank's rows copied out and the rest freed before the next table.
        """
        device = self.local.weights.device if self.local is not None else self.id_errors.device
        generator = torch.Generator(device=device).manual_seed(seed)
        keep: list[list[tuple[Shard, torch.Tensor]]] = [[] for _ in self.tables]
        for j, shard in enumerate(self.plan.ranks[self.rank]):
            keep[shard.table].append((shard, table_view(self.local.weights, self.local.layout, j)))
        for t, config in enumerate(start):
            _draw_rows(config, 0, config.num_embeddings, generator, keep[t])
        for t, old, new in growth:
            _draw_rows(start[t], old, new, generator, keep[t])

    def held_bytes(self) -> int:
        """Bytes of the rows and optimizer state this rank holds."""
        if self.local is None:
            return 0
        return sum(b.numel() * b.element_size() for b in (self.local.weights, self.local.state1, self.local.state2))

    def whole_bytes(self) -> int:
        """Bytes the whole collection's rows and optimizer state take (``layout``): what one process would hold."""
        weights = self.layout.total_elems * torch.empty(0, dtype=self._dtype).element_size()
        state = {"rowwise_adagrad": self.layout.total_rows, "adagrad": self.layout.total_elems,
                 "adam": 2 * self.layout.total_elems}.get(self.optimizer.name, 0)
        return weights + 4 * state  # optimizer state is fp32

    @property
    def _dtype(self) -> torch.dtype:
        return self.local.weights.dtype if self.local is not None else torch.float32

    def _metadata(self) -> dict[str, torch.Tensor]:
        """The whole collection's layout as ``EmbeddingBagCollection`` keeps it in a state_dict."""
        return {name: torch.tensor(values, dtype=torch.int64) for name, values in (
            ("num_embeddings", self.layout.rows), ("capacities", self.layout.capacities), ("dims", self.layout.dims))}

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        for name, value in self._metadata().items():
            destination[prefix + name] = value

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        """Checks the layout a checkpoint records against this one; rows never come this way (a whole
        collection's are unexpected here: ``sharded_checkpoint.read_rows`` reads this rank's of them)."""
        mine = self._metadata()
        for name, value in mine.items():
            key = prefix + name
            if key not in state_dict:
                missing_keys.append(key)
            elif not torch.equal(state_dict[key].to(torch.int64).cpu(), value):
                error_msgs.append(f"{key}: the checkpoint has {state_dict[key].tolist()}, this model "
                                  f"{value.tolist()}")
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k[len(prefix):] not in mine)

    def _apply(self, fn, recurse=True):
        if self.local is not None:  # ``.to()`` and the like reach the shards, which are not a submodule
            self.local._apply(fn, recurse)
        return super()._apply(fn, recurse)

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


DRAW_BLOCK = 1 << 20  # values drawn at a time on a CPU by ``ShardedEmbeddings.draw_initial`` (4 MiB in fp32)


def _draw_rows(config: TableConfig, first: int, end: int, generator: torch.Generator,
               keep: list[tuple[Shard, torch.Tensor]]) -> None:
    """Rows ``[first, end)`` of a table's initial values, drawn from ``generator`` as one ``config.initialize``
    of all of them would draw them; the rows inside each kept shard copied to its (rows, dim) view.

    On a CPU, a uniform or normal draw of n values takes n values of the generator's stream (a normal one
    in blocks of 16, recomputing the last 16 from 16 more when n is not a multiple of 16), so blocks of a
    multiple of 16 values, the last one at least 16 long, give the whole draw's values."""
    count, dim = end - first, config.dim
    if count <= 0:
        return
    blocked = generator.device.type == "cpu" and config.init in ("uniform", "normal", "zeros")
    rows_per_block = max(16, -(-(DRAW_BLOCK // dim) // 16) * 16) if blocked else count
    bounds = list(range(0, count, rows_per_block))
    if len(bounds) > 1 and (count - bounds[-1]) * dim < 16:
        bounds.pop()  # the last block joins the one before: the whole draw's tail, recomputed, falls inside it
    bounds.append(count)
    for a, b in zip(bounds, bounds[1:], strict=False):
        block = torch.empty(b - a, dim, device=generator.device)
        config.initialize(block, generator)
        for shard, rows in keep:
            lo, hi = max(first + a, shard.lo), min(first + b, shard.hi)
            if lo < hi:
                rows[lo - shard.lo:hi - shard.lo].copy_(block[lo - first - a:hi - first - a])
