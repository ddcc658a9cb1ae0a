"""Training on several processes: the process group, who reads which rows, and the sharded training loop.

Under ``torchrun`` (``recloop train --nproc N``, or ``torchrun --nproc-per-node N -m recloop.cli train ...``)
``recloop.train`` finds ``WORLD_SIZE`` and ``RANK`` in its environment and:

- joins the process group (``gloo`` on CPUs, ``nccl`` on GPUs, one GPU per local rank);
- splits the training rows into ``data_shards`` shards of parquet row groups, balanced by rows (one
  shard per process by default); each rank reads only its shards' row groups, each shard in its own
  seeded order. A step's global batch is every shard's next ``batch_size / data_shards`` rows, in shard
  order, and an epoch ends when the first shard runs out (the rows the others have left, at most about
  one row group each after balancing, are skipped that epoch);
- builds its model with only its shards of the embedding tables (``rank_model``, ``model.sharded``): its
  rows of the initial values, or of the checkpoint it starts from, and no others; the dense layers are
  whole on every rank and run under DistributedDataParallel; the loss is the mean over the global batch,
  so a step is the same as one process's step on the concatenated batch;
- writes every checkpoint, the last one too, with each rank's table rows in a file of its own
  (``model.sharded_checkpoint``; rank 0 writes the rest). No rank ever holds every table: the whole model
  is put together afterwards by the one process that validates and registers it (``recloop.train.complete``;
  ``recloop train --nproc N`` is that process for the ranks it launched).

One process with ``data_shards=2`` reads the same shards and builds the same global batches as two ranks:
that is the reference the equivalence test compares a 2-rank run with.

Example::

    torchrun --standalone --nproc-per-node 2 -m recloop.cli train --mode full --device cpu --no-track
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from recloop.data import ChunkLoader, FeatureSchema
from recloop.data.loader import Batch

if TYPE_CHECKING:
    from recloop.model import ModelConfig, RankingModel


@dataclass(frozen=True)
class Ranks:
    """This process's place: ``rank`` of ``world`` (``local_rank`` on its machine); world 1 alone."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def leader(self) -> bool:
        return self.rank == 0


def join(device: str) -> tuple[Ranks, bool]:
    """Join the process group ``torchrun`` describes in the environment (no-op outside it).

    Returns the ranks and whether this call started the group (the caller then ends it with ``leave``).
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return Ranks(), False
    ranks = Ranks(int(os.environ["RANK"]), world, int(os.environ.get("LOCAL_RANK", "0")))
    if dist.is_initialized():
        return ranks, False
    cuda = device != "cpu" and torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(ranks.local_rank)
    dist.init_process_group("nccl" if cuda else "gloo")
    return ranks, True


def leave(started: bool) -> None:
    if started and dist.is_initialized():
        dist.destroy_process_group()


def device_for(name: str, ranks: Ranks) -> torch.device:
    """``auto``/``cuda`` is this rank's GPU under torchrun; ``cpu`` stays the CPU."""
    if name == "cpu" or (name == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    return torch.device("cuda", ranks.local_rank) if ranks.world > 1 else torch.device("cuda")


# --- who reads which rows -----------------------------------------------------------------------------------


def shard_row_groups(files: list[Path], shards: int) -> list[list[tuple[Path, int]]]:
    """Row groups (file, index) split into ``shards`` sets of near-equal rows: largest first, each to the
    lightest shard so far (ties to the lowest shard). Deterministic, so every rank computes the same split."""
    groups = []
    for f in files:
        metadata = pq.ParquetFile(f).metadata
        groups += [((Path(f), g), metadata.row_group(g).num_rows) for g in range(metadata.num_row_groups)]
    out: list[list[tuple[Path, int]]] = [[] for _ in range(shards)]
    rows = [0] * shards
    for position, (piece, count) in sorted(enumerate(groups), key=lambda x: (-x[1][1], x[0])):
        target = min(range(shards), key=lambda s: (rows[s], s))
        out[target].append((position, piece))
        rows[target] += count
    return [[piece for _, piece in sorted(shard)] for shard in out]


class ShardLoader(ChunkLoader):
    """A ``ChunkLoader`` over some row groups of the files (one data shard)."""

    def __init__(self, pieces: list[tuple[Path, int]], schema: FeatureSchema, batch_size: int, *, seed: int,
                 device: torch.device):
        if not pieces:
            raise ValueError("a data shard without row groups: fewer row groups than data_shards")
        files = sorted({p for p, _ in pieces})
        super().__init__(files, schema, batch_size, device=device, seed=seed)
        self._pieces = list(pieces)
        # the row groups' sizes, which size each group's shuffle (``_group_sizes``): the shard's own
        self._piece_rows = [pq.ParquetFile(p).metadata.row_group(g).num_rows for p, g in self._pieces]
        self.num_rows = sum(self._piece_rows)


def concat_batches(batches: list[Batch], num_tables: int) -> Batch:
    """Batches of the kernels' table-major jagged layout joined row-wise (rows of the first, then the next)."""
    if len(batches) == 1:
        return batches[0]
    lengths = [(b.offsets[1:] - b.offsets[:-1]).view(num_tables, b.size) for b in batches]
    starts = [b.offsets[:: b.size].tolist() for b in batches]
    values = torch.cat([b.values[s[t]:s[t + 1]] for t in range(num_tables) for b, s in zip(batches, starts,
                                                                                             strict=True)])
    all_lengths = torch.cat([lengths[k][t] for t in range(num_tables) for k in range(len(batches))])
    offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)])
    extra = {k: torch.cat([b.extra[k] for b in batches]) for k in batches[0].extra}
    return Batch(torch.cat([b.dense for b in batches]), torch.cat([b.label for b in batches]), values, offsets, extra)


