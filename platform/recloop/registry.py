"""MLflow IO: training runs, the logged model, registered versions and the aliases that carry state.

Every alias and version function takes ``model_name``: the ranker (``recloop-ranker``, the default) and
the retriever (``recloop-retriever``) are separate registered models, each with its own versions and
aliases.

Aliases: ``champion`` (serving), ``challenger`` (passed the gate, in canary), ``previous`` (the last
champion, for rollback). A version that fails the gate keeps its number, its ``gate`` tag saying
``failed`` with the reasons. Tags: one per concern, JSON where it has parts (``gate``: the verdict first,
then the champion, window, reasons and thresholds; ``alias.<name>``: who moved it, why and when;
``rolled_back``; ``canary``: see ``recloop.canary.tag``). Tracking runs on SQLite under ``RECLOOP_HOME`` unless ``RECLOOP_MLFLOW_TRACKING_URI`` names
a server or database; artifacts go under ``RECLOOP_HOME/mlartifacts`` unless
``RECLOOP_MLFLOW_ARTIFACT_URI`` names an object store.

Example::

    summary = train(settings, config, tracker=TrainingRun(settings))  # the run spans the training
    logged = log_training(settings, summary, example)  # + pyfunc model (recloop.model_code), new version
    set_alias(settings, "challenger", logged.version, who="gate", why="passed")
    version_by_alias(settings, "champion")
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import time
import warnings
from dataclasses import dataclass

import numpy as np
import pandas as pd

from recloop import endpoints
from recloop.ingest.ledger import exclusive_lock
from recloop.settings import Settings

EXPERIMENT = "recloop"
MODEL_NAME = "recloop-ranker"
RETRIEVER_NAME = "recloop-retriever"  # its versions: recloop.retrieval.publish; same aliases, its own
ALIASES = ("champion", "challenger", "previous")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoggedModel:
    run_id: str
    model_uri: str
    version: str


_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(name: str) -> str:
    """``name`` as MLflow accepts a metric name: ``=`` and ``:`` (slice names such as ``device=mobile``)
    become ``.``, anything else outside letters, digits, ``_ - . / `` and space becomes ``_``."""
    return _METRIC_NAME.sub("_", name.replace("=", ".").replace(":", "."))


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
    object_store(settings)
    endpoints.require_mlflow(settings)
    uri = tracking_uri(settings)
    settings.home.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return experiment(settings, EXPERIMENT)


def object_store(settings: Settings) -> None:
    """The S3-compatible object store of ``RECLOOP_OBJECT_STORE_*`` (MinIO, say) for MLflow's artifacts, as
    boto3 reads it: its endpoint and keys. Variables already set by the user win."""
    for variable, value in (("MLFLOW_S3_ENDPOINT_URL", settings.object_store_url),
                            ("AWS_ACCESS_KEY_ID", settings.object_store_access_key),
                            ("AWS_SECRET_ACCESS_KEY", settings.object_store_secret_key.get_secret_value())):
        if value:
            os.environ.setdefault(variable, value)


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


def tracking_uri(settings: Settings) -> str:
    """This installation's tracking (and registry) URI, as ``configure`` sets it process-wide."""
    return endpoints.with_connect_timeout(settings.resolved_mlflow_tracking_uri(), endpoints.limits_for(settings))


def mlflow_client(settings: Settings):
    """A client of this installation's tracking store and registry, named explicitly: MLflow's process-wide
    URIs (``configure``) are another installation's while a second one runs in the same process (tests: two
    servers; a server thread of one read the other's aliases, then failed to load that version from its own)."""
    from mlflow import MlflowClient

    configure(settings)
    uri = tracking_uri(settings)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def _flatten(prefix: str, value, out: dict) -> dict:
    if isinstance(value, dict):
        for key, inner in value.items():
            _flatten(f"{prefix}.{key}" if prefix else key, inner, out)
    else:
        out[prefix] = value if not isinstance(value, list | tuple) else json.dumps(value)
    return out


