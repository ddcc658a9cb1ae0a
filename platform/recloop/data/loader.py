"""The training dataloader: parquet → big chunks on the device → shuffled buffer → contiguous batches.

Rows move in chunks (parquet row groups), never one by one. Several threads decode row groups with
Arrow (which releases the GIL) a few chunks ahead and, on a GPU, write each column straight into pinned
host memory (a ring of reused buffers, column-major: one contiguous copy per column, made without the
GIL). One thread copies each chunk to the device asynchronously on a side stream, transposes it to rows
there, and hands it over with a CUDA event: the consumer's stream waits for the copy, the host never
does, and the chunk's memory is recorded on the consumer's stream so the allocator cannot reuse it too
early.
``shuffle_chunks`` chunks are concatenated and permuted on the device; batches are then contiguous
slices, already in the embedding kernels' layout::

    Batch.dense   (B, n_dense) float32        Batch.label (B,) float32
    Batch.values  (nnz,) int64                Batch.offsets (T*B + 1,) int64, table-major:
                  [cat_0 of all B rows][cat_1 ...]...[multi-hot_0 lists of all B rows]...

One-hot categorical columns give bags of length 1; multi-hot columns give their lists. Every row comes
exactly once per epoch; the order is a function of (seed, epoch); the last batch may be partial. List
lengths stay on the host as well, so every slice bound is a Python int: assembling a batch never waits
for the GPU. With ``pad_values_to`` the values are padded (zeros past ``offsets[-1]``, which the kernels
ignore) to a multiple of it, so that batches repeat a few shapes (CUDA graphs). Works the same on a
CPU (no pinned memory, no side stream).

Example::

    loader = ChunkLoader(files, schema, batch_size=16384, device="cuda", seed=0)
    for batch in loader.epoch(0):
        logits = model(batch.dense, batch.values, batch.offsets)
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

# How an epoch's rows become batches. A mid-epoch checkpoint records it with its batch count, which names the
# same rows only under the same plan. 1: a group of ``shuffle_chunks`` chunks ended in a smaller batch; 2 (since
# 2026-11-26): a group's rows past its last full batch join the next group, every batch full but an epoch's last.
BATCH_PLAN = 2


@dataclass(frozen=True)
class FeatureSchema:
    """What the training rows hold (``features/schema.json`` written by the feature job)."""

    dense: tuple[str, ...]
    categorical: dict[str, int]  # column -> num_embeddings
    multi_hot: dict[str, int]
    label: str = "label"
    state_version: int = 0
    extra: tuple[str, ...] = ()  # columns carried along for evaluation (oracle, entity keys)
    hashed: tuple[str, ...] = ()  # tables of hashed ids (and crosses): their rows are buckets, not a vocabulary
    budgets: tuple[tuple[str, int], ...] = ()  # (table, max_rows): tables keyed by id under a row budget

    @classmethod
    def load(cls, path: Path, extra: tuple[str, ...] = ()) -> FeatureSchema:
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError as err:
            raise FileNotFoundError(f"no feature schema at {path}: run `recloop features` first") from err
        return cls(dense=tuple(raw["dense"]),
                   categorical={k: v["num_embeddings"] for k, v in raw["categorical"].items()},
                   multi_hot={k: v["num_embeddings"] for k, v in raw["multi_hot"].items()},
                   label=raw.get("label", "label"), state_version=raw.get("state_version", 0), extra=extra,
                   hashed=tuple(k for k, v in raw["categorical"].items() if v.get("hashed")),
                   budgets=tuple((k, int(v["max_rows"])) for k, v in raw["categorical"].items() if v.get("max_rows")))

    @property
    def tables(self) -> list[tuple[str, int]]:
        """(column, num_embeddings) in the order of the jagged layout: one-hot, then multi-hot."""
        return [*self.categorical.items(), *self.multi_hot.items()]


# Ids per batch are padded to a multiple of this on a GPU (``ChunkLoader``'s default with multi-hot columns): few
# shapes, so that a compiled training step replays a few CUDA graphs instead of recording one per batch.
VALUES_BUCKET = 1 << 14


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
class LoaderStats:
    """Where an epoch's time went, by stage (seconds; thread times add up across threads).

    Read against ``epoch_s``: a consumer that waited most of the epoch (``consumer_wait_s``) had a slow
    producer; a producer that waited for decoded chunks (``decode_wait_s``) had too few or slow decoding
    threads (``decode_s`` is their busy time, summed, so it can exceed the epoch); a producer blocked handing
    chunks over (``handover_wait_s``) had a slow consumer. All are host times: on a GPU, ``move_s`` and
    ``batching_s`` are the time to issue copies and kernels, not the device's time to run them."""

    epoch_s: float = 0.0
    chunks: int = 0
    rows: int = 0
    decode_s: float = 0.0  # decoding threads: parquet row group → host arrays or staging slot (sum over threads)
    slot_wait_s: float = 0.0  # producer: waiting for a staging slot's last copies to finish
    decode_wait_s: float = 0.0  # producer: waiting for the next chunk in epoch order to be decoded
    move_s: float = 0.0  # producer: issuing the chunk's copies to the device (and transposes)
    handover_wait_s: float = 0.0  # producer: waiting for room in the prefetch queue
    consumer_wait_s: float = 0.0  # consumer: waiting for the next chunk
    shuffle_s: float = 0.0  # the shuffling thread: drawing (and pinning) each group's permutation
    shuffle_wait_s: float = 0.0  # consumer: waiting for the next group's permutation
    batching_s: float = 0.0  # consumer: concatenating, permuting and slicing groups into batches

    def as_dict(self) -> dict[str, float | int]:
        return dict(self.__dict__)


