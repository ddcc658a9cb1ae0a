"""Sharded tables in checkpoints through ``torch.distributed.checkpoint``: each rank writes its own shards.

Under several ranks a training checkpoint's tables are not gathered: every rank saves the rows it holds
(``ShardedEmbeddings``: whole tables and row ranges, with their optimizer state) with DCP's
``HuggingFaceStorageWriter(save_distributed=True)``, one safetensors file per rank whose header records
each chunk's offset in its table. Nothing is pickled (DCP's default ``FileSystemWriter`` writes a pickled
``.metadata``; this writer writes none: the reader finds every chunk from the safetensors headers)::

    step-0000400/tables/shard-00000-model-00001-of-00001.safetensors   rank 0's shards
    step-0000400/tables/shard-00001-model-00001-of-00001.safetensors   rank 1's shards

The completed checkpoint of a run trained by several ranks is written the same way (``recloop.train``): the
whole model is put together afterwards by the one process that validates and registers it
(``read_full_tables``, through ``checkpoint.load_weights``), never by a rank.

A table ``t`` is ``tables.<name>.<buffer>`` (``weight``, ``state1``, ``state2``: its rows of each) of
shape (rows, width): a row-wise table is a ``DTensor`` sharded on rows (``plan_sharding`` cuts rows as
``Shard(0)`` does), a table-wise one a plain tensor only its owner has. So a checkpoint loads into any
world size and any plan (``load_tables``: each rank reads only its own rows), or into one process's whole
collection (``read_full_tables``), and either equals the rows the ranks held bit for bit. ``read_rows``
reads a rank's rows of a checkpoint whose tables have grown since (a warm start), whole or sharded, through
``safetensors`` slices: no other row is read.

Example::

    save_tables(step_dir / "tables", model.embeddings)            # collective: every rank calls it
    load_tables(step_dir / "tables", model.embeddings)            # collective, any world size
    read_rows(champion_dir, model.embeddings, champion_rows)      # one rank, its rows of a whole checkpoint
    read_full_tables(step_dir / "tables", whole.embeddings)       # one process, no process group
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from recloop.model.sharded import ShardedEmbeddings, _state_views
from recloop_kernels import EmbeddingBagCollection
from recloop_kernels.config import Layout

BUFFERS = ("weight", "state1", "state2")
STEP = "tables.step"
SHARDING_INFO = "DCP_SHARDING_INFO"  # the header metadata where DCP records each chunk's offsets in its tensor
ELEMENT_BYTES = {"F32": 4, "F16": 2, "BF16": 2}  # a safetensors weight's dtype: rows are padded to 16 bytes of it
WHOLE_PREFIX = "sparse_arch.embeddings."  # a whole model's tables in its model.safetensors (RankingModel)


def _key(name: str, buffer: int) -> str:
    return f"tables.{name}.{BUFFERS[buffer]}"


def _mesh(device: torch.device):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (dist.get_world_size(),))


def _state(sharded: ShardedEmbeddings, copy: bool) -> tuple[dict[str, torch.Tensor], list]:
    """This rank's entries (tensors of its own rows: copies, or fresh ones to load into) and, per entry,
    the view of its collection it comes from or goes to."""
    from torch.distributed.tensor import DTensor, Shard

    local = sharded.local
    state: dict[str, torch.Tensor] = {}
    targets = []
    if local is None:
        return state, targets
    mesh = _mesh(local.weights.device) if any(s.row_wise for s in sharded.plan.ranks[sharded.rank]) else None
    for j, shard in enumerate(sharded.plan.ranks[sharded.rank]):
        for buffer, view in enumerate(_state_views(local, j)):
            rows = view[:shard.rows]
            tensor = rows.detach().clone() if copy else torch.empty_like(rows, memory_format=torch.contiguous_format)
            if shard.row_wise:
                width = rows.shape[1]
                tensor = DTensor.from_local(tensor, mesh, [Shard(0)], run_check=False,
                                            shape=torch.Size([sharded.table_rows[shard.table], width]),
                                            stride=(width, 1))
            state[_key(shard.name, buffer)] = tensor
            targets.append((_key(shard.name, buffer), rows))
    state[STEP] = local.step.detach().clone() if copy else torch.empty_like(local.step)
    targets.append((STEP, local.step))
    return state, targets


def save_tables(folder: Path, sharded: ShardedEmbeddings) -> None:
    """Every rank's shards into ``folder``, each rank writing its own file (collective)."""
    state, _ = _state(sharded, copy=True)
    dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(folder), save_distributed=True))


