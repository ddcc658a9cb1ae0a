"""Checkpoints: the one place they are written, read, loaded and found.

A training run writes step folders of safetensors (tensors) plus JSON (configuration, vocabulary version,
counters), never pickle, and points ``latest.json`` at the newest complete one (an atomic rename)::

    $RECLOOP_HOME/checkpoints/<run id>/step-000400/{model.safetensors, dense_optimizer.safetensors, state.json}
    $RECLOOP_HOME/checkpoints/<run id>/latest.json

Under several ranks a run's checkpoints keep the tables sharded, its last one too: every rank writes its own
rows to ``step-…/tables/`` (``recloop.model.sharded_checkpoint``: DCP, safetensors, no pickle) and rank 0
writes the rest without them (``save(..., staged=…, sharded_tables=True)``). The last one ``awaits
completion``: one process outside the ranks reads it whole (``load_weights`` puts the tables together),
validates it and writes the run's completed checkpoint, whole (the one registered and served), beside it::

    $RECLOOP_HOME/checkpoints/<run id>/step-0000400/{model.safetensors, ..., tables/shard-0000{1,2}-…}  the ranks'
    $RECLOOP_HOME/checkpoints/<run id>/step-0000400.1/{model.safetensors, ...}                          completed

A registered model version carries its step folder as an MLflow artifact, and the size and SHA-256 of
each of its files as a version tag (``MANIFEST_TAG``, see ``manifest``). Everything that starts from a
registered version (the gate, warm start, serving, the monitor's scoring) goes through ``resolve``,
which downloads that artifact into ``$RECLOOP_HOME/cache/models/``, verified against the manifest
before it counts as complete, checked again on each use and fetched afresh when damaged — never a path
on the trainer's disk, so a process on another machine (or another home) finds the same files.

Example::

    folder = resolve(settings, "7")                # the registered version's checkpoint, downloaded once
    model, state = load_model(folder)              # a RankingModel in eval mode, and its JSON state
    inputs = trained_inputs(state)                 # the feature columns it was trained on
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors.torch import load_file, save_file

if TYPE_CHECKING:
    from recloop.model import RankingModel
    from recloop.settings import Settings

STEP_PREFIX = "step-"
KEEP_STEPS = 2
TABLES = "tables"  # a sharded checkpoint's folder of per-rank table shards
TABLE_BUFFERS = ("weights", "state1", "state2", "step")  # what a sharded checkpoint keeps in TABLES only
AWAITS_COMPLETION = "awaits_completion"  # a run's ranks finished it; one process completes it (recloop.train)
log = logging.getLogger("recloop.checkpoint")


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


# --- writing -------------------------------------------------------------------------------------------------


def step_folder(run_dir: Path, step: int) -> Path:
    """The folder ``save`` writes step ``step`` to: ``step-NNNNNNN``, or ``step-NNNNNNN.K`` when a save of the
    same step is there already (a run's last periodic save and its completed one): the folder ``latest.json``
    may point at is never removed before the new one is in place."""
    folder, again = run_dir / f"{STEP_PREFIX}{step:07d}", 0
    while folder.exists():
        again += 1
        folder = run_dir / f"{STEP_PREFIX}{step:07d}.{again}"
    return folder


def staging_folder(run_dir: Path, step_dir: Path) -> Path:
    return run_dir / f".{step_dir.name}.tmp"


def save(run_dir: Path, step: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer, info: dict,
         completed: bool, staged: Path | None = None, sharded_tables: bool = False,
         without: str | None = None, awaits_completion: bool = False) -> Path:
    """Write a step folder (``step_folder``: model, dense optimizer, ``state.json`` = ``info`` + the
    optimizer's scalars), then point ``latest.json`` at it. A crash at any point leaves the previous
    checkpoint intact. ``staged``: the step's staging folder, where the ranks wrote their table shards
    (``sharded_tables``: the model's file then leaves them out). ``without``: leave out the model's tensors
    under this prefix (tables written to a table log instead: ``write_tables``). ``awaits_completion``: the
    last checkpoint of a run its ranks trained to the end, which one process completes (``awaiting_completion``)."""
    step_dir = step_folder(run_dir, step) if staged is None else run_dir / staged.name[1:-len(".tmp")]
    staging = staging_folder(run_dir, step_dir)
    if staged is None:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
    left_out = _table_keys(model) if sharded_tables else set()  # (a rank's model has none of them anyway)
    weights = {k: v.detach().contiguous() for k, v in model.state_dict().items()
               if k not in left_out and (without is None or not k.startswith(without))}
    save_file(weights, staging / "model.safetensors")
    tensors, meta = _optimizer_tensors(optimizer)
    save_file(tensors, staging / "dense_optimizer.safetensors")
    marks = {"completed": completed, **({AWAITS_COMPLETION: True} if awaits_completion else {})}
    (staging / "state.json").write_text(json.dumps({**info, "optimizer": meta, **marks}, indent=2) + "\n")
    os.replace(staging, step_dir)
    pointer = {"step_dir": step_dir.name, **marks, "finished_at": time.time()}
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


def awaiting_completion(run_dir: Path) -> dict | None:
    """The state of a run folder's last checkpoint when its ranks trained it to the end and no process has
    completed it yet (validated it, written it whole: ``recloop.train.complete``), else None."""
    pointer = run_dir / "latest.json"
    if not pointer.exists() or not json.loads(pointer.read_text()).get(AWAITS_COMPLETION):
        return None
    return read(run_dir)


def runs_awaiting_completion(checkpoints: Path) -> list[Path]:
    """The run folders under ``checkpoints`` that await completion (``awaiting_completion``), oldest first."""
    waiting = []
    for pointer in Path(checkpoints).glob("*/latest.json"):
        marks = json.loads(pointer.read_text())
        if marks.get(AWAITS_COMPLETION):
            waiting.append((marks.get("finished_at", 0.0), pointer.parent))
    return [run for _, run in sorted(waiting)]


def load_model(path: Path | str, device: str | torch.device = "cpu") -> tuple[RankingModel, dict]:
    """A trained model (eval mode) and its JSON state. Ids admitted after its training map to the OOV row:
    a loaded model is scored or served on newer data than it saw."""
    from recloop.model import ModelConfig, RankingModel

    state = read(path)
    inputs = trained_inputs(state)
    model = RankingModel(ModelConfig.from_dict(state["model"]), len(inputs.dense), list(inputs.tables),
                         device=device)
    load_weights(model, Path(state["path"]), torch.device(device))
    model.eval()
    model.map_unknown_ids = True
    if state.get("calibration"):
        model.calibration = (float(state["calibration"][0]), float(state["calibration"][1]))
    return model, state


def load_weights(model: RankingModel, folder: Path, device: torch.device, tables: bool = True) -> bool:
    """A step folder's weights into ``model``; returns whether its tables are sharded (``TABLES``). Those are
    read whole here unless ``tables`` is False (each rank then reads its own: ``sharded_checkpoint.load_tables``)."""
    weights = load_file(folder / "model.safetensors", device=str(device))
    if not (folder / TABLES).is_dir():
        model.load_state_dict(weights)
        return False
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or set(missing) - _table_keys(model):
        raise CheckpointError(f"{folder}: model.safetensors does not match the model (missing {missing}, "
                              f"unexpected {unexpected})")
    if tables:
        from recloop.model.sharded_checkpoint import read_full_tables

        read_full_tables(folder / TABLES, model.embeddings)
    return True


def load_dense_weights(model: RankingModel, folder: Path, device: torch.device) -> None:
    """A step folder's weights into ``model`` but for its tables (a whole checkpoint's or a sharded one's alike),
    reading no table's tensors: a process holding some of the tables reads its rows of them itself
    (``recloop.model.sharded_checkpoint.read_rows``)."""
    from safetensors import safe_open

    prefix = _tables_prefix(model)
    with safe_open(str(folder / "model.safetensors"), framework="pt", device=str(device)) as f:
        weights = {key: f.get_tensor(key) for key in f.keys() if not key.startswith(prefix)}  # noqa: SIM118
    missing, unexpected = model.load_state_dict(weights, strict=False)
    if unexpected or any(not key.startswith(prefix) for key in missing):
        raise CheckpointError(f"{folder}: model.safetensors does not match the model (missing {missing}, "
                              f"unexpected {unexpected})")


def _tables_prefix(model: torch.nn.Module) -> str:
    """Where the model's embedding tables sit in its state_dict (``sparse_arch.embeddings.``)."""
    return next(name for name, module in model.named_modules() if module is model.embeddings) + "."


def _table_keys(model: torch.nn.Module) -> set[str]:
    """The model's state keys of its embedding tables' buffers (their rows, optimizer state, step)."""
    return {f"{_tables_prefix(model)}{buffer}" for buffer in TABLE_BUFFERS}


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


# --- table logs: checkpoints of what changed ------------------------------------------------------------------
#
# A dynamic table (``recloop_kernels.dynamic``) marks every row, slot, map position and sketch counter it
# changes, so an hourly checkpoint of a huge table can hold only those: a log of safetensors files, a full one
# every ``full_every`` entries, deltas between, and ``log.json`` listing the entries on disk::
#
#     <folder>/0000001-full.safetensors  0000002-delta.safetensors  ...  0000004-full.safetensors  ...  log.json
#
# The chain before the newest full entry is kept too (a step folder written before that entry may still be
# the one ``latest.json`` names); older ones are removed.

TABLE_LOG = "log.json"


def write_tables(folder: Path, embeddings, full_every: int) -> dict:
    """Append a checkpoint of ``embeddings`` (a ``DynamicEmbeddingBagCollection``) to the table log in ``folder``.

    Full (its ``state_dict``) when the log is empty or ``full_every`` entries have been written since the last
    full one, else the delta since the previous entry. A crash leaves the previous log intact (the file, then
    the log, are renamed into place). Returns the entry: number, file, kind, bytes.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    entries = _table_entries(folder)
    fulls = [i for i, e in enumerate(entries) if e["kind"] == "full"]
    full = not fulls or len(entries) - fulls[-1] >= max(1, full_every)
    number = entries[-1]["number"] + 1 if entries else 1
    name = f"{number:07d}-{'full' if full else 'delta'}.safetensors"
    tensors = dict(embeddings.state_dict()) if full else embeddings.delta_state_dict()
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, folder / f".{name}.tmp")
    os.replace(folder / f".{name}.tmp", folder / name)
    entry = {"number": number, "file": name, "kind": "full" if full else "delta",
             "bytes": (folder / name).stat().st_size}
    entries.append(entry)
    if full and len(fulls) >= 1:  # keep this chain and the one before it
        entries = entries[fulls[-1]:]
    (folder / f"{TABLE_LOG}.tmp").write_text(json.dumps({"entries": entries}, indent=1) + "\n")
    os.replace(folder / f"{TABLE_LOG}.tmp", folder / TABLE_LOG)
    keep = {e["file"] for e in entries}
    for old in folder.glob("*.safetensors"):
        if old.name not in keep:
            old.unlink(missing_ok=True)
    embeddings.clear_touched()
    return entry


def restore_tables(folder: Path, embeddings, upto: int | None = None, drop_later: bool = False) -> int:
    """Load the table log in ``folder`` into ``embeddings`` as it stood at entry ``upto`` (default: the newest):
    the last full entry up to it, then each delta after that in order, bit for bit. Returns the entries applied.

    ``drop_later``: remove the entries after ``upto`` from the log (a run resuming from ``upto``: entries a
    crash left after it describe a future that will not happen, and the next delta starts from ``upto``)."""
    folder = Path(folder)
    everything = _table_entries(folder)
    entries = [e for e in everything if upto is None or e["number"] <= upto]
    fulls = [i for i, e in enumerate(entries) if e["kind"] == "full"]
    if not fulls or (upto is not None and entries[-1]["number"] != upto):
        raise CheckpointError(f"{folder} holds no table log up to entry {upto}")
    chain = entries[fulls[-1]:]
    device = str(embeddings.weights.device)
    embeddings.load_state_dict(load_file(Path(folder) / chain[0]["file"], device=device))
    for entry in chain[1:]:
        embeddings.apply_delta(load_file(Path(folder) / entry["file"], device=device))
    embeddings.clear_touched()
    if drop_later and len(entries) < len(everything):
        (folder / f"{TABLE_LOG}.tmp").write_text(json.dumps({"entries": entries}, indent=1) + "\n")
        os.replace(folder / f"{TABLE_LOG}.tmp", folder / TABLE_LOG)
        for entry in everything[len(entries):]:
            (folder / entry["file"]).unlink(missing_ok=True)
    return len(chain)


def _table_entries(folder: Path) -> list[dict]:
    path = folder / TABLE_LOG
    return json.loads(path.read_text())["entries"] if path.exists() else []


# --- finding a registered version's checkpoint -------------------------------------------------------------------


def cache_dir(settings: Settings) -> Path:
    return settings.home.resolve() / "cache" / "models"


MANIFEST_TAG = "checkpoint.manifest"


def manifest_tags(step_dir: Path | str) -> dict[str, str]:
    """The version's ``MANIFEST_TAG``: a line to read (how many files, how large) and the manifest itself, each
    file's size and SHA-256 (``manifest``), as its record: what every download must match."""
    from recloop.version_tags import readable

    files = manifest(step_dir)
    size = sum(f["size"] for f in files.values())
    return readable(MANIFEST_TAG, f"{len(files)} files, {size / 1e6:,.1f} MB: a download must match each file's size "
                                  f"and SHA-256 ({MANIFEST_TAG}.json)", files)
_MANIFEST_FILE = ".manifest.json"  # beside ``.complete``: what the cached copy was checked against


def manifest(step_dir: Path | str) -> dict[str, dict[str, int | str]]:
    """Size and SHA-256 of every file of a step folder: recorded on the version at registration, so a
    download can be checked against what was registered rather than against itself."""
    folder = Path(step_dir)
    return {path.name: {"size": path.stat().st_size, "sha256": _sha256(path)}
            for path in sorted(folder.iterdir()) if path.is_file()}


WEIGHTS_TAG = "weights.sha256"


def weights_digest(step_dir: Path | str) -> str:
    """What makes two checkpoints the same model: the SHA-256 of its weights file and its calibration. Two
    trainings that end with the same digest score every request alike, whatever their configurations said
    (``fit_to_data`` raising the epochs, ``days`` that did not change the rows)."""
    folder = Path(step_dir)
    calibration = json.loads((folder / "state.json").read_text()).get("calibration")
    digest = hashlib.sha256(_sha256(folder / "model.safetensors").encode())
    digest.update(json.dumps(calibration).encode())
    return digest.hexdigest()


def files_digest(folder: Path | str, names: tuple[str, ...]) -> str:
    """The retriever's ``WEIGHTS_TAG``: one SHA-256 over the named files that exist in ``folder`` (each file's name
    and checksum): for a retriever, its towers and the catalog they index (``items.safetensors``: the items'
    vectors and clicks; ``attributes.json``), not the index built from them (rebuilt, it need not be byte-equal)."""
    digest = hashlib.sha256()
    for name in names:
        path = Path(folder) / name
        if path.is_file():
            digest.update(f"{name}:{_sha256(path)}\n".encode())
    return digest.hexdigest()


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def verify(step_dir: Path, expected: dict | None) -> str | None:
    """Why ``step_dir`` is not the checkpoint that was registered, or None when it is.

    With a manifest every file must have its registered size and SHA-256. Without one (a version
    registered before manifests) the files are checked for what can be checked alone: ``state.json``
    parses and each safetensors file is as long as its own header says.
    """
    if expected is not None:
        for name, recorded in sorted(expected.items()):
            path = step_dir / name
            if not path.is_file():
                return f"{name} is missing"
            size = path.stat().st_size
            if size != recorded["size"]:
                return f"{name} is {size} bytes, {recorded['size']} were registered"
            if _sha256(path) != recorded["sha256"]:
                return f"{name} does not have the registered SHA-256"
        return None
    try:
        json.loads((step_dir / "state.json").read_text())
    except (OSError, ValueError) as err:
        return f"state.json cannot be read: {err}"
    for path in sorted(step_dir.glob("*.safetensors")):
        problem = _safetensors_problem(path)
        if problem:
            return f"{path.name}: {problem}"
    return None


def _safetensors_problem(path: Path) -> str | None:
    """A safetensors file is an 8-byte header length, a JSON header, then the tensors' bytes."""
    size = path.stat().st_size
    with open(path, "rb") as handle:
        head = handle.read(8)
        if len(head) < 8:
            return f"{size} bytes: shorter than a safetensors header"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"{size} bytes: its header alone claims {length}"
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            return "its header is not JSON"
    end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
    if size != 8 + length + end:
        return f"{size} bytes where its header says {8 + length + end}"
    return None


def resolve(settings: Settings, version: str, model_name: str | None = None, refetch: bool = False) -> Path:
    """The step folder of a registered version's checkpoint, downloaded from the registry and verified.

    A download is checked against the size and SHA-256 recorded at registration (``MANIFEST_TAG``)
    before it is marked complete, and lands in a staging folder renamed into place, so a reader never
    sees half a model. A cached copy is checked again on every call (against the manifest it was
    downloaded with: no registry call) and fetched afresh when it no longer matches; ``refetch`` fetches
    it afresh anyway.

    Raises:
        CheckpointError: the registry's own copy does not match what was registered (or has no
            checkpoint); naming the file and the difference.
    """
    name = model_name or _model_name()
    target = _cached(settings, name, version)
    if (target / ".complete").exists() and not refetch:
        expected = _read_manifest(target)
        folder = _step_folder(target, version)
        problem = verify(folder, expected)
        if problem is None:
            return folder
        log.warning("cached model v%s is damaged (%s): fetching it again", version, problem)
    return _download(settings, name, version, target)


def model_folder(settings: Settings, version: str, model_name: str | None = None) -> Path:
    """A registered version's whole artifact folder as MLflow wrote it (its ``MLmodel`` at the top, the
    checkpoint inside), downloaded and verified as ``resolve`` does: what ``mlflow.pyfunc.load_model`` opens."""
    resolve(settings, version, model_name)
    return _cached(settings, model_name or _model_name(), version)


def _cached(settings: Settings, name: str, version: str) -> Path:
    """Where a registered version's verified download lives (``resolve`` writes it)."""
    return cache_dir(settings) / name / f"v{version}"


def _model_name() -> str:
    from recloop import registry

    return registry.MODEL_NAME


def _download(settings: Settings, name: str, version: str, target: Path) -> Path:
    import mlflow

    from recloop import registry

    uri = registry.tracking_uri(settings)  # named, not process-wide: a server thread of another home may move it
    from recloop.version_tags import record

    recorded = record(registry.mlflow_client(settings).get_model_version(name, version).tags or {}, MANIFEST_TAG)
    expected = json.loads(recorded) if recorded else None
    staging = target.with_name(f".v{version}.{os.getpid()}.{threading.get_ident()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{version}", dst_path=str(staging),
                                            tracking_uri=uri, registry_uri=uri)
        problem = verify(_step_folder(staging, version), expected)
        if problem:
            raise CheckpointError(f"model version {version}: the registry's copy of its checkpoint is damaged "
                                  f"({problem})")
        (staging / _MANIFEST_FILE).write_text(json.dumps(expected))
        (staging / ".complete").touch()
        target.parent.mkdir(parents=True, exist_ok=True)
        if target.exists():  # a damaged copy: moved aside, then removed (a reader holding it keeps its files)
            aside = target.with_name(f".v{version}.damaged.{os.getpid()}.{threading.get_ident()}")
            with contextlib.suppress(OSError):
                os.rename(target, aside)
            shutil.rmtree(aside, ignore_errors=True)
        with contextlib.suppress(OSError):  # another process placed a copy meanwhile: it was verified too
            os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return _step_folder(target, version)


def _read_manifest(target: Path) -> dict | None:
    try:
        return json.loads((target / _MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None


def _step_folder(root: Path, version: str) -> Path:
    found = sorted(p.parent for p in root.rglob("state.json"))
    if not found:
        raise CheckpointError(f"model version {version} has no checkpoint (state.json) in its artifacts")
    return found[-1]
