"""Sharded tables without a whole copy anywhere: a rank allocates and draws only its rows (the same values as
the whole collection's), reads only its rows of a checkpoint (whole or sharded), and on 2 real gloo processes
each rank writes only its own shards through torch.distributed.checkpoint (safetensors, no pickle); the
tables read back (on one process, or resharded on two with another plan) equal the rows the ranks held bit
for bit."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from recloop.model.sharded import ShardedEmbeddings, _state_views, grown_layout, plan_sharding
from recloop.model.sharded_checkpoint import load_tables, read_full_tables, read_rows, save_tables
from recloop_kernels import EmbeddingBagCollection, TableConfig

TABLES = [TableConfig("user", 37, 8), TableConfig("item", 23, 8, pooling="mean"), TableConfig("device", 5, 4),
          TableConfig("country", 3, 4)]


def _collection(seed: int, tables=TABLES) -> EmbeddingBagCollection:
    return EmbeddingBagCollection(tables, optimizer="rowwise_adagrad", seed=seed, backend="reference")


def _tables(collection: EmbeddingBagCollection) -> dict[str, torch.Tensor]:
    return {f"{c.name}.{b}": view[:collection.layout.rows[t]].clone()
            for t, c in enumerate(collection.tables) for b, view in enumerate(_state_views(collection, t))}


def _held(sharded: ShardedEmbeddings) -> dict[str, torch.Tensor]:
    """This rank's rows of each table and buffer, keyed by where they sit in the whole table."""
    return {f"{s.name}.{b}.{s.lo}": view[:s.rows].clone() for j, s in enumerate(sharded.plan.ranks[sharded.rank])
            for b, view in enumerate(_state_views(sharded.local, j))}


def _assembled(files: list[Path], rows: dict[str, int]) -> dict[str, torch.Tensor]:
    """Every rank's ``_held`` rows put in place: what gathering them to one process would give."""
    whole: dict[str, torch.Tensor] = {}
    for path in files:
        for key, held in load_file(path).items():
            name, buffer, lo = key.split(".")
            table = whole.setdefault(f"{name}.{buffer}", torch.full((rows[name], held.shape[1]), float("nan")))
            table[int(lo):int(lo) + held.shape[0]] = held
    return whole


