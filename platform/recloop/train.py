"""Full and incremental training with checkpoints that resume, on the chunked loader and fused kernels.

Windows come from the hourly training files of ``recloop features``:

- the newest ``validation_hours`` hours are held out (never trained on) and score the model;
- ``full``: from scratch over the ``days`` before them, ``epochs`` passes;
- ``incremental``: warm start from a checkpoint (weights, sparse and dense optimizer state), grow the
  embedding tables for ids that are new since, one pass over the hours it has not seen (plus an
  optional replay sample of older hours).

A run's folder is named by a hash of what it trains (mode, window, base checkpoint, configuration), so
rerunning the same command after a crash finds it and resumes from its last checkpoint; in
deterministic mode the resumed run ends with the same weights as an uninterrupted one. Checkpoints are
safetensors (tensors) plus JSON (configuration, vocabulary version, counters), never pickle::

    $RECLOOP_HOME/checkpoints/<run id>/step-000400/{model.safetensors, dense_optimizer.safetensors, state.json}
    $RECLOOP_HOME/checkpoints/<run id>/latest.json   → the newest complete step folder (atomic rename)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file, save_file

from recloop.data import ChunkLoader, FeatureSchema, training_files
from recloop.evaluate import metrics, predict, slice_metrics
from recloop.features.job import FeatureLayout
from recloop.model import ModelConfig, RankingModel
from recloop.settings import Settings

ORACLE_COLUMNS = ("p_click",)
# Columns of the training rows the validation is sliced by (when present): new vs returning users,
# device, item category. The gate compares candidate and champion on each slice.
SLICE_COLUMNS = ("user_is_new", "c_device", "c_category")


class TrainError(RuntimeError):
    """Training cannot start: no rows, nothing new, or a checkpoint that does not fit the features."""


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does.

    Args:
        mode: ``full`` or ``incremental``.
        days: window of a full retrain (hours before the held-out ones).
        epochs: passes of a full retrain (an incremental run makes one).
        batch_size: rows per step.
        lr: dense (MLP) Adam learning rate at ``reference_batch``; scaled by sqrt(batch/reference) and,
            from scratch, warmed up linearly over ``warmup_steps`` so large batches stay stable.
        validation_hours: newest hours held out for validation.
        replay_fraction: incremental only: older hours replayed, as a fraction of the new hours.
        checkpoint_every: steps between checkpoints.
        warm_state_decay: incremental only: the embedding optimizer's accumulated state is multiplied by
            this at warm start. Adagrad's sums only grow, so without decay a model trained for long takes
            ever smaller steps on new data.
        deterministic: results that do not depend on thread scheduling (and equal after a resume).
        device: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.
        compile: ``torch.compile`` backend for the model (``inductor``, ``aot_eager``...), ``off``, or
            ``auto``: inductor on a GPU, where every batch but an epoch's last has the same shape and launch
            overhead matters; eager on a CPU. The embedding kernels are torch.library ops, so the model
            compiles whole around them.
    """

    mode: Literal["full", "incremental"] = "full"
    days: int = 7
    epochs: int = 1
    batch_size: int = 4096
    lr: float = 1e-3
    reference_batch: int = 1024
    warmup_steps: int = 20
    validation_hours: int = 6
    replay_fraction: float = 0.0
    checkpoint_every: int = 200
    warm_state_decay: float = 1.0
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"
    compile: str = "auto"
    model: ModelConfig = field(default_factory=ModelConfig)

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass
class TrainSummary:
    mode: str
    run_id: str
    checkpoint: str
    samples: int = 0
    steps: int = 0
    samples_per_s: float = 0.0
    seconds: float = 0.0
    auc: float = float("nan")
    logloss: float = float("nan")
    calibration: float = float("nan")
    oracle_auc: float | None = None
    validation_rows: int = 0
    slices: dict[str, dict[str, float]] = field(default_factory=dict)
    loss_curve: list[list[float]] = field(default_factory=list)  # [step, training loss] every 10 steps
    train_hours: list[str] = field(default_factory=list)
    validation_hours: list[str] = field(default_factory=list)
    trained_until: str = ""
    state_version: int = 0
    warm_start: str | None = None
    grown_tables: dict[str, list[int]] = field(default_factory=dict)
    resumed_from_step: int = 0

    def to_dict(self) -> dict:
        out = asdict(self)
        out["train_hours"] = [self.train_hours[0], self.train_hours[-1]] if self.train_hours else []
        return out


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def checkpoints_dir(settings: Settings) -> Path:
    return settings.home.resolve() / "checkpoints"


