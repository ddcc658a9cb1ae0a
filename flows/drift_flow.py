"""Drift and KPI monitor (every 30 minutes): drift or KPI decay requests a full retrain, debounced.

The request is a Prefect event (``recloop.retrain.requested``) that the ``full-retrain`` deployment's
trigger answers (``prefect.yaml``); its concurrency limit keeps one retrain at a time and the cool-down
in ``recloop.trigger`` keeps a persistent drift from asking again. ``retrain_inline`` runs the retrain
here instead, for the embedded demo, which has no deployments.
"""

import time

from prefect import flow, task
from prefect.events import emit_event

from recloop import pipeline, trigger
from recloop.flow_support import markdown_table, publish, tag_run
from recloop.monitor import load_config
from recloop.settings import Settings


@task(retries=2, retry_delay_seconds=10, persist_result=True)
def monitor_task(spec: str, hours: int, config_path: str | None) -> dict:
    config = load_config(config_path) if config_path else None
    return pipeline.check_drift(Settings(), spec, hours=hours, config=config, log=True)


@flow(name="drift", log_prints=True)
def drift_flow(spec: str = "synthetic", hours: int = 24, now: float | None = None,
               cooldown_seconds: float = 6 * 3600, retrain_inline: bool = False,
               retrain_parameters: dict | None = None, config_path: str | None = None) -> dict:
    result = monitor_task(spec, hours, config_path)
    verdict = trigger.decide_and_record(Settings(), result["decision"], result["reasons"],
                                        now=time.time() if now is None else now,
                                        config=trigger.TriggerConfig(cooldown_seconds=cooldown_seconds))
    tag_run(f"drift:{result['decision']}")
    notes = "".join(f"\n\nnote: {note}" for note in result.get("notes", []))
    publish("drift-summary", f"**{result['decision']}** — " + "; ".join(result["reasons"]) + notes + "\n\n"
            + markdown_table([{"drift_share": result["drift_share"], "drifted_columns": ", ".join(
                result["drifted_columns"]), "trigger": verdict.reason}]), "drift monitor")
    result["trigger"] = verdict.to_dict()
    if verdict.retrain:
        emit_event(event="recloop.retrain.requested", resource={"prefect.resource.id": "recloop.loop"},
                   payload={"reason": verdict.reason, "decision": result["decision"],
                            "parameters": retrain_parameters or {}})
        if retrain_inline:
            from retrain_flow import retrain_flow

            result["retrain"] = retrain_flow(mode="full", reason=verdict.reason, **(retrain_parameters or {}))
    return result