def _rank(rank: int, world: int, init: str, folder: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        full = _collection(seed=1)
        # user and item row-wise (one range per rank), device and country whole on one rank each
        sharded = ShardedEmbeddings.from_collection(full, plan_sharding(full, world, row_wise_above=10), rank)
        with torch.no_grad():  # as after training: every shard's rows and optimizer state moved, per rank
            generator = torch.Generator().manual_seed(100 + rank)
            for j in range(len(sharded.plan.ranks[rank])):
                for view in _state_views(sharded.local, j):
                    view.add_(torch.rand(view.shape, generator=generator))
            sharded.local.step.fill_(7)
        save_tables(Path(folder) / "tables", sharded)
        save_file(_held(sharded), str(Path(folder) / f"held-{rank}.safetensors"))
        # resharded: another plan (every table row-wise), into tables that start elsewhere (another seed)
        other = _collection(seed=2)
        resharded = ShardedEmbeddings.from_collection(other, plan_sharding(other, world, row_wise_above=0), rank)
        load_tables(Path(folder) / "tables", resharded)
        save_file(_held(resharded), str(Path(folder) / f"resharded-{rank}.safetensors"))
    finally:
        dist.destroy_process_group()


def test_each_rank_writes_its_shards_and_any_layout_reads_the_rows_the_ranks_held(tmp_path: Path):
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    # spawned, as torchrun starts its ranks: a fork of a test worker that has run servers and Prefect's threads
    # before inherits their locks (one rank exited 1 with no trace in a full suite run)
    mp.start_processes(_rank, args=(2, f"file://{tmp_path / 'rendezvous'}", str(tmp_path)), nprocs=2, join=True,
                       start_method="spawn")
    rows = {c.name: c.num_embeddings for c in TABLES}
    held = _assembled(sorted(tmp_path.glob("held-*.safetensors")), rows)
    assert not any(t.isnan().any() for t in held.values())  # the ranks' rows cover every table

    files = sorted(p.name for p in (tmp_path / "tables").iterdir())
    assert files == ["shard-00001-model-00001-of-00001.safetensors", "shard-00002-model-00001-of-00001.safetensors"]
    per_file = []
    for name in files:  # no rank wrote every table: each file holds its rank's rows only
        with safe_open(str(tmp_path / "tables" / name), framework="pt") as f:
            offsets = json.loads(f.metadata()["DCP_SHARDING_INFO"])
            names = list(f.keys())  # a safetensors handle is not a mapping: it names its tensors by keys()
            per_file.append({k: f.get_slice(k).get_shape()[0] for k in names if k.endswith(".weight")})
            assert set(offsets) == set(names)
        assert sum(per_file[-1].values()) < sum(rows.values())
    assert {k: sum(h.get(k, 0) for h in per_file) for k in per_file[0].keys() | per_file[1].keys()} == \
        {f"tables.{n}.weight": r for n, r in rows.items()}

    one = _collection(seed=3)  # one process, no process group: the whole tables
    read_full_tables(tmp_path / "tables", one)
    assert int(one.step) == 7
    resharded = _assembled(sorted(tmp_path.glob("resharded-*.safetensors")), rows)
    for source in (_tables(one), resharded):
        assert source.keys() == held.keys()
        for key, tensor in held.items():
            assert torch.equal(source[key], tensor), key
    assert not torch.equal(_tables(_collection(seed=3))["user.0"], held["user.0"])  # it moved

    # a rank of another world reads its rows of the sharded checkpoint alone (safetensors slices, no DCP)
    full = _collection(seed=5)
    for rank in range(3):
        mine = ShardedEmbeddings.from_collection(full, plan_sharding(full, 3, row_wise_above=0), rank)
        read_rows(tmp_path, mine, [c.num_embeddings for c in TABLES])
        assert int(mine.local.step) == 7
        for key, rows_held in _held(mine).items():
            name, buffer, lo = key.split(".")
            assert torch.equal(rows_held, held[f"{name}.{buffer}"][int(lo):int(lo) + rows_held.shape[0]]), key


GROWN = [TableConfig("user", 5000, 8), TableConfig("item", 700, 16, pooling="mean", init="normal"),
         TableConfig("device", 5, 4), TableConfig("country", 3, 4, init="normal")]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_a_rank_draws_and_reads_only_its_rows_of_what_the_whole_collection_holds(world: int, tmp_path: Path):
    """Each rank allocates its plan's share of the rows and nothing more, and its rows are the whole collection's
    bit for bit: a new collection's initial values (grown since: the new rows drawn after, as ``grow`` draws
    them), or a whole checkpoint's rows read through slices (only rows the checkpoint has; the grown ones kept)."""
    whole = _collection(seed=4, tables=GROWN)
    whole.grow("user", 7000)  # past its capacity: reallocated, capacity 7500
    whole.grow("country", 9)
    now = [TableConfig(c.name, r, c.dim, c.pooling, c.init) for c, r in zip(GROWN, whole.layout.rows, strict=True)]
    layout = grown_layout(_collection(seed=0, tables=GROWN).layout, whole.layout.rows)
    assert layout == whole.layout  # the capacities a rank records without holding the rows
    plan = plan_sharding(now, world, row_wise_above=100 if world > 1 else None)
    with torch.no_grad():
        trained = _collection(seed=9, tables=GROWN)  # a checkpoint of the tables before they grew, trained
        for buffer in (trained.weights, trained.state1):
            buffer.add_(torch.rand(buffer.shape, generator=torch.Generator().manual_seed(3)))
        trained.step.fill_(11)
    save_file({f"sparse_arch.embeddings.{k}": v.contiguous() for k, v in trained.state_dict().items()},
              str(tmp_path / "model.safetensors"))

    rows_held = 0
    for rank in range(world):
        drawn = ShardedEmbeddings(now, plan, rank, whole.optimizer, layout=layout)
        drawn.draw_initial(4, GROWN, [(0, 5000, 7000), (3, 3, 9)])
        reference = ShardedEmbeddings.from_collection(whole, plan, rank)
        shards = plan.ranks[rank]
        assert drawn.local.weights.numel() == sum(s.rows * -(-s.dim // 4) * 4 for s in shards)  # its rows only
        rows_held += sum(s.rows for s in shards)
        assert drawn.held_bytes() < whole.weights.numel() * 4 or world == 1
        for j, shard in enumerate(shards):
            assert torch.equal(_state_views(drawn.local, j)[0][:shard.rows],
                               _state_views(reference.local, j)[0][:shard.rows]), (rank, shard)

        read_rows(tmp_path, drawn, [5000, 700, 5, 3])  # the checkpoint's rows over the drawn ones
        assert int(drawn.local.step) == 11
        for j, shard in enumerate(shards):
            before = min(shard.hi, GROWN[shard.table].num_embeddings) - shard.lo  # rows the checkpoint has
            for got, source, initial in zip(_state_views(drawn.local, j), _state_views(trained, shard.table),
                                            _state_views(reference.local, j), strict=True):
                assert torch.equal(got[:max(before, 0)], source[shard.lo:shard.lo + max(before, 0)])
                assert torch.equal(got[max(before, 0):shard.rows], initial[max(before, 0):shard.rows])
    assert rows_held == sum(whole.layout.rows)  # every row once, over the ranks
    assert ShardedEmbeddings(now, plan, 0, whole.optimizer, layout=layout).whole_bytes() == \
        sum(b.numel() * 4 for b in (whole.weights, whole.state1))