@dataclass
class _Chunk:
    """Rows on the device, columnar; multi-hot columns as (values, lengths) with the lengths on the host too."""

    dense: torch.Tensor
    label: torch.Tensor
    categorical: torch.Tensor  # (N, n_cat)
    lists: list[tuple[torch.Tensor, torch.Tensor]]
    host_lengths: list[np.ndarray]
    extra: dict[str, torch.Tensor]

    @property
    def rows(self) -> int:
        return self.label.shape[0]


class _Staging:
    """A ring of host buffers that decoding threads write chunks into, reused chunk after chunk.

    On a GPU the buffers are pinned (pinning memory is slow; reusing it is free) and a slot is rewritten
    only after the copies that read it last time have finished (its event). Each chunk takes a slot, in
    epoch order, before its decoding starts; the ring has more slots than chunks can be under way at once
    (``ChunkLoader._chunks``), so no slot is taken while a thread still writes it.
    """

    def __init__(self, slots: int, pinned: bool):
        self._buffers: list[dict[str, torch.Tensor]] = [{} for _ in range(slots)]
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._busy = [False] * slots
        self._pinned = pinned
        self._next = 0

    def take(self) -> int:
        slot, self._next = self._next, (self._next + 1) % len(self._buffers)
        if self._busy[slot]:
            raise RuntimeError("loader staging ring too small: a slot is still being filled")
        event = self._events[slot]
        while event is not None and not event.query():  # this (producer) thread waits, never the training
            time.sleep(1e-4)  # loop; polling rather than synchronizing keeps the wait out of CUDA's sync checks
        self._busy[slot] = True
        return slot

    def buffer(self, slot: int, name: str, shape: tuple[int, ...], dtype: np.dtype) -> torch.Tensor:
        """Slot ``slot``'s buffer ``name`` viewed as ``shape`` and ``dtype`` (grown when too small); only the
        thread that holds the slot calls this."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape)) * dtype.itemsize
        buffer = self._buffers[slot].get(name)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(max(nbytes, 1 << 16) * 5 // 4, dtype=torch.uint8, pin_memory=self._pinned)
            self._buffers[slot][name] = buffer
        return buffer[:nbytes].view(torch.from_numpy(np.empty(0, dtype)).dtype).view(shape)

    def done(self, slot: int, event: torch.cuda.Event | None) -> None:
        self._events[slot] = event
        self._busy[slot] = False


# Ids are staged and copied to the device as they are on disk, int32 where the writer could (training files
# hold int32 ids: ``recloop.formats.id_dtype``), and widened to the kernels' int64 on the device.
_WIDE = {torch.int32: torch.int64}


def _id_dtype(types) -> type:
    """How a chunk's ids are staged: int32 when every column's on-disk type fits in it, else int64."""
    return np.int32 if all(pa.types.is_integer(t) and t.bit_width <= 32 and not (
        pa.types.is_unsigned_integer(t) and t.bit_width == 32) for t in types) else np.int64


@dataclass
class _Staged:
    """A chunk decoded into a staging slot: column-major dense and categorical blocks, lists, extras."""

    slot: int
    tensors: dict[str, torch.Tensor]  # views of the slot's buffers
    host_lengths: list[np.ndarray]  # multi-hot list lengths, also kept on the host (own memory)


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
        prefetch: chunks moved to the device ahead of the consumer.
        workers: threads decoding parquet row groups (default: up to 8, one per two cores).
        arrow_threads: each row group's columns are decoded in parallel on Arrow's own thread pool (one thread
            a core, shared by the workers); off, each worker decodes its row group alone. Default: off where
            4 or more workers already keep the cores busy (8 workers would each fan out onto 16 Arrow threads
            on a 16-core host; H100 machine, 2026-11-26, median of 3 epochs: 26.2M rows/s off, 27.0M on, the
            same within the spread), on where fewer do (one worker on 2 cores).
        pad_values_to: pad each batch's values to a multiple of this (None: no padding). Default ``"auto"``:
            ``VALUES_BUCKET`` on a GPU when the schema has multi-hot columns, else none. Unpadded, every batch's
            ids have their own length and a compiled step records a CUDA graph for each (issue 39: 1.0M
            samples/s instead of 11.4M at batch 16K on an H200); padded, one graph per bucket.
        staging: decoding threads write each chunk, column by column, into a ring of reused host buffers
            (pinned on a GPU), and the chunk is transposed to rows on the device. Default: on a GPU. Off,
            each thread stacks its chunk into rows on the host (one copy that holds the GIL; the loader
            before staging did that and delivered 6.3M rows/s on a 16-core H100 machine), and on a GPU the
            chunk is then copied from pageable memory, the host waiting for each copy (a comparison only).
    """

    def __init__(self, files: list[Path], schema: FeatureSchema, batch_size: int, device: str | torch.device = "cpu",
                 seed: int = 0, shuffle: bool = True, shuffle_chunks: int = 16, prefetch: int = 2,
                 workers: int | None = None, pad_values_to: int | None | str = "auto", staging: bool | None = None,
                 arrow_threads: bool | None = None):
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
        self.workers = workers if workers is not None else max(1, min(8, (os.cpu_count() or 2) // 2))
        if pad_values_to == "auto":
            pad_values_to = VALUES_BUCKET if self.device.type == "cuda" and schema.multi_hot else None
        elif pad_values_to is not None and (isinstance(pad_values_to, str) or pad_values_to < 1):
            raise ValueError(f"pad_values_to must be a positive int, None or 'auto', not {pad_values_to!r}")
        self.pad_values_to = pad_values_to
        self.staging = self.device.type == "cuda" if staging is None else staging
        self.arrow_threads = self.workers < 4 if arrow_threads is None else arrow_threads
        self.stats = LoaderStats()  # the last (or current) epoch's stage times
        self._stats_lock = threading.Lock()
        metadata = {f: pq.ParquetFile(f).metadata for f in self.files}
        self._pieces = [(f, g) for f in self.files for g in range(metadata[f].num_row_groups)]
        self._piece_rows = [metadata[f].row_group(g).num_rows for f, g in self._pieces]
        self.num_rows = sum(m.num_rows for m in metadata.values())
        if self.num_rows == 0:
            raise ValueError("no training rows in the given files")

    # --- reading ------------------------------------------------------------------------------------------

    def _read(self, piece: tuple[Path, int]) -> dict[str, np.ndarray]:
        """One row group as host arrays (the only per-chunk work done on the CPU; runs in worker threads)."""
        path, group = piece
        schema = self.schema
        columns = [*schema.dense, schema.label, *schema.categorical, *schema.multi_hot, *schema.extra]
        table = pq.ParquetFile(path).read_row_group(group, columns=columns, use_threads=self.arrow_threads)
        host = {
            "dense": np.stack([table[c].to_numpy().astype(np.float32, copy=False) for c in schema.dense], axis=1)
            if schema.dense else np.zeros((table.num_rows, 0), np.float32),
            "label": table[schema.label].to_numpy().astype(np.float32, copy=False),
            "categorical": np.stack([table[c].to_numpy() for c in schema.categorical], axis=1, dtype=np.int64)
            if schema.categorical else np.zeros((table.num_rows, 0), np.int64),  # int32 ids widened in the copy
        }
        for c in schema.multi_hot:
            lists = table[c].combine_chunks()
            host[f"values:{c}"] = pc.list_flatten(lists).to_numpy().astype(np.int64, copy=False)
            host[f"lengths:{c}"] = pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64)
        for c in schema.extra:
            column = np.asarray(table[c].to_numpy(zero_copy_only=False))
            host[f"extra:{c}"] = column.astype(np.float64 if column.dtype.kind == "f" else np.int64)
        return host

    def _read_staged(self, piece: tuple[Path, int], staging: _Staging, slot: int) -> _Staged:
        """One row group written into staging slot ``slot``, a column at a time (runs in worker threads).

        Each column is one contiguous copy out of Arrow, which numpy makes without the GIL: the threads
        work in parallel. Dense and categorical columns stay column-major (one row per column); the
        device transposes them (``_to_device``)."""
        path, group = piece
        schema = self.schema
        columns = [*schema.dense, schema.label, *schema.categorical, *schema.multi_hot, *schema.extra]
        table = pq.ParquetFile(path).read_row_group(group, columns=columns, use_threads=self.arrow_threads)
        rows = table.num_rows
        ids = _id_dtype(table.schema.field(c).type for c in schema.categorical)
        tensors = {"dense": staging.buffer(slot, "dense", (len(schema.dense), rows), np.float32),
                   "label": staging.buffer(slot, "label", (rows,), np.float32),
                   "categorical": staging.buffer(slot, "categorical", (len(schema.categorical), rows), ids)}
        for block, names in (("dense", schema.dense), ("categorical", schema.categorical)):
            target = tensors[block].numpy()
            for i, c in enumerate(names):
                target[i] = table[c].to_numpy()
        tensors["label"].numpy()[:] = table[schema.label].to_numpy()
        host_lengths = []
        for c in schema.multi_hot:
            lists = table[c].combine_chunks()
            values = pc.list_flatten(lists)
            lengths = pc.list_value_length(lists).fill_null(0).to_numpy().astype(np.int64)
            for name, array, dtype in ((f"values:{c}", values.to_numpy(), _id_dtype([values.type])),
                                       (f"lengths:{c}", lengths, np.int64)):
                tensors[name] = staging.buffer(slot, name, array.shape, dtype)
                tensors[name].numpy()[:] = array
            host_lengths.append(lengths)
        for c in schema.extra:
            column = np.asarray(table[c].to_numpy(zero_copy_only=False))
            tensors[f"extra:{c}"] = staging.buffer(slot, f"extra:{c}", column.shape,
                                                   np.float64 if column.dtype.kind == "f" else np.int64)
            tensors[f"extra:{c}"].numpy()[:] = column
        return _Staged(slot, tensors, host_lengths)

    def _to_device(self, decoded, stream, consumer, staging: _Staging | None):
        """A decoded chunk on the device, and the event its copies complete at (None on a CPU).

        ``decoded``: a ``_Staged`` chunk (in staging slot, column-major blocks), or host arrays in rows."""
        staged = staging is not None

        def move(name: str) -> torch.Tensor:
            if staged:
                tensor, rows_first = decoded.tensors[name], name in ("dense", "categorical")
            else:
                tensor, rows_first = torch.from_numpy(np.require(decoded[name], requirements=["C", "W"])), False
            if stream is None:  # a CPU: a staged chunk is copied out of its slot, which is reused
                return (tensor.t() if rows_first else tensor).to(_WIDE.get(tensor.dtype, tensor.dtype), copy=True,
                                                                 memory_format=torch.contiguous_format) \
                    if staged else tensor
            with torch.cuda.stream(stream):  # pinned when staged; else a copy from pageable memory
                tensor = tensor.to(self.device, non_blocking=staged)
                if rows_first or tensor.dtype == torch.int32:  # one kernel: transposed and ids widened
                    tensor = (tensor.t() if rows_first else tensor).to(_WIDE.get(tensor.dtype, tensor.dtype),
                                                                       memory_format=torch.contiguous_format,
                                                                       copy=True)  # (no copy: a view)
            tensor.record_stream(consumer)  # freed while the consumer may still read it: wait for that
            return tensor

        host_lengths = decoded.host_lengths if staged else [decoded[f"lengths:{c}"] for c in self.schema.multi_hot]
        chunk = self._chunk(move, host_lengths)
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        if staged:
            staging.done(decoded.slot, event)
        return chunk, event

    def _chunk(self, move, host_lengths: list[np.ndarray]) -> _Chunk:
        lists = [(move(f"values:{c}"), move(f"lengths:{c}")) for c in self.schema.multi_hot]
        return _Chunk(move("dense"), move("label"), move("categorical"), lists, host_lengths,
                      {c: move(f"extra:{c}") for c in self.schema.extra})

    def _order(self, epoch: int) -> list[int]:
        """The row groups' order in ``epoch``."""
        order = list(range(len(self._pieces)))
        if self.shuffle:
            order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(order)).tolist()
        return order

    def _group_sizes(self, epoch: int) -> list[int]:
        """Rows of each group ``epoch`` will shuffle, in order, from the row groups' sizes alone (``epoch``'s
        grouping: ``shuffle_chunks`` chunks plus the previous group's rows past its last full batch)."""
        sizes, carried, pending = [], 0, []
        for i in self._order(epoch):
            pending.append(self._piece_rows[i])
            if len(pending) == self.shuffle_chunks:
                sizes.append(carried + sum(pending))
                carried, pending = sizes[-1] % self.batch_size, []
        if pending or carried:
            sizes.append(carried + sum(pending))
        return sizes

    def _permutations(self, epoch: int, generator: torch.Generator, stats: LoaderStats):
        """Each group's permutation, drawn ahead by a thread of its own, in group order with ``generator`` (the
        same draws as in the consumer, so the same order), pinned on a GPU: drawing 2M (a group of 16 row
        groups of 128K rows) took 45 ms on a 2-core EPYC, time the consumer made no batches in.

        Returns ``(next_permutation, halt)``: the next one (waiting for it), and the stop of the thread."""
        ready: queue.Queue = queue.Queue(maxsize=2)
        stop = threading.Event()
        pin = self.device.type == "cuda"

        def hand(item) -> bool:  # False once the epoch is over
            while not stop.is_set():
                try:
                    ready.put(item, timeout=0.05)
                    return True
                except queue.Full:
                    continue
            return False

        def draw() -> None:
            try:
                for size in self._group_sizes(epoch):
                    began = time.perf_counter()
                    perm = torch.randperm(size, generator=generator)
                    perm = perm.pin_memory() if pin else perm
                    stats.shuffle_s += time.perf_counter() - began
                    if not hand(perm):
                        return
                hand(None)  # no more groups
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                hand(err)

        thread = threading.Thread(target=draw, daemon=True, name="recloop-shuffle")
        thread.start()

        def next_permutation() -> torch.Tensor:
            began = time.perf_counter()
            item = ready.get()
            stats.shuffle_wait_s += time.perf_counter() - began
            if isinstance(item, BaseException):
                raise item
            if item is None:
                raise RuntimeError("loader: more groups than the row groups' sizes said; the training files "
                                   "changed during the epoch")
            return item

        def halt() -> None:
            stop.set()
            thread.join()

        return next_permutation, halt

    def _chunks(self, epoch: int) -> Iterator[_Chunk]:
        """Chunks in epoch order: decoded by ``workers`` threads, moved by one, ``prefetch`` ahead."""
        order = self._order(epoch)
        cuda = self.device.type == "cuda"
        stream = torch.cuda.Stream(self.device) if cuda else None
        consumer = torch.cuda.current_stream(self.device) if cuda else None  # the stream batches are used on
        # Chunks under way at once: at most workers + prefetch decoding or decoded, one more being taken.
        staging = _Staging(self.workers + self.prefetch + 2, pinned=cuda) if self.staging else None
        buffer: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()
        stats, clock = self.stats, time.perf_counter

        def decode(piece: tuple[Path, int], slot: int | None):  # in a decoding thread
            began = clock()
            try:
                return self._read(piece) if slot is None else self._read_staged(piece, staging, slot)
            finally:
                with self._stats_lock:
                    stats.decode_s += clock() - began

        def hand_over(future) -> None:  # the next chunk in epoch order: to the device, then to the consumer
            began = clock()
            decoded = future.result()
            decoded_at = clock()
            moved = self._to_device(decoded, stream, consumer, staging)
            moved_at = clock()
            buffer.put(moved)
            stats.decode_wait_s += decoded_at - began
            stats.move_s += moved_at - decoded_at
            stats.handover_wait_s += clock() - moved_at
            stats.chunks += 1
            stats.rows += moved[0].rows

        def produce() -> None:
            try:
                with ThreadPoolExecutor(self.workers, thread_name_prefix="recloop-decode") as pool:
                    pending: deque = deque()
                    for i in order:
                        slot = None
                        if staging is not None:
                            began = clock()
                            slot = staging.take()
                            stats.slot_wait_s += clock() - began
                        pending.append(pool.submit(decode, self._pieces[i], slot))
                        if len(pending) > self.workers + self.prefetch:
                            if stop.is_set():
                                return
                            hand_over(pending.popleft())
                    while pending and not stop.is_set():
                        hand_over(pending.popleft())
                buffer.put(None)
            except BaseException as err:  # noqa: BLE001 - re-raised in the consumer
                buffer.put(err)

        worker = threading.Thread(target=produce, daemon=True, name="recloop-loader")
        worker.start()
        try:
            while True:
                began = clock()
                item = buffer.get()
                stats.consumer_wait_s += clock() - began
                if item is None:
                    return
                if isinstance(item, BaseException):
                    raise item
                chunk, event = item
                if event is not None:
                    consumer.wait_event(event)  # the GPU waits for the copies, not the host
                yield chunk
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    buffer.get_nowait()
                except queue.Empty:
                    worker.join(timeout=0.05)

    # --- batching -----------------------------------------------------------------------------------------

    def epoch(self, epoch: int = 0, skip_batches: int = 0) -> Iterator[Batch]:
        """The batches of one epoch; ``skip_batches`` skips the first ones (to resume a run).

        Every batch but the epoch's last is full: the rows a group of ``shuffle_chunks`` chunks leaves over
        after its last full batch join the next group (a smaller batch mid-epoch would run outside the
        training step's CUDA graphs, and weigh its rows more)."""
        generator = torch.Generator(device="cpu").manual_seed(int(np.random.default_rng([self.seed, epoch, 1])
                                                                  .integers(0, 2**62)))
        self.stats = stats = LoaderStats()
        started = time.perf_counter()
        pending: list[_Chunk] = []
        produced = 0
        next_permutation, halt = self._permutations(epoch, generator, stats) if self.shuffle else (None, None)

        def emit(group: list[_Chunk], last: bool) -> Iterator[Batch | _Chunk]:
            nonlocal produced
            began = time.perf_counter()
            joined = _concat(group)
            group.clear()  # the chunks are in ``joined`` now: free them while its batches are assembled
            stats.batching_s += time.perf_counter() - began
            batches = self._batches(joined, next_permutation() if next_permutation else None, last, stats)
            del joined  # once shuffled, the unshuffled rows are garbage
            for item in batches:
                if isinstance(item, _Chunk):  # the remainder, for the next group
                    yield item
                    continue
                produced += 1
                if produced > skip_batches:
                    yield item

        carried: _Chunk | None = None  # the previous group's remainder
        try:
            for chunk in self._chunks(epoch):
                pending.append(chunk)
                if len(pending) == self.shuffle_chunks:
                    group, carried = ([carried] if carried is not None else []) + pending, None
                    pending = []
                    for item in emit(group, last=False):
                        if isinstance(item, _Chunk):
                            carried = item
                        else:
                            yield item
            group = ([carried] if carried is not None else []) + pending
            pending, carried = [], None
            if group:
                yield from emit(group, last=True)
        finally:  # an epoch left early (a resumed run's skip, a calibration) still says how long it ran
            if halt:
                halt()
            stats.epoch_s = time.perf_counter() - started

    def _batches(self, chunk: _Chunk, perm: torch.Tensor | None, last: bool,
                 stats: LoaderStats) -> Iterator[Batch | _Chunk]:
        """The group's batches, its rows in ``perm`` order (None: as they are); unless it is the epoch's
        ``last``, its rows past the last full batch come last, as a ``_Chunk`` (a copy: fewer than
        ``batch_size`` rows, which must not keep the group alive)."""
        clock = time.perf_counter
        began = clock()
        if perm is not None:
            if perm.numel() != chunk.rows:
                raise RuntimeError(f"loader: a group of {chunk.rows} rows got a permutation of {perm.numel()}; "
                                   "the training files changed during the epoch")
            chunk = _permute(chunk, perm)
        # Where each row's list starts, on the host: batch slices need no value from the device.
        host_offsets = [np.concatenate([[0], np.cumsum(lengths)]) for lengths in chunk.host_lengths]
        end_of_full = chunk.rows if last else chunk.rows - chunk.rows % self.batch_size
        stats.batching_s += clock() - began
        for start in range(0, end_of_full, self.batch_size):
            end = min(start + self.batch_size, chunk.rows)
            began = clock()
            batch = self._assemble(chunk, start, end, host_offsets)
            stats.batching_s += clock() - began
            yield batch
        if end_of_full < chunk.rows:
            yield _slice(chunk, end_of_full, chunk.rows, host_offsets)

    def _assemble(self, chunk: _Chunk, start: int, end: int, host_offsets: list[np.ndarray]) -> Batch:
        size = end - start
        categorical = chunk.categorical[start:end]
        parts = [categorical.t().reshape(-1)]
        lengths = [torch.ones(categorical.shape[1] * size, dtype=torch.int64, device=self.device)]
        for (values, list_lengths), offsets in zip(chunk.lists, host_offsets, strict=True):
            parts.append(values[int(offsets[start]):int(offsets[end])])
            lengths.append(list_lengths[start:end])
        nnz = categorical.shape[1] * size + sum(int(o[end] - o[start]) for o in host_offsets)
        if self.pad_values_to:
            padding = -nnz % self.pad_values_to
            if padding:
                parts.append(torch.zeros(padding, dtype=torch.int64, device=self.device))
        all_lengths = torch.cat(lengths)
        offsets = torch.cat([all_lengths.new_zeros(1), all_lengths.cumsum(0)])
        return Batch(chunk.dense[start:end], chunk.label[start:end], torch.cat(parts), offsets,
                     {k: v[start:end] for k, v in chunk.extra.items()})


