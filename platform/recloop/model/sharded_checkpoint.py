"""Sharded tables in checkpoints through ``torch.distributed.checkpoint``: each rank writes its own shards.

Under several ranks a training checkpoint's tables are not gathered: every rank saves the rows it holds
(``ShardedEmbeddings``: whole tables and row ranges, with their optimizer state) with DCP's
``HuggingFaceStorageWriter(save_distributed=True)``, one safetensors file per rank whose header records
each chunk's offset in its table. Nothing is pickled (DCP's default ``FileSystemWriter`` writes a pickled
``.metadata``; this writer writes none: the reader finds every chunk from the safetensors headers)::

    step-0000400/tables/shard-00000-model-00001-of-00001.safetensors   rank 0's shards
    step-0000400/tables/shard-00001-model-00001-of-00001.safetensors   rank 1's shards

A table ``t`` is ``tables.<name>.<buffer>`` (``weight``, ``state1``, ``state2``: its rows of each) of
shape (rows, width): a row-wise table is a ``DTensor`` sharded on rows (``plan_sharding`` cuts rows as
``Shard(0)`` does), a table-wise one a plain tensor only its owner has. So a checkpoint loads into any
world size and any plan (``load_tables``: each rank reads only its own rows), or into one process's whole
collection (``read_full_tables``), and either equals the gathered tables bit for bit.

Example::

    save_tables(step_dir / "tables", trained.module.sparse)       # collective: every rank calls it
    load_tables(step_dir / "tables", resumed.module.sparse)       # collective, any world size
    read_full_tables(step_dir / "tables", model.embeddings)       # one process, no process group
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

from recloop.model.sharded import ShardedEmbeddings, _state_views
from recloop_kernels import EmbeddingBagCollection

BUFFERS = ("weight", "state1", "state2")
STEP = "tables.step"


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
