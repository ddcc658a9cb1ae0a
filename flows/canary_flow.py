"""The canary controller's check (every 10 minutes): start, hold, step the share, promote or roll back.

``model_name`` picks whose canary: the ranker's (default) or the retriever's (``recloop-retriever``).
"""

from prefect import flow, task

from recloop.canary import controller
from recloop.flow_support import (
    canary_run_name,
    log,
    markdown_table,
    outcome_state,
    publish,
    record_outcome,
    settings_from,
    tag_run,
)


@task(retries=2, retry_delay_seconds=10)
def canary_task(config_path: str | None, start: bool, settings: dict | None, model_name: str) -> dict:
    resolved, config = settings_from(settings), controller.load_config(config_path)
    if start:
        return controller.start(resolved, config, model_name=model_name).to_dict()
    return controller.step(resolved, config, model_name=model_name).to_dict()


@task
def running_canary_task(settings: dict | None, model_name: str = "recloop-ranker",
                        max_wait_hours: float | None = None) -> dict | None:
    """The challenger whose canary is in progress and its share (``None``: no canary is running, or it has run
    longer than ``max_wait_hours``: a canary that no traffic reaches must not hold back retrains for ever)."""
    import time

    found = controller.running_tag(settings_from(settings), model_name)
    if found is None:
        return None
    version, tag = found
    hours = (time.time() - tag.started_at) / 3600 if tag.started_at is not None else 0.0
    canary = {"version": version, "share": tag.share, "hours": round(hours, 2), "age_hours": hours}
    return None if max_wait_hours is not None and outwaited(canary, max_wait_hours) else canary


def outwaited(canary: dict, max_wait_hours: float) -> bool:
    """Whether a scheduled run supersedes this running canary (``running_canary_task``'s): it has run longer
    than the run waits. Says so in the run's log when it has."""
    if canary["age_hours"] <= max_wait_hours:
        return False
    log("v%s's canary has run %.1f h, longer than a scheduled retrain waits (%s h): it is superseded",
        canary["version"], canary["age_hours"], max_wait_hours)
    return True


def waits_for(canary: dict, what: str) -> str:
    """Why a scheduled incremental run of ``what`` waits for the running canary instead of superseding it."""
    return (f"v{canary['version']}'s canary is still running (share {canary['share']:.0%}): the scheduled {what} "
            "waits for its decision; the next one trains on every hour the champion has not seen")


@flow(name="canary", flow_run_name=canary_run_name, log_prints=True)
def canary_flow(config_path: str | None = None, start: bool = False, settings: dict | None = None,
                model_name: str = "recloop-ranker") -> dict:
    result = canary_task(config_path, start, settings, model_name)
    if result.get("challenger"):
        tag_run(f"model:{model_name}", f"model-version:{result['challenger']}", f"canary:{result['action']}")
    decision = result.get("decision") or {}
    retriever = model_name != "recloop-ranker"
    if result.get("challenger"):
        record_outcome(settings_from(settings), "retriever-canary" if retriever else "canary", result["action"])
    log("%s%s%s: %s", "retriever " if retriever else "", result["action"],
        f" v{result['challenger']}" if result.get("challenger") else "",
        "; ".join(decision.get("reasons", [])) or "no challenger")
    if result["action"] in NO_OPS:  # nothing moved: filterable (tag no-op) and named so on the run's badge
        tag_run(NO_OP_TAG)
    publish("retriever-canary-decision" if retriever else "canary-decision",
            f"**{result['action']}** — " + "; ".join(decision.get("reasons", [])) + "\n\n"
            + markdown_table([{"variant": k, **v} for k, v in result.get("stats", {}).items()]), "canary decision")
    why = "; ".join(decision.get("reasons", [])) or result.get("message") or "no challenger"
    return outcome_state(STATE_NAMES.get(result["action"], result["action"].capitalize()), why,
                         {k: v for k, v in result.items() if k != "stats"})


NO_OPS = ("none", "hold")
NO_OP_TAG = "no-op"
"""The tag of a check that moved nothing (no canary running, or one held): the Prefect UI's runs list filters
them out by tag (a 3-day demo's list was mostly such checks)."""
STATE_NAMES = {"none": "NoCanary", "hold": "Held", "start": "Started", "step": "Stepped", "promote": "Promoted",
               "rollback": "RolledBack"}