# --- the loop ----------------------------------------------------------------------------------------------


def rank_model(config: ModelConfig, n_dense: int, tables: list[tuple[str, int]], device: torch.device, seed: int,
               ranks: Ranks, row_wise_above: int | None, *, start: list[tuple[str, int]] | None = None,
               source: Path | None = None, resumed: bool = False) -> RankingModel:
    """The model this rank trains: the dense arches whole, as ``RankingModel(config, n_dense, tables, seed=seed)``
    makes them, and of the tables only this rank's shards of ``plan_sharding``: no table is allocated whole.

    Args:
        tables: (name, rows) of the tables now. start: their rows in ``source`` (tables grow for new ids at a
            warm start; default: ``tables``). The new rows, or all of them without a source, start as one
            process's ``RankingModel`` (grown from ``start``) would have them (``ShardedEmbeddings.draw_initial``).
        source: the step folder to start from (a single-process checkpoint or a sharded one); None: new.
        resumed: ``source`` is this run's own checkpoint: its sharded tables are read through DCP (``load_tables``,
            collective), any other source's rows through slices of its files (``read_rows``).
    """
    from recloop import checkpoint
    from recloop.model import RankingModel
    from recloop.model.ranking import table_configs
    from recloop.model.sharded import ShardedEmbeddings, grown_layout, plan_sharding
    from recloop.model.sharded_checkpoint import load_tables, read_rows, recorded_capacities
    from recloop_kernels import OptimizerConfig
    from recloop_kernels.config import POOLING_CODES, Layout, alignment

    start = start or tables
    before, now = table_configs(start, config), table_configs(tables, config)
    rows = tuple(r for _, r in start)
    capacities = recorded_capacities(source) if source is not None else rows
    layout = grown_layout(Layout(tuple(c.dim for c in now), capacities, rows,
                                 tuple(POOLING_CODES[c.pooling] for c in now), alignment(torch.float32)),
                          [r for _, r in tables])
    sparse = ShardedEmbeddings(now, plan_sharding(now, ranks.world, row_wise_above), ranks.rank,
                               OptimizerConfig(config.embedding_optimizer, lr=config.embedding_lr), layout=layout,
                               device=device)
    growth = [(t, old, new) for t, ((_, old), (_, new)) in enumerate(zip(start, tables, strict=True)) if new > old]
    if source is None or growth:
        sparse.draw_initial(seed, before, growth)
    model = RankingModel(config, n_dense, tables, device=device, seed=seed, embeddings=sparse)
    if source is not None:
        checkpoint.load_dense_weights(model, source, device)
        if resumed and not growth and (source / checkpoint.TABLES).is_dir():
            load_tables(source / checkpoint.TABLES, sparse)  # each rank its own rows, whatever plan wrote them
        else:
            read_rows(source, sparse, rows)
    return model


def wrap(model: RankingModel, ranks: Ranks) -> torch.nn.Module:
    """The model a rank trains: the whole model alone, else ``rank_model``'s under DDP over the dense arches."""
    if ranks.world == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    device_ids = [ranks.local_rank] if next(model.parameters()).is_cuda else None
    with warnings.catch_warnings():
        # The shards are rank-local: they must never be broadcast, not even at construction, which only
        # broadcast_buffers=False guarantees (its replacement still syncs buffers at init).
        warnings.filterwarnings("ignore", message=".*broadcast_buffers.*", category=FutureWarning)
        return DistributedDataParallel(model, device_ids=device_ids, broadcast_buffers=False)


