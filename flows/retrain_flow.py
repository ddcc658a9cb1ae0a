"""The loop: ingest → features → train → gate → canary start, for the ranker and then the retriever (each
its own registered model, gate and canary). Hourly incremental; full on drift or by hand."""

from typing import Literal

from prefect import flow

from flows.canary_flow import canary_flow
from flows.features_flow import features_flow
from flows.gate_flow import gate_flow
from flows.ingest_flow import ingest_flow
from flows.retriever_flow import retriever_flow
from flows.train_flow import train_flow
from recloop.flow_support import tag_run


@flow(name="retrain", log_prints=True)
def retrain_flow(mode: Literal["incremental", "full"] = "incremental", reason: str = "scheduled",
                 spec: str = "synthetic", days: int = 7, epochs: int = 1, batch_size: int | None = None,
                 validation_hours: int = 6, canary_config: str | None = None,
                 gate_thresholds: str | None = None, retriever: bool = True, retriever_thresholds: str | None = None,
                 retriever_epochs: int = 3, settings: dict | None = None) -> dict:
    result: dict = {"mode": mode, "reason": reason}
    result["ingest"] = ingest_flow(spec, settings=settings)
    result["features"] = features_flow(spec, settings=settings)
    result["train"] = train_flow(mode=mode, days=days, epochs=epochs if mode == "full" else 1,
                                 batch_size=batch_size, validation_hours=validation_hours, settings=settings)
    version = result["train"]["mlflow"]["version"]
    result["gate"] = gate_flow(version, gate_thresholds, settings=settings)
    if result["gate"]["alias"] == "challenger":
        result["canary"] = canary_flow(config_path=canary_config, start=True, settings=settings)
    if retriever:
        result["retriever"] = retriever_flow(mode=mode, spec=spec, days=days, epochs=retriever_epochs,
                                             validation_hours=validation_hours, thresholds_path=retriever_thresholds,
                                             canary_config=canary_config, settings=settings)
    tag_run(f"model-version:{version}", f"mode:{mode}")
    return result
