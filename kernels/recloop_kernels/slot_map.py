"""The id → slot map of dynamic tables, as device tensors: hashing, a count-min sketch, a windowed hash map.

Everything here is a handful of vectorized torch ops over whole batches, so it runs where the tensors are
(CPU or GPU) with no Python loop over ids:

- ``mix64``: a 64-bit finalizer (MurmurHash3's fmix64) in int64 arithmetic (wrap-around multiply, logical
  shifts by masking), so a key hashes to the same bits on every device and in the Python reference.
- ``CountMinSketch``: sightings per (table, key) in ``depth`` rows of ``width`` int32 counters; an estimate
  is the minimum over the rows, never below the true count (collisions only add), and it is halved every
  ``half_life`` steps so that old sightings fade and a months-long stream does not saturate it.
- ``WindowedHashMap``: open addressing where a key lives within ``PROBE`` positions from its home
  (``mix64(key, table) mod (capacity - PROBE + 1)``, so that a window never wraps), one region of
  positions per table::

      region of table t:  | ... | home .. home+PROBE-1 | ... |
      lookup:  read each key's window as one contiguous row (an unfolded view: 256 bytes, not 32 scattered
               reads; 5x faster on a CPU) → compare → the one match, or none
      insert:  the first free position of the window; several new keys wanting one position: the lowest
               index wins and the others try again next round (a round per conflict, a few at most)
      delete:  mark the position free (a lookup scans the whole window, so no tombstone is needed)

  The lookup is a fixed number of gathers: no host synchronization, whatever the load. Linear probing's
  clusters have a geometric tail, P(length ≥ k) ≈ (α·e^(1-α))^k at load α: at one half a window of 32
  would be full for ~2e-3 of the inserts, at one quarter (``map_capacity``: 4 positions a row) for ~1e-9.
  An insert that finds its window full is refused and counted (``failed_inserts``): the id stays on its
  hashed fallback row, which is what it had before admission.
"""

from __future__ import annotations

import torch

PROBE = 32  # positions a key may live at, from its home
EMPTY = -1
_M1 = 0xFF51AFD7ED558CCD - (1 << 64)  # fmix64's constants as signed int64
_M2 = 0xC4CEB9FE1A85EC53 - (1 << 64)
_GOLDEN = 0x9E3779B97F4A7C15 - (1 << 64)
MASK64 = (1 << 64) - 1


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed values)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def mix64(keys: torch.Tensor, salt: torch.Tensor | int) -> torch.Tensor:
    """fmix64(key + salt·golden) as int64 bit patterns (negative values are patterns with the top bit set)."""
    if isinstance(salt, int):  # salt·golden wrapped to a signed 64-bit value, as the tensor product wraps
        offset = (salt * _GOLDEN) & MASK64
        x = keys.to(torch.int64) + (offset - (1 << 64) if offset >= 1 << 63 else offset)
    else:
        x = keys.to(torch.int64) + salt.to(torch.int64) * _GOLDEN
    x = x ^ _shr(x, 33)
    x = x * _M1
    x = x ^ _shr(x, 33)
    x = x * _M2
    return x ^ _shr(x, 33)


def mix64_int(key: int, salt: int) -> int:
    """``mix64`` in Python integers (the reference's hash; equal bit for bit, as unsigned)."""
    x = (key + salt * (_GOLDEN & MASK64)) & MASK64
    x ^= x >> 33
    x = (x * (_M1 & MASK64)) & MASK64
    x ^= x >> 33
    x = (x * (_M2 & MASK64)) & MASK64
    return x ^ (x >> 33)


def bucket(keys: torch.Tensor, salt: torch.Tensor | int, buckets: torch.Tensor | int) -> torch.Tensor:
    """A key's bucket in [0, buckets): the hash's low 62 bits (non-negative) modulo ``buckets``."""
    return (mix64(keys, salt) & ((1 << 62) - 1)) % buckets


def bucket_int(key: int, salt: int, buckets: int) -> int:
    return (mix64_int(key, salt) & ((1 << 62) - 1)) % buckets


def uniform_from_keys(keys: torch.Tensor, salt: int, columns: int) -> torch.Tensor:
    """(n, columns) float32 values in [0, 1), each a hash of (key, salt, column): the same key draws the same
    values on every device, at any step, in any batch (a counter-based draw, not a generator's stream)."""
    base = mix64(keys, salt)  # (n,)
    bits = mix64(base[:, None], torch.arange(1, columns + 1, device=keys.device)[None, :])  # (n, columns)
    return (_shr(bits, 40).to(torch.float32) * 2.0**-24)  # the top 24 bits: exact in float32, never 1.0


