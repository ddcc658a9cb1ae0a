"""What the Prefect flows in ``flows/`` share: artifacts, run tags and names, the one slot for training and
gating, and Prefect's embedded defaults.

Kept out of ``flows/`` so the flow files stay thin wiring; imported only by them (and the demo).
"""

from __future__ import annotations

import contextvars
import os
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager, suppress
from datetime import UTC, datetime
from pathlib import Path

from recloop import endpoints
from recloop.hours import hour_stem
from recloop.locks import exclusive_lock
from recloop.settings import Settings

# How long a request to Prefect's temporary local server may take. Its SQLite database is shared by the API and
# the server's own services (task-run recorder, event persister), and a statement waits up to 60 s for the
# write lock (Prefect's ``PRAGMA busy_timeout``) before the server answers 503, which the client retries. A
# client that gives up sooner (recloop's 15 s for real services) abandons a request still queued for the lock
# and sends it again behind it: `recloop demo` died so on day 3 (httpx.ReadTimeout creating a subflow, the
# server logging "database is locked"), 1 run of 2 on a quiet machine (RESULTS.md, 2026-11-27). Waiting past
# the server's own lock wait lets the server's answer decide; a real server keeps recloop's limits.
EMBEDDED_SERVER_REQUEST_SECONDS = 120.0
EMBEDDED_SERVER_RETRIES = 5  # Prefect's default
# Prefect's own local servers (the temporary one a run starts, and `recloop up`'s), their background writers
# batched. The task-run recorder writes each task-run event (three a task) in a transaction of its own as it
# arrives (Prefect's batch size 1); the API's own writes meet that SQLite lock, get "database is locked" and are
# retried 2, 4, 8… s later. A flow of 10 tasks and a 3-task subflow took 3.9 s (in-process work 0.1 s) on a 2-core
# host, 1.0 s with the recorder batched (as with it off); the event persister batched too (20 a transaction by
# default). Both still flush every 5 s and at shutdown, so the UI shows a task run at most that much later. A
# server recloop does not start (``RECLOOP_PREFECT_API_URL`` / ``PREFECT_API_URL``) keeps its own settings.
EMBEDDED_SERVER_WRITERS = {
    "PREFECT_SERVER_SERVICES_TASK_RUN_RECORDER_BATCH_SIZE": "200",
    "PREFECT_SERVER_SERVICES_EVENT_PERSISTER_BATCH_SIZE": "200",
}


def configure_prefect(settings: Settings) -> None:
    """Embedded defaults before Prefect is imported: its state under ``RECLOOP_HOME`` (so ``recloop up``
    shows the demo's runs), a patient ephemeral server, no analytics, bounded client timeouts and retries
    (``recloop.endpoints``; past the temporary server's own lock wait, ``EMBEDDED_SERVER_REQUEST_SECONDS``);
    ``RECLOOP_PREFECT_API_URL`` points at a real server instead."""
    os.environ.setdefault("PREFECT_HOME", str(settings.home.resolve() / "prefect"))
    Path(os.environ["PREFECT_HOME"]).mkdir(parents=True, exist_ok=True)  # Prefect warns when it cannot
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "180")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    run_logs_to_the_ui_only()
    limits = endpoints.limits_for(settings)
    if not (settings.prefect_api_url or os.environ.get("PREFECT_API_URL")):  # the temporary local server
        os.environ.setdefault("PREFECT_API_REQUEST_TIMEOUT",
                              str(max(limits.request_seconds, EMBEDDED_SERVER_REQUEST_SECONDS)))
        # its 503s on a locked database ("database is locked" at once when a transaction's snapshot is stale)
        # are retried with Prefect's own count and backoff (2, 4, 8, 16, 32 s), not recloop's fail-fast one
        os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", str(max(limits.attempts - 1, EMBEDDED_SERVER_RETRIES)))
        batch_embedded_server_writers()
    endpoints.prefect_environment(limits)
    if settings.prefect_api_url:
        os.environ.setdefault("PREFECT_API_URL", settings.prefect_api_url)


def embedded_server_writers() -> dict[str, str]:
    """``EMBEDDED_SERVER_WRITERS``, each unless the environment sets it already."""
    return {name: os.environ.get(name, value) for name, value in EMBEDDED_SERVER_WRITERS.items()}


def batch_embedded_server_writers() -> None:
    """``EMBEDDED_SERVER_WRITERS`` in the environment (unless set), before a temporary server starts: it takes
    its settings from the environment of the process that starts it."""
    os.environ.update(embedded_server_writers())