class TrainingRun:
    """The MLflow run of one training, open while it trains: the trainer's ``recloop.train.Tracker``.

    Opened when the training starts (its configuration as parameters, its windows as tags and MLflow
    datasets), fed the training loss at each reading and each epoch's end (written every few seconds, so a
    fast GPU loop never waits on the tracking store), given the validation figures and closed FINISHED when
    the training ends. A run stopped by an error is closed FAILED (KILLED on an interrupt) with the error as
    the ``recloop.stopped`` tag; the same training resumed from its checkpoint (the same ``recloop.run_id``)
    takes the same MLflow run up again. ``log_training`` then logs the model into it and registers it.

    Example::

        summary = train(settings, config, tracker=TrainingRun(settings))
        logged = log_training(settings, summary, example)
    """

    flush_seconds = 5.0

    def __init__(self, settings: Settings, start_time: int | None = None):
        self.settings = settings
        self.start_time = start_time  # ms since the epoch; None: now
        self.run_id: str | None = None
        self._pending: list = []
        self._flushed = time.monotonic()

    def started(self, start) -> None:
        """Open (or, after a crash, reopen) the run: ``start`` is a ``recloop.train.RunStart``."""
        from mlflow import MlflowClient
        from mlflow.entities import Param

        experiment = configure(self.settings)
        client = MlflowClient()
        earlier = _unregistered_run(client, experiment, start.run_id)
        if earlier is not None:  # the same training, taken up again from its last checkpoint
            self.run_id = earlier.info.run_id
            client.update_run(self.run_id, status="RUNNING")
            if "recloop.stopped" in earlier.data.tags:
                client.delete_tag(self.run_id, "recloop.stopped")
            client.set_tag(self.run_id, "recloop.resumed_from_step", str(start.resumed_from_step))
            return
        tags = {"recloop.mode": start.mode, "recloop.run_id": start.run_id,
                "recloop.train_window": f"{start.train_hours[0]}..{start.train_hours[-1]}",
                "recloop.validation_window": f"{start.validation_hours[0]}..{start.validation_hours[-1]}",
                "recloop.state_version": str(start.state_version), "recloop.warm_start": start.warm_start or ""}
        self.run_id = client.create_run(experiment, start_time=self.start_time, tags=tags,
                                        run_name=start.run_id).info.run_id
        params = [Param(key, str(value)) for key, value in _flatten("", start.params, {}).items()]
        for first in range(0, len(params), 100):  # MLflow's limit per batch
            client.log_batch(self.run_id, params=params[first:first + 100])
        _log_datasets(self.settings, client, self.run_id, start)

    def progress(self, step: int, figures: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self._pending.extend(Metric(name, float(value), now, int(step)) for name, value in figures.items())
        if time.monotonic() - self._flushed >= self.flush_seconds:
            self._flush()

    def trained(self, summary) -> None:
        """The validation figures of the ended training (a ``recloop.train.TrainSummary``); closes the run."""
        from mlflow import MlflowClient

        self._flush()
        client = MlflowClient()
        self.progress(summary.steps, _figures(summary))
        self._flush()
        client.log_dict(self.run_id, _flatten("", {"slices": summary.slices}, {}), "validation_slices.json")
        if summary.baselines:
            client.log_dict(self.run_id, summary.baselines, "baselines.json")
        client.set_terminated(self.run_id, "FINISHED")

    def failed(self, error: BaseException) -> None:
        """Closes the run FAILED (KILLED on an interrupt), naming the error; what was logged stays."""
        if self.run_id is None:
            return
        from mlflow import MlflowClient

        client = MlflowClient()
        try:
            self._flush()
            client.set_tag(self.run_id, "recloop.stopped", f"{type(error).__name__}: {error}"[:500])
            client.set_terminated(self.run_id, "KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
        except Exception:  # noqa: BLE001 - the training's own error is the one to report, not the tracker's
            pass

    def _flush(self) -> None:
        from mlflow import MlflowClient

        pending, self._pending, self._flushed = self._pending, [], time.monotonic()
        for first in range(0, len(pending), 1000):  # MLflow's limit per batch
            MlflowClient().log_batch(self.run_id, metrics=pending[first:first + 1000])


def _unregistered_run(client, experiment: str, run_id: str):
    """The newest MLflow run of training ``run_id`` that registered no version (None: none)."""
    for run in client.search_runs([experiment], f"tags.`recloop.run_id` = '{run_id}'",
                                  order_by=["attributes.start_time DESC"]):
        if not client.search_model_versions(f"name='{MODEL_NAME}' and run_id='{run.info.run_id}'"):
            return run
    return None


def _figures(summary) -> dict[str, float]:
    """A training summary's figures as metrics: validation, per slice, baselines on the same rows."""
    figures = {"auc": summary.auc, "logloss": summary.logloss, "calibration": summary.calibration,
               "samples": summary.samples, "samples_per_s": summary.samples_per_s, "seconds": summary.seconds,
               "validation_rows": summary.validation_rows, "ndcg": summary.ndcg}
    if summary.oracle_auc is not None:
        figures["oracle_auc"] = summary.oracle_auc
    for name, scores in summary.baselines.items():  # recloop.gate.baselines on the same held-out rows
        for metric in ("auc", "logloss", "ndcg"):
            if scores.get(metric) is not None:
                figures[f"baseline_{name}_{metric}"] = scores[metric]
    for name, scores in summary.slices.items():
        figures[f"slice_auc.{name.replace('=', '.')}"] = scores["auc"]
    return {k: float(v) for k, v in figures.items() if v == v}


def log_training(settings: Settings, summary, example: pd.DataFrame) -> LoggedModel:
    """Log the model of a finished training (checkpoint, pyfunc model) into its run and register it.

    The run is the one ``TrainingRun`` kept while it trained. A summary trained without one (a test's, an
    older home's) gets a run of its own, back-dated to when its training began, with what the tracker would
    have logged.

    Args:
        summary: the trainer's ``TrainSummary``.
        example: a few training rows; their ``d_*``, ``c_*``, ``m_*`` columns are the model's input
            example and fix its signature.
    """
    import mlflow
    from mlflow import MlflowClient

    from recloop import checkpoint, model_code
    from recloop.ranker_pyfunc import RecloopRanker

    state = checkpoint.read(summary.checkpoint)
    experiment = configure(settings)
    client = MlflowClient()
    for earlier in client.search_runs([experiment], f"tags.`recloop.run_id` = '{summary.run_id}'"):
        versions = client.search_model_versions(f"name='{MODEL_NAME}' and run_id='{earlier.info.run_id}'")
        if versions:  # this training run is logged and registered already (a rerun of the same command)
            first = min(versions, key=lambda v: int(v.version))
            return LoggedModel(earlier.info.run_id, first.source, str(first.version))
    tracked = _unregistered_run(client, experiment, summary.run_id)
    if tracked is None:
        run_id = _run_after_the_fact(settings, summary, state, example)
    else:
        run_id = tracked.info.run_id
        if "auc" not in tracked.data.metrics:  # trained to the end, stopped before its figures were logged
            tracking = TrainingRun(settings)
            tracking.run_id = run_id
            tracking.trained(summary)
    with mlflow.start_run(run_id=run_id) as run:
        inputs = example[[c for c in example.columns if c.startswith(("d_", "c_", "m_"))]].copy()
        # Ids are int64 (MLflow's "long") in the signature, as the model takes them; training files hold int32
        # where a table fits (formats.id_dtype), which the signature accepts as well.
        for c in inputs.columns:
            if c.startswith("c_"):
                inputs[c] = inputs[c].astype("int64")
            elif c.startswith("m_"):
                inputs[c] = inputs[c].map(lambda ids: np.asarray(ids, dtype=np.int64))
        # Self-contained (recloop.model_code): recloop and its kernels ship as the model's code, so it loads
        # wherever MLflow serves; the MLmodel names modules and relative paths only.
        with warnings.catch_warnings(), model_code.code_paths() as code:
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")  # ids, never missing
            info = mlflow.pyfunc.log_model(
                name="model", loader_module="recloop.ranker_pyfunc", data_path=summary.checkpoint, code_paths=code,
                signature=model_code.signature(RecloopRanker(summary.checkpoint), inputs), input_example=inputs,
                pip_requirements=model_code.requirements(model_code.RANKER),
            )
    # What a download must match: sizes and checksums of the checkpoint's files, on the version itself.
    files = json.dumps(checkpoint.manifest(state["path"]), separators=(",", ":"))
    version = register(settings, info.model_uri, run.info.run_id, tags={checkpoint.MANIFEST_TAG: files})
    return LoggedModel(run.info.run_id, info.model_uri, version)


def _run_after_the_fact(settings: Settings, summary, state: dict, example: pd.DataFrame) -> str:
    """A run for a training that had no tracker, as ``TrainingRun`` would have kept it; its id."""
    import pyarrow.parquet as pq

    from recloop.features.job import FeatureLayout
    from recloop.train import RunStart

    training = FeatureLayout.for_settings(settings).training

    def rows(hours: list[str], otherwise: int) -> int:
        files = [training / f"{hour}.parquet" for hour in hours]
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files) if all(f.exists() for f in files) else otherwise

    tracking = TrainingRun(settings, start_time=int((time.time() - float(summary.seconds or 0.0)) * 1000))
    tracking.started(RunStart(
        run_id=summary.run_id, mode=summary.mode, params={"train": state["train"], "model": state["model"]},
        train_hours=summary.train_hours, validation_hours=summary.validation_hours,
        train_rows=rows(summary.train_hours, summary.samples),
        validation_rows=rows(summary.validation_hours, summary.validation_rows), example=example,
        state_version=summary.state_version, warm_start=summary.warm_start))
    for step, loss in summary.loss_curve:
        tracking.progress(int(step), {"train_loss": loss})
    tracking.trained(summary)
    return tracking.run_id


def _log_datasets(settings: Settings, client, run_id: str, start) -> None:
    """The training and validation windows as MLflow datasets (the run's Datasets column and inputs): the
    feature folder as source, the hours and row count as tags, a digest of the hours trained on; the
    profile is the schema with a few example rows."""
    import hashlib

    import mlflow
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    from recloop.features.job import FeatureLayout

    source = str(FeatureLayout.for_settings(settings).training)
    example = start.example
    inputs = []
    for context, hours, rows in (("training", start.train_hours, start.train_rows),
                                 ("validation", start.validation_hours, start.validation_rows)):
        if not hours:
            continue
        digest = hashlib.sha256("\n".join(hours).encode()).hexdigest()[:16]
        with warnings.catch_warnings():  # its hints: a local folder is a local folder; ids are integers
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            dataset = mlflow.data.from_pandas(example, source=source, name=f"{context} {hours[0]}..{hours[-1]}",
                                              targets="label" if "label" in example.columns else None,
                                              digest=digest)
            entity = dataset._to_mlflow_entity()  # what mlflow.log_input sends, for a run not the active one
        inputs.append(DatasetInput(entity, tags=[InputTag("hours", str(len(hours))), InputTag("rows", str(rows)),
                                                 InputTag(MLFLOW_DATASET_CONTEXT, context)]))
    client.log_inputs(run_id, datasets=inputs)


# MLflow error codes that say the registration itself is refused: trying again cannot help.
PERMANENT = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED", "UNAUTHENTICATED",
                       "INVALID_STATE", "BAD_REQUEST", "FEATURE_DISABLED"})


