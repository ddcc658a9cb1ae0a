"""Judge a registered version against the champion on the same held-out window (pass → challenger)."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import publish, settings_from, tag_run
from recloop.gate import load_thresholds


@task(persist_result=True, result_serializer="json")
def gate_task(version: str | None, thresholds_path: str | None, settings: dict | None) -> dict:
    thresholds = load_thresholds(thresholds_path) if thresholds_path else None
    outcome = pipeline.gate(settings_from(settings), version, thresholds)
    return {**outcome.to_dict(), "report": outcome.report}


@flow(name="gate", log_prints=True)
def gate_flow(version: str | None = None, thresholds_path: str | None = None, settings: dict | None = None) -> dict:
    outcome = gate_task(version, thresholds_path, settings)
    tag_run(f"model-version:{outcome['version']}", "gate:passed" if outcome["passed"] else "gate:failed")
    publish("gate-report", outcome.pop("report"), f"gate of version {outcome['version']}")
    return outcome