def load_tables(folder: Path, sharded: ShardedEmbeddings) -> None:
    """This rank's shards (of any plan, on any world size) read from ``folder`` (collective)."""
    from torch.distributed.tensor import DTensor

    state, targets = _state(sharded, copy=False)
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)))
    with torch.no_grad():
        for key, view in targets:
            value = state[key]
            view.copy_(value.to_local() if isinstance(value, DTensor) else value)


def read_full_tables(folder: Path, collection: EmbeddingBagCollection) -> None:
    """Every table of ``collection`` (one process, no process group) read from a sharded ``folder``."""
    state, targets = {}, []
    for t, config in enumerate(collection.tables):
        for buffer, view in enumerate(_state_views(collection, t)):
            rows = view[:collection.layout.rows[t]]
            state[_key(config.name, buffer)] = torch.empty_like(rows, memory_format=torch.contiguous_format)
            targets.append((_key(config.name, buffer), rows))
    state[STEP] = torch.empty_like(collection.step)
    targets.append((STEP, collection.step))
    with warnings.catch_warnings():  # "no process group: loading in a single process": what is meant here
        warnings.filterwarnings("ignore", message=".*single process.*", category=UserWarning)
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(folder)), no_dist=True)
    with torch.no_grad():
        for key, view in targets:
            view.copy_(state[key])


def recorded_capacities(folder: Path, prefix: str = WHOLE_PREFIX) -> tuple[int, ...]:
    """The tables' capacities a step folder's ``model.safetensors`` records (whole or sharded: both keep the
    collection's layout there), read alone."""
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return tuple(f.get_tensor(prefix + "capacities").tolist())


@torch.no_grad()
def read_rows(folder: Path, sharded: ShardedEmbeddings, source_rows: Sequence[int],
              prefix: str = WHOLE_PREFIX) -> None:
    """This rank's rows of a step folder's tables, and their step: the rows of table t below ``source_rows[t]``
    (the checkpoint's rows; a table grown since keeps its newer rows as they are). One process, no process
    group, and only those rows are read: slices of the whole collection's flat buffers in ``model.safetensors``
    (a single-process checkpoint; ``prefix``: its tables' keys), or of each rank's chunks in ``tables/``."""
    from safetensors import safe_open

    local, mine = sharded.local, sharded.plan.ranks[sharded.rank]
    if local is None:
        return
    tables = folder / "tables"  # (recloop.checkpoint.TABLES)
    device = str(local.weights.device)
    if tables.is_dir():
        for path in sorted(tables.glob("*.safetensors")):
            with safe_open(str(path), framework="pt", device=device) as f:
                chunks = json.loads((f.metadata() or {}).get(SHARDING_INFO, "{}"))
                for j, shard in enumerate(mine):
                    end = min(shard.hi, source_rows[shard.table])
                    for buffer, view in enumerate(_state_views(local, j)):
                        key = _key(shard.name, buffer)
                        if key not in chunks:
                            continue
                        first, piece = chunks[key]["saved_offsets"][0], f.get_slice(key)
                        lo, hi = max(shard.lo, first), min(end, first + piece.get_shape()[0])
                        if lo < hi:
                            view[lo - shard.lo:hi - shard.lo].copy_(piece[lo - first:hi - first])
                if STEP in chunks:
                    local.step.copy_(f.get_tensor(STEP))
        return
    with safe_open(str(folder / "model.safetensors"), framework="pt", device=device) as f:
        weights = f.get_slice(prefix + "weights")
        dims = tuple(f.get_tensor(prefix + "dims").tolist())
        capacities = tuple(f.get_tensor(prefix + "capacities").tolist())
        padded = Layout(dims, capacities, capacities, (0,) * len(dims), 16 // ELEMENT_BYTES[weights.get_dtype()])
        # a checkpoint written before rows were padded to 16 bytes holds them unpadded
        layout = padded if weights.get_shape()[0] == padded.total_elems else Layout(dims, capacities, capacities,
                                                                                    (0,) * len(dims), 1)
        sources = [weights, *(f.get_slice(prefix + name) for name in ("state1", "state2")
                              if f.get_slice(prefix + name).get_shape()[0])]
        for j, shard in enumerate(mine):
            t, count = shard.table, min(shard.hi, source_rows[shard.table]) - shard.lo
            if count <= 0:
                continue
            for view, source in zip(_state_views(local, j), sources, strict=True):
                if source.get_shape()[0] == layout.total_rows:  # one value per row (rowwise Adagrad)
                    first = layout.row_offsets[t] + shard.lo
                    view[:count].copy_(source[first:first + count].view(count, 1))
                else:
                    first, stride = layout.elem_offsets[t] + shard.lo * layout.strides[t], layout.strides[t]
                    view[:count].copy_(source[first:first + count * stride].view(count, stride)[:, :dims[t]])
        local.step.copy_(f.get_tensor(prefix + "step"))
