"""Judge a registered version against the champion on the same held-out window (pass → challenger)."""

from prefect import flow, task
from prefect.states import Cancelled

from recloop import pipeline
from recloop.flow_support import SlotBusy, gate_run_name, log, model_slot, publish, settings_from, tag_run
from recloop.gate import load_thresholds


@task(persist_result=True, result_serializer="json")
def gate_task(version: str | None, thresholds_path: str | None, settings: dict | None) -> dict:
    thresholds = load_thresholds(thresholds_path) if thresholds_path else None
    outcome = pipeline.gate(settings_from(settings), version, thresholds)
    return {**outcome.to_dict(), "report": outcome.report}


@flow(name="gate", flow_run_name=gate_run_name, log_prints=True)
def gate_flow(version: str | None = None, thresholds_path: str | None = None, slot_timeout_seconds: float = 3600,
              settings: dict | None = None) -> dict:
    """Holds the ``recloop-model`` slot while it judges (moving aliases races with a retrain's gate)."""
    try:
        with model_slot(slot_timeout_seconds, settings_from(settings).home):
            outcome = gate_task(version, thresholds_path, settings)
    except SlotBusy as busy:
        log("%s", busy)
        return Cancelled(message=str(busy))
    verdict = "passed" if outcome["passed"] else outcome.get("verdict") if outcome.get("verdict") == \
        "insufficient evidence" else "failed"
    log("v%s %s the gate → %s%s", outcome["version"], verdict, outcome["alias"] or "no alias",
        "".join(f"\n  - {reason}" for reason in [*outcome["reasons"], *outcome.get("insufficient", [])]))
    tag_run(f"model-version:{outcome['version']}", f"gate:{verdict}")
    publish("gate-report", outcome.pop("report"), f"gate of version {outcome['version']}")
    return outcome


@task
def judged_task(version: str, settings: dict | None, model_name: str = "recloop-ranker") -> dict | None:
    """The version's recorded gate verdict (``registry.gate_record``), None when it was never gated."""
    from recloop import registry

    return registry.gate_record(registry.version_info(settings_from(settings), version, model_name).tags)


def already_judged(version: str, duplicate_of: str | None, record: dict | None) -> str | None:
    """Why a retrain's candidate is not gated (None: it is): its weights are a registered version's, or it was
    judged already (a queued retrain that found the run before it trained, registered and gated this very
    version: judging it again moved nothing, or moved aliases a refusal had settled)."""
    if record is not None:
        verdict = "passed" if record["verdict"] == "passed" else "refused"
        return (f"v{version} was judged already ({verdict} by the gate"
                + (f" against champion v{record['champion']}" if record.get("champion") else "") + "): not gated again"
                + ("; this run trained the same weights" if duplicate_of else ""))
    if duplicate_of is not None:
        return f"this run trained the same weights as registered v{version}: no new version, not gated"
    return None
