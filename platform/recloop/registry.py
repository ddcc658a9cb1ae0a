"""MLflow IO: training runs, the logged model, registered versions and the aliases that carry state.

Every alias and version function takes ``model_name``: the ranker (``recloop-ranker``, the default) and
the retriever (``recloop-retriever``) are separate registered models, each with its own versions and
aliases.

Aliases: ``champion`` (serving), ``challenger`` (passed the gate, in canary), ``previous`` (the last
champion, for rollback). A version that fails the gate keeps its number, tagged ``gate=failed`` with
the reasons. Tags: one per concern, JSON where it has parts (``gate`` the verdict and ``gate.detail``,
``alias.<name>``: who moved it, why and when, ``rolled_back``). Tracking runs on SQLite under ``RECLOOP_HOME`` unless ``RECLOOP_MLFLOW_TRACKING_URI`` names
a server or database; artifacts go under ``RECLOOP_HOME/mlartifacts`` unless
``RECLOOP_MLFLOW_ARTIFACT_URI`` names an object store.

Example::

    logged = log_training(settings, summary)        # run + pyfunc model + new version
    set_alias(settings, "challenger", logged.version, who="gate", why="passed")
    version_by_alias(settings, "champion")
"""

from __future__ import annotations

import getpass
import json
import os
import time
import warnings
from dataclasses import dataclass

import pandas as pd

from recloop import endpoints
from recloop.ingest.ledger import exclusive_lock
from recloop.settings import Settings

EXPERIMENT = "recloop"
MODEL_NAME = "recloop-ranker"
RETRIEVER_NAME = "recloop-retriever"  # its versions: recloop.retrieval.publish; same aliases, its own
ALIASES = ("champion", "challenger", "previous")


@dataclass(frozen=True)
class LoggedModel:
    run_id: str
    model_uri: str
    version: str


def configure(settings: Settings) -> str:
    """Point MLflow at this installation; returns the id of the training experiment.

    Raises:
        endpoints.ServiceUnavailable: a tracking server that does not answer, within seconds.
    """
    import logging

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # its INFO lines (schema migrations...) are noise
    import mlflow

    logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"].upper())  # imported earlier, maybe
    logging.getLogger("alembic").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Logging a model copies its artifacts with a tqdm bar on stderr: noise in every command's output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    uri = endpoints.with_connect_timeout(endpoints.require_mlflow(settings), endpoints.limits_for(settings))
    settings.home.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return experiment(settings, EXPERIMENT)


def experiment(settings: Settings, name: str) -> str:
    """The id of experiment ``name``, created with its artifacts where ``artifact_location`` says. Every
    experiment is made here: one created without a location on a local store would write to ``./mlruns``
    of whatever directory the process runs in."""
    import mlflow

    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = artifact_location(settings, name, mlflow.get_tracking_uri())
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - created meanwhile by another process
        return mlflow.get_experiment_by_name(name).experiment_id


def artifact_location(settings: Settings, name: str, tracking_uri: str) -> str | None:
    """Where experiment ``name`` keeps its artifacts: ``RECLOOP_MLFLOW_ARTIFACT_URI`` (``mlflow-artifacts:/...``
    through a server that proxies its object store, or the store itself); else, with a tracking server, the
    server's own default (None: a server started with ``--serve-artifacts`` proxies them); else (SQLite under
    the home) ``RECLOOP_HOME/mlartifacts``."""
    base = settings.mlflow_artifact_uri
    if not base and tracking_uri.startswith(("http://", "https://")):
        return None
    base = base or (settings.home.resolve() / "mlartifacts").as_uri()
    return base if name == EXPERIMENT else f"{base.rstrip('/')}/{name}"


def _client(settings: Settings):
    from mlflow import MlflowClient

    configure(settings)
    return MlflowClient()


def _flatten(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, inner, out)
    else:
        out[prefix] = value if not isinstance(value, list | tuple) else json.dumps(value)
    return out