@contextmanager
def in_process_runs() -> Iterator[None]:
    """Flow runs called in this process against the embedded server (the demo, ``recloop retrain`` without a
    server): no heartbeats. A heartbeat lets a server mark a run crashed when the process running it dies;
    the embedded server dies with that process, and each run's end waited for the heartbeat thread's
    one-second sleep (1.2 s against 0.2 s for an empty flow; a 3-day demo makes ~40 runs). A run on a
    real server (``PREFECT_API_URL`` in the environment, as ``recloop retrain`` decides; a deployment's
    worker) keeps Prefect's heartbeats. The setting holds in this thread's context (subflows included)."""
    if os.environ.get("PREFECT_API_URL"):
        yield
        return
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def run_logs_to_the_ui_only() -> None:
    """Prefect's logging settings (before its logging is set up): the run loggers at INFO, so each run's page
    in the UI shows what it did; the console shows Prefect's warnings only."""
    os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")
    for logger in ("PREFECT_FLOW_RUNS", "PREFECT_TASK_RUNS"):
        os.environ.setdefault(f"PREFECT_LOGGING_LOGGERS_{logger}_LEVEL", "INFO")
    os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


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
    """Add tags (e.g. ``model-version:7``) to the current flow run, after the fact; a ``model-version`` tag
    puts the version in the run's name (``with_version``)."""
    from prefect import get_client
    from prefect.context import FlowRunContext

    context = FlowRunContext.get()
    if context is None or context.flow_run is None:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(context.flow_run.id)
        name = run.name
        for version in (t.split(":", 1)[1] for t in tags if t.startswith("model-version:")):
            name = with_version(name, version)  # the version in the run's name too, once it is known
        client.update_flow_run(context.flow_run.id, tags=sorted({*run.tags, *tags}),
                               name=name if name != run.name else None)


# --- one training or gate at a time, across every deployment ---------------------------------------------------

MODEL_SLOT = "recloop-model"
"""The slot every flow which trains or gates holds while it does: the hourly and the full retrain, ``train``
and ``gate`` by hand. Always a file lock (``run/recloop-model.lock`` in ``RECLOOP_HOME``): runs of one home on
one machine, with or without a server, exclude each other, and the operating system releases the lock with
the process that held it. On a Prefect server (an API URL set), also its global concurrency limit of that
name (limit 1; created on first use; ``prefect gcl inspect recloop-model`` shows who holds it), for workers
on other machines. Not the server's limit alone without a server: the embedded server lives as long as one
command, so a command stopped while holding it (Ctrl-C, a crash) left the slot counted in the database with
no lease to expire it, and every later training or gate waited for it in vain."""
MODEL_SLOT_FILE = "recloop-model.lock"

_holding: contextvars.ContextVar[bool] = contextvars.ContextVar("recloop_model_slot", default=False)


class SlotBusy(TimeoutError):
    """Another run held the model slot for longer than this one would wait."""


def ensure_model_slot() -> None:
    """Create the ``recloop-model`` limit (1 slot) if the Prefect server has none (an existing one is kept)."""
    from prefect import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(MODEL_SLOT)
        except ObjectNotFound:
            with suppress(ObjectAlreadyExists):  # created meanwhile by another run
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=MODEL_SLOT, limit=1))


@contextmanager
def model_slot(timeout_seconds: float | None = None, home: Path | None = None) -> Iterator[None]:
    """Hold ``recloop-model`` while training or gating; a run nested in one that holds it (the retrain's
    ``train`` and ``gate`` subflows) goes on without waiting for itself.

    Raises:
        SlotBusy: the slot stayed taken for ``timeout_seconds``.
    """
    if _holding.get():
        yield
        return
    from prefect.settings import get_current_settings

    held = ExitStack()
    try:
        began = time.monotonic()
        lock = (home or Settings().home).resolve() / "run" / MODEL_SLOT_FILE
        held.enter_context(file_slot(lock, timeout_seconds))
        if get_current_settings().api.url:  # a server: its limit too, whichever machine the run is on
            from prefect.concurrency.sync import concurrency

            ensure_model_slot()
            left = None if timeout_seconds is None else max(0.0, timeout_seconds - (time.monotonic() - began))
            held.enter_context(concurrency(MODEL_SLOT, occupy=1, timeout_seconds=left, strict=True))
    except TimeoutError as err:
        held.close()
        raise SlotBusy(f"another run held {MODEL_SLOT!r} for {timeout_seconds:.0f} s (one training or gate "
                       "at a time): nothing was done") from err
    with held:
        token = _holding.set(True)
        try:
            yield
        finally:
            _holding.reset(token)


@contextmanager
def file_slot(path: Path, timeout_seconds: float | None = None) -> Iterator[None]:
    """``exclusive_lock`` on ``path`` for the block, the holder's pid written in it (for a person looking)."""
    with exclusive_lock(path, timeout_seconds):
        path.write_text(f"{os.getpid()}\n")
        yield


# --- run names, run logs, the outcome on the run ---------------------------------------------------------------


