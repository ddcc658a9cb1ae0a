"""The canary controller's check (every 10 minutes): hold, step the share, promote or roll back."""

from prefect import flow, task

from recloop.flow_support import markdown_table, publish, tag_run
from recloop.serve import controller
from recloop.settings import Settings


@task(retries=2, retry_delay_seconds=10)
def canary_task(config_path: str | None, start: bool) -> dict:
    settings = Settings()
    config = controller.load_config(config_path)
    if start:
        return controller.start(settings, config) | {"action": "start"}
    return controller.step(settings, config)


@flow(name="canary", log_prints=True)
def canary_flow(config_path: str | None = None, start: bool = False) -> dict:
    result = canary_task(config_path, start)
    version = result.get("challenger") or result.get("version")
    if version:
        tag_run(f"model-version:{version}", f"canary:{result['action']}")
    decision = result.get("decision") or {}
    publish("canary-decision", f"**{result['action']}** — " + "; ".join(decision.get("reasons", [])) + "\n\n"
            + markdown_table([{"variant": k, **v} for k, v in result.get("stats", {}).items()]), "canary decision")
    return {k: v for k, v in result.items() if k != "stats"}
