"""Full and incremental training of the two-tower retriever, then every item's vector into the index.

Windows are the ranker's (``recloop.train``), by time: the files of the newest ``validation_hours`` of training
rows are held out; a ``full`` run trains from scratch on the ``days`` before them for ``epochs`` passes; an
``incremental`` run warm-starts from a retriever (weights and the tables' optimizer state), grows the
tables for ids the vocabularies admitted since, and makes one pass over the hours it has not seen.
Only clicked rows train it (in-batch negatives, log-Q correction: ``recloop.model.retrieval``).

Row budgets: a table whose feature has ``max_rows`` (the ranker's budget, ``CategoricalFeature.max_rows``; a
history list takes its vocabulary's), or which ``RetrievalConfig.max_rows`` names, is dynamic: it holds at most
that many rows, whatever the vocabularies grow to, and an incremental run does not grow it.

After training, the item tower embeds the whole catalog (every admitted item it has a row for) and the
vectors go into the ANN index. A run's folder holds everything serving needs, as safetensors, JSON and
the index's own file, never pickle::

    $RECLOOP_HOME/retrieval/<run id>/
        model.safetensors     both towers (tables, their optimizer state, MLPs)
        items.safetensors     catalog: item_index, raw_ids, numeric attributes, training clicks, vectors
        attributes.json       text attributes of the catalog items (only when there are some)
        index.faiss, index.safetensors, index.json      (recloop.retrieval.index)
        state.json            configuration, tables, windows, vocabulary version, summary

The run id is a hash of what it trains, so rerunning the same command finds the finished run.

Example::

    summary = train_retriever(settings, RetrievalTrainConfig(mode="full", days=3))
    summary.scores["overall"]["recall@500"], summary.checkpoint
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from recloop.data import training_files
from recloop.features.definition import FeatureLayout
from recloop.features.state import StateStore
from recloop.hours import file_hour, hour_after
from recloop.model.retrieval import RetrievalConfig, TwoTowerModel, in_batch_softmax_loss
from recloop.retrieval.data import (
    ItemCatalog,
    RetrievalFeatures,
    Rows,
    build_catalog,
    click_counts,
    item_bags,
    log_sampling_probability,
    newest_attributes,
    read_rows,
    user_bags,
)
from recloop.retrieval.index import IndexConfig, ItemIndex
from recloop.settings import Settings


class RetrievalTrainError(RuntimeError):
    """Training cannot start: no clicks, nothing new, or a warm start that does not fit the features."""


@dataclass(frozen=True)
class RetrievalTrainConfig:
    """What a retriever training run does.

    Args:
        mode: ``full`` or ``incremental``.
        days, epochs: window and passes of a full run (an incremental run makes one pass).
        batch_size: clicks per step, and so in-batch negatives per click + 1.
        lr: the towers' MLPs' Adam learning rate (the tables use ``model.embedding_lr``).
        validation_hours: newest hours held out, as the ranker's.
        min_validation_clicks: the held-out window grows back, period by period, until it holds this many clicks
            (the gate's ``min_clicks``) or half of the periods; a sparse log's last period may hold one click.
        eval_ks: the K of recall@K and NDCG@K in the summary (the largest is retrieved).
        seed, device: reproducibility and placement (``auto``: CUDA when present).
        model, features, index: the towers, which columns feed them, the ANN index.
        spec: the dataset spec of the lake, a shipped name or a YAML path (the catalog's raw item attributes
            are read from it).
    """

    mode: Literal["full", "incremental"] = "full"
    days: int = 7
    epochs: int = 3
    batch_size: int = 512
    lr: float = 3e-3
    validation_hours: int = 6
    min_validation_clicks: int = 200
    eval_ks: tuple[int, ...] = (100, 500)
    seed: int = 0
    device: str = "auto"
    model: RetrievalConfig = field(default_factory=RetrievalConfig)
    features: RetrievalFeatures | None = None  # None: from the spec and the lake (``features_for``)
    index: IndexConfig = field(default_factory=IndexConfig)
    spec: str = "synthetic"

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class RetrievalSummary:
    mode: str
    run_id: str
    checkpoint: str
    clicks: int = 0
    steps: int = 0
    seconds: float = 0.0
    index_seconds: float = 0.0
    catalog_items: int = 0
    scores: dict = field(default_factory=dict)  # RetrievalScores.to_dict() on the held-out hours
    loss_curve: list[list[float]] = field(default_factory=list)
    train_hours: list[str] = field(default_factory=list)
    validation_hours: list[str] = field(default_factory=list)
    trained_until: str = ""
    state_version: int = 0
    warm_start: str | None = None
    grown_tables: dict[str, list[int]] = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        out["train_hours"] = [self.train_hours[0], self.train_hours[-1]] if self.train_hours else []
        return out


def retrieval_dir(settings: Settings) -> Path:
    return settings.home.resolve() / "retrieval"


def latest_retriever(settings: Settings) -> Path | None:
    """The newest finished retriever run (until the registry names a champion)."""
    done = [(json.loads(p.read_text()).get("finished_at", 0), p.parent) for p in retrieval_dir(settings).glob(
        "*/state.json")]
    return max(done)[1] if done else None


def read_state(folder: Path) -> dict:
    """A retriever folder's JSON state (with ``path``)."""
    try:
        state = json.loads((Path(folder) / "state.json").read_text())
    except FileNotFoundError as err:
        raise RetrievalTrainError(f"{folder} is not a retriever (no state.json)") from err
    state["path"] = str(folder)
    return state


def train_retriever(settings: Settings, config: RetrievalTrainConfig, *, warm_start: Path | None = None,
                    oracle=None) -> RetrievalSummary:
    """Train (full or incremental), export the catalog's vectors and index, score the held-out hours.

    Args:
        warm_start: the retriever an incremental run starts from (default: the newest finished one).
        oracle: a ``WorldOracle`` to add the oracle recall to the held-out scores (simulated worlds).
    """
    from recloop.retrieval.retriever import Retriever, score_window

    layout = FeatureLayout.for_settings(settings)
    files = training_files(layout.training)
    validation, trainable, recent = time_windows(files, config.validation_hours, config.days,
                                                 config.min_validation_clicks, clicks_in)
    base = None
    if config.mode == "incremental":
        base_path = warm_start or latest_retriever(settings)
        if base_path is None:
            raise RetrievalTrainError("incremental training needs a retriever to start from: train a full one first")
        base = read_state(base_path)
        train_files = [f for f in trainable if f.stem >= base["trained_until"]]
        if not train_files:
            raise RetrievalTrainError(f"nothing new to train on: {base['path']} has seen every hour up to "
                                      f"{base['trained_until']}")
        epochs = 1
    else:
        train_files, epochs = recent, config.epochs

    if config.features is None:  # a warm start keeps its towers' columns; a full run derives them
        config = replace(config, features=RetrievalFeatures.from_dict(base["features"]) if base and "features" in base
                         else features_for(settings, config.spec, layout.schema))
    # Row budgets: the features' (per column, as the ranker's) and the retriever's configuration (per table; it wins).
    budgets = {**dict(config.features.table_budgets(layout.schema)), **dict(config.model.max_rows)}
    config = replace(config, model=replace(config.model, max_rows=tuple(budgets.items())))
    state = StateStore(layout.state).latest()
    identity = {"mode": config.mode, "files": [f.stem for f in train_files], "base": base["path"] if base else None,
                "config": config.to_dict(), "state_version": state.version}
    run_id = f"{config.mode}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]}"
    run_dir = retrieval_dir(settings) / run_id
    if (run_dir / "state.json").exists():
        return RetrievalSummary(**read_state(run_dir)["summary"])

    features = config.features
    device = torch.device("cuda" if config.device == "auto" and torch.cuda.is_available()
                          else "cpu" if config.device == "auto" else config.device)
    user_tables, item_tables = features.table_sizes(layout.schema)
    model, grown = _build(config, user_tables, item_tables, base, device)
    clicks = read_rows(train_files, features)
    if len(clicks) == 0:
        raise RetrievalTrainError(f"no clicks in the training window {train_files[0].stem}..{train_files[-1].stem}")
    # popularity (the fallback, the gate's baseline) and the log-Q correction: the clicks of the whole window,
    # not only an incremental run's new hours
    counts = click_counts(clicks if train_files == recent else read_rows(recent, features), features,
                          dict(item_tables)[features.item_id])
    log_q = torch.from_numpy(log_sampling_probability(counts)).to(device)

    started = time.perf_counter()
    steps, loss_curve = fit(model, clicks, features, log_q, config, epochs, device)
    seconds = time.perf_counter() - started

    catalog = build_catalog(read_rows(files, features, clicked_only=False), features,
                            state.vocabularies[features.item_vocabulary])
    # every admitted item the item tower can embed: below its table's rows, or any under a budget (an item
    # without a row of its own, evicted or not yet admitted, is embedded from its fallback row)
    known = (np.ones(len(catalog), dtype=bool) if features.item_id in model.item_tower.dynamic_tables
             else catalog.item_index < model.item_tower.embeddings.layout.rows[0])
    catalog = ItemCatalog(catalog.item_index[known], catalog.raw_ids[known],
                          {k: v[known] for k, v in catalog.categorical.items()}, catalog.dense[known])
    vectors = item_vectors(model, catalog, features, device)
    index = ItemIndex.build(vectors.numpy(), catalog.raw_ids, config.index)
    item_clicks = counts[catalog.item_index]
    retriever = Retriever(model, features, catalog, index, item_clicks,
                          catalog_attributes(settings, config, catalog.raw_ids))
    scores = score_window(retriever, validation, config.eval_ks, oracle)

    summary = RetrievalSummary(
        mode=config.mode, run_id=run_id, checkpoint=str(run_dir), clicks=len(clicks), steps=steps,
        seconds=round(seconds, 3), index_seconds=round(index.build_seconds, 4), catalog_items=len(catalog),
        scores=scores.to_dict(), loss_curve=loss_curve, train_hours=[f.stem for f in train_files],
        validation_hours=[f.stem for f in validation], trained_until=hour_after(train_files[-1].stem),
        state_version=state.version, warm_start=base["path"] if base else None, grown_tables=grown)
    _save(run_dir, retriever, config, user_tables, item_tables, summary)
    return summary


def features_for(settings: Settings, spec_source: str, schema_path: Path) -> RetrievalFeatures:
    """``RetrievalFeatures.for_spec`` over the newest 200k events of the lake."""
    from recloop import datasets
    from recloop.ingest.lake import read_window

    spec = datasets.resolve(settings, spec_source, remember=False)
    if spec.item_key is None:
        raise RetrievalTrainError(f"spec {spec.name!r} has no item_key column: nothing to retrieve")
    wanted = [spec.item_key, *(c.name for c in spec.columns if c.role in ("categorical", "numeric")
                               or (c.role == "multi_hot" and c.vocabulary != spec.item_key))]  # (a history: no)
    events = read_window(settings, spec, None, None, columns=wanted)
    events = events.slice(max(0, events.num_rows - 200_000)).to_pandas()
    try:
        return RetrievalFeatures.for_spec(spec, events, schema_path)
    except ValueError as err:
        raise RetrievalTrainError(str(err)) from err


def clicks_in(path: Path) -> int:
    """The clicks (positive labels) of one training-rows file."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    return int(pc.sum(pq.read_table(path, columns=["label"])["label"]).as_py() or 0)


def time_windows(files: list[Path], validation_hours: int, days: int, min_clicks: int = 0,
                 clicks: Callable[[Path], int] | None = None) -> tuple[list[Path], list[Path], list[Path]]:
    """(held out, the files before them, the last ``days`` of those): by time, as the ranker's windows, whatever
    the files' period (an hour, a day, a week) and however many hours had no events. At least one file is
    held out and one left to train on; with ``min_clicks`` (counted by ``clicks``), the held-out window grows
    back a file at a time until it holds them or half of the files."""
    if len(files) < 2:
        raise RetrievalTrainError(f"{len(files)} period(s) of training rows: one is held out, so nothing is left "
                                  "to train on (run `recloop features` first)")
    newest = file_hour(files[-1])
    cut = len(files) - 1
    while cut > 0 and file_hour(files[cut - 1]) > newest - timedelta(hours=validation_hours):
        cut -= 1
    if cut == 0:
        raise RetrievalTrainError(f"the {validation_hours} hours held out cover all {len(files)} files of training "
                                  "rows: nothing is left to train on")
    if min_clicks and clicks is not None:
        held = sum(clicks(f) for f in files[cut:])
        while held < min_clicks and cut > 1 and len(files) - cut < len(files) // 2:
            cut -= 1
            held += clicks(files[cut])
    validation, trainable = files[cut:], files[:cut]
    since = file_hour(validation[0]) - timedelta(days=days)
    recent = [f for f in trainable if file_hour(f) >= since]
    if not recent:
        raise RetrievalTrainError(f"no training rows in the {days} days before the held-out hours (the newest "
                                  f"before them start {trainable[-1].stem}): build features for that stretch, "
                                  "or train over more days")
    return validation, trainable, recent


def catalog_attributes(settings: Settings, config: RetrievalTrainConfig, raw_ids: np.ndarray
                       ) -> dict[str, np.ndarray]:
    """The catalog items' newest raw attributes in the lake (``features.item_attributes``)."""
    from recloop import datasets
    from recloop.ingest.lake import read_window

    spec = datasets.resolve(settings, config.spec, remember=False)
    wanted = [c.name for c in spec.columns if c.name in config.features.item_attributes]
    events = read_window(settings, spec, None, None, columns=[spec.item_key, spec.timestamp, *wanted])
    return newest_attributes(events, spec.item_key, spec.timestamp, tuple(wanted), raw_ids)


def fit(model: TwoTowerModel, clicks: Rows, features: RetrievalFeatures, log_q: torch.Tensor | None,
        config: RetrievalTrainConfig, epochs: int, device: torch.device) -> tuple[int, list[list[float]]]:
    """Passes of in-batch-softmax steps over the clicks; returns the steps made and the loss every 10 steps."""
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=config.lr)
    rng = np.random.default_rng(config.seed)
    item_ids = clicks.columns[features.item_id]
    dense = np.stack([clicks.columns[c].astype(np.float32) for c in features.item_dense], axis=1) \
        if features.item_dense else np.zeros((len(clicks), 0), np.float32)
    dense = np.nan_to_num(dense)
    steps, curve = 0, []
    model.train()
    for _ in range(epochs):
        order = rng.permutation(len(clicks))
        for start in range(0, len(order), config.batch_size):
            batch = order[start:start + config.batch_size]
            if len(batch) < 2:  # a softmax over one item teaches nothing
                continue
            user_values, user_offsets = user_bags(clicks, features, batch, device)
            item_values, item_offsets = item_bags(item_ids[batch], [clicks.columns[c][batch] for c in
                                                                   features.item_categorical], device)
            users, items = model(user_values, user_offsets, item_values, item_offsets,
                                 torch.from_numpy(dense[batch]).to(device))
            targets = torch.from_numpy(item_ids[batch]).to(device)
            correction = log_q[targets] if (log_q is not None and model.config.logq_correction) else None
            loss = in_batch_softmax_loss(users, items, targets, correction, model.config.temperature)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # the tables' rows touched by the batch are updated here (fused optimizer)
            optimizer.step()
            steps += 1
            if steps % 10 == 0:
                curve.append([steps, round(float(loss.detach()), 5)])
    model.eval()
    return steps, curve


