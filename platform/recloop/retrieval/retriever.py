"""A trained retriever as one object: the towers, the catalog and its index; loaded, queried, scored.

``Retriever.retrieve`` is the first stage of the recommendation path: user rows (id, context, history,
as the feature job builds them) → user vectors → the index's nearest catalog items. Ids the model has
no row for (admitted after it was trained) are looked up as out of vocabulary, as in its training data;
under a row budget an id without a row of its own (evicted, or not yet admitted) pools its table's hashed
fallback row.

Example::

    retriever = Retriever.load(Path(summary.checkpoint))
    ids, scores = retriever.retrieve(rows, k=500)          # (Q, 500) raw item ids, best first
    scores = score_window(retriever, validation_files, ks=(100, 500), oracle=WorldOracle(world))
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from scipy.special import log_softmax

from recloop.features.vocab import FIRST_INDEX
from recloop.model.retrieval import RetrievalConfig, TwoTowerModel
from recloop.retrieval.data import ItemCatalog, RetrievalFeatures, Rows, object_array, read_rows, user_bags
from recloop.retrieval.evaluate import (
    RetrievalScores,
    WorldOracle,
    oracle_recall,
    popularity_ranking,
    retrieval_scores,
    target_ranks,
)
from recloop.retrieval.index import IndexConfig, ItemIndex

ORACLE_USERS = 500  # users sampled for the oracle recall


class Retriever:
    """Towers + catalog + index (see the module docstring).

    Args:
        model: the two towers (in eval mode when served).
        features: which row columns feed the towers.
        catalog: the indexed items (vocabulary indices, raw ids, attributes).
        index: the catalog's vectors, searchable.
        item_clicks: (N,) training clicks per catalog item: the popularity fallback and baseline.
        attributes: raw item attributes per catalog item, (N,) each: float64 for numbers (NaN: unknown),
            objects for text (None: unknown); what the ranker is told about a retrieved item, and the
            category the ordering rules cap.
    """

    def __init__(self, model: TwoTowerModel, features: RetrievalFeatures, catalog: ItemCatalog, index: ItemIndex,
                 item_clicks: np.ndarray, attributes: dict[str, np.ndarray] | None = None):
        self.model, self.features, self.catalog, self.index = model, features, catalog, index
        self.item_clicks = np.asarray(item_clicks, dtype=np.int64)
        self.attributes = {k: v if isinstance(v, np.ndarray) and v.dtype == object
                           else np.asarray(v, dtype=np.float64) for k, v in (attributes or {}).items()}
        self._popular = popularity_ranking(self.item_clicks, catalog.raw_ids, len(catalog))
        self._by_id = np.argsort(catalog.raw_ids, kind="stable")
        self._sorted_ids = catalog.raw_ids[self._by_id]

    def has_user_row(self, user_index: int) -> bool:
        """Whether the user tower has a row of its own for this user index: one the vocabulary admitted before the
        model trained, or, under a row budget, an admitted and not evicted one."""
        if user_index < FIRST_INDEX:  # null or out of vocabulary
            return False
        return bool(self.model.user_tower.has_row(self.features.user_id, torch.tensor([user_index]))[0])

    def positions(self, item_ids: np.ndarray) -> np.ndarray:
        """Catalog positions of raw item ids (-1 for ids not in the catalog)."""
        item_ids = np.asarray(item_ids, dtype=np.int64)
        if len(self._sorted_ids) == 0:
            return np.full(len(item_ids), -1, dtype=np.int64)
        at = np.minimum(np.searchsorted(self._sorted_ids, item_ids), len(self._sorted_ids) - 1)
        return np.where(self._sorted_ids[at] == item_ids, self._by_id[at], -1)

    @torch.no_grad()
    def user_vectors(self, rows: Rows, batch_size: int = 8192) -> torch.Tensor:
        """(Q, D) vectors of user rows (one per row)."""
        tower = self.model.user_tower
        device = next(tower.parameters()).device
        out = []
        for start in range(0, len(rows), batch_size):
            index = np.arange(start, min(start + batch_size, len(rows)))
            values, offsets = user_bags(rows, self.features, index, device)
            out.append(tower(tower.known_ids(values, offsets), offsets).float().cpu())
        return torch.cat(out) if out else torch.zeros(0, self.model.config.output_dim)

    def retrieve(self, rows: Rows, k: int) -> tuple[np.ndarray, np.ndarray]:
        """Each row's ``k`` nearest catalog items: raw ids (Q, k) and scores, best first (-1: none)."""
        return self.index.search(self.user_vectors(rows), k)

    def log_propensity(self, item_ids: np.ndarray, scores: np.ndarray | None) -> np.ndarray:
        """log P(item | user) over the given retrieved items (normalized over them), from their retrieval
        ``scores`` (cosines): the towers' logits ``score / temperature``, plus log of the item's share of the
        training clicks when the model was trained with the logQ correction (which took exactly that out of
        its logits: what is left ranks items against their popularity, not by how likely the user picks them).

        ``scores`` None (a user the towers cannot place, answered from the popular items): the items' share of
        the training clicks alone, the best estimate of what someone the model knows nothing about picks.
        """
        if scores is None:
            logits = np.zeros(len(item_ids))
        else:
            logits = np.asarray(scores, dtype=np.float64) / self.model.config.temperature
        if scores is None or self.model.config.logq_correction:
            positions = self.positions(item_ids)
            clicks = np.where(positions >= 0, self.item_clicks[np.maximum(positions, 0)], 0).astype(np.float64)
            logits = logits + np.log((clicks + 1.0) / (self.item_clicks.sum() + len(self.item_clicks)))
        return log_softmax(logits) if len(logits) else logits

    def popular(self, k: int) -> np.ndarray:
        """The ``k`` most clicked catalog items (raw ids): the answer for a user the model cannot place."""
        return self._popular[:k]

    # --- files ---------------------------------------------------------------------------------------------

    def save_items(self, folder: Path) -> None:
        catalog = self.catalog
        tensors = {"item_index": catalog.item_index, "raw_ids": catalog.raw_ids, "dense": catalog.dense,
                   "clicks": self.item_clicks, **{f"categorical.{k}": v for k, v in catalog.categorical.items()},
                   **{f"attribute.{k}": v for k, v in self.attributes.items() if v.dtype != object}}
        save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in tensors.items()},
                  Path(folder) / "items.safetensors")
        text = {k: v.tolist() for k, v in self.attributes.items() if v.dtype == object}
        if text:  # text and list attributes (a brand, genres): safetensors holds numbers only
            (Path(folder) / "attributes.json").write_text(json.dumps(text))

    @classmethod
    def load(cls, folder: Path, device: str | torch.device = "cpu", index_config: IndexConfig | None = None
             ) -> Retriever:
        """A retriever saved by ``train_retriever`` (safetensors, JSON and the index's own file)."""
        folder = Path(folder)
        state = json.loads((folder / "state.json").read_text())
        features = RetrievalFeatures.from_dict(state["features"])
        model = TwoTowerModel(RetrievalConfig.from_dict(state["model"]), [tuple(t) for t in state["user_tables"]],
                              [tuple(t) for t in state["item_tables"]], len(features.item_dense),
                              set(features.history), device)
        model.load_state_dict(load_file(folder / "model.safetensors", device=str(torch.device(device))))
        model.eval()
        items = {k: v.numpy() for k, v in load_file(folder / "items.safetensors").items()}
        catalog = ItemCatalog(items["item_index"], items["raw_ids"],
                              {k.split(".", 1)[1]: v for k, v in items.items() if k.startswith("categorical.")},
                              items["dense"])
        return cls(model, features, catalog, ItemIndex.load(folder, index_config), items["clicks"],
                   saved_attributes(folder, items))


