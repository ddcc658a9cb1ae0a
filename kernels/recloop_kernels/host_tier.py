"""``HostCachedEmbeddingBagCollection``: tables kept in host memory, their hot rows cached on the device.

A table larger than the GPU's memory lives whole (rows and optimizer state) in host memory, pinned when
CUDA is there; the device holds a cache of ``cache_rows`` rows per table, itself an ordinary
``EmbeddingBagCollection`` over which the fused forward/backward/optimizer kernels run::

    host (pinned):   store  = every row + its optimizer state          (an EmbeddingBagCollection on the CPU)
    device:          cache  = cache_rows rows + state per table         (an EmbeddingBagCollection)
                     map    = table row → cache slot                    (slot_map.WindowedHashMap)

    a batch:  its distinct rows → the map → rows not cached are copied in (only those), into free slots or
              the least recently used slots that this batch and the one in flight do not use; those rows
              are written back to the store first; the ids become cache slots; the cache trains as usual.

``prefetch(values, offsets)`` stages the *next* batch while the current one trains (on CUDA the copies run
on a side stream; the next ``forward`` of the same tensors waits for them); ``flush()`` writes every cached
row back, so that ``store`` (and ``state_dict``) holds the whole table. The results are the same as with
the whole table on the device: the same rows, summed in the same order (tests/test_host_tier.py).

Example::

    ebc = HostCachedEmbeddingBagCollection([TableConfig("item", 50_000_000, 64)], cache_rows=4_000_000,
                                           optimizer="rowwise_adagrad", device="cuda")
    ebc.prefetch(next_values, next_offsets)         # while this batch trains
    loss(ebc(values, offsets)).backward()
    ebc.hits, ebc.lookups                            # distinct rows found cached, distinct rows asked for
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from recloop_kernels import reference
from recloop_kernels.collection import EmbeddingBagCollection
from recloop_kernels.config import TableConfig
from recloop_kernels.dynamic import map_capacity
from recloop_kernels.slot_map import EMPTY, WindowedHashMap, unique_pairs


def copy_rows(src: EmbeddingBagCollection, src_rows: torch.Tensor, dst: EmbeddingBagCollection,
              dst_rows: torch.Tensor, t: int) -> None:
    """Rows ``src_rows`` of table t of ``src`` (weights and optimizer state) into rows ``dst_rows`` of ``dst``.

    Host to device: the gathered rows are pinned and copied asynchronously (on the current stream);
    device to host: copied synchronously (the rows are read on the host right after)."""
    src_rows, dst_rows = src_rows.to(src.weights.device), dst_rows.to(dst.weights.device)
    for a, b in ((src.weights, dst.weights), (src.state1, dst.state1), (src.state2, dst.state2)):
        if not a.numel():
            continue
        if a.numel() == src.layout.total_rows:  # one value a row (row-wise Adagrad)
            rows = a[src.layout.row_offsets[t] + src_rows]
        else:
            rows = reference.table_view(a, src.layout, t)[src_rows]
        to_device = b.is_cuda and not rows.is_cuda
        if to_device:
            rows = rows.pin_memory()
        rows = rows.to(b.device, non_blocking=to_device)
        if b.numel() == dst.layout.total_rows:
            b[dst.layout.row_offsets[t] + dst_rows] = rows
        else:
            reference.table_view(b, dst.layout, t)[dst_rows] = rows


class HostCachedEmbeddingBagCollection(nn.Module):
    """Tables in host memory with a device cache of hot rows (module docstring).

    Args:
        tables: the tables (their full sizes).
        cache_rows: device rows per table (an int for all, or one per table); at least the distinct rows
            of two batches of that table (the one training and the one prefetched).
        device: where the cache lives (the store is always on the host).
        **kwargs: as ``EmbeddingBagCollection`` (optimizer, lr, dtype, seed, backend...).
    """

    def __init__(self, tables: Sequence[TableConfig], cache_rows: int | Sequence[int],
                 device: torch.device | str | None = None, **kwargs):
        super().__init__()
        device = torch.device(device) if device is not None else torch.device("cpu")
        sizes = [cache_rows] * len(tables) if isinstance(cache_rows, int) else list(cache_rows)
        sizes = [min(size, t.num_embeddings) for size, t in zip(sizes, tables, strict=True)]
        self.store = EmbeddingBagCollection(tables, device="cpu", **kwargs)
        if device.type == "cuda":  # pinned: copies to and from the device run asynchronously, at full speed
            for name in ("weights", "state1", "state2"):
                setattr(self.store, name, getattr(self.store, name).pin_memory())
        self.cache = EmbeddingBagCollection([replace(t, num_embeddings=n, init="zeros")
                                             for t, n in zip(tables, sizes, strict=True)], device=device, **kwargs)
        self.map = WindowedHashMap([map_capacity(n) for n in sizes])
        self.cache_sizes = sizes
        self._slot_offsets = [sum(sizes[:t]) for t in range(len(sizes))]
        keys, slots = self.map.new(device)
        self.register_buffer("map_keys", keys, persistent=False)
        self.register_buffer("map_slots", slots, persistent=False)
        self.register_buffer("cached_row", torch.full((sum(sizes),), EMPTY, dtype=torch.int64, device=device),
                             persistent=False)
        self.register_buffer("slot_last", torch.zeros(sum(sizes), dtype=torch.int64, device=device),
                             persistent=False)
        self.clock = 0
        self.hits = 0
        self.lookups = 0
        self.rows_copied_in = 0
        self.rows_written_back = 0
        self._in_flight = torch.zeros(0, dtype=torch.int64, device=device)  # slots of the batch training now
        self._staged: tuple | None = None  # (values, offsets, rows, slots used, copy event) of a prefetch
        self._copy_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def tables(self) -> list[TableConfig]:
        return self.store.tables

    @property
    def embedding_dim(self) -> int:
        return self.store.embedding_dim

    @property
    def hit_rate(self) -> float:
        """Share of the distinct rows asked for that were already cached."""
        return self.hits / self.lookups if self.lookups else 0.0

    # --- staging rows ---------------------------------------------------------------------------------------

    @torch.no_grad()
    def _stage(self, values: torch.Tensor, offsets: torch.Tensor,
               protect: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Bring the batch's rows into the cache without evicting the slots ``protect``; returns the cache row
        of every value (a bad id stays out of range) and the slots the batch uses."""
        num_tables = self.store.layout.num_tables
        batch_size = (offsets.numel() - 1) // num_tables
        device = self.cached_row.device
        values, offsets = values.to(device), offsets.to(device)
        position = torch.arange(values.numel(), device=device)
        starts = offsets[batch_size * torch.arange(1, num_tables, device=device)]
        table = torch.searchsorted(starts.contiguous(), position, right=True)
        rows = values.to(torch.int64)
        sizes = torch.tensor(self.store.layout.rows, device=device)[table]
        valid = (rows >= 0) & (rows < sizes) & (position >= offsets[0]) & (position < offsets[-1])
        pairs = torch.stack(unique_pairs(table[valid], rows[valid]))
        found, slot = self.map.lookup(self.map_keys, self.map_slots, pairs[1], pairs[0])
        self.clock += 1
        self.lookups += pairs.shape[1]
        self.hits += int(found.sum())
        slot_offsets = torch.tensor(self._slot_offsets, dtype=torch.int64, device=device)
        busy = torch.zeros(self.cached_row.numel(), dtype=torch.bool, device=device)
        busy[protect] = True
        busy[(slot_offsets[pairs[0]] + slot)[found]] = True
        missing = pairs[:, ~found]
        for t in torch.unique(missing[0]).tolist():
            self._fetch(t, missing[1][missing[0] == t], busy)
        found, slot = self.map.lookup(self.map_keys, self.map_slots, rows, table)
        used = (slot_offsets[table] + slot)[found & valid]
        self.slot_last[used] = self.clock
        return torch.where(found & valid, slot, torch.where(valid, -1, rows)), used

    def _fetch(self, t: int, rows: torch.Tensor, busy: torch.Tensor) -> None:
        """Copy rows of table t in from the store, writing the least recently used free-able rows back first."""
        lo, size = self._slot_offsets[t], self.cache_sizes[t]
        cached = self.cached_row[lo:lo + size]
        free = cached == EMPTY
        evictable = ~free & ~busy[lo:lo + size]
        if rows.numel() > int(free.sum()) + int(evictable.sum()):
            raise ValueError(f"table {self.store.tables[t].name!r}: {rows.numel()} rows to bring in, but only "
                             f"{int(free.sum()) + int(evictable.sum())} of {size} cache rows can take them: "
                             "raise cache_rows above the distinct rows of two batches")
        evict = rows.numel() - int(free.sum())
        if evict > 0:
            last = torch.where(evictable, self.slot_last[lo:lo + size], torch.iinfo(torch.int64).max)
            victims = torch.topk(last, evict, largest=False).indices
            copy_rows(self.cache, victims, self.store, cached[victims], t)  # written back before reuse
            self.map.delete(self.map_keys, cached[victims], torch.full_like(victims, t))
            cached[victims] = EMPTY
            self.rows_written_back += evict
        slots = (cached == EMPTY).nonzero().squeeze(1)[:rows.numel()]
        copy_rows(self.store, rows, self.cache, slots, t)
        inserted = self.map.insert(self.map_keys, self.map_slots, rows, torch.full_like(rows, t), slots)
        if not bool(inserted.all()):  # cannot happen at a load of one half (slot_map.py), but never silently
            raise RuntimeError("the cache map refused a row (a full probe window)")
        cached[slots] = rows
        self.rows_copied_in += rows.numel()

    # --- the module ---------------------------------------------------------------------------------------

    def prefetch(self, values: torch.Tensor, offsets: torch.Tensor) -> None:
        """Stage the next batch's rows now (a side stream on CUDA); its ``forward`` then copies nothing."""
        stream = self._copy_stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream())  # rows written back are final
            with torch.cuda.stream(stream):
                rows, used = self._stage(values, offsets, self._in_flight)
                event = torch.cuda.Event()
                event.record(stream)
        else:
            (rows, used), event = self._stage(values, offsets, self._in_flight), None
        self._staged = (values, offsets, rows, used, event)

    def forward(self, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings (B, ΣD), as ``EmbeddingBagCollection`` gives them over the whole tables."""
        staged = self._staged
        if staged is not None and staged[0] is values and staged[1] is offsets:
            rows, used, event = staged[2:]
            if event is not None:
                torch.cuda.current_stream().wait_event(event)
                for tensor in (rows, used):  # made on the copy stream, used on this one: freed after this one
                    tensor.record_stream(torch.cuda.current_stream())
        else:
            rows, used = self._stage(values, offsets, self._in_flight)
        self._staged = None
        self._in_flight = used
        offsets = offsets.to(rows.device)
        if per_sample_weights is not None:
            per_sample_weights = per_sample_weights.to(rows.device)
        return self.cache(rows.to(values.dtype), offsets, per_sample_weights)

    @torch.no_grad()
    def flush(self) -> None:
        """Write every cached row back to the store (the store then holds the whole state)."""
        for t in range(self.store.layout.num_tables):
            lo, size = self._slot_offsets[t], self.cache_sizes[t]
            slots = (self.cached_row[lo:lo + size] != EMPTY).nonzero().squeeze(1)
            copy_rows(self.cache, slots, self.store, self.cached_row[lo + slots], t)
        self.store.step.copy_(self.cache.step)
        if self._copy_stream is not None:
            torch.cuda.synchronize()

    def table(self, name: str) -> torch.Tensor:
        """Table ``name`` whole, from the store (call ``flush`` first for the newest rows)."""
        return self.store.weight(name)