def latest_checkpoint(settings: Settings) -> Path | None:
    """The newest completed run's final checkpoint (until the MLflow registry names a champion)."""
    completed = []
    for pointer in checkpoints_dir(settings).glob("*/latest.json"):
        info = json.loads(pointer.read_text())
        if info.get("completed"):
            completed.append((info["finished_at"], pointer.parent / info["step_dir"]))
    return max(completed)[1] if completed else None


def read_checkpoint(path: Path) -> dict:
    """A checkpoint's JSON state (``path``: a step folder, or a run folder meaning its latest step)."""
    path = Path(path)
    if (path / "latest.json").exists():
        path = path / json.loads((path / "latest.json").read_text())["step_dir"]
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError as err:
        raise TrainError(f"{path} is not a checkpoint (no state.json)") from err
    state["path"] = str(path)
    return state


def train(settings: Settings, config: TrainConfig, *, warm_start: Path | None = None,
          on_progress: Callable[[int, int, float], None] | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainSummary:
    """Train (or resume) a run; returns its summary. Raises ``TrainError`` on bad input.

    ``on_progress(samples, total_samples, samples_per_s)`` is called every few steps; ``on_step(step)``
    after each step (tests use it to simulate a crash).
    """
    layout = FeatureLayout.for_settings(settings)
    files = training_files(layout.training)
    if not files:
        raise TrainError(f"no training rows under {layout.training}: run `recloop features` first")
    if len(files) <= config.validation_hours:
        raise TrainError(f"only {len(files)} hours of training rows; {config.validation_hours} are held out "
                         "for validation, so nothing is left to train on")
    present = set(pq.read_schema(files[0]).names)
    extra = tuple(c for c in (*ORACLE_COLUMNS, *SLICE_COLUMNS) if c in present)
    schema = FeatureSchema.load(layout.schema, extra=extra)
    validation, trainable = files[-config.validation_hours:], files[:-config.validation_hours]

    base = None
    if config.mode == "incremental":
        base_path = warm_start or latest_checkpoint(settings)
        if base_path is None:
            raise TrainError("incremental training needs a checkpoint to start from: train --mode full first")
        base = read_checkpoint(base_path)
        new = [f for f in trainable if f.stem >= base["trained_until"]]
        if not new:
            raise TrainError(f"nothing new to train on: the checkpoint has seen every hour up to "
                             f"{base['trained_until']}")
        older = [f for f in trainable if f.stem < base["trained_until"]]
        replay_count = min(len(older), math.ceil(len(new) * config.replay_fraction))
        replay = sorted(np.random.default_rng(config.seed).choice(len(older), replay_count, replace=False).tolist())
        train_files = [older[i] for i in replay] + new
        epochs = 1
    else:
        train_files = trainable[-config.days * 24:]
        epochs = config.epochs

    identity = {"mode": config.mode, "files": [f.stem for f in train_files], "base": base["path"] if base else None,
                "config": config.to_dict(), "state_version": schema.state_version}
    run_id = f"{config.mode}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]}"
    run_dir = checkpoints_dir(settings) / run_id
    if (run_dir / "latest.json").exists() and json.loads((run_dir / "latest.json").read_text()).get("completed"):
        return TrainSummary(**read_checkpoint(run_dir)["summary"])

    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    device = _device(config.device)
    model, optimizer, grown, resumed = _build(config, schema, device, run_dir, base)
    position = dict(resumed) if resumed else {"step": 0, "epoch": 0, "batch": 0, "samples": 0}
    loader = ChunkLoader(train_files, schema, config.batch_size, device=device, seed=config.seed)
    total = loader.num_rows * epochs
    loss_fn = torch.nn.BCEWithLogitsLoss()
    scale = math.sqrt(config.batch_size / config.reference_batch)
    started = time.perf_counter()
    samples_this_run = 0
    loss_curve: list[list[float]] = []
    model.train()
    step_model = _compiled(model, config.compile, device)
    for epoch in range(position["epoch"], epochs):
        skip = position["batch"] if epoch == position["epoch"] else 0
        for batch_index, batch in enumerate(loader.epoch(epoch, skip_batches=skip), start=skip):
            for group in optimizer.param_groups:  # a warm-started model is already past its warm-up
                warmup = 1.0 if base else min(1.0, (position["step"] + 1) / max(config.warmup_steps, 1))
                group["lr"] = config.lr * scale * warmup
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                logits = step_model(batch.dense, batch.values, batch.offsets)
            loss = loss_fn(logits.float(), batch.label)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()  # also updates the touched embedding rows (fused sparse optimizer)
            optimizer.step()
            position.update(step=position["step"] + 1, epoch=epoch, batch=batch_index + 1,
                            samples=position["samples"] + batch.size)
            samples_this_run += batch.size
            if position["step"] % config.checkpoint_every == 0:
                _save(run_dir, model, optimizer, config, schema, position, train_files, completed=False)
            if position["step"] % 10 == 0:
                loss_curve.append([position["step"], float(loss.detach())])
            if on_progress and position["step"] % 10 == 0:
                on_progress(position["samples"], total, samples_this_run / (time.perf_counter() - started))
            if on_step:
                on_step(position["step"])
        position.update(epoch=epoch + 1, batch=0)
    seconds = time.perf_counter() - started

    valid_loader = ChunkLoader(validation, schema, max(config.batch_size, 8192), device=device, shuffle=False)
    labels, scores, extras = predict(model, valid_loader.epoch(0))
    scores_metrics = metrics(labels, scores, extras.get("p_click"))
    slices = slice_metrics(labels, scores, _slice_values(extras, layout))
    summary = TrainSummary(
        mode=config.mode, run_id=run_id, checkpoint="", samples=position["samples"], steps=position["step"],
        samples_per_s=round(samples_this_run / seconds, 1) if seconds > 0 else 0.0, seconds=round(seconds, 3),
        auc=scores_metrics["auc"], logloss=scores_metrics["logloss"], calibration=scores_metrics["calibration"],
        oracle_auc=scores_metrics.get("oracle_auc"), validation_rows=scores_metrics["rows"], slices=slices,
        train_hours=[f.stem for f in train_files], validation_hours=[f.stem for f in validation],
        trained_until=_after(train_files[-1].stem), state_version=schema.state_version,
        warm_start=base["path"] if base else None, grown_tables=grown,
        resumed_from_step=resumed["step"] if resumed else 0, loss_curve=loss_curve,
    )
    summary.checkpoint = str(run_dir / f"step-{position['step']:07d}")
    _save(run_dir, model, optimizer, config, schema, position, train_files, completed=True, summary=summary)
    return summary


def _slice_values(extras: dict[str, np.ndarray], layout: FeatureLayout) -> dict[str, np.ndarray]:
    """Readable slice labels per validation row: user new/returning, device and category by name."""
    from recloop.features.state import StateStore

    out = {}
    if "user_is_new" in extras:
        out["user"] = np.where(extras["user_is_new"].astype(bool), "new", "returning")
    state = StateStore(layout.state).latest()
    for column in ("c_device", "c_category"):
        if column not in extras:
            continue
        names = {}
        vocabulary = state.vocabularies.get(column[2:]) if state else None
        if vocabulary is not None:
            admitted = vocabulary.admitted().to_pydict()
            names = dict(zip(admitted["index"], admitted["value"], strict=True))
        out[column[2:]] = np.array([str(names.get(int(i), f"#{int(i)}")) for i in extras[column]])
    return out


def load_model(checkpoint: Path, device: str | torch.device = "cpu") -> tuple[RankingModel, dict]:
    """A trained model from a checkpoint folder (safetensors + JSON, no pickle), and its JSON state."""
    state = read_checkpoint(Path(checkpoint))
    model = RankingModel(ModelConfig.from_dict(state["model"]), len(state["dense"]),
                         [tuple(t) for t in state["tables"]], device=device)
    model.load_state_dict(load_file(Path(state["path"]) / "model.safetensors", device=str(torch.device(device))))
    model.eval()
    model.map_unknown_ids = True  # scored or served on newer data than it was trained on
    return model, state


def _compiled(model: RankingModel, backend: str, device: torch.device) -> torch.nn.Module:
    if backend == "off" or (backend == "auto" and device.type != "cuda"):
        return model
    return torch.compile(model, backend="inductor" if backend == "auto" else backend)


def _after(hour_stem: str) -> str:
    """The hour after ``YYYY-MM-DDTHH`` (the first hour a checkpoint has not seen)."""
    from datetime import datetime, timedelta

    return (datetime.strptime(hour_stem, "%Y-%m-%dT%H") + timedelta(hours=1)).strftime("%Y-%m-%dT%H")


def _build(config: TrainConfig, schema: FeatureSchema, device: torch.device, run_dir: Path, base: dict | None):
    """The model and dense optimizer: resumed from this run, warm-started from ``base``, or new."""
    model_config = ModelConfig.from_dict({**config.model.to_dict(), "multi_hot_columns": tuple(schema.multi_hot)})
    tables = schema.tables
    source, resumed = None, None
    if (run_dir / "latest.json").exists():
        source = read_checkpoint(run_dir)
        resumed = source["position"]
    elif base is not None:
        source = base
        if base["state_version"] > schema.state_version:
            raise TrainError(f"checkpoint {base['path']} was trained on vocabulary version {base['state_version']}, "
                             f"newer than the features' version {schema.state_version}")
    grown: dict[str, list[int]] = {}
    if source is None:
        model = RankingModel(model_config, len(schema.dense), tables, device=device, seed=config.seed)
    else:
        old_tables = [tuple(t) for t in source["tables"]]
        current = dict(tables)
        if [name for name, _ in old_tables] != [name for name, _ in tables] or any(
                rows > current[name] for name, rows in old_tables) or source["dense"] != list(schema.dense):
            raise TrainError(f"checkpoint {source['path']} does not match the features: its tables "
                             f"{old_tables} vs {tables} (vocabulary version {source['state_version']} vs "
                             f"{schema.state_version}); retrain with --mode full")
        model = RankingModel(ModelConfig.from_dict(source["model"]), len(schema.dense), old_tables, device=device,
                             seed=config.seed)
        model.load_state_dict(load_file(Path(source["path"]) / "model.safetensors", device=str(device)))
        for name, rows in old_tables:
            if current[name] > rows:
                model.embeddings.grow(name, current[name])
                grown[name] = [rows, current[name]]
        if resumed is None and config.warm_state_decay != 1.0:
            with torch.no_grad():
                model.embeddings.state1.mul_(config.warm_state_decay)
    optimizer = torch.optim.Adam(model.dense_parameters(), lr=config.lr)
    if source is not None:
        _load_optimizer(optimizer, Path(source["path"]), device)
    return model, optimizer, grown, resumed


def _save(run_dir: Path, model: RankingModel, optimizer: torch.optim.Optimizer, config: TrainConfig,
          schema: FeatureSchema, position: dict, train_files: list[Path], completed: bool,
          summary: TrainSummary | None = None) -> Path:
    """Write a checkpoint into its own step folder, then point ``latest.json`` at it (atomic)."""
    step_dir = run_dir / f"step-{position['step']:07d}"
    staging = run_dir / f".{step_dir.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(state, staging / "model.safetensors")
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, staging / "dense_optimizer.safetensors")
    info = {
        "model": model.config.to_dict(), "train": config.to_dict(), "tables": [[n, r] for n, r in zip(
            model.table_names, model.embeddings.layout.rows, strict=True)], "dense": list(schema.dense),
        "state_version": schema.state_version, "position": dict(position), "optimizer": meta,
        "trained_until": _after(train_files[-1].stem), "completed": completed,
        "summary": asdict(summary) if summary else None,
    }
    (staging / "state.json").write_text(json.dumps(info, indent=2) + "\n")
    shutil.rmtree(step_dir, ignore_errors=True)
    os.replace(staging, step_dir)
    pointer = {"step_dir": step_dir.name, "completed": completed, "finished_at": time.time()}
    (run_dir / "latest.json.tmp").write_text(json.dumps(pointer) + "\n")
    os.replace(run_dir / "latest.json.tmp", run_dir / "latest.json")
    for old in sorted(run_dir.glob("step-*"))[:-2]:  # keep the last two
        shutil.rmtree(old, ignore_errors=True)
    return step_dir


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    state = optimizer.state_dict()
    tensors, scalars = {}, {}
    for index, values in state["state"].items():
        for key, value in values.items():
            if torch.is_tensor(value):
                tensors[f"{index}.{key}"] = value.detach().contiguous()
            else:
                scalars[f"{index}.{key}"] = value
    return tensors, {"param_groups": state["param_groups"], "scalars": scalars}


def _load_optimizer(optimizer: torch.optim.Optimizer, folder: Path, device: torch.device) -> None:
    meta = json.loads((folder / "state.json").read_text())["optimizer"]
    tensors = load_file(folder / "dense_optimizer.safetensors", device=str(device))
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for key, value in meta["scalars"].items():
        index, name = key.split(".", 1)
        state.setdefault(int(index), {})[name] = value
    for group in state.values():  # Adam keeps its step on the CPU unless capturable
        if "step" in group and torch.is_tensor(group["step"]):
            group["step"] = group["step"].cpu()
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
