"""Judge a registered version against the champion on the same held-out window (pass → challenger)."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import publish, tag_run
from recloop.gate import load_thresholds
from recloop.settings import Settings


@task(persist_result=True)
def gate_task(version: str | None, thresholds_path: str | None) -> dict:
    thresholds = load_thresholds(thresholds_path) if thresholds_path else None
    return pipeline.gate(Settings(), version, thresholds)


@flow(name="gate", log_prints=True)
def gate_flow(version: str | None = None, thresholds_path: str | None = None) -> dict:
    outcome = gate_task(version, thresholds_path)
    tag_run(f"model-version:{outcome['version']}", "gate:passed" if outcome["passed"] else "gate:failed")
    publish("gate-report", outcome["report"], f"gate of version {outcome['version']}")
    return {k: v for k, v in outcome.items() if k != "report"}