def log_training(settings: Settings, summary, example: pd.DataFrame) -> LoggedModel:
    """Log a finished training run (configs, metrics, lineage, checkpoint, pyfunc model) and register it.

    Args:
        summary: the trainer's ``TrainSummary``.
        example: a few training rows; their ``d_*``, ``c_*``, ``m_*`` columns are the model's input
            example and fix its signature.
    """
    import mlflow
    from mlflow import MlflowClient

    from recloop import checkpoint, ranker_pyfunc

    state = checkpoint.read(summary.checkpoint)
    experiment = configure(settings)
    client = MlflowClient()
    for earlier in client.search_runs([experiment], f"tags.`recloop.run_id` = '{summary.run_id}'"):
        versions = client.search_model_versions(f"name='{MODEL_NAME}' and run_id='{earlier.info.run_id}'")
        if versions:  # this training run is logged and registered already (a rerun of the same command)
            first = min(versions, key=lambda v: int(v.version))
            return LoggedModel(earlier.info.run_id, first.source, str(first.version))
    # The run spans the training: it starts when the training did (the summary's duration before now).
    began = int((time.time() - float(summary.seconds or 0.0)) * 1000)
    created = client.create_run(experiment, start_time=began, run_name=summary.run_id)
    with mlflow.start_run(run_id=created.info.run_id) as run:
        _log_datasets(settings, summary, example)
        mlflow.log_params(_flatten("", {"train": state["train"], "model": state["model"]}, {}))
        figures = {"auc": summary.auc, "logloss": summary.logloss, "calibration": summary.calibration,
                   "samples": summary.samples, "samples_per_s": summary.samples_per_s, "seconds": summary.seconds,
                   "validation_rows": summary.validation_rows}
        if summary.oracle_auc is not None:
            figures["oracle_auc"] = summary.oracle_auc
        figures["ndcg"] = summary.ndcg
        for name, scores in summary.baselines.items():  # recloop.gate.baselines on the same held-out rows
            for metric in ("auc", "logloss", "ndcg"):
                if scores.get(metric) is not None:
                    figures[f"baseline_{name}_{metric}"] = scores[metric]
        for name, scores in summary.slices.items():
            figures[f"slice_auc.{name.replace('=', '.')}"] = scores["auc"]
        mlflow.log_metrics({k: float(v) for k, v in figures.items() if v == v})
        if summary.loss_curve:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            MlflowClient().log_batch(run.info.run_id, metrics=[
                Metric("train_loss", loss, now, int(step)) for step, loss in summary.loss_curve])
        mlflow.set_tags({
            "recloop.mode": summary.mode, "recloop.run_id": summary.run_id,
            "recloop.train_window": f"{summary.train_hours[0]}..{summary.train_hours[-1]}",
            "recloop.validation_window": f"{summary.validation_hours[0]}..{summary.validation_hours[-1]}",
            "recloop.state_version": str(summary.state_version),
            "recloop.warm_start": summary.warm_start or "",
        })
        mlflow.log_dict(_flatten("", {"slices": summary.slices}, {}), "validation_slices.json")
        if summary.baselines:
            mlflow.log_dict(summary.baselines, "baselines.json")
        inputs = example[[c for c in example.columns if c.startswith(("d_", "c_", "m_"))]]
        with warnings.catch_warnings():  # its hint about integer columns: ours are indices, never missing
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            info = mlflow.pyfunc.log_model(
                name="model", python_model=ranker_pyfunc.__file__, artifacts={"checkpoint": summary.checkpoint},
                input_example=inputs, pip_requirements=["mlflow>=3", "torch>=2.5", "safetensors", "pandas", "numpy"],
            )
    # What a download must match: sizes and checksums of the checkpoint's files, on the version itself.
    files = json.dumps(checkpoint.manifest(state["path"]), separators=(",", ":"))
    version = register(settings, info.model_uri, run.info.run_id, tags={checkpoint.MANIFEST_TAG: files})
    return LoggedModel(run.info.run_id, info.model_uri, version)


def _log_datasets(settings: Settings, summary, example: pd.DataFrame) -> None:
    """The training and validation windows as MLflow datasets (the run's Datasets column and inputs): the
    feature folder as source, the hours and row count as tags, a digest of the hours trained on; the
    profile is the schema with a few example rows."""
    import hashlib

    import mlflow

    from recloop.features.job import FeatureLayout

    source = str(FeatureLayout.for_settings(settings).training)
    for context, hours, rows in (("training", summary.train_hours, summary.samples),
                                 ("validation", summary.validation_hours, summary.validation_rows)):
        if not hours:
            continue
        digest = hashlib.sha256("\n".join(hours).encode()).hexdigest()[:16]
        with warnings.catch_warnings():  # its hints: a local folder is a local folder; ids are integers
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            dataset = mlflow.data.from_pandas(example, source=source, name=f"{context} {hours[0]}..{hours[-1]}",
                                              targets="label" if "label" in example.columns else None,
                                              digest=digest)
            mlflow.log_input(dataset, context=context, tags={"hours": str(len(hours)), "rows": str(rows)})


def register(settings: Settings, model_uri: str, run_id: str | None = None, attempts: int = 8,
             model_name: str = MODEL_NAME, tags: dict[str, str] | None = None) -> str:
    """A new version of the registered model (with ``tags`` from its creation); safe when several runs
    register at once.

    MLflow numbers versions ``MAX(version)+1``, so two registrations can collide: registrations are
    serialized with a file lock on this machine and retried with backoff against a shared server.
    """
    from mlflow.exceptions import MlflowException

    client = _client(settings)
    with exclusive_lock(settings.home.resolve() / "mlflow-register.lock"):
        for attempt in range(attempts):
            try:
                try:
                    client.create_registered_model(model_name)
                except MlflowException as err:
                    if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                        raise
                version = client.create_model_version(model_name, model_uri, run_id=run_id, tags=tags)
                return str(version.version)
            except MlflowException:
                if attempt == attempts - 1:
                    raise
                time.sleep(0.1 * 2**attempt)
    raise RuntimeError("unreachable")