def saved_attributes(folder: Path, items: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The catalog's attributes as ``save_items`` wrote them: numbers in ``items.safetensors`` (``items``,
    its arrays), text in ``attributes.json``."""
    attributes = {k.split(".", 1)[1]: v for k, v in items.items() if k.startswith("attribute.")}
    if (Path(folder) / "attributes.json").exists():
        attributes.update({k: object_array(v)
                           for k, v in json.loads((Path(folder) / "attributes.json").read_text()).items()})
    return attributes


def score_window(retriever: Retriever, files: list[Path], ks: tuple[int, ...] = (100, 500),
                 oracle: WorldOracle | None = None, seed: int = 0) -> RetrievalScores:
    """Recall and NDCG@K of the clicks in ``files`` (overall, new users, new items), the popularity
    baseline on the same clicks, and with an oracle the oracle recall@K of both."""
    features = retriever.features
    rows = read_rows(files, features)
    top = max(ks)
    found, _ = retriever.retrieve(rows, top)
    targets = rows.columns[features.raw_item]
    ranks = target_ranks(found, targets)
    popular = retriever.popular(top)
    popular_ranks = target_ranks(np.broadcast_to(popular, (len(rows), len(popular))), targets)
    slices = {"user=new": rows.columns["user_is_new"], "item=new": rows.columns["item_is_new"]}
    oracle_figures = None
    if oracle is not None and len(rows):
        oracle_figures = oracle_scores(retriever, rows, oracle, ks, seed)
    scores = retrieval_scores(ranks, ks, slices, popular_ranks, oracle_figures)
    if oracle_figures is not None and scores.popularity is not None:
        for key in [k for k in scores.overall if k.startswith("popularity_")]:
            scores.popularity[key.removeprefix("popularity_")] = scores.overall.pop(key)
    return scores


def oracle_scores(retriever: Retriever, rows: Rows, oracle: WorldOracle, ks: tuple[int, ...], seed: int = 0
                  ) -> dict[str, float]:
    """Oracle recall@K of the retriever and of popularity, for up to ``ORACLE_USERS`` users of the window,
    each as of their last event in it."""
    features = retriever.features
    users = rows.columns[features.raw_user]
    order = np.argsort(rows.columns["ts"], kind="stable")
    last = {}
    for position in order:  # the newest row of each user
        last[int(users[position])] = position
    chosen = np.array(sorted(last.values()), dtype=np.int64)
    if len(chosen) > ORACLE_USERS:
        chosen = np.sort(np.random.default_rng(seed).choice(chosen, ORACLE_USERS, replace=False))
    sample = rows.take(chosen)
    day = oracle.day_of(int(np.median(sample.columns["ts"])))
    top = max(ks)
    best = oracle.best_items(sample.columns[features.raw_user], retriever.catalog.raw_ids, day, top)
    found, _ = retriever.retrieve(sample, top)
    popular = np.broadcast_to(retriever.popular(top), (len(sample), min(top, len(retriever.catalog))))
    out = {}
    for k in ks:
        best_k = best if k == top else oracle.best_items(sample.columns[features.raw_user],
                                                         retriever.catalog.raw_ids, day, k)
        out[f"oracle_recall@{k}"] = oracle_recall(found[:, :k], best_k)
        out[f"popularity_oracle_recall@{k}"] = oracle_recall(popular[:, :k], best_k)
    out["oracle_users"] = len(sample)
    return out