def _transient(err: BaseException) -> bool:
    """Whether a failed registration may succeed when tried again: a version number taken by another
    registration at the same moment, a locked store, a server that did not answer; not a refusal."""
    from mlflow.exceptions import MlflowException

    return isinstance(err, MlflowException) and err.error_code not in PERMANENT


def register(settings: Settings, model_uri: str, run_id: str | None = None, attempts: int = 8,
             model_name: str = MODEL_NAME, tags: dict[str, str] | None = None) -> str:
    """A new version of the registered model (with ``tags`` from its creation); safe when several runs
    register at once.

    MLflow numbers versions ``MAX(version)+1``, so two registrations can collide: registrations are
    serialized with a file lock on this machine and retried with exponential backoff (tenacity, ``attempts``
    in all, each wait logged) against a shared server; a refusal (``PERMANENT``) is raised at once.
    """
    from mlflow.exceptions import MlflowException
    from tenacity import Retrying, before_sleep_log, retry_if_exception, stop_after_attempt, wait_exponential

    client = mlflow_client(settings)
    retrying = Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=0.1, max=5.0),
                        retry=retry_if_exception(_transient), reraise=True,
                        before_sleep=before_sleep_log(log, logging.WARNING))
    with exclusive_lock(settings.home.resolve() / "mlflow-register.lock"):
        for attempt in retrying:
            with attempt:
                try:
                    client.create_registered_model(model_name)
                except MlflowException as err:
                    if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                        raise
                version = client.create_model_version(model_name, model_uri, run_id=run_id, tags=tags)
    return str(version.version)


