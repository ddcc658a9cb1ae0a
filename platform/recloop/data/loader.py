"""The training dataloader: parquet → big chunks on the device → shuffled buffer → contiguous batches.

Rows move in chunks (parquet row groups), never one by one: each chunk is decoded by Arrow, staged in
pinned host memory and copied to the device asynchronously on a side stream (on a GPU), while a
background thread prepares the next. ``shuffle_chunks`` chunks are concatenated and permuted on the
device; batches are then contiguous slices, already in the embedding kernels' layout::

    Batch.dense   (B, n_dense) float32        Batch.label (B,) float32
    Batch.values  (nnz,) int64                Batch.offsets (T*B + 1,) int64, table-major:
                  [cat_0 of all B rows][cat_1 ...]...[multi-hot_0 lists of all B rows]...

One-hot categorical columns give bags of length 1; multi-hot columns give their lists. Every row comes
exactly once per epoch; the order is a function of (seed, epoch); the last batch may be partial.
Works the same on a CPU (no pinned memory, no side stream).

Example::

    loader = ChunkLoader(files, schema, batch_size=8192, device="cuda", seed=0)
    for batch in loader.epoch(0):
        logits = model(batch.dense, batch.values, batch.offsets)
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch


@dataclass(frozen=True)
class FeatureSchema:
    """What the training rows hold (``features/schema.json`` written by the feature job)."""

    dense: tuple[str, ...]
    categorical: dict[str, int]  # column -> num_embeddings
    multi_hot: dict[str, int]
    label: str = "label"
    state_version: int = 0
    extra: tuple[str, ...] = ()  # columns carried along for evaluation (oracle, entity keys)

    @classmethod
    def load(cls, path: Path, extra: tuple[str, ...] = ()) -> FeatureSchema:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no feature schema at {path}: run `recloop features` first") from err
        return cls(dense=tuple(raw["dense"]),
                   categorical={k: v["num_embeddings"] for k, v in raw["categorical"].items()},
                   multi_hot={k: v["num_embeddings"] for k, v in raw["multi_hot"].items()},
                   label=raw.get("label", "label"), state_version=raw.get("state_version", 0), extra=extra)

    @property
    def tables(self) -> list[tuple[str, int]]:
        """(column, num_embeddings) in the order of the jagged layout: one-hot, then multi-hot."""
        return [*self.categorical.items(), *self.multi_hot.items()]


@dataclass
class Batch:
    dense: torch.Tensor
    label: torch.Tensor
    values: torch.Tensor
    offsets: torch.Tensor
    extra: dict[str, torch.Tensor] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.label.shape[0]


@dataclass
class _Chunk:
    """Rows on the device, columnar; multi-hot columns as (values, lengths)."""

    dense: torch.Tensor
    label: torch.Tensor
    categorical: torch.Tensor  # (N, n_cat)
    lists: list[tuple[torch.Tensor, torch.Tensor]]
    extra: dict[str, torch.Tensor]

    @property
    def rows(self) -> int:
        return self.label.shape[0]


class ChunkLoader:
    """Batches from training parquet files (see the module docstring).

    Args:
        files: parquet files of training rows.
        schema: which columns are dense, categorical and multi-hot.
        batch_size: rows per batch (the last one of an epoch may be smaller).
        device: where batches are delivered.
        seed: the order of an epoch is a function of (seed, epoch).
        shuffle: permute rows within a buffer of ``shuffle_chunks`` chunks (and the chunk order).
        shuffle_chunks: chunks mixed together before batching.
        prefetch: chunks read ahead by the background thread.
    """

    def __init__(self, files: list[Path], schema: FeatureSchema, batch_size: int, device: str | torch.device = "cpu",
                 seed: int = 0, shuffle: bool = True, shuffle_chunks: int = 16, prefetch: int = 2):
        if not files:
            raise ValueError("no training files: the window holds no rows")
        if batch_size < 1:
            raise ValueError("batch_size must be positive")
        self.files = [Path(f) for f in files]
        self.schema = schema
        self.batch_size = batch_size
        self.device = torch.device(device)
        self.seed = seed
        self.shuffle = shuffle
        self.shuffle_chunks = max(1, shuffle_chunks)
        self.prefetch = max(1, prefetch)
        self._pieces = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        self.num_rows = sum(pq.ParquetFile(f).metadata.num_rows for f in self.files)
        if self.num_rows == 0:
            raise ValueError("no training rows in the given files")

    # --- reading ------------------------------------------------------------------------------------------

    def _read(self, piece: tuple[Path, int]) -> dict[str, np.ndarray]:
        """One row group as host arrays (the only per-chunk work done on the CPU)."""
        path, group = piece
        schema = self.schema
        columns = [*schema.dense, schema.label, *schema.categorical, *schema.multi_hot, *schema.extra]
        table = pq.ParquetFile(path).read_row_group(group, columns=columns)
        host = {
            "dense": np.stack([table[c].to_numpy().astype(np.float32, copy=False) for c in schema.dense], axis=1)
            if schema.dense else np.zeros((table.num_rows, 0), np.float32),
            "label": table[schema.label].to_numpy().astype(np.float32, copy=False),
            "categorical": np.stack([table[c].to_numpy().astype(np.int64, copy=False) for c in schema.categorical],
                                    axis=1) if schema.categorical else np.zeros((table.num_rows, 0), np.int64),
        }
        for c in schema.multi_hot:
            lists = table[c].combine_chunks()
            host[f"values:{c}"] = pc.list_flatten(lists).to_numpy().astype(np.int64, copy=False)
            host[f"lengths:{c}"] = pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64)
        for c in schema.extra:
            host[f"extra:{c}"] = table[c].to_numpy(zero_copy_only=False)
        return host

    def _to_device(self, host: dict[str, np.ndarray], stream) -> _Chunk:
        cuda = self.device.type == "cuda"

        def move(array: np.ndarray) -> torch.Tensor:
            tensor = torch.from_numpy(np.require(array, requirements=["C", "W"]))
            if cuda:
                tensor = tensor.pin_memory()
                with torch.cuda.stream(stream):
                    return tensor.to(self.device, non_blocking=True)
            return tensor

        lists = [(move(host[f"values:{c}"]), move(host[f"lengths:{c}"])) for c in self.schema.multi_hot]
        extra = {c: move(np.asarray(host[f"extra:{c}"]).astype(np.float64 if host[f"extra:{c}"].dtype.kind == "f"
                                                               else np.int64)) for c in self.schema.extra}
        chunk = _Chunk(move(host["dense"]), move(host["label"]), move(host["categorical"]), lists, extra)
        if cuda:
            stream.synchronize()
        return chunk

    def _chunks(self, epoch: int) -> Iterator[_Chunk]:
        """Chunks in epoch order, read and moved by a background thread ``prefetch`` ahead."""
        order = list(range(len(self._pieces)))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(order)).tolist()
        stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        buffer: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for i in order:
                    if stop.is_set():
                        return
                    buffer.put(self._to_device(self._read(self._pieces[i]), stream))
                buffer.put(None)
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                buffer.put(err)

        worker = threading.Thread(target=produce, daemon=True)
        worker.start()
        try:
            while True:
                item = buffer.get()
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    buffer.get_nowait()
                except queue.Empty:
                    worker.join(timeout=0.05)

    # --- batching -----------------------------------------------------------------------------------------

    def epoch(self, epoch: int = 0, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of one epoch; ``skip_batches`` skips the first ones (to resume a run)."""
        generator = torch.Generator(device="cpu").manual_seed(int(np.random.default_rng([self.seed, epoch, 1])
                                                                  .integers(0, 2**62)))
        pending: list[_Chunk] = []
        produced = 0
        chunks = self._chunks(epoch)
        for chunk in chunks:
            pending.append(chunk)
            if len(pending) == self.shuffle_chunks:
                for batch in self._batches(_concat(pending), generator):
                    produced += 1
                    if produced > skip_batches:
                        yield batch
                pending = []
        if pending:
            for batch in self._batches(_concat(pending), generator):
                produced += 1
                if produced > skip_batches:
                    yield batch

    def _batches(self, chunk: _Chunk, generator: torch.Generator) -> Iterator[Batch]:
        if self.shuffle:
            chunk = _permute(chunk, torch.randperm(chunk.rows, generator=generator).to(self.device))
        list_offsets = [torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]) for _, lengths in chunk.lists]
        for start in range(0, chunk.rows, self.batch_size):
            end = min(start + self.batch_size, chunk.rows)
            yield self._assemble(chunk, start, end, list_offsets)

    def _assemble(self, chunk: _Chunk, start: int, end: int, list_offsets: list[torch.Tensor]) -> Batch:
        size = end - start
        categorical = chunk.categorical[start:end]
        parts = [categorical.t().reshape(-1)]
        lengths = [torch.ones(categorical.shape[1] * size, dtype=torch.int64, device=self.device)]
        for (values, list_lengths), offsets in zip(chunk.lists, list_offsets, strict=True):
            parts.append(values[offsets[start]:offsets[end]])
            lengths.append(list_lengths[start:end])
        all_lengths = torch.cat(lengths)
        offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)])
        return Batch(chunk.dense[start:end], chunk.label[start:end], torch.cat(parts), offsets,
                     {k: v[start:end] for k, v in chunk.extra.items()})


