"""MLflow IO for the retriever: log and register a trained retriever, and run its gate.

A retriever version of ``recloop-retriever`` is one MLflow model: the loader
(``recloop/retriever_pyfunc.py``) with recloop as its code (``recloop.model_code``: it loads without
recloop installed) and the retriever's folder (towers as safetensors, catalog, FAISS index, JSON state)
as its data. Aliases are the ranker's: ``champion``, ``challenger``, ``previous``,
set through ``recloop.registry`` with ``model_name=RETRIEVER_NAME``.

Example::

    logged = log_retriever(settings, summary)
    outcome = run_retrieval_gate(settings, logged.version, oracle=WorldOracle(world))
    outcome["alias"]       # 'champion' (first model), 'challenger' (passed) or None (failed)
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

from recloop import model_code, registry
from recloop.registry import RETRIEVER_NAME, LoggedModel
from recloop.retrieval.evaluate import WorldOracle
from recloop.retrieval.gate import RetrievalThresholds, decide, report_markdown
from recloop.settings import Settings

PIP_REQUIREMENTS = model_code.requirements(model_code.RETRIEVER)


def log_retriever(settings: Settings, summary) -> LoggedModel:
    """Log a finished retriever run (configuration, held-out scores, windows, folder) and register it.

    A rerun with the same run id finds the version registered before.
    """
    import mlflow
    import pandas as pd
    from mlflow import MlflowClient

    from recloop import checkpoint
    from recloop.retrieval.train import read_state
    from recloop.retriever_pyfunc import RecloopRetriever

    state = read_state(Path(summary.checkpoint))
    experiment = registry.configure(settings)
    client = MlflowClient()
    for earlier in client.search_runs([experiment], f"tags.`recloop.run_id` = '{summary.run_id}'"):
        versions = client.search_model_versions(f"name='{RETRIEVER_NAME}' and run_id='{earlier.info.run_id}'")
        if versions:
            first = min(versions, key=lambda v: int(v.version))
            return LoggedModel(earlier.info.run_id, first.source, str(first.version))
    with mlflow.start_run(experiment_id=experiment, run_name=f"retriever-{summary.run_id}") as run:
        mlflow.log_params(registry._flatten("", {"train": state["train"]}, {}))
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
        features = state["features"]
        example = pd.DataFrame({features["user_id"]: [2], **{c: [2] for c in features["context"]},
                                **{c: [[2, 3]] for c in features["history"]}})
        with warnings.catch_warnings():  # its hint about integer columns: ours are indices, never missing
            warnings.filterwarnings("ignore", message="Hint: Inferred schema contains integer")
            with model_code.code_paths() as code:  # self-contained: recloop ships as the model's code
                info = mlflow.pyfunc.log_model(name="retriever", loader_module="recloop.retriever_pyfunc",
                                               data_path=summary.checkpoint, code_paths=code,
                                               signature=model_code.signature(RecloopRetriever(summary.checkpoint),
                                                                              example, {"k": 500}),
                                               input_example=(example, {"k": 500}), pip_requirements=PIP_REQUIREMENTS)
    files = json.dumps(checkpoint.manifest(summary.checkpoint), separators=(",", ":"))  # what a download must match
    version = registry.register(settings, info.model_uri, run.info.run_id, model_name=RETRIEVER_NAME,
                                tags={checkpoint.MANIFEST_TAG: files})
    return LoggedModel(run.info.run_id, info.model_uri, version)


def retriever_folder(settings: Settings, version: str) -> Path:
    """A registered retriever's folder, downloaded from the registry once (``checkpoint.resolve``): a
    replica or the gate needs no shared filesystem with the trainer."""
    from recloop import checkpoint

    return checkpoint.resolve(settings, version, RETRIEVER_NAME)


def run_retrieval_gate(settings: Settings, version: str, thresholds: RetrievalThresholds | None = None,
                       oracle: WorldOracle | None = None) -> dict:
    """Score candidate and champion on the candidate's held-out hours, decide, tag, and set the alias.

    A pass makes the first retriever ``champion`` and any later one ``challenger`` (its canary starts
    from there); a failure leaves the version registered, its ``gate`` tag saying ``failed`` with the reasons.
    """
    from recloop.features.job import FeatureLayout
    from recloop.retrieval.retriever import Retriever, score_window

    thresholds = thresholds or RetrievalThresholds()
    info = registry.version_info(settings, version, RETRIEVER_NAME)
    champion_version = registry.version_by_alias(settings, "champion", RETRIEVER_NAME)
    if champion_version == version:
        raise RuntimeError(f"retriever version {version} is already the champion")
    if info.validation_window is None:
        raise RuntimeError(f"retriever version {version} has no held-out window in its run's tags")
    window = info.validation_window
    training = FeatureLayout.for_settings(settings).training
    files = sorted(p for p in training.glob("*.parquet") if window[0] <= p.stem <= window[1])
    if not files:
        raise RuntimeError(f"the held-out hours {window} are no longer in {training}")
    ks = tuple(sorted({100, thresholds.k}))
    candidate = score_window(Retriever.load(retriever_folder(settings, version)), files, ks, oracle)
    champion = None
    if champion_version is not None:
        champion = score_window(Retriever.load(retriever_folder(settings, champion_version)), files, ks, oracle)
    mode = info.mode or "full"
    decision = decide(candidate, champion, thresholds, mode)
    report = report_markdown(decision, candidate, champion, version, champion_version, mode)
    from mlflow import MlflowClient

    MlflowClient().log_text(info.run_id, report, f"gate_report_v{version}.md")
    registry.describe(settings, version, report, RETRIEVER_NAME)
    recall = f"recall@{thresholds.k}"
    registry.tag(settings, version, registry.gate_tag(
        decision.passed, champion=champion_version, window=list(window), reasons=list(decision.reasons),
        **{recall: candidate.overall.get(recall), f"champion_{recall}": champion.overall.get(recall) if champion else None}),
        RETRIEVER_NAME)
    alias = None
    if decision.passed and champion_version is None:
        registry.promote(settings, version, who="gate", why="first retriever: passed the floors",
                         model_name=RETRIEVER_NAME)
        alias = "champion"
    elif decision.passed:
        registry.set_challenger(settings, version, who="gate", why="passed the gate", model_name=RETRIEVER_NAME)
        alias = "challenger"
    return {"passed": decision.passed, "reasons": list(decision.reasons), "version": version, "alias": alias,
            "champion": champion_version, "mode": mode, "first_model": decision.first_model,
            "candidate": candidate.to_dict(), "champion_scores": champion.to_dict() if champion else None,
            "figures": decision.figures, "report": report}