def _alias_unset(err: Exception) -> bool:
    """Whether an alias lookup's MlflowException says the alias (or the model) does not exist, rather than
    that the registry could not answer: a locked SQLite store, a lost connection or a server's 5xx come
    as TEMPORARILY_UNAVAILABLE (or another code) and must not read as "no champion"."""
    code = getattr(err, "error_code", "")
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(err))


def alias_version(client, alias: str, model_name: str = MODEL_NAME) -> str | None:
    """The version ``alias`` points to through ``client`` (an ``MlflowClient``), None when the alias or the
    model does not exist; an error when the registry cannot answer (``_alias_unset``)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException as err:
        if _alias_unset(err):
            return None
        raise


def version_by_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> str | None:
    """``alias_version`` with this installation's client."""
    return alias_version(mlflow_client(settings), alias, model_name)


def aliases(settings: Settings, model_name: str = MODEL_NAME) -> dict[str, str | None]:
    return {alias: version_by_alias(settings, alias, model_name) for alias in ALIASES}


def set_alias(settings: Settings, alias: str, version: str, *, who: str | None = None, why: str = "",
              model_name: str = MODEL_NAME) -> None:
    client = mlflow_client(settings)
    client.set_registered_model_alias(model_name, alias, version)
    tag(settings, version, {f"alias.{alias}": json.dumps({  # one tag per alias: who moved it, why, when
        "by": who or getpass.getuser(), "why": why, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})},
        model_name)


