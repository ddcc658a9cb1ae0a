"""The canary controller's check (every 10 minutes): start, hold, step the share, promote or roll back."""

from prefect import flow, task

from recloop.canary import controller
from recloop.flow_support import (
    canary_run_name,
    log,
    markdown_table,
    publish,
    record_outcome,
    settings_from,
    tag_run,
)


@task(retries=2, retry_delay_seconds=10)
def canary_task(config_path: str | None, start: bool, settings: dict | None) -> dict:
    resolved, config = settings_from(settings), controller.load_config(config_path)
    return (controller.start(resolved, config) if start else controller.step(resolved, config)).to_dict()


@flow(name="canary", flow_run_name=canary_run_name, log_prints=True)
def canary_flow(config_path: str | None = None, start: bool = False, settings: dict | None = None) -> dict:
    result = canary_task(config_path, start, settings)
    if result.get("challenger"):
        tag_run(f"model-version:{result['challenger']}", f"canary:{result['action']}")
    decision = result.get("decision") or {}
    if result.get("challenger"):
        record_outcome(settings_from(settings), "canary", result["action"])
    log("%s%s: %s", result["action"], f" v{result['challenger']}" if result.get("challenger") else "",
        "; ".join(decision.get("reasons", [])) or "no challenger")
    publish("canary-decision", f"**{result['action']}** — " + "; ".join(decision.get("reasons", [])) + "\n\n"
            + markdown_table([{"variant": k, **v} for k, v in result.get("stats", {}).items()]), "canary decision")
    return {k: v for k, v in result.items() if k != "stats"}