def held_tables(model: RankingModel, ranks: Ranks) -> dict:
    """What each rank holds of the tables (collective): bytes of rows and optimizer state per rank, and what the
    whole tables take (one process's model), for the checkpoint's JSON and the benchmarks."""
    sparse = model.embeddings
    held = torch.tensor([sparse.held_bytes()], dtype=torch.int64, device=next(model.parameters()).device)
    every = [torch.zeros_like(held) for _ in range(ranks.world)]
    dist.all_gather(every, held)
    return {"world": ranks.world, "rank_bytes": [int(b) for b in every], "whole_bytes": sparse.whole_bytes()}


def fit(trained: torch.nn.Module, optimizer: torch.optim.Optimizer, loaders: list[ShardLoader], num_tables: int,
        epochs: int, ranks: Ranks, lr: Callable[[int], float], position: dict, save: Callable[[bool], object],
        checkpoint_every: int, on_progress: Callable[[int, int, float], None] | None = None,
        on_step: Callable[[int], None] | None = None,
        on_figures: Callable[[int, dict[str, float]], None] | None = None) -> list[list[float]]:
    """The training loop over this rank's data shards from ``position`` (updated in place) to the last epoch.

    Args:
        trained: ``wrap``'s model. loaders: this rank's shards, in shard order.
        lr: the dense learning rate for a step number (warm-up, batch scaling).
        save: writes a checkpoint (collective under several ranks: every rank calls it).
        on_figures: ``(step, figures)`` on rank 0: each loss reading, each epoch's end (the run's tracker).
    Returns:
        The loss curve, ``[step, mean loss of the global batch]`` every 10 steps.
    """
    from recloop.model.sharded import ShardedEmbeddings

    # bad ids are checked (collectively) before each checkpoint and at the end: a run that met any saves none
    check_ids = [m.raise_id_errors for m in trained.modules() if isinstance(m, ShardedEmbeddings)]
    loss_fn = torch.nn.BCEWithLogitsLoss(reduction="sum")
    device = loaders[0].device
    total = sum(loader.num_rows for loader in loaders) * epochs * ranks.world
    started, first_samples = time.perf_counter(), position["samples"]
    curve: list[list[float]] = []
    trained.train()
    for epoch in range(position["epoch"], epochs):
        skip = position["batch"] if epoch == position["epoch"] else 0
        streams: list[Iterator[Batch]] = [loader.epoch(epoch, skip_batches=skip) for loader in loaders]
        batch_index = skip
        while True:
            batches = [next(stream, None) for stream in streams]
            present = all(b is not None for b in batches)
            figures = torch.tensor([sum(b.size for b in batches if b is not None), int(present)], dtype=torch.float64,
                                   device=device)
            if ranks.world > 1:
                dist.all_reduce(figures)  # rows of the global batch, and how many ranks still have a batch
            if figures[1].item() < ranks.world:
                break
            global_rows = figures[0].item()
            batch = concat_batches(batches, num_tables)
            for group in optimizer.param_groups:
                group["lr"] = lr(position["step"])
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = trained(batch.dense, batch.values, batch.offsets)
            # The sum over this rank's rows / global rows, times world: DDP's average over ranks then makes
            # the gradient that of the mean over the global batch (the sparse exchange divides by world).
            loss = loss_fn(logits.float(), batch.label) * (ranks.world / global_rows)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            batch_index += 1
            position.update(step=position["step"] + 1, epoch=epoch, batch=batch_index,
                            samples=position["samples"] + int(global_rows))
            if position["step"] % checkpoint_every == 0:
                for check in check_ids:
                    check()
                save(False)
            if position["step"] % 10 == 0:
                mean = loss.detach().double() / ranks.world
                if ranks.world > 1:
                    dist.all_reduce(mean)
                curve.append([position["step"], float(mean)])
                if on_figures and ranks.leader:
                    on_figures(position["step"], {"train_loss": curve[-1][1]})
                if on_progress and ranks.leader:
                    on_progress(position["samples"], total, (position["samples"] - first_samples)
                                / (time.perf_counter() - started))
            if on_step:
                on_step(position["step"])
        for stream in streams:
            stream.close()  # stops the shards' reader threads
        position.update(epoch=epoch + 1, batch=0)
        if on_figures and ranks.leader:
            on_figures(position["step"], {"epoch": epoch + 1, "samples_per_s": round(
                (position["samples"] - first_samples) / max(time.perf_counter() - started, 1e-9), 1)})
    for check in check_ids:
        check()
    return curve


def share_summary(summary: dict | None, ranks: Ranks) -> dict:
    """Rank 0's training summary, on every rank (collective)."""
    box = [summary]
    dist.broadcast_object_list(box, src=0)
    return box[0]
