"""MLflow IO for the retriever: log and register a trained retriever (its gate run: ``recloop.gate.retrieval_runner``).

A retriever version of ``recloop-retriever`` is one MLflow model: the loader
(``recloop/retrieval/pyfunc.py``) with recloop as its code (``recloop.model_code``: it loads without
recloop installed) and the retriever's folder (towers as safetensors, catalog, FAISS index, JSON state)
as its data. Aliases are the ranker's: ``champion``, ``challenger``, ``previous``,
set through ``recloop.registry`` with ``model_name=RETRIEVER_NAME``.

Example::

    logged = log_retriever(settings, summary)
    folder = retriever_folder(settings, logged.version)   # downloaded and verified
"""

from __future__ import annotations

import warnings
from pathlib import Path

from recloop import model_code, registry, tracking
from recloop.registry import RETRIEVER_NAME, LoggedModel
from recloop.settings import Settings

PIP_REQUIREMENTS = model_code.requirements(model_code.RETRIEVER)
CONTENT = ("model.safetensors", "items.safetensors", "attributes.json")  # what the digest covers (not the index)


def log_retriever(settings: Settings, summary) -> LoggedModel:
    """Log a finished retriever run (configuration, held-out scores, windows, folder) and register it.

    A rerun with the same run id finds the version registered before. A retriever whose towers and catalog are
    a registered version's (the same digest, ``checkpoint.WEIGHTS_TAG``) registers no version: its run points at
    that one (``tracking.DUPLICATE_TAG``) and the ``LoggedModel`` says ``duplicate_of``.
    """
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    from recloop import checkpoint
    from recloop.retrieval.train import read_state

    state = read_state(Path(summary.checkpoint))
    experiment = registry.configure(settings)
    client = MlflowClient()
    for earlier in client.search_runs([experiment], f"tags.`recloop.run_id` = '{summary.run_id}'"):
        versions = client.search_model_versions(f"name='{RETRIEVER_NAME}' and run_id='{earlier.info.run_id}'")
        if versions:
            first = min(versions, key=lambda v: int(v.version))
            return LoggedModel(earlier.info.run_id, first.source, str(first.version))
    with mlflow.start_run(experiment_id=experiment, run_name=f"retriever-{summary.run_id}") as run:
        mlflow.log_params(tracking.flatten_params("", {"train": state["train"]}, {}))
        overall = summary.scores.get("overall", {})
        popularity = summary.scores.get("popularity") or {}
        metrics = {**{k.replace("@", "_at_"): v for k, v in overall.items()},
                   **{f"popularity_{k.replace('@', '_at_')}": v for k, v in popularity.items()},
                   "clicks_trained": summary.clicks, "seconds": summary.seconds,
                   "index_seconds": summary.index_seconds, "catalog_items": summary.catalog_items}
        mlflow.log_metrics({k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and v == v})
        mlflow.set_tags({
            "recloop.kind": "retriever", "recloop.mode": summary.mode, "recloop.run_id": summary.run_id,
            "recloop.train_window": f"{summary.train_hours[0]}..{summary.train_hours[-1]}",
            "recloop.validation_window": f"{summary.validation_hours[0]}..{summary.validation_hours[-1]}",
            "recloop.state_version": str(summary.state_version), "recloop.warm_start": summary.warm_start or "",
        })
        mlflow.log_dict(summary.scores, "validation_scores.json")
        digest = checkpoint.files_digest(summary.checkpoint, CONTENT)
        same = tracking.version_with_weights(client, digest, RETRIEVER_NAME)
        if same is not None:  # the same retriever registered already: the run points at it, no new version
            mlflow.set_tag(tracking.DUPLICATE_TAG, str(same.version))
            return LoggedModel(run.info.run_id, same.source, str(same.version), duplicate_of=str(same.version))
        features = state["features"]
        example = pd.DataFrame({features["user_id"]: [2], **{c: [2] for c in features["context"]},
                                **{c: [[2, 3]] for c in features["history"]}})
        with warnings.catch_warnings():  # its hint about integer columns: ours are indices, never missing
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            with model_code.code_paths() as code:  # self-contained: recloop ships as the model's code
                info = mlflow.pyfunc.log_model(name="retriever", loader_module="recloop.retrieval.pyfunc",
                                               data_path=summary.checkpoint, code_paths=code,
                                               signature=_signature(example, {"k": 500}),
                                               input_example=(example, {"k": 500}), pip_requirements=PIP_REQUIREMENTS)
    version = registry.register(settings, info.model_uri, run.info.run_id, model_name=RETRIEVER_NAME,
                                tags={**checkpoint.manifest_tags(summary.checkpoint), checkpoint.WEIGHTS_TAG: digest})
    return LoggedModel(run.info.run_id, info.model_uri, version)


def retriever_folder(settings: Settings, version: str) -> Path:
    """A registered retriever's folder, downloaded from the registry once (``checkpoint.resolve``): a
    replica or the gate needs no shared filesystem with the trainer."""
    from recloop import checkpoint

    return checkpoint.resolve(settings, version, RETRIEVER_NAME)


def _signature(example, params: dict):
    """The retriever's MLflow signature: its user rows in (inferred from ``example``), ``k`` as a parameter, and
    what ``RecloopRetriever.predict`` answers: each row's item ids and scores. Declared rather than inferred
    from a prediction, so that logging never depends on the weights loading (serving's load check is the place
    where a version that does not load is found and rolled back)."""
    from mlflow.models import ModelSignature, infer_signature
    from mlflow.types.schema import Array, ColSpec, Schema

    inferred = infer_signature(example, params=params)
    outputs = Schema([ColSpec(Array("long"), "item_ids"), ColSpec(Array("float"), "scores")])
    return ModelSignature(inputs=inferred.inputs, outputs=outputs, params=inferred.params)
