"""Train (incremental warm start from the champion, or full from scratch) and register the model; with
``nproc`` > 1, as that many processes under torchrun (one per GPU: ``recloop train --nproc N``)."""

import json
import os
import subprocess
import sys
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
    choices = tuple(config.get("embedding_l2_choices") or ())  # a list once the parameters went through JSON
    return pipeline.train_and_register(settings_from(settings),
                                       TrainConfig(**{**config, "embedding_l2_choices": choices})).to_dict()


def _settings_environment(settings: dict | None) -> dict[str, str]:
    """The flow's ``settings`` parameter as the ``RECLOOP_*`` variables a child process reads (a setting that is
    None is left unset, its default: "null" in the environment does not parse as a number)."""
    return {f"RECLOOP_{name.upper()}": value if isinstance(value, str) else json.dumps(value)
            for name, value in (settings or {}).items() if value is not None}


@task(retries=1, retry_delay_seconds=30, persist_result=True, result_serializer="json")
def train_processes_task(config: dict, nproc: int, settings: dict | None) -> dict:
    """``recloop train --nproc N``: the ranks share the tables and the data; the command's own process then
    completes the run (the tables put together, validated, written whole), registers the version and prints
    the same report ``train_task`` returns. Resumable as a one-process run is (its checkpoint)."""
    command = [sys.executable, "-m", "recloop.cli", "train", "--nproc", str(nproc), "--json",
               "--mode", config["mode"], "--days", str(config["days"]), "--epochs", str(config["epochs"]),
               "--validation-hours", str(config["validation_hours"]), "--replay", str(config["replay_fraction"])]
    if config["batch_size"]:
        command += ["--batch-size", str(config["batch_size"])]
    if config.get("seed"):
        command += ["--seed", str(config["seed"])]
    if config.get("embedding_l2_choices"):  # refused under torchrun, with the reason: not dropped silently
        command += ["--embedding-l2-choices", ",".join(str(c) for c in config["embedding_l2_choices"])]
    done = subprocess.run(command, env={**os.environ, **_settings_environment(settings)}, capture_output=True,
                          text=True, check=False)
    reports = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(reports) != 1:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"recloop train --nproc {nproc} failed (exit {done.returncode}): {tail}")
    return reports[0]


@flow(name="train", flow_run_name=train_run_name, log_prints=True)
def train_flow(mode: Literal["incremental", "full"] = "incremental", days: int = 7, epochs: int = 1,
               batch_size: int | None = None, validation_hours: int = 6, replay_fraction: float = 0.0,
               slot_timeout_seconds: float = 3600, nproc: int = 1, seed: int = 0,
               embedding_l2_choices: list[float] | None = None, settings: dict | None = None) -> dict:
    """Holds the ``recloop-model`` slot while it trains (``flow_support.model_slot``); a run that waited
    ``slot_timeout_seconds`` for it ends Cancelled, having done nothing. ``nproc`` > 1 trains as that many
    processes (one per GPU of the machine or pod: the deployment asks for as many, prefect.yaml). ``seed``:
    ``TrainConfig.seed`` (initialization and batch order). ``embedding_l2_choices``: a full run tries these
    embedding penalties besides the default and keeps one that does better on the newest rows
    (``TrainConfig.embedding_l2_choices``; one process only)."""
    config = {"mode": mode, "days": days, "epochs": epochs, "batch_size": batch_size,
              "validation_hours": validation_hours, "replay_fraction": replay_fraction, "seed": seed,
              "embedding_l2_choices": list(embedding_l2_choices or [])}
    try:
        with model_slot(slot_timeout_seconds, settings_from(settings).home):
            result = (train_processes_task(config, nproc, settings) if nproc > 1
                      else train_task(config, settings))
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