@torch.no_grad()
def item_vectors(model: TwoTowerModel, catalog: ItemCatalog, features: RetrievalFeatures,
                 device: torch.device | str = "cpu", batch_size: int = 65536) -> torch.Tensor:
    """Every catalog item's vector through the item tower: (N, D) float32 on the host."""
    out = []
    for start in range(0, len(catalog), batch_size):
        part = slice(start, start + batch_size)
        values, offsets = item_bags(catalog.item_index[part], [catalog.categorical[c][part] for c in
                                                                features.item_categorical], device)
        out.append(model.item_tower(values, offsets, torch.from_numpy(catalog.dense[part]).to(device)).float().cpu())
    return torch.cat(out) if out else torch.zeros(0, model.config.output_dim)


def _build(config: RetrievalTrainConfig, user_tables, item_tables, base: dict | None, device: torch.device
           ) -> tuple[TwoTowerModel, dict[str, list[int]]]:
    """A new model, or the base retriever's grown to the current vocabularies."""
    multi_hot = set(config.features.history)
    if base is None:
        return TwoTowerModel(config.model, user_tables, item_tables, len(config.features.item_dense), multi_hot,
                             device, config.seed), {}
    old_user, old_item = [tuple(t) for t in base["user_tables"]], [tuple(t) for t in base["item_tables"]]
    if [n for n, _ in old_user] != [n for n, _ in user_tables] or [n for n, _ in old_item] != [
            n for n, _ in item_tables]:
        raise RetrievalTrainError(f"retriever {base['path']} has tables {old_user} / {old_item}; the features give "
                                  f"{user_tables} / {item_tables}: train a full one")
    base_model = RetrievalConfig.from_dict(base["model"])
    names = {n for n, _ in (*old_user, *old_item)}
    old_budgets = {n: r for n, r in base_model.max_rows if n in names}
    budgets = {n: r for n, r in config.model.max_rows if n in names}
    if old_budgets != budgets:
        raise RetrievalTrainError(f"retriever {base['path']} has row budgets {old_budgets}, the features and "
                                  f"configuration give {budgets}: train a full one")
    model = TwoTowerModel(base_model, old_user, old_item, len(config.features.item_dense), multi_hot, device,
                          config.seed)
    model.load_state_dict(load_file(Path(base["path"]) / "model.safetensors", device=str(device)))
    grown = {}
    for tower, tables in ((model.user_tower, user_tables), (model.item_tower, item_tables)):
        for (name, rows), old_rows in zip(tables, tower.embeddings.layout.rows, strict=True):
            if name in budgets:  # a dynamic table's rows are a budget, not a vocabulary's size: nothing to grow
                continue
            if rows < old_rows:
                raise RetrievalTrainError(f"table {name} shrank from {old_rows} to {rows} rows: vocabularies are "
                                          "append-only, so the features were rebuilt; train a full retriever")
            if rows > old_rows:
                tower.embeddings.grow(name, rows)
                grown[name] = [old_rows, rows]
    return model, grown


def _save(run_dir: Path, retriever, config: RetrievalTrainConfig, user_tables, item_tables,
          summary: RetrievalSummary) -> None:
    """Write the run's folder aside and rename it into place: it appears whole or not at all."""
    staging = run_dir.with_name(f".{run_dir.name}.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in retriever.model.state_dict().items()},
              staging / "model.safetensors")
    retriever.save_items(staging)
    retriever.index.save(staging)
    info = {"model": config.model.to_dict(), "train": config.to_dict(), "features": config.features.to_dict(),
            "user_tables": [[n, r] for n, r in zip(config.features.user_tables,
                                                   retriever.model.user_tower.embeddings.layout.rows, strict=True)],
            "item_tables": [[n, r] for n, r in zip(config.features.item_tables,
                                                   retriever.model.item_tower.embeddings.layout.rows, strict=True)],
            "trained_until": summary.trained_until, "state_version": summary.state_version,
            "finished_at": time.time(), "summary": asdict(summary)}
    (staging / "state.json").write_text(json.dumps(info, indent=2, default=_json_default) + "\n")
    shutil.rmtree(run_dir, ignore_errors=True)
    os.replace(staging, run_dir)


def _json_default(value):
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, float) and math.isnan(value):
        return None
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