def _slice(chunk: _Chunk, start: int, end: int, host_offsets: list[np.ndarray]) -> _Chunk:
    """Rows ``start:end`` of ``chunk``, copied (a view would keep the whole chunk's memory alive);
    ``host_offsets``: where each row's list starts, per list column."""
    lists = [(values[int(offsets[start]):int(offsets[end])].clone(), lengths[start:end].clone())
             for (values, lengths), offsets in zip(chunk.lists, host_offsets, strict=True)]
    return _Chunk(chunk.dense[start:end].clone(), chunk.label[start:end].clone(), chunk.categorical[start:end].clone(),
                  lists, [lengths[start:end].copy() for lengths in chunk.host_lengths],
                  {k: v[start:end].clone() for k, v in chunk.extra.items()})


def _concat(chunks: list[_Chunk]) -> _Chunk:
    if len(chunks) == 1:
        return chunks[0]
    lists = [(torch.cat([c.lists[i][0] for c in chunks]), torch.cat([c.lists[i][1] for c in chunks]))
             for i in range(len(chunks[0].lists))]
    host_lengths = [np.concatenate([c.host_lengths[i] for c in chunks]) for i in range(len(chunks[0].lists))]
    return _Chunk(torch.cat([c.dense for c in chunks]), torch.cat([c.label for c in chunks]),
                  torch.cat([c.categorical for c in chunks]), lists, host_lengths,
                  {k: torch.cat([c.extra[k] for c in chunks]) for k in chunks[0].extra})


def _permute(chunk: _Chunk, perm: torch.Tensor) -> _Chunk:
    """Rows in ``perm`` order (a CPU permutation); jagged lists gathered on the device, sizes from the host."""
    device = chunk.label.device
    on_device = perm.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else perm
    host_perm = perm.numpy()
    lists, host_lengths = [], []
    for (values, lengths), lengths_host in zip(chunk.lists, chunk.host_lengths, strict=True):
        new_lengths_host = lengths_host[host_perm]
        total = int(new_lengths_host.sum())
        starts = lengths.cumsum(0) - lengths
        new_lengths = lengths[on_device]
        new_starts = new_lengths.cumsum(0) - new_lengths
        within = torch.arange(total, device=device) - torch.repeat_interleave(new_starts, new_lengths,
                                                                              output_size=total)
        source = torch.repeat_interleave(starts[on_device], new_lengths, output_size=total) + within
        lists.append((values[source], new_lengths))
        host_lengths.append(new_lengths_host)
    return _Chunk(chunk.dense[on_device], chunk.label[on_device], chunk.categorical[on_device], lists, host_lengths,
                  {k: v[on_device] for k, v in chunk.extra.items()})


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
