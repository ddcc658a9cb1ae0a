"""What the Prefect flows in ``flows/`` share: artifacts, run tags, and Prefect's embedded defaults.

Kept out of ``flows/`` so the flow files stay thin wiring; imported only by them (and the demo).
"""

from __future__ import annotations

import os
from pathlib import Path

from recloop.settings import Settings


def configure_prefect(settings: Settings) -> None:
    """Embedded defaults before Prefect is imported: its state under ``RECLOOP_HOME`` (so ``recloop up``
    shows the demo's runs), a patient ephemeral server, no analytics; ``RECLOOP_PREFECT_API_URL`` points
    at a real server instead."""
    os.environ.setdefault("PREFECT_HOME", str(settings.home.resolve() / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect warns when it cannot
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    if settings.prefect_api_url:
        os.environ.setdefault("PREFECT_API_URL", settings.prefect_api_url)


SECRET_FIELDS = ("admin_token", "object_store_secret_key")


def settings_from(overrides: dict | None) -> Settings:
    """The settings a flow runs with: ``RECLOOP_*`` from the environment, overridden by the flow's
    ``settings`` parameter (a JSON object of ``Settings`` fields, secrets excluded)."""
    return Settings(**(overrides or {}))


def settings_parameter(settings: Settings) -> dict:
    """``settings`` as a flow parameter: its non-secret fields as JSON (visible in the Prefect UI, so secrets
    stay in the worker's environment)."""
    return {**settings.model_dump(mode="json", exclude=set(SECRET_FIELDS)), "home": str(settings.home.resolve())}


def markdown_table(rows: list[dict]) -> str:
    if not rows:
        return "_nothing_\n"
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "|" + " --- |" * len(columns)]
    lines += ["| " + " | ".join(_cell(row.get(c)) for c in columns) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.4f}"
    return "" if value is None else str(value).replace("|", "\\|")


def publish(key: str, markdown: str, description: str) -> None:
    """A markdown artifact on the current flow run (a no-op outside one)."""
    from prefect.artifacts import create_markdown_artifact
    from prefect.context import FlowRunContext

    if FlowRunContext.get() is not None:
        create_markdown_artifact(key=key, markdown=markdown, description=description)


def tag_run(*tags: str) -> None:
    """Add tags (e.g. ``model-version:7``) to the current flow run, after the fact."""
    from prefect import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(context.flow_run.id)
        client.update_flow_run(context.flow_run.id, tags=sorted({*run.tags, *tags}))