def _concat(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    lists = [(torch.cat([c.lists[i][0] for c in chunks]), torch.cat([c.lists[i][1] for c in chunks]))
             for i in range(len(chunks[0].lists))]
    return _Chunk(torch.cat([c.dense for c in chunks]), torch.cat([c.label for c in chunks]),
                  torch.cat([c.categorical for c in chunks]), lists,
                  {k: torch.cat([c.extra[k] for c in chunks]) for k in chunks[0].extra})


def _permute(chunk: _Chunk, perm: torch.Tensor) -> _Chunk:
    """Rows in ``perm`` order; jagged lists gathered without leaving the device."""
    lists = []
    for values, lengths in chunk.lists:
        starts = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)[:-1]])
        new_lengths = lengths[perm]
        total = int(new_lengths.sum())
        new_starts = torch.cat([new_lengths.new_zeros(1), new_lengths.cumsum(0)[:-1]])
        within = torch.arange(total, device=values.device) - torch.repeat_interleave(new_starts, new_lengths,
                                                                                      output_size=total)
        source = torch.repeat_interleave(starts[perm], new_lengths, output_size=total) + within
        lists.append((values[source], new_lengths))
    return _Chunk(chunk.dense[perm], chunk.label[perm], chunk.categorical[perm], lists,
                  {k: v[perm] for k, v in chunk.extra.items()})


