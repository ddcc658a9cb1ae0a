"""Train (incremental warm start from the champion, or full from scratch) and register the model."""

from typing import Literal

from prefect import flow, task
from prefect.states import Cancelled

from recloop import pipeline
from recloop.flow_support import (
    SlotBusy,
    log,
    markdown_table,
    model_slot,
    publish,
    settings_from,
    tag_run,
    train_run_name,
)
from recloop.train import TrainConfig


@task(retries=1, retry_delay_seconds=30, persist_result=True, result_serializer="json")
def train_task(config: dict, settings: dict | None) -> dict:
    return pipeline.train_and_register(settings_from(settings), TrainConfig(**config)).to_dict()


@flow(name="train", flow_run_name=train_run_name, log_prints=True)
def train_flow(mode: Literal["incremental", "full"] = "incremental", days: int = 7, epochs: int = 1,
               batch_size: int | None = None, validation_hours: int = 6, replay_fraction: float = 0.0,
               slot_timeout_seconds: float = 3600, settings: dict | None = None) -> dict:
    """Holds the ``recloop-model`` slot while it trains (``flow_support.model_slot``); a run that waited
    ``slot_timeout_seconds`` for it ends Cancelled, having done nothing."""
    try:
        with model_slot(slot_timeout_seconds, settings_from(settings).home):
            result = train_task({"mode": mode, "days": days, "epochs": epochs, "batch_size": batch_size,
                                 "validation_hours": validation_hours, "replay_fraction": replay_fraction}, settings)
    except SlotBusy as busy:
        log("%s", busy)
        return Cancelled(message=str(busy))
    version = result["mlflow"]["version"]
    log("trained v%s (%s) on %s..%s: %s samples in %.1f s, validation AUC %.4f%s", version, mode,
        *(result["train_hours"] or ["?", "?"]), result["samples"], result["seconds"], result["auc"],
        f" (the same weights as registered v{version}: no new version)" if result["mlflow"].get("duplicate_of")
        else "")
    for override in result.get("overrides", []):
        log("overridden: %s", override)
    tag_run(f"model-version:{version}", f"mode:{mode}")
    publish("training", markdown_table([{"version": version, "mode": mode, "samples": result["samples"],
                                         "auc": result["auc"], "oracle_auc": result["oracle_auc"],
                                         "seconds": result["seconds"]}]), "training run")
    return result
