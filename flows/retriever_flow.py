"""Train the retriever (incremental from its champion, or full), build its index, register, gate, and start
its canary: the same steps as the ranker's, for ``recloop-retriever``. Run by the retrain flow. A retriever
whose towers and catalog are a registered version's registers nothing new and, like a version judged already,
is not gated (``skipped`` says why)."""

from typing import Literal

from prefect import flow, task

from flows.canary_flow import canary_flow, running_canary_task, waits_for
from flows.gate_flow import already_judged, judged_task
from recloop import pipeline
from recloop.flow_support import markdown_table, publish, retriever_run_name, settings_from, tag_run
from recloop.registry import RETRIEVER_NAME


@task(retries=1, retry_delay_seconds=30, persist_result=True, result_serializer="json")
def train_retriever_task(config: dict, spec: str | None, settings: dict | None) -> dict:
    from recloop import datasets
    from recloop.retrieval.train import RetrievalTrainConfig, RetrievalTrainError

    resolved = settings_from(settings)
    try:
        trained = pipeline.train_and_register_retriever(
            resolved, RetrievalTrainConfig(**config, spec=datasets.source(resolved, spec)))
    except RetrievalTrainError as err:  # e.g. no new hours since the champion: nothing to train, not a failure
        return {"skipped": str(err)}
    return trained.to_dict()


@task(persist_result=True, result_serializer="json")
def gate_retriever_task(version: str, thresholds_path: str | None, settings: dict | None) -> dict:
    from recloop.config_files import load_dataclass
    from recloop.gate.retrieval import RetrievalThresholds

    thresholds = load_dataclass(thresholds_path, RetrievalThresholds) if thresholds_path else None
    outcome = pipeline.gate_retriever(settings_from(settings), version, thresholds)
    return {k: v for k, v in outcome.items() if k not in ("candidate", "champion_scores")} | {
        "candidate": {"overall": outcome["candidate"]["overall"], "popularity": outcome["candidate"]["popularity"]}}


@flow(name="retriever", flow_run_name=retriever_run_name, log_prints=True)
def retriever_flow(mode: Literal["incremental", "full"] = "incremental", spec: str | None = None, days: int = 7,
                   epochs: int = 3, validation_hours: int = 6, thresholds_path: str | None = None,
                   canary_config: str | None = None, wait_for_canary_hours: float | None = None,
                   settings: dict | None = None) -> dict:
    """``wait_for_canary_hours`` (the retrain flow's scheduled incremental runs): while the retriever's canary
    runs (started at most this long ago), train nothing, as the ranker waits for its own (a new challenger would
    reset the canary's evidence)."""
    if wait_for_canary_hours is not None and (canary := running_canary_task(
            settings, RETRIEVER_NAME, max_wait_hours=wait_for_canary_hours)) is not None:
        skipped = waits_for(canary, "retriever retrain") + "; nothing trained"
        publish("retriever", f"retriever not trained: {skipped}", "retriever training")
        return {"train": {"skipped": skipped}, "waiting_for": canary}
    result: dict = {"train": train_retriever_task({"mode": mode, "days": days, "epochs": epochs if mode == "full" else 1,
                                                   "validation_hours": validation_hours}, spec, settings)}
    if "skipped" in result["train"]:
        publish("retriever", f"retriever not trained: {result['train']['skipped']}", "retriever training")
        return result
    version = result["train"]["mlflow"]["version"]
    record = judged_task(version, settings, RETRIEVER_NAME)
    if (skip := already_judged(version, result["train"]["mlflow"].get("duplicate_of"), record)) is not None:
        # the same towers and catalog as a registered version, or a version judged already: no gate, as the ranker
        tag_run(f"model:{RETRIEVER_NAME}", f"model-version:{version}", "gate:skipped")
        publish("retriever", f"retriever not gated: {skip}", "retriever training")
        return {**result, "skipped": skip}
    result["gate"] = gate_retriever_task(version, thresholds_path, settings)
    if result["gate"]["alias"] == "challenger":
        result["canary"] = canary_flow(config_path=canary_config, start=True, settings=settings,
                                       model_name=RETRIEVER_NAME)
    tag_run(f"model:{RETRIEVER_NAME}", f"model-version:{version}", f"mode:{result['train']['mode']}")
    overall = result["train"]["scores"].get("overall", {})
    publish("retriever", markdown_table([{"version": version, "mode": result["train"]["mode"],
                                          "clicks": result["train"]["clicks"], **overall,
                                          "gate": "passed" if result["gate"]["passed"] else "failed",
                                          "alias": result["gate"]["alias"]}]), "retriever training and gate")
    return result