def training_files(folder: Path, start: str | None = None, end: str | None = None) -> list[Path]:
    """Hourly training files (``YYYY-MM-DDTHH.parquet``) with ``start <= hour < end`` (ISO prefixes)."""
    files = sorted(Path(folder).glob("*.parquet"))
    return [f for f in files if (start is None or f.stem >= start[:13]) and (end is None or f.stem < end[:13])]


def rows_to_batch(rows: pa.Table, dense: Sequence[str], tables: Sequence[str]) -> Batch:
    """Feature rows → the kernels' jagged layout, straight from Arrow (one-hot ``c_*`` then ``m_*`` lists)."""
    size = rows.num_rows
    dense_values = torch.from_numpy(np.stack([rows[c].to_numpy() for c in dense], axis=1).astype(np.float32)) \
        if dense else torch.zeros(size, 0)
    parts, lengths = [], []
    for name in tables:
        if name.startswith("m_"):
            lists = rows[name].combine_chunks()
            parts.append(pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64))
            lengths.append(pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64))
        else:
            parts.append(rows[name].to_numpy().astype(np.int64))
            lengths.append(np.ones(size, dtype=np.int64))
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    offsets = np.concatenate([[0], np.cumsum(all_lengths)])
    values = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return Batch(dense_values, torch.zeros(size), torch.from_numpy(values), torch.from_numpy(offsets))