def set_challenger(settings: Settings, version: str, *, who: str | None = None, why: str = "",
                   model_name: str = MODEL_NAME) -> None:
    """Make ``version`` the challenger. A challenger it replaces whose canary was still running is marked
    ``superseded`` in its ``canary`` tag (share 0, the reason), so no version is left saying "running"."""
    from dataclasses import replace

    from recloop.canary.tag import CanaryTag

    old = version_by_alias(settings, "challenger", model_name)
    if old is not None and old != version:
        tag_ = CanaryTag.from_tags(version_info(settings, old, model_name).tags)
        if tag_ is not None and tag_.state == "running":
            tag(settings, old, replace(tag_, state="superseded", share=0.0, reasons=(
                f"superseded by v{version} before a decision ({who or 'unknown'}: {why})",)).to_tag(), model_name)
    set_alias(settings, "challenger", version, who=who, why=why, model_name=model_name)


def remove_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> None:
    mlflow_client(settings).delete_registered_model_alias(model_name, alias)


def tag(settings: Settings, version: str, tags: dict[str, str], model_name: str = MODEL_NAME) -> None:
    client = mlflow_client(settings)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, str(value))


GATE_TAG = "gate"


def gate_tag(passed: bool, **detail) -> dict[str, str]:
    """The gate's one tag: ``{"gate": JSON}``, the verdict first (what the MLflow UI shows of it), then
    ``detail`` (champion, window, reasons, figures, thresholds)."""
    return {GATE_TAG: json.dumps({"verdict": "passed" if passed else "failed", **detail}, default=str)}


def gate_record(tags: dict[str, str]) -> dict | None:
    """A version's gate verdict and detail (``{"verdict": "passed" | "failed", ...}``), ``None`` if never gated.
    Versions gated before the one tag carry a plain verdict (and ``gate.detail`` JSON): read as the same."""
    raw = tags.get(GATE_TAG)
    if raw is None:
        return None
    if raw in ("passed", "failed"):
        try:
            detail = json.loads(tags.get(f"{GATE_TAG}.detail") or "{}")
        except ValueError:
            detail = {}
        return {"verdict": raw, **(detail if isinstance(detail, dict) else {})}
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) and record.get("verdict") in ("passed", "failed") else None


def describe(settings: Settings, version: str, description: str, model_name: str = MODEL_NAME) -> None:
    mlflow_client(settings).update_model_version(model_name, version, description=description)


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
    client = mlflow_client(settings)
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
    client = mlflow_client(settings)
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
