"""The retriever's inputs, read from the ranker's training rows: same lake, same vocabularies, same indices.

The feature job writes one training row per impression (``c_*`` vocabulary indices, ``m_*`` lists,
``d_*`` floats, and the raw entity keys). The retriever uses

- the **clicked** rows as (user, item) positives: the user side is the user id, the context and the
  click history as of the event; the item side is the item id and its attributes;
- the **catalog**: every item the item vocabulary has admitted, with its attributes from its newest row;
- the **popularity** of items among the training clicks (the log-Q correction's sampling probability,
  and the popularity baseline).

Batches are in the kernels' jagged, table-major layout (see ``recloop_kernels.collection``)::

    user bags:  [user_id × B][device × B][country × B][history lists × B]    offsets: T_u·B + 1
    item bags:  [item_id × B][category × B]                                  offsets: T_i·B + 1

Example::

    rows = read_rows(files, RetrievalFeatures(), clicked_only=True)
    values, offsets = user_bags(rows, RetrievalFeatures(), np.arange(len(rows)))
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from recloop.features.vocab import FIRST_INDEX, Vocabulary

# Columns carried along for evaluation: raw keys, event time, the new-entity flags, the true probability.
EXTRA_COLUMNS = ("ts", "user_is_new", "item_is_new", "p_click")


@dataclass(frozen=True)
class RetrievalFeatures:
    """Which training-row columns feed which tower (defaults: the synthetic dataset's columns).

    Args:
        user_id, item_id: the entity indices (``c_<key>``).
        context: one-hot request columns of the user tower (known at request time).
        history: list columns of the user tower (recent clicks, mapped through the item vocabulary).
        item_categorical: one-hot item attributes.
        item_dense: float item attributes.
        raw_user, raw_item: the raw entity keys (int64), as requests name them.
        item_vocabulary: the vocabulary (column) whose admitted ids are the catalog.
        item_attributes: the dataset's raw item columns (as requests name them) kept per catalog item: the
            ranker is asked about retrieved items with these as their per-candidate context, and the
            ordering rules read the category from them.
        category: the attribute the per-category cap and boosts apply to ("" for none): the first categorical
            item attribute with integer values (boosts are keyed by integers).
    """

    user_id: str = "c_user_id"
    context: tuple[str, ...] = ("c_device", "c_country")
    history: tuple[str, ...] = ("m_history",)
    item_id: str = "c_item_id"
    item_categorical: tuple[str, ...] = ("c_category",)
    item_dense: tuple[str, ...] = ("d_price",)
    raw_user: str = "user_id"
    raw_item: str = "item_id"
    item_vocabulary: str = "item_id"
    item_attributes: tuple[str, ...] = ("category", "price")
    category: str = "category"

    @property
    def user_tables(self) -> tuple[str, ...]:
        return (self.user_id, *self.context, *self.history)

    @property
    def item_tables(self) -> tuple[str, ...]:
        return (self.item_id, *self.item_categorical)

    @property
    def columns(self) -> tuple[str, ...]:
        return (*self.user_tables, *self.item_tables, *self.item_dense, self.raw_user, self.raw_item)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, raw: dict) -> RetrievalFeatures:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})

    @classmethod
    def for_spec(cls, spec, events, schema_path: Path) -> RetrievalFeatures:
        """The towers' columns for a dataset spec (any key names), from its roles and its data.

        The keys come from the spec's ``user_key`` / ``item_key``; the user's history is every multi-hot
        column that shares the item key's vocabulary. A categorical or numeric column whose value is fixed
        per item (in at least 99 % of the items seen in ``events``, a pandas frame of the lake) is an item
        attribute (item tower); another categorical column is request context (user tower); a numeric one
        that varies per event (a position, say) is left out. Only columns the feature job wrote are used.
        """
        user, item = spec.user_key, spec.item_key
        if user is None or item is None:
            raise ValueError(f"spec {spec.name!r} has no user_key or item_key column: retrieval needs both")
        raw = json.loads(Path(schema_path).read_text())
        categorical, dense = set(raw["categorical"]), set(raw["dense"])

        def fixed_per_item(column: str) -> bool:
            values = events[column]
            if spec.column(column).dtype == "list<int64>":  # lists are not hashable: as tuples
                values = values.map(lambda v: None if v is None else tuple(v.tolist() if isinstance(v, np.ndarray) else v))
            distinct = values.groupby(events[item]).nunique(dropna=True)
            return len(distinct) > 0 and float((distinct <= 1).mean()) >= 0.99

        item_categorical, item_dense, context, attributes, integer_categories = [], [], [], [], []
        for column in spec.columns:
            if column.role == "categorical" and f"c_{column.name}" in categorical:
                if fixed_per_item(column.name):
                    item_categorical.append(f"c_{column.name}")
                    attributes.append(column.name)
                    if column.dtype.startswith(("int", "uint")):
                        integer_categories.append(column.name)
                else:
                    context.append(f"c_{column.name}")
            elif column.role == "numeric" and f"d_{column.name}" in dense and fixed_per_item(column.name):
                item_dense.append(f"d_{column.name}")
                attributes.append(column.name)
        history = tuple(f"m_{c.name}" for c in spec.model_lists()
                        if c.vocabulary == item and f"m_{c.name}" in raw["multi_hot"])
        # a list fixed per item (a film's genres) is kept with the catalog too: /recommend's rank stage gives it
        # to the ranker, which was trained with it (without, every candidate's genres were unknown to it)
        attributes += [c.name for c in spec.columns if c.role == "multi_hot" and c.vocabulary != item
                       and f"m_{c.name}" in raw["multi_hot"] and c.name in events.columns and fixed_per_item(c.name)]
        return cls(user_id=f"c_{user}", context=tuple(context), history=history, item_id=f"c_{item}",
                   item_categorical=tuple(item_categorical), item_dense=tuple(item_dense), raw_user=user,
                   raw_item=item, item_vocabulary=item, item_attributes=tuple(attributes),
                   category=integer_categories[0] if integer_categories else "")

    def table_sizes(self, schema_path: Path) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        """(name, rows) of the user tower's and the item tower's tables, from the feature job's schema."""
        raw = json.loads(Path(schema_path).read_text())
        sizes = {k: v["num_embeddings"] for k, v in {**raw["categorical"], **raw["multi_hot"]}.items()}
        missing = [c for c in (*self.user_tables, *self.item_tables) if c not in sizes]
        if missing:
            raise ValueError(f"the training rows have no columns {missing} (schema {schema_path})")
        return [(c, sizes[c]) for c in self.user_tables], [(c, sizes[c]) for c in self.item_tables]

    def table_budgets(self, schema_path: Path) -> tuple[tuple[str, int], ...]:
        """(table, max_rows) of the towers' tables under a row budget, from the feature job's schema: a
        categorical column's own (``CategoricalFeature.max_rows``, as the ranker takes it), and for a list
        column the budget of the column whose vocabulary it uses (the history's ids are item ids: a budget on
        the item id bounds the history's table too)."""
        raw = json.loads(Path(schema_path).read_text())
        own = {k: int(v["max_rows"]) for k, v in raw["categorical"].items() if v.get("max_rows")}
        by_vocabulary = {k: own.get(f"c_{v['vocabulary']}") for k, v in raw["multi_hot"].items()}
        budgets = {**own, **{k: v for k, v in by_vocabulary.items() if v}}
        return tuple((c, budgets[c]) for c in (*self.user_tables, *self.item_tables) if c in budgets)


@dataclass
class Rows:
    """Training rows held as numpy columns; list columns as (offsets (N+1,), values)."""

    columns: dict[str, np.ndarray]
    lists: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def take(self, index: np.ndarray) -> Rows:
        """The rows at ``index``, in that order."""
        lists = {}
        for name, (offsets, values) in self.lists.items():
            starts, lengths = offsets[index], offsets[index + 1] - offsets[index]
            lists[name] = (np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64), values[_ranges(starts, lengths)])
        return Rows({k: v[index] for k, v in self.columns.items()}, lists)


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenated ``arange(s, s + n)`` for each (s, n), vectorized."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends = np.cumsum(lengths)
    return np.repeat(starts - (ends - lengths), lengths) + np.arange(total)


