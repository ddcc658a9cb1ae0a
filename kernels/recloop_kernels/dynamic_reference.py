"""A readable reference of the dynamic tables' id → row assignment: Python dicts, exact counts, one id at a time.

``ReferenceSlotMap.rows_for`` gives, for the same stream of batches, the same inner rows as
``DynamicEmbeddingBagCollection.rows_for`` (dynamic.py) and says which rows it reset, with the rules
written out plainly:

- a training batch first counts every sighting (exact counts here, where the module uses a count-min
  sketch: the two agree while the sketch has no collision; halved every ``count_half_life`` steps);
- ids not in the map whose count reached ``admit_after`` are candidates, most seen first (ties: smaller
  id first); they take free slots (smallest first), then the slots of the rows with the lowest score
  that this batch did not use: ``lru`` the oldest last use, ``lfu`` the smallest count decayed by half
  every ``lfu_half_life`` steps (ties: the smaller slot); when neither is left the rest wait;
- an admitted id's row is ``fallback_rows + slot``; any other id's row is its hashed fallback row;
- every row used gets its score: last use = now, decayed count + uses.

Example::

    ref = ReferenceSlotMap({"item": DynamicTableConfig(max_rows=3, admit_after=2)}, ["item"])
    rows, resets = ref.rows_for([[5, 5, 9]], training=True)   # one list of ids per table
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from recloop_kernels.dynamic import DynamicTableConfig
from recloop_kernels.slot_map import bucket_int


class ReferenceSlotMap:
    """The id → row assignment of dynamic tables (module docstring).

    Args:
        dynamic: table name → config (as given to ``DynamicEmbeddingBagCollection``).
        names: every table's name, in bag order (static tables pass their ids through).
        count_half_life: as the module's.
    """

    def __init__(self, dynamic: Mapping[str, DynamicTableConfig], names: Sequence[str], count_half_life: int = 0):
        self.names = list(names)
        self.dynamic = {name: dynamic[name] for name in names if name in dynamic}
        self.count_half_life = count_half_life
        self.clock = 0
        self.slot_of: dict[str, dict[int, int]] = {n: {} for n in self.dynamic}  # id → slot
        self.key_of: dict[str, list[int | None]] = {n: [None] * c.max_rows for n, c in self.dynamic.items()}
        self.last: dict[str, list[int]] = {n: [0] * c.max_rows for n, c in self.dynamic.items()}
        self.freq: dict[str, list[float]] = {n: [0.0] * c.max_rows for n, c in self.dynamic.items()}
        self.counts: dict[str, dict[int, int]] = {n: {} for n in self.dynamic}

    def row(self, name: str, key: int) -> int:
        config = self.dynamic[name]
        d = list(self.dynamic).index(name)
        if key in self.slot_of[name]:
            return config.fallback_rows + self.slot_of[name][key]
        return bucket_int(key, d, config.fallback_rows)

    def rows_for(self, ids: Sequence[Sequence[int]], training: bool) -> tuple[list[list[int]], dict[str, list[int]]]:
        """Rows of each table's ids (a list per table, in bag order), and the rows reset per table."""
        resets: dict[str, list[int]] = {}
        if training:
            self.clock += 1
            for name, keys in zip(self.names, ids, strict=True):
                if name in self.dynamic:
                    resets[name] = self._admit(name, keys)
        rows = [[self.row(name, k) if name in self.dynamic else k for k in keys]
                for name, keys in zip(self.names, ids, strict=True)]
        if training:
            for name, keys in zip(self.names, ids, strict=True):
                if name in self.dynamic:
                    self._score(name, keys)
            if self.count_half_life and self.clock % self.count_half_life == 0:
                for counts in self.counts.values():
                    for key in counts:
                        counts[key] //= 2
        return rows, resets

    def _decayed(self, name: str, slot: int) -> float:
        return self.freq[name][slot] * 2.0 ** (-(self.clock - self.last[name][slot]) / self.dynamic[name].lfu_half_life)

    def _admit(self, name: str, keys: Sequence[int]) -> list[int]:
        config, counts, slot_of = self.dynamic[name], self.counts[name], self.slot_of[name]
        for key in keys:
            counts[key] = counts.get(key, 0) + 1
        busy = {slot_of[k] for k in keys if k in slot_of}
        waiting = sorted({k for k in keys if k not in slot_of and counts[k] >= config.admit_after},
                         key=lambda k: (-counts[k], k))
        free = [s for s in range(config.max_rows) if self.key_of[name][s] is None]
        evictable = [s for s in range(config.max_rows) if self.key_of[name][s] is not None and s not in busy]
        admit = waiting[:len(free) + len(evictable)]
        if len(admit) > len(free):
            if config.eviction == "lru":
                ranked = sorted(evictable, key=lambda s: (self.last[name][s], s))
            else:
                ranked = sorted(evictable, key=lambda s: (self._decayed(name, s), s))
            for slot in ranked[:len(admit) - len(free)]:
                del slot_of[self.key_of[name][slot]]
                self.key_of[name][slot] = None
        free = [s for s in range(config.max_rows) if self.key_of[name][s] is None]
        for key, slot in zip(admit, free, strict=False):
            slot_of[key] = slot
            self.key_of[name][slot] = key
            self.last[name][slot], self.freq[name][slot] = self.clock, 0.0
        return [config.fallback_rows + slot_of[k] for k in admit]

    def _score(self, name: str, keys: Sequence[int]) -> None:
        uses: dict[int, int] = {}
        for key in keys:
            if key in self.slot_of[name]:
                slot = self.slot_of[name][key]
                uses[slot] = uses.get(slot, 0) + 1
        for slot, n in uses.items():
            self.freq[name][slot] = self._decayed(name, slot) + n
            self.last[name][slot] = self.clock