SIMULATED_DAY_TAG = "day:"
"""A run tagged ``day:N`` (the demo tags every run of simulated day N, subflows included) is named for that day
instead of the wall-clock hour: a 3-day demo's 44 runs all fell in the same hour and shared ten names."""


def _scheduled_hour() -> str:
    from prefect.runtime import flow_run

    when = flow_run.scheduled_start_time or datetime.now(UTC)
    return hour_stem(when)


def _parameters() -> dict:
    from prefect.runtime import flow_run

    return dict(flow_run.parameters or {})


def _when_and_id() -> str:
    """``day2-3f9a1c`` (a simulated day) or ``2026-11-23T10-3f9a1c`` (the hour it was scheduled for, UTC),
    then the start of the run's id: two runs of one flow in one hour (or day) never share a name."""
    from prefect.runtime import flow_run

    day = next((t[len(SIMULATED_DAY_TAG):] for t in (flow_run.tags or []) if t.startswith(SIMULATED_DAY_TAG)), None)
    when = f"day{day}" if day is not None else _scheduled_hour()
    return f"{when}-{str(flow_run.id or '')[:6]}".rstrip("-")


def run_name(kind: str) -> str:
    """``ingest-2026-11-23T10-3f9a1c``, ``drift-day2-3f9a1c`` (see ``_when_and_id``)."""
    return f"{kind}-{_when_and_id()}"


def retrain_run_name() -> str:
    """``retrain-incremental-day2-3f9a1c``: the mode, when; ``-v7`` after the mode once a version is trained."""
    return f"retrain-{_parameters().get('mode', 'incremental')}-{_when_and_id()}"


def train_run_name() -> str:
    return f"train-{_parameters().get('mode', 'incremental')}-{_when_and_id()}"


def retriever_run_name() -> str:
    """``retriever-full-day2-3f9a1c``: the retriever's subflow of a retrain, by its mode and when."""
    return f"retriever-{_parameters().get('mode', 'incremental')}-{_when_and_id()}"


def gate_run_name() -> str:
    """``gate-v7-day2-3f9a1c``, or ``gate-newest-…`` when no version is named."""
    version = _parameters().get("version")
    return f"gate-v{version}-{_when_and_id()}" if version else f"gate-newest-{_when_and_id()}"


def canary_run_name() -> str:
    """``canary-check-day2-…``, ``canary-start-…``; ``retriever-canary-…`` for the retriever's; the challenger's
    version is added once the check knows it (``tag_run``)."""
    parameters = _parameters()
    prefix = "retriever-canary-" if parameters.get("model_name") == "recloop-retriever" else "canary-"
    return prefix + ("start-" if parameters.get("start") else "check-") + _when_and_id()


def with_version(name: str, version: str) -> str:
    """``retrain-incremental-day2-3f9a1c`` → ``retrain-incremental-v7-day2-3f9a1c``: the model version a run
    made or judged, in its name, before when (unchanged if it is there already)."""
    import re

    if re.search(rf"-v{re.escape(str(version))}(-|$)", name):
        return name
    return re.sub(r"-(day\d+|\d{4}-\d\d-\d\dT\d\d)(-|$)", rf"-v{version}-\1\2", name, count=1)


def log(message: str, *args) -> None:
    """An INFO line on the current run's log (shown on its page in the Prefect UI); nothing outside a run."""
    from prefect.context import FlowRunContext, TaskRunContext

    if FlowRunContext.get() is None and TaskRunContext.get() is None:
        return
    from prefect import get_run_logger

    get_run_logger().info(message, *args)


def record_outcome(settings: Settings, stage: str, outcome: str) -> None:
    """Count a run's outcome in ``$RECLOOP_HOME/loop/outcomes.json`` (``{stage: {outcome: n}}``), which the
    serving API exports as ``recloop_loop_outcomes_total`` (the alert rules read it)."""
    import json

    from filelock import FileLock

    path = settings.home.resolve() / "loop" / "outcomes.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path.with_suffix(".lock"))):
        counts = json.loads(path.read_text()) if path.exists() else {}
        counts.setdefault(stage, {})[outcome] = counts.get(stage, {}).get(outcome, 0) + 1
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts, sort_keys=True))
        tmp.replace(path)


def record_failed_run(flow, flow_run, state) -> None:
    """A Prefect ``on_failure`` / ``on_crashed`` hook: the run's failure counted (``record_outcome``)."""
    record_outcome(settings_from((flow_run.parameters or {}).get("settings")), flow.name, "failed")


def outcome_state(name: str, message: str, data: dict):
    """A Completed state named for the outcome (``Skipped``, ``Refused``...): the run's badge in the UI says
    what happened, its message why, and calling the flow still returns ``data``."""
    from prefect.states import Completed

    log("%s: %s", name, message)
    return Completed(name=name, message=message, data=data)