def read_rows(files: list[Path], features: RetrievalFeatures, clicked_only: bool = True) -> Rows:
    """The retriever's columns of these training files (only the clicked rows by default)."""
    wanted = list(dict.fromkeys([*features.columns, "label", *EXTRA_COLUMNS]))
    tables = []
    for path in files:
        present = set(pq.read_schema(path).names)
        table = pq.read_table(path, columns=[c for c in wanted if c in present])
        if clicked_only:
            table = table.filter(pc.greater(table["label"], 0))
        tables.append(table)
    if not tables:
        raise ValueError("no training files given")
    table = pa.concat_tables(tables, promote_options="permissive")  # int32 ids next to int64 ones: widened
    columns, lists = {}, {}
    for name in table.column_names:
        column = table[name].combine_chunks()
        if name in features.history:
            column = column.fill_null(pa.scalar([], column.type))
            offsets = column.offsets.to_numpy().astype(np.int64)
            lists[name] = (offsets - offsets[0], pc.list_flatten(column).to_numpy().astype(np.int64))
        elif name == "ts":
            columns[name] = column.cast(pa.int64()).to_numpy()
        else:
            columns[name] = column.to_numpy(zero_copy_only=False)
    for flag in ("user_is_new", "item_is_new"):  # missing → not new
        columns.setdefault(flag, np.zeros(table.num_rows, dtype=bool))
    return Rows(columns, lists)