def version_by_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return str(_client(settings).get_model_version_by_alias(model_name, alias).version)
    except MlflowException:
        return None


def aliases(settings: Settings, model_name: str = MODEL_NAME) -> dict[str, str | None]:
    return {alias: version_by_alias(settings, alias, model_name) for alias in ALIASES}


def set_alias(settings: Settings, alias: str, version: str, *, who: str | None = None, why: str = "",
              model_name: str = MODEL_NAME) -> None:
    client = _client(settings)
    client.set_registered_model_alias(model_name, alias, version)
    tag(settings, version, {f"alias.{alias}": json.dumps({  # one tag per alias: who moved it, why, when
        "by": who or getpass.getuser(), "why": why, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})},
        model_name)


def remove_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> None:
    _client(settings).delete_registered_model_alias(model_name, alias)


def tag(settings: Settings, version: str, tags: dict[str, str], model_name: str = MODEL_NAME) -> None:
    client = _client(settings)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, str(value))


def describe(settings: Settings, version: str, description: str, model_name: str = MODEL_NAME) -> None:
    _client(settings).update_model_version(model_name, version, description=description)


@dataclass(frozen=True)
class VersionInfo:
    """A registered version as the loop reads it: its tags and aliases, and its training run's lineage.

    ``train_window`` and ``validation_window`` are the first and last training-file hours
    (``YYYY-MM-DDTHH``) of the run. The checkpoint itself is found by ``checkpoint.resolve``.
    """

    version: str
    run_id: str | None
    tags: dict[str, str]
    aliases: tuple[str, ...]
    mode: str | None
    source: str
    train_window: tuple[str, str] | None
    validation_window: tuple[str, str] | None


def version_info(settings: Settings, version: str, model_name: str = MODEL_NAME) -> VersionInfo:
    client = _client(settings)
    found = client.get_model_version(model_name, version)
    run_tags = client.get_run(found.run_id).data.tags if found.run_id else {}

    def window(name: str) -> tuple[str, str] | None:
        value = run_tags.get(name)
        return tuple(value.split("..", 1)) if value else None  # type: ignore[return-value]

    return VersionInfo(str(found.version), found.run_id, dict(found.tags), tuple(found.aliases),
                       run_tags.get("recloop.mode"), found.source, window("recloop.train_window"),
                       window("recloop.validation_window"))


class UnknownVersion(LookupError):
    """No such registered version (the message names the versions there are)."""


def require_version(settings: Settings, version: str, model_name: str = MODEL_NAME) -> None:
    """Raises ``UnknownVersion`` unless ``version`` of ``model_name`` is registered."""
    client = _client(settings)
    numbers = sorted(int(v.version) for v in client.search_model_versions(f"name='{model_name}'"))
    if str(version).isdigit() and int(version) in numbers:
        return
    known = f"versions {numbers[0]}..{numbers[-1]}" if numbers else "no version registered yet"
    raise UnknownVersion(f"{model_name} has no version {version!r} ({known})")


def promote(settings: Settings, version: str, *, who: str | None = None, why: str = "",
            model_name: str = MODEL_NAME) -> dict[str, str | None]:
    """``champion`` := version, ``previous`` := the old champion, ``challenger`` removed if it was this.

    Raises:
        UnknownVersion: ``version`` is not registered.
    """
    require_version(settings, version, model_name)
    old = version_by_alias(settings, "champion", model_name)
    if old is not None and old != version:
        set_alias(settings, "previous", old, who=who, why=f"replaced by v{version}", model_name=model_name)
    set_alias(settings, "champion", version, who=who, why=why, model_name=model_name)
    if version_by_alias(settings, "challenger", model_name) == version:
        remove_alias(settings, "challenger", model_name)
    return aliases(settings, model_name)


def rollback(settings: Settings, *, who: str | None = None, why: str = "",
             model_name: str = MODEL_NAME) -> dict[str, str | None]:
    """``champion`` := ``previous`` (the demoted version is tagged with who and why)."""
    previous = version_by_alias(settings, "previous", model_name)
    if previous is None:
        raise RuntimeError("nothing to roll back to: no version has the 'previous' alias")
    current = version_by_alias(settings, "champion", model_name)
    if current is not None:
        tag(settings, current, {"rolled_back": json.dumps({
            "by": who or getpass.getuser(), "why": why, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})},
            model_name)
    set_alias(settings, "champion", previous, who=who, why=f"rollback: {why}", model_name=model_name)
    remove_alias(settings, "previous", model_name)
    return aliases(settings, model_name)
