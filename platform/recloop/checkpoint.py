"""Checkpoints: the one place they are written, read, loaded and found.

A training run writes step folders of safetensors (tensors) plus JSON (configuration, vocabulary version,
counters), never pickle, and points ``latest.json`` at the newest complete one (an atomic rename)::

    $RECLOOP_HOME/checkpoints/<run id>/step-000400/{model.safetensors, dense_optimizer.safetensors, state.json}
    $RECLOOP_HOME/checkpoints/<run id>/latest.json

A registered model version carries its step folder as an MLflow artifact. Everything that starts from a
registered version (the gate, warm start, serving, the monitor's scoring) goes through ``resolve``,
which downloads that artifact once into ``$RECLOOP_HOME/cache/models/`` — never a path on the trainer's
disk, so a process on another machine (or another home) finds the same files.

Example::

    folder = resolve(settings, "7")                # the registered version's checkpoint, downloaded once
    model, state = load_model(folder)              # a RankingModel in eval mode, and its JSON state
    inputs = trained_inputs(state)                 # the feature columns it was trained on
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from recloop.model import RankingModel
    from recloop.settings import Settings

STEP_PREFIX = "step-"
KEEP_STEPS = 2


class CheckpointError(RuntimeError):
    """A folder that is not a checkpoint, or a version whose checkpoint cannot be found."""


@dataclass(frozen=True)
class TrainedInputs:
    """The feature layout a checkpoint was trained on: its dense columns, its tables (name, rows) and the
    vocabulary version that numbered those rows."""

    dense: tuple[str, ...]
    tables: tuple[tuple[str, int], ...]
    state_version: int

    @property
    def table_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.tables)


def trained_inputs(state: dict) -> TrainedInputs:
    return TrainedInputs(tuple(state["dense"]), tuple((name, int(rows)) for name, rows in state["tables"]),
                         int(state["state_version"]))


def hour_after(hour_stem: str) -> str:
    """The hour after ``YYYY-MM-DDTHH`` (the first hour a checkpoint has not seen)."""
    return (datetime.strptime(hour_stem, "%Y-%m-%dT%H") + timedelta(hours=1)).strftime("%Y-%m-%dT%H")


# --- writing -------------------------------------------------------------------------------------------------


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: dict,
         completed: bool) -> Path:
    """Write a step folder (model, dense optimizer, ``state.json`` = ``info`` + the optimizer's scalars),
    then point ``latest.json`` at it. A crash at any point leaves the previous checkpoint intact."""
    step_dir = run_dir / f"{STEP_PREFIX}{step:07d}"
    staging = run_dir / f".{step_dir.name}.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, staging / "model.safetensors")
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, staging / "dense_optimizer.safetensors")
    (staging / "state.json").write_text(json.dumps({**info, "optimizer": meta, "completed": completed}, indent=2)
                                        + "\n")
    shutil.rmtree(step_dir, ignore_errors=True)
    os.replace(staging, step_dir)
    pointer = {"step_dir": step_dir.name, "completed": completed, "finished_at": time.time()}
    (run_dir / "latest.json.tmp").write_text(json.dumps(pointer) + "\n")
    os.replace(run_dir / "latest.json.tmp", run_dir / "latest.json")
    for old in sorted(run_dir.glob(f"{STEP_PREFIX}*"))[:-KEEP_STEPS]:
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


# --- reading -------------------------------------------------------------------------------------------------


def read(path: Path | str) -> dict:
    """A checkpoint's JSON state, with ``path`` set to its step folder (``path`` may name a run folder,
    meaning its newest step)."""
    path = Path(path)
    if (path / "latest.json").exists():
        path = path / json.loads((path / "latest.json").read_text())["step_dir"]
    try:
        state = json.loads((path / "state.json").read_text())
    except FileNotFoundError as err:
        raise CheckpointError(f"{path} is not a checkpoint (no state.json)") from err
    state["path"] = str(path)
    return state


def completed_run(run_dir: Path) -> dict | None:
    """The state of a run folder's final checkpoint when the run completed, else None."""
    pointer = run_dir / "latest.json"
    if not pointer.exists() or not json.loads(pointer.read_text()).get("completed"):
        return None
    return read(run_dir)


def load_model(path: Path | str, device: str | torch.device = "cpu") -> tuple[RankingModel, dict]:
    """A trained model (eval mode) and its JSON state. Ids admitted after its training map to the OOV row:
    a loaded model is scored or served on newer data than it saw."""
    from recloop.model import ModelConfig, RankingModel

    state = read(path)
    inputs = trained_inputs(state)
    model = RankingModel(ModelConfig.from_dict(state["model"]), len(inputs.dense), list(inputs.tables),
                         device=device)
    model.load_state_dict(load_file(Path(state["path"]) / "model.safetensors", device=str(torch.device(device))))
    model.eval()
    model.map_unknown_ids = True
    return model, state


def load_optimizer(optimizer: torch.optim.Optimizer, path: Path | str, device: torch.device) -> None:
    """Restore the dense optimizer's state saved beside a checkpoint's weights."""
    folder = Path(read(path)["path"])
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


# --- finding a registered version's checkpoint -------------------------------------------------------------------


def cache_dir(settings: Settings) -> Path:
    return settings.home.resolve() / "cache" / "models"


def resolve(settings: Settings, version: str, model_name: str | None = None) -> Path:
    """The step folder of a registered version's checkpoint, downloaded from the registry once.

    The download lands in a staging folder renamed into place, so a reader never sees half a model.
    """
    import mlflow

    from recloop import registry

    name = model_name or registry.MODEL_NAME
    target = cache_dir(settings) / name / f"v{version}"
    done = target / ".complete"
    if not done.exists():
        registry.configure(settings)
        staging = target.with_name(f".v{version}.{os.getpid()}.{threading.get_ident()}")
        shutil.rmtree(staging, ignore_errors=True)
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(staging))
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            staging.rename(target)
        except OSError:  # another process finished first: keep theirs
            shutil.rmtree(staging, ignore_errors=True)
        done.touch()
    found = sorted(p.parent for p in target.rglob("state.json"))
    if not found:
        raise CheckpointError(f"model version {version} has no checkpoint (state.json) in its artifacts")
    return found[-1]
