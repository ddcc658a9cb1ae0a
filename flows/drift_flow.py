"""Drift and KPI monitor (every 30 minutes): drift or KPI decay requests a full retrain, debounced.

The request is a Prefect event (``recloop.retrain.requested``) that the ``full-retrain`` deployment's
trigger answers (``prefect.yaml``); its concurrency limit keeps one retrain at a time and the cool-down
(``recloop.monitor``'s trigger) keeps a persistent drift from asking again; a request with no outcome after
``unanswered_seconds`` (its event lost, its run dead) is asked again. ``retrain_inline`` runs the
retrain here instead, for the embedded demo, which has no deployments.
"""

import time

from prefect import flow, task
from prefect.events import emit_event

from flows.retrain_flow import retrain_flow
from recloop import datasets, pipeline
from recloop.flow_support import log, markdown_table, publish, run_name, settings_from, tag_run
from recloop.monitor import TriggerConfig, runner


@task(retries=2, retry_delay_seconds=10)
def monitor_task(spec: str | None, hours: int, config_path: str | None, now: float, cooldown_seconds: float,
                 settings: dict | None) -> dict:
    resolved = settings_from(settings)
    report = pipeline.check_drift(resolved, spec, hours=hours, config=runner.load_config(config_path), log=True)
    verdict = runner.request_retrain(resolved, report.decision, now=now,
                                     config=TriggerConfig(cooldown_seconds=cooldown_seconds))
    return {**report.to_dict(), "trigger": verdict.to_dict()}


@flow(name="drift", flow_run_name=lambda: run_name("drift"), log_prints=True)
def drift_flow(spec: str | None = None, hours: int = 24, now: float | None = None,
               cooldown_seconds: float = 6 * 3600, retrain_inline: bool = False,
               retrain_parameters: dict | None = None, config_path: str | None = None,
               settings: dict | None = None) -> dict:
    spec = datasets.source(settings_from(settings), spec)  # resolved once: the retrain it asks for uses the same
    result = monitor_task(spec, hours, config_path, time.time() if now is None else now, cooldown_seconds, settings)
    verdict = result["trigger"]
    if verdict["retrain"]:  # first: the run's tags and summary below are for people, the request is the loop
        emit_event(event="recloop.retrain.requested", resource={"prefect.resource.id": "recloop.loop"},
                   payload={"reason": verdict["reason"], "decision": result["decision"], "spec": spec,
                            "parameters": retrain_parameters or {}})
    tag_run(f"drift:{result['decision']}")
    log("%s: %s; trigger: %s", result["decision"], "; ".join(result["reasons"]), verdict["reason"])
    notes = "".join(f"\n\nnote: {note}" for note in result["notes"])
    publish("drift-summary", f"**{result['decision']}** — " + "; ".join(result["reasons"]) + notes + "\n\n"
            + markdown_table([{"drift_share": result["drift_share"], "drifted_columns": ", ".join(
                result["drifted_columns"]), "trigger": verdict["reason"]}]), "drift monitor")
    if verdict["retrain"] and retrain_inline:  # the retrain records its gate verdict (the cool-down rule)
        result["retrain"] = retrain_flow(mode="full", reason=verdict["reason"], spec=spec, settings=settings,
                                         monitor_request=True, requested_at=time.time() if now is None else now,
                                         **(retrain_parameters or {}))
    return result