class CountMinSketch:
    """Approximate sightings per (table, key) (module docstring). Holds no state of its own: the counters
    are a (depth, width) int32 tensor owned by the module that checkpoints it.

    Args:
        depth, width: counter rows and counters a row (width a power of two).

    Example::

        sketch = CountMinSketch(4, 1 << 16)
        counters = sketch.new()
        sketch.add(counters, keys, tables)
        sketch.estimate(counters, keys, tables)     # ≥ the true counts
    """

    def __init__(self, depth: int = 4, width: int = 1 << 16):
        if width & (width - 1):
            raise ValueError(f"sketch width must be a power of two, got {width}")
        self.depth, self.width = depth, width

    def new(self, device=None) -> torch.Tensor:
        return torch.zeros(self.depth, self.width, dtype=torch.int32, device=device)

    def _cells(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Flat counter index of each key in each row: (depth, n)."""
        salts = tables.to(torch.int64) * 131 + 7
        rows = [(mix64(keys, salts + d) & (self.width - 1)) + d * self.width for d in range(self.depth)]
        return torch.stack(rows) if rows else keys.new_zeros(0, keys.numel())

    def add(self, counters: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Count one sighting of each (key, table) pair (repeats count again); returns the flat cells changed."""
        cells = self._cells(keys, tables).reshape(-1)
        counters.view(-1).index_add_(0, cells, torch.ones_like(cells, dtype=torch.int32))
        return cells

    def estimate(self, counters: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """Sightings so far of each pair (int64; an overestimate only where every row collides)."""
        cells = self._cells(keys, tables)
        return counters.view(-1)[cells].amin(dim=0).to(torch.int64)


def unique_pairs(tables: torch.Tensor, keys: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The distinct (table, key) pairs, sorted by table then key (``torch.unique(dim=1)`` compares pairs one by
    one on a CPU: 100x slower)."""
    order = torch.argsort(keys, stable=True)
    order = order[torch.argsort(tables[order], stable=True)]
    tables, keys = tables[order], keys[order]
    first = torch.ones_like(keys, dtype=torch.bool)
    first[1:] = (tables[1:] != tables[:-1]) | (keys[1:] != keys[:-1])
    return tables[first], keys[first]


class WindowedHashMap:
    """Key → slot maps of several tables in one pair of flat tensors (module docstring).

    Args:
        capacities: positions per table (multiples of ``PROBE``); table t owns the positions
            ``starts[t] : starts[t] + capacities[t]``.

    The state is two int64 tensors (``new``): ``keys`` (``EMPTY`` where free) and ``slots``.
    """

    def __init__(self, capacities: list[int]):
        for c in capacities:
            if c % PROBE or c < PROBE:
                raise ValueError(f"map capacities must be positive multiples of {PROBE}, got {capacities}")
        self.capacities = list(capacities)
        self.starts = [sum(capacities[:t]) for t in range(len(capacities))]
        self.total = sum(capacities)
        self._meta_cache: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def new(self, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.full((self.total,), EMPTY, dtype=torch.int64, device=device),
                torch.zeros(self.total, dtype=torch.int64, device=device))

    def _meta(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """Window starts and capacities on ``device``, copied there once (a host round trip each time before)."""
        key = str(device)
        if key not in self._meta_cache:
            self._meta_cache[key] = (torch.tensor(self.starts, dtype=torch.int64, device=device),
                                     torch.tensor(self.capacities, dtype=torch.int64, device=device))
        return self._meta_cache[key]

    def homes(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The flat position where each key's window starts: (n,)."""
        starts, capacities = self._meta(keys.device)
        start, capacity = starts[tables], capacities[tables]
        return start + (mix64(keys, tables.to(torch.int64) * 2 + 1) & ((1 << 62) - 1)) % (capacity - PROBE + 1)

    def windows(self, keys: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
        """The PROBE positions each key may live at: (n, PROBE) flat positions."""
        return self.homes(keys, tables)[:, None] + torch.arange(PROBE, device=keys.device, dtype=torch.int64)

    def lookup(self, map_keys: torch.Tensor, map_slots: torch.Tensor, keys: torch.Tensor,
               tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(found (n,) bool, slot (n,) int64, -1 where not found). No host synchronization."""
        home = self.homes(keys, tables)
        hit = map_keys.unfold(0, PROBE, 1).index_select(0, home) == keys[:, None]  # (n, PROBE): one True at most
        found = hit.any(dim=1)
        where = home + hit.to(torch.int8).argmax(dim=1)
        return found, torch.where(found, map_slots.index_select(0, where), -1)

    def insert(self, map_keys: torch.Tensor, map_slots: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
               slots: torch.Tensor) -> torch.Tensor:
        """Insert distinct keys that are not in the map; returns the mask of those inserted (the others found
        their window full). One host synchronization a round (new keys arrive only at admission)."""
        inserted = torch.zeros(keys.numel(), dtype=torch.bool, device=keys.device)
        pending = torch.arange(keys.numel(), device=keys.device)
        windows = self.windows(keys, tables)
        while pending.numel():
            window = windows[pending]
            free = map_keys[window] == EMPTY
            has_room = free.any(dim=1)
            target = window.gather(1, free.to(torch.int8).argmax(dim=1, keepdim=True)).squeeze(1)
            pending, target = pending[has_room], target[has_room]  # a full window: refused for good
            order = torch.argsort(target, stable=True)  # pending ascends: the lowest index first in each tie
            sorted_target = target[order]
            first = torch.ones_like(sorted_target, dtype=torch.bool)
            first[1:] = sorted_target[1:] != sorted_target[:-1]
            won = torch.zeros_like(first).index_fill_(0, order[first], True)
            winners = pending[won]
            map_keys[target[won]] = keys[winners]
            map_slots[target[won]] = slots[winners]
            inserted[winners] = True
            pending = pending[~won]
        return inserted

    def delete(self, map_keys: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor) -> None:
        """Free the positions of these keys (those not in the map are ignored)."""
        positions = self.windows(keys, tables)
        hit = map_keys[positions] == keys[:, None]
        map_keys[positions[hit]] = EMPTY