def user_bags(rows: Rows, features: RetrievalFeatures, index: np.ndarray, device: str | torch.device = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The user tower's (values, offsets) for rows ``index``: one-hot tables, then the history lists."""
    one_hot = [rows.columns[c][index] for c in (features.user_id, *features.context)]
    lists = [rows.take(index).lists[c] for c in features.history] if features.history else []
    return jagged(one_hot, lists, device)


def item_bags(item_ids: np.ndarray, categorical: list[np.ndarray], device: str | torch.device = "cpu"
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """The item tower's (values, offsets): the item id, then each categorical attribute, one id per bag."""
    return jagged([item_ids, *categorical], [], device)


def jagged(one_hot: list[np.ndarray], lists: list[tuple[np.ndarray, np.ndarray]], device: str | torch.device
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Table-major bags: each one-hot column gives bags of one id, each list column its lists."""
    batch = len(one_hot[0]) if one_hot else len(lists[0][0]) - 1
    values = [np.asarray(c, dtype=np.int64) for c in one_hot] + [v for _, v in lists]
    lengths = [np.ones(batch, dtype=np.int64)] * len(one_hot) + [np.diff(o) for o, _ in lists]
    offsets = np.concatenate([[0], np.cumsum(np.concatenate(lengths))]).astype(np.int64)
    flat = np.concatenate(values) if values else np.zeros(0, dtype=np.int64)
    return torch.from_numpy(flat).to(device), torch.from_numpy(offsets).to(device)


@dataclass(frozen=True)
class ItemCatalog:
    """Every admitted item with its attributes: what the index holds.

    Args:
        item_index: (N,) vocabulary indices (the item tower's ids).
        raw_ids: (N,) the items' raw keys, as requests and responses name them.
        categorical: per attribute column, (N,) indices (0 = null when the item has no row yet).
        dense: (N, n_dense) float32 attributes (0 when unknown).
    """

    item_index: np.ndarray
    raw_ids: np.ndarray
    categorical: dict[str, np.ndarray]
    dense: np.ndarray

    def __len__(self) -> int:
        return len(self.item_index)


def build_catalog(rows: Rows, features: RetrievalFeatures, vocabulary: Vocabulary) -> ItemCatalog:
    """The admitted items of ``vocabulary``, with attributes from their newest row in ``rows`` (all rows,
    not only clicks: an item shown but never clicked still has attributes)."""
    admitted = vocabulary.admitted()
    item_index = admitted["index"].to_numpy().astype(np.int64)
    raw_ids = admitted["value"].cast(pa.int64()).to_numpy()
    size = FIRST_INDEX + len(item_index)
    order = np.argsort(rows.columns["ts"], kind="stable") if "ts" in rows.columns else np.arange(len(rows))
    newest = np.full(size, -1, dtype=np.int64)
    newest[rows.columns[features.item_id][order]] = order  # later rows overwrite earlier ones
    row = newest[item_index]
    known = row >= 0
    categorical = {}
    for column in features.item_categorical:
        values = np.zeros(len(item_index), dtype=np.int64)
        values[known] = rows.columns[column][row[known]]
        categorical[column] = values
    dense = np.zeros((len(item_index), len(features.item_dense)), dtype=np.float32)
    for j, column in enumerate(features.item_dense):
        dense[known, j] = np.nan_to_num(rows.columns[column][row[known]].astype(np.float32))
    return ItemCatalog(item_index, raw_ids, categorical, dense)


def click_counts(rows: Rows, features: RetrievalFeatures, num_items: int) -> np.ndarray:
    """Clicks per item index (rows: clicked rows), length ``num_items``."""
    return np.bincount(rows.columns[features.item_id], minlength=num_items)[:num_items].astype(np.int64)


def log_sampling_probability(counts: np.ndarray, smoothing: float = 1.0) -> np.ndarray:
    """log q per item: its share of the training clicks, smoothed so an unclicked item is not −inf."""
    counts = counts.astype(np.float64) + smoothing
    return np.log(counts / counts.sum()).astype(np.float32)


def object_array(values: list) -> np.ndarray:
    """A 1-D object array of ``values`` as they are (``np.array`` makes lists of equal length a 2-D array)."""
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def newest_attributes(events: pa.Table, item_key: str, timestamp: str, columns: tuple[str, ...],
                      raw_ids: np.ndarray) -> dict[str, np.ndarray]:
    """Each item's newest value of each raw attribute column in ``events`` (lake rows), aligned with
    ``raw_ids``: float64 for numbers (NaN where the item has no row or the value is null), objects for text
    and lists (None there)."""
    def as_objects(column: str) -> bool:  # text and lists: kept as Python objects
        return column in events.column_names and (pa.types.is_string(events[column].type)
                                                 or pa.types.is_large_string(events[column].type)
                                                 or pa.types.is_list(events[column].type)
                                                 or pa.types.is_large_list(events[column].type))

    out = {c: np.full(len(raw_ids), None, dtype=object) if as_objects(c) else np.full(len(raw_ids), np.nan)
           for c in columns}
    present = [c for c in columns if c in events.column_names]
    if events.num_rows == 0 or not present:
        return out
    order = np.argsort(events[timestamp].cast(pa.int64()).to_numpy(), kind="stable")
    items = events[item_key].combine_chunks().to_numpy(zero_copy_only=False)[order]
    last = np.unique(items[::-1], return_index=True)  # (sorted ids, their newest row counted from the end)
    ids, newest = last[0], len(items) - 1 - last[1]
    position = np.searchsorted(ids, raw_ids)
    found = (position < len(ids)) & (ids[np.minimum(position, len(ids) - 1)] == raw_ids)
    rows = order[newest[position[found]]]
    for column in present:
        values = events[column].combine_chunks() if as_objects(column) else events[column].cast(pa.float64()).combine_chunks()
        values = object_array(values.to_pylist()) if as_objects(column) else values.to_numpy(zero_copy_only=False)
        out[column][found] = values[rows]
    return out
