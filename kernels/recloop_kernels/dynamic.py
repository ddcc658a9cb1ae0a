"""``DynamicEmbeddingBagCollection``: tables keyed by raw ids with a fixed row budget, admission and eviction.

A dynamic table takes any non-negative 64-bit id and keeps at most ``max_rows`` rows of its own, plus a
few ``fallback_rows`` shared by hashing::

    inner table t (an ordinary EmbeddingBagCollection table of fallback_rows + max_rows rows):
        | fallback rows 0 .. F-1: ids not (yet) admitted, by hash | admitted slots F .. F+max_rows-1 |

    each training batch, for the ids of dynamic tables:
      1. count the sightings (count-min sketch)                  ids seen fewer than ``admit_after``
      2. look the ids up in the id → slot map (slot_map.py)     times share a hashed fallback row, so
      3. ids not found and seen ``admit_after`` times or more   rare ids still learn something
         are admitted, most-seen first: a free slot, or the slot of the row with the lowest score not
         used by this batch (``eviction``: ``lru``, the least recently used; ``lfu``, the least
         frequently used with counts decaying by half every ``lfu_half_life`` steps); the evicted id's
         row AND its optimizer state are reset, so an admitted (or re-admitted) id starts fresh, from its
         initial row (a hash of the seed, the table and the id: the same row at any slot or step)
      4. the ids become inner row ids; the fused forward/backward/optimizer kernels run over them
      5. the rows used get their score (last use, decayed count)

Out of training (``eval()``, serving) only step 2 and 4 run: the map is read, never changed, and an id
without a row pools its fallback row. Tables not named in ``dynamic`` are static: their ids are row
numbers, as in ``EmbeddingBagCollection`` (and they still ``grow``).

The map, the slot scores, the sketch and the clock are buffers, so ``state_dict`` (safetensors) carries
them and a loaded module serves the same id → row map. Every row, slot and map position changed since
``clear_touched()`` is marked, which ``delta_state_dict`` / ``apply_delta`` turn into checkpoints of
what changed.

Host synchronization: the lookup (step 2) has none; a training batch synchronizes where shapes depend on
the data (selecting the dynamic ids, the distinct candidates, admission) — a handful of times a batch.

Example::

    ebc = DynamicEmbeddingBagCollection([TableConfig("item", 1, 16), TableConfig("country", 300, 16)],
                                        {"item": DynamicTableConfig(max_rows=100_000, admit_after=2)},
                                        optimizer="rowwise_adagrad", lr=0.05)
    pooled = ebc(values, offsets)     # item ids are raw ids (e.g. 64-bit hashes); country ids are rows
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal

import torch
from torch import nn

from recloop_kernels import reference
from recloop_kernels.collection import EmbeddingBagCollection
from recloop_kernels.config import TableConfig
from recloop_kernels.slot_map import (
    EMPTY,
    PROBE,
    CountMinSketch,
    WindowedHashMap,
    bucket,
    mix64_int,
    uniform_from_keys,
    unique_pairs,
)

Eviction = Literal["lru", "lfu"]


@dataclass(frozen=True)
class DynamicTableConfig:
    """The budget and policies of one dynamic table.

    Args:
        max_rows: rows of its own the table may hold (admitted ids).
        admit_after: sightings an id needs before it gets its own row (1: at first sight).
        fallback_rows: rows shared, by hash, by ids not admitted (≥ 1).
        eviction: ``lru`` or ``lfu`` (with decay; see ``lfu_half_life``).
        lfu_half_life: training steps after which an unused row's count has halved (``lfu``).

    Example::

        DynamicTableConfig(max_rows=1_000_000, admit_after=3, fallback_rows=4096, eviction="lfu")
    """

    max_rows: int
    admit_after: int = 2
    fallback_rows: int = 1024
    eviction: Eviction = "lru"
    lfu_half_life: float = 1000.0

    def __post_init__(self) -> None:
        if self.max_rows < 1 or self.fallback_rows < 1 or self.admit_after < 1:
            raise ValueError(f"max_rows, fallback_rows and admit_after must be ≥ 1: {self}")
        if self.eviction not in ("lru", "lfu"):
            raise ValueError(f"eviction must be 'lru' or 'lfu', not {self.eviction!r}")
        if self.lfu_half_life <= 0:
            raise ValueError("lfu_half_life must be positive")


def map_capacity(max_rows: int) -> int:
    """Positions of a table's map: 4 × max_rows rounded up to a whole window (a load of a quarter at most,
    where a full window is a ~1e-9 event: slot_map.py)."""
    return -(-4 * max_rows // PROBE) * PROBE


KEYED_INIT_SALT = 0x5EED  # keeps the initial rows' hash apart from the map's and the sketch's


def keyed_initial_rows(table: TableConfig, keys: torch.Tensor, salt: int) -> torch.Tensor:
    """(n, dim) initial rows for ids ``keys`` under ``table``'s init, each a function of (salt, id) only
    (``slot_map.uniform_from_keys``): ``uniform`` ±scale, ``normal`` by Box–Muller, ``zeros``; a callable init
    fills the rows as it would any others (not keyed)."""
    rows = torch.empty(keys.numel(), table.dim, device=keys.device)
    if callable(table.init) or table.init == "zeros":
        table.initialize(rows)
    elif table.init == "uniform":
        scale = table.init_scale if table.init_scale is not None else table.num_embeddings ** -0.5
        rows.copy_(uniform_from_keys(keys, salt, table.dim).mul_(2).sub_(1).mul_(scale))
    elif table.init == "normal":
        scale = table.init_scale if table.init_scale is not None else table.dim ** -0.5
        u = uniform_from_keys(keys, salt, 2 * table.dim)
        radius = torch.sqrt(-2 * torch.log1p(-u[:, :table.dim]))  # 1 - u in (0, 1]: a finite radius
        rows.copy_(radius * torch.cos(2 * math.pi * u[:, table.dim:]) * scale)
    else:
        table.initialize(rows)  # raises: an unknown init
    return rows


class DynamicEmbeddingBagCollection(nn.Module):
    """Embedding tables where some are keyed by raw ids under a row budget (module docstring).

    Args:
        tables: every table, static and dynamic, in the order of the bags (a dynamic table's
            ``num_embeddings`` is ignored: it holds ``fallback_rows + max_rows`` rows).
        dynamic: table name → its ``DynamicTableConfig``.
        sketch_depth, sketch_width: the admission sketch (shared by the dynamic tables); the width defaults
            to the total budget rounded up to a power of two (at least 1024): 16 bytes a budgeted row.
        count_half_life: training steps after which the sketch's counts are halved (0: never).
        **kwargs: as ``EmbeddingBagCollection`` (optimizer, lr, dtype, device, seed, backend...).
    """

    def __init__(self, tables: Sequence[TableConfig], dynamic: Mapping[str, DynamicTableConfig],
                 sketch_depth: int = 4, sketch_width: int | None = None, count_half_life: int = 0, **kwargs):
        super().__init__()
        names = [t.name for t in tables]
        unknown = set(dynamic) - set(names)
        if unknown:
            raise ValueError(f"dynamic tables {sorted(unknown)} are not among the tables {names}")
        self.dynamic = {name: dynamic[name] for name in names if name in dynamic}  # in table order
        self.count_half_life = count_half_life
        inner = [replace(t, num_embeddings=dynamic[t.name].fallback_rows + dynamic[t.name].max_rows)
                 if t.name in dynamic else t for t in tables]
        self.inner = EmbeddingBagCollection(inner, **kwargs)
        self._seed = int(kwargs.get("seed", 0))
        device = self.inner.weights.device
        self._tables = [names.index(name) for name in self.dynamic]  # collection index of dynamic table d
        configs = list(self.dynamic.values())
        self._dynamic_of = [self._tables.index(t) if t in self._tables else -1 for t in range(len(tables))]
        self._slot_offsets = [sum(c.max_rows for c in configs[:d]) for d in range(len(configs))]
        total_slots = sum(c.max_rows for c in configs)
        if sketch_width is None:
            sketch_width = max(1024, 1 << math.ceil(math.log2(max(total_slots, 1))))
        self.sketch = CountMinSketch(sketch_depth, sketch_width)
        self.map = WindowedHashMap([map_capacity(c.max_rows) for c in configs])
        map_keys, map_slots = self.map.new(device)
        self.register_buffer("map_keys", map_keys)
        self.register_buffer("map_slots", map_slots)
        self.register_buffer("slot_keys", torch.full((total_slots,), EMPTY, dtype=torch.int64, device=device))
        self.register_buffer("slot_last", torch.zeros(total_slots, dtype=torch.int64, device=device))
        self.register_buffer("slot_freq", torch.zeros(total_slots, dtype=torch.float64, device=device))
        self.register_buffer("sketch_counts", self.sketch.new(device))
        self.register_buffer("clock", torch.zeros(1, dtype=torch.int64, device=device))
        # Host mirrors, so that a training step on a GPU does not wait on the device for them: the clock's value
        # (None: read once from the buffer, after a checkpoint is loaded) and the per-table constants' device
        # copies (a list copied to a GPU is a host round trip, seven of them a step before).
        self._now: int | None = 0
        self._constants: dict = {}
        self.register_load_state_dict_post_hook(lambda module, _keys: module._forget_host_mirrors())
        # What changed since clear_touched(): for delta checkpoints (not part of the state).
        self.register_buffer("touched_rows", torch.zeros(self.inner.layout.total_rows, dtype=torch.bool,
                                                         device=device), persistent=False)
        self.register_buffer("touched_slots", torch.zeros(total_slots, dtype=torch.bool, device=device),
                             persistent=False)
        self.register_buffer("touched_map", torch.zeros(self.map.total, dtype=torch.bool, device=device),
                             persistent=False)
        self.register_buffer("touched_sketch", torch.zeros(sketch_depth * sketch_width, dtype=torch.bool,
                                                           device=device), persistent=False)
        self.failed_inserts = 0  # admissions refused because a map window was full (see slot_map.py)
        self.admitted = 0
        self.evicted = 0

    # --- what users read -------------------------------------------------------------------------------------

    @property
    def tables(self) -> list[TableConfig]:
        return self.inner.tables

    @property
    def layout(self):
        return self.inner.layout

    @property
    def embedding_dim(self) -> int:
        return self.inner.embedding_dim

    # The inner collection's buffers, for code written against ``EmbeddingBagCollection`` (the trainer's id
    # checks, warm-start state decay, layout).
    @property
    def weights(self) -> torch.Tensor:
        return self.inner.weights

    @property
    def state1(self) -> torch.Tensor:
        return self.inner.state1

    @property
    def state2(self) -> torch.Tensor:
        return self.inner.state2

    @property
    def step(self) -> torch.Tensor:
        return self.inner.step

    @property
    def id_errors(self) -> torch.Tensor:
        return self.inner.id_errors

    def prepare_for_graphs(self) -> None:
        self.inner.prepare_for_graphs()

    def rows_held(self) -> dict[str, int]:
        """Admitted rows per dynamic table (one host synchronization)."""
        held = {}
        for d, (name, config) in enumerate(self.dynamic.items()):
            lo = self._slot_offsets[d]
            held[name] = int((self.slot_keys[lo:lo + config.max_rows] != EMPTY).sum())
        return held

    def slot_of(self, name: str, keys: torch.Tensor) -> torch.Tensor:
        """The admitted slot of each id of table ``name`` (-1: not admitted; it pools a fallback row)."""
        d = list(self.dynamic).index(name)
        keys = keys.to(self.map_keys.device, torch.int64)
        found, slot = self.map.lookup(self.map_keys, self.map_slots, keys, torch.full_like(keys, d))
        return torch.where(found, slot, -1)

    def weight(self, name: str) -> torch.Tensor:
        """The inner table ``name`` (fallback rows first, then the slots), as ``EmbeddingBagCollection.weight``."""
        return self.inner.weight(name)

    def grow(self, name: str, new_num_embeddings: int, dense_optimizer=None) -> None:
        """Grow a static table (dynamic tables have a fixed budget)."""
        if name in self.dynamic:
            raise ValueError(f"table {name!r} is dynamic: its rows are a budget ({self.dynamic[name].max_rows})")
        before = self.inner.layout.total_rows
        self.inner.grow(name, new_num_embeddings, dense_optimizer)
        if self.inner.layout.total_rows != before:  # rows moved: the touched marks follow the new layout
            self.touched_rows = torch.ones(self.inner.layout.total_rows, dtype=torch.bool,
                                           device=self.touched_rows.device)

    def raise_id_errors(self) -> None:
        self.inner.raise_id_errors()

    def _forget_host_mirrors(self) -> None:
        self._now = None
        self._constants = {}

    def _consts(self, device: torch.device) -> dict[str, torch.Tensor]:
        """The per-table constants on ``device``, copied there once (again after a static table grows)."""
        layout = self.inner.layout
        key = (str(device), tuple(layout.rows), tuple(layout.row_offsets))
        if key not in self._constants:
            configs = list(self.dynamic.values())
            self._constants = {key: {
                "dynamic_of": torch.tensor(self._dynamic_of, dtype=torch.int64, device=device),
                "fallback_rows": torch.tensor([c.fallback_rows for c in configs], dtype=torch.int64, device=device),
                "slot_offsets": torch.tensor(self._slot_offsets, dtype=torch.int64, device=device),
                "admit_after": torch.tensor([c.admit_after for c in configs], dtype=torch.int64, device=device),
                "half_lives": torch.tensor([c.lfu_half_life for c in configs], dtype=torch.float64, device=device),
                "rows": torch.tensor(layout.rows, dtype=torch.int64, device=device),
                "row_offsets": torch.tensor(layout.row_offsets, dtype=torch.int64, device=device),
            }}
        return self._constants[key]

    # --- forward ---------------------------------------------------------------------------------------------

    def forward(self, values: torch.Tensor, offsets: torch.Tensor,
                per_sample_weights: torch.Tensor | None = None) -> torch.Tensor:
        """Pooled embeddings (B, ΣD): ids of dynamic tables mapped to their rows first (module docstring)."""
        rows = self.rows_for(values, offsets)
        return self.inner(rows, offsets, per_sample_weights)

    @torch.no_grad()
    def rows_for(self, values: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Inner row ids for table-major bags; in training mode, admits, evicts and scores first."""
        if not self.dynamic:
            return values
        num_tables = len(self.inner.tables)
        batch_size = (offsets.numel() - 1) // num_tables
        position = torch.arange(values.numel(), device=values.device)
        starts = offsets[batch_size * torch.arange(1, num_tables, device=offsets.device)].to(values.device)
        table = torch.searchsorted(starts.contiguous(), position, right=True)  # (n,) table of each value
        keys = values.to(torch.int64)
        consts = self._consts(values.device)
        dynamic_of = consts["dynamic_of"][table]
        is_dynamic = (dynamic_of >= 0) & (position >= offsets[0]) & (position < offsets[-1]) & (keys >= 0)
        d = dynamic_of.clamp(min=0)
        if self.training:  # the step's own lookup, after admission, serves: no second pass over the batch
            picked, picked_found, picked_slot = self._train_step(keys, dynamic_of, is_dynamic)
            found = torch.zeros_like(is_dynamic).index_put_((picked,), picked_found)
            slot = torch.full_like(keys, -1).index_put_((picked,), picked_slot)
        else:
            found, slot = self.map.lookup(self.map_keys, self.map_slots, keys, d)
        fallback_rows = consts["fallback_rows"][d]
        mapped = torch.where(found, fallback_rows + slot, bucket(keys, d, fallback_rows))
        rows = torch.where(is_dynamic, mapped, torch.where(dynamic_of >= 0, -1, keys))
        if self.training:
            self._mark_rows(rows, table, position < offsets[-1])
        return rows.to(values.dtype)

    def _train_step(self, keys: torch.Tensor, dynamic_of: torch.Tensor,
                    is_dynamic: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Count, admit (evicting), score; returns the dynamic positions, and whether / where each has a slot."""
        if self._now is None:  # after a checkpoint was loaded: one read
            self._now = int(self.clock)
        self._now += 1
        self.clock += 1
        now = self._now
        consts = self._consts(keys.device)
        picked = is_dynamic.nonzero().squeeze(1)
        keys, tables = keys[picked], dynamic_of[picked]
        self.touched_sketch[self.sketch.add(self.sketch_counts, keys, tables)] = True
        found, slot = self.map.lookup(self.map_keys, self.map_slots, keys, tables)
        slot_offsets = consts["slot_offsets"]
        in_use = (slot_offsets[tables] + slot)[found]
        pairs = torch.stack(unique_pairs(tables[~found], keys[~found]))  # sorted by table, then key
        if pairs.numel():
            counts = self.sketch.estimate(self.sketch_counts, pairs[1], pairs[0])
            thresholds = consts["admit_after"]
            eligible = counts >= thresholds[pairs[0]]
            if eligible.any():
                self._admit(pairs[0][eligible], pairs[1][eligible], counts[eligible], in_use, now)
                found, slot = self.map.lookup(self.map_keys, self.map_slots, keys, tables)
        used, uses = torch.unique((slot_offsets[tables] + slot)[found], return_counts=True)
        half_lives = consts["half_lives"][torch.searchsorted(slot_offsets, used, right=True) - 1]
        decayed = self.slot_freq[used] * torch.exp2(-(now - self.slot_last[used]).double() / half_lives)
        self.slot_freq[used] = decayed + uses.double()
        self.slot_last[used] = now
        self.touched_slots[used] = True
        if self.count_half_life and now % self.count_half_life == 0:
            self.touched_sketch |= self.sketch_counts.view(-1) > 0  # every count the halving changes
            self.sketch_counts.bitwise_right_shift_(1)
        return picked, found, slot

    def _admit(self, tables: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor, in_use: torch.Tensor,
               now: int) -> None:
        """Give rows to candidate ids (distinct, not in the map), table by table (module docstring, step 3)."""
        busy = torch.zeros(self.slot_keys.numel(), dtype=torch.bool, device=keys.device)
        busy[in_use] = True
        for d in torch.unique(tables).tolist():
            config = list(self.dynamic.values())[d]
            lo, hi = self._slot_offsets[d], self._slot_offsets[d] + config.max_rows
            mine = tables == d
            order = torch.sort(-counts[mine], stable=True).indices  # most seen first; ties by key (sorted)
            candidates = keys[mine][order]
            slot_keys = self.slot_keys[lo:hi]  # a view: writes land in the buffer
            free = slot_keys == EMPTY
            evictable = ~free & ~busy[lo:hi]
            admit = min(candidates.numel(), int(free.sum()) + int(evictable.sum()))
            if admit == 0:
                continue
            candidates = candidates[:admit]
            evict = admit - int(free.sum())
            if evict > 0:
                if config.eviction == "lru":  # last use, ties by slot, in one int64: a partial selection is exact
                    score = self.slot_last[lo:hi] * config.max_rows + torch.arange(config.max_rows,
                                                                                   device=keys.device)
                    score = torch.where(evictable, score, torch.iinfo(torch.int64).max)
                    victims = torch.topk(score, evict, largest=False, sorted=True).indices
                else:
                    score = self.slot_freq[lo:hi] * torch.exp2(-(now - self.slot_last[lo:hi]).double()
                                                               / config.lfu_half_life)
                    score = torch.where(evictable, score, math.inf)
                    victims = torch.sort(score, stable=True).indices[:evict]  # lowest score; ties: lowest slot
                self._mark_map(self.slot_keys[lo + victims], d)
                self.map.delete(self.map_keys, slot_keys[victims], torch.full_like(victims, d))
                slot_keys[victims] = EMPTY
                self.evicted += evict
            slots = (slot_keys == EMPTY).nonzero().squeeze(1)[:admit]
            inserted = self.map.insert(self.map_keys, self.map_slots, candidates, torch.full_like(candidates, d),
                                       slots)
            self.failed_inserts += int((~inserted).sum())
            slots, candidates = slots[inserted], candidates[inserted]
            self._mark_map(candidates, d)
            slot_keys[slots] = candidates
            self.slot_last[lo + slots] = now
            self.slot_freq[lo + slots] = 0.0
            self.touched_slots[lo + slots] = True
            if evict > 0:  # a victim slot nobody took still had its row: it is now free, and starts fresh later
                self.touched_slots[lo + victims] = True
            self.admitted += int(slots.numel())
            self._reset_rows(self._tables[d], config.fallback_rows + slots, candidates)

    def _reset_rows(self, t: int, rows: torch.Tensor, keys: torch.Tensor) -> None:
        """Fresh rows for the ids ``keys``: the table's init, and zero optimizer state (an admitted id starts
        from nothing).

        Each id's values are a hash of (seed, table, id) (``keyed_initial_rows``), not draws from a running
        generator: an id starts from the same row whatever its slot, the step it is admitted at, or a resume
        from a checkpoint, and a re-admitted id from the row it first had (on any device: the hash is integer
        arithmetic; a ``normal`` init's log and cosine may differ there in the last bit). Two runs whose tables
        differ only in their budgets (and the same ``init_scale``: the default uniform scale follows the
        table's rows, fallback + budget) give an id the same start, and differ only where the budget acted
        (benchmarks/dynamic_tables.py pairs them so)."""
        inner = self.inner
        layout = inner.layout
        fresh = keyed_initial_rows(inner.tables[t], keys, mix64_int(self._seed, KEYED_INIT_SALT + t))
        reference.table_view(inner.weights, layout, t)[rows] = fresh.to(inner.weights)
        for state in (inner.state1, inner.state2):
            if state.numel() == layout.total_rows:  # one value a row (row-wise Adagrad)
                state[layout.row_offsets[t] + rows] = 0
            elif state.numel():
                reference.table_view(state, layout, t)[rows] = 0
        self.touched_rows[layout.row_offsets[t] + rows] = True

    def _mark_rows(self, rows: torch.Tensor, table: torch.Tensor, in_bags: torch.Tensor) -> None:
        """Mark the inner rows a training batch uses (its backward updates them)."""
        consts = self._consts(rows.device)
        sizes = consts["rows"][table]
        ok = in_bags & (rows >= 0) & (rows < sizes)
        offsets = consts["row_offsets"][table]
        self.touched_rows[(offsets + rows)[ok]] = True

    def _mark_map(self, keys: torch.Tensor, d: int) -> None:
        """Mark the map positions these keys occupy (before a delete, after an insert)."""
        positions = self.map.windows(keys, torch.full_like(keys, d))
        self.touched_map[positions[self.map_keys[positions] == keys[:, None]]] = True

    # --- checkpoints of what changed ------------------------------------------------------------------------

    def clear_touched(self) -> None:
        """Start a new delta: nothing has changed since now."""
        for mark in (self.touched_rows, self.touched_slots, self.touched_map, self.touched_sketch):
            mark.zero_()

    def delta_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything changed since ``clear_touched()``: touched rows (weights, optimizer state), slots, map
        positions and sketch counters, and the clock and step. ``apply_delta`` on a module holding the state
        as of that moment gives this one's state bit for bit."""
        inner, layout = self.inner, self.inner.layout
        delta: dict[str, torch.Tensor] = {}
        for t in range(layout.num_tables):
            lo = layout.row_offsets[t]
            rows = self.touched_rows[lo:lo + layout.capacities[t]].nonzero().squeeze(1)
            delta[f"rows.{t}"] = rows
            delta[f"weights.{t}"] = reference.table_view(inner.weights, layout, t)[rows].contiguous()
            for name in ("state1", "state2"):
                state = getattr(inner, name)
                if state.numel() == layout.total_rows:
                    delta[f"{name}.{t}"] = state[lo + rows].contiguous()
                elif state.numel():
                    delta[f"{name}.{t}"] = reference.table_view(state, layout, t)[rows].contiguous()
        slots = self.touched_slots.nonzero().squeeze(1)
        positions = self.touched_map.nonzero().squeeze(1)
        cells = self.touched_sketch.nonzero().squeeze(1)
        delta.update({"slots": slots, "slot_keys": self.slot_keys[slots], "slot_last": self.slot_last[slots],
                      "slot_freq": self.slot_freq[slots], "map_positions": positions,
                      "map_keys": self.map_keys[positions], "map_slots": self.map_slots[positions],
                      "sketch_cells": cells, "sketch_counts": self.sketch_counts.view(-1)[cells],
                      "clock": self.clock.clone(),
                      "step": inner.step.clone(), "num_embeddings": inner.num_embeddings.clone()})
        return {k: v.detach().contiguous() for k, v in delta.items()}

    @torch.no_grad()
    def apply_delta(self, delta: Mapping[str, torch.Tensor]) -> None:
        """Write a ``delta_state_dict`` over this module's state (see there)."""
        inner, layout = self.inner, self.inner.layout
        if not torch.equal(delta["num_embeddings"].cpu(), inner.num_embeddings.cpu()):
            raise ValueError("a delta over other table sizes (a static table grew): restore a full checkpoint")
        device = inner.weights.device
        for t in range(layout.num_tables):
            rows = delta[f"rows.{t}"].to(device)
            reference.table_view(inner.weights, layout, t)[rows] = delta[f"weights.{t}"].to(device)
            for name in ("state1", "state2"):
                state = getattr(inner, name)
                if state.numel() == layout.total_rows:
                    state[layout.row_offsets[t] + rows] = delta[f"{name}.{t}"].to(device)
                elif state.numel():
                    reference.table_view(state, layout, t)[rows] = delta[f"{name}.{t}"].to(device)
        slots, positions = delta["slots"].to(device), delta["map_positions"].to(device)
        for name in ("slot_keys", "slot_last", "slot_freq"):
            getattr(self, name)[slots] = delta[name].to(device)
        self.map_keys[positions] = delta["map_keys"].to(device)
        self.map_slots[positions] = delta["map_slots"].to(device)
        self.sketch_counts.view(-1)[delta["sketch_cells"].to(device)] = delta["sketch_counts"].to(device)
        self.clock.copy_(delta["clock"])
        self._now = None  # read from the restored clock at the next step
        inner.step.copy_(delta["step"])

    def extra_repr(self) -> str:
        budgets = ", ".join(f"{n}≤{c.max_rows} (admit after {c.admit_after}, {c.eviction})"
                            for n, c in self.dynamic.items())
        return f"dynamic=[{budgets}]"
