"""The MLflow run of a training: opened at its first step, fed its losses, closed with its figures, and the
trained model logged into it and registered.

``recloop.train`` knows nothing of MLflow: it tells a ``Tracker`` (``TrainingRun`` here) when it starts, each
loss reading and when it ends. ``log_training`` then logs the checkpoint as a pyfunc model into the same run
and registers a new version through ``recloop.registry``. The registry below records and resolves versions;
this module is the only one that ties a training to them.

Example::

    summary = train(settings, config, tracker=TrainingRun(settings))  # the run spans the training
    logged = log_training(settings, summary, example)  # + pyfunc model (recloop.model_code), new version
"""

from __future__ import annotations

import json
import time
import warnings

import numpy as np
import pandas as pd

from recloop import checkpoint, model_code
from recloop.features.definition import FeatureLayout
from recloop.ranker_pyfunc import RecloopRanker
from recloop.registry import MODEL_NAME, LoggedModel, configure, register
from recloop.settings import Settings
from recloop.train import RunStart
from recloop.version_tags import readable


def flatten_params(prefix: str, value, out: dict) -> dict:
    """Nested configuration as MLflow parameters: ``{"train": {"epochs": 2}}`` → ``{"train.epochs": 2}``."""
    if isinstance(value, dict):
        for key, inner in value.items():
            flatten_params(f"{prefix}.{key}" if prefix else key, inner, out)
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
        params = [Param(key, str(value)) for key, value in flatten_params("", start.params, {}).items()]
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
        client.log_dict(self.run_id, flatten_params("", {"slices": summary.slices}, {}), "validation_slices.json")
        if summary.baselines:
            client.log_dict(self.run_id, summary.baselines, "baselines.json")
        client.set_terminated(self.run_id, "FINISHED")

    def flush(self) -> None:
        """The figures held back (``progress`` sends them every ``flush_seconds``) sent now."""
        if self.run_id is not None:
            self._flush()

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
    for name, scores in summary.baselines.items():  # recloop.baselines on the same held-out rows
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
    digest = checkpoint.weights_digest(state["path"])
    same = version_with_weights(client, digest)
    if same is not None:  # the same model registered already: the run points at it, no new version
        client.set_tag(run_id, DUPLICATE_TAG, str(same.version))
        return LoggedModel(run_id, same.source, str(same.version), duplicate_of=str(same.version))
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
    tags = {**checkpoint.manifest_tags(state["path"]), checkpoint.WEIGHTS_TAG: digest}
    if getattr(summary, "overrides", None):
        tags.update(readable(OVERRIDES_TAG, "; ".join(summary.overrides), list(summary.overrides)))
    version = register(settings, info.model_uri, run.info.run_id, tags=tags)
    return LoggedModel(run.info.run_id, info.model_uri, version)


DUPLICATE_TAG = "recloop.duplicate_of_version"  # on a run whose weights a registered version has already
OVERRIDES_TAG = "train.overrides"  # on a version: what its trainer did instead of what it was asked (JSON list)


def version_with_weights(client, digest: str, model_name: str = MODEL_NAME):
    """The first registered version whose weights digest is ``digest``, or None (versions registered before the
    digest was recorded carry none: never matched)."""
    found = [v for v in client.search_model_versions(f"name='{model_name}'")
             if (v.tags or {}).get(checkpoint.WEIGHTS_TAG) == digest]
    return min(found, key=lambda v: int(v.version)) if found else None


def _run_after_the_fact(settings: Settings, summary, state: dict, example: pd.DataFrame) -> str:
    """A run for a training that had no tracker, as ``TrainingRun`` would have kept it; its id."""
    import pyarrow.parquet as pq

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
