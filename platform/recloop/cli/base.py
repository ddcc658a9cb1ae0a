"""The ``recloop`` command: the Typer app, its options and what every command shares (the commands:
``data``, ``models``, ``loop``).

Human-readable output and progress bars go to stderr; with ``--json`` the command prints exactly one JSON
object on stdout, for scripts and flows, errors included. A failure is one line: errors in what the user
asked for exit with code 2, an unreachable service with 3, anything else with 1; ``recloop --debug``
shows the traceback (see ``cli_boundary``).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from enum import StrEnum
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from recloop.cli_boundary import USAGE_ERROR, ErrorBoundary, UserError, debug_option, emit_json, fail
from recloop.settings import Settings


class Drift(StrEnum):
    """The simulator's drift scenarios (``recloop.simulate.DRIFT_SCENARIOS``; a test keeps them equal)."""

    none = "none"
    gradual = "gradual"
    sudden = "sudden"
    covariate = "covariate"
    broken_column = "broken_column"


class Mode(StrEnum):
    full = "full"
    incremental = "incremental"


class Device(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class CanaryAction(StrEnum):
    status = "status"
    step = "step"
    promote = "promote"
    rollback = "rollback"
    start = "start"

app = typer.Typer(
    cls=ErrorBoundary,
    add_completion=False,
    no_args_is_help=True,
    help="recloop: continuous retraining for GPU recommenders. Settings come from RECLOOP_* variables.",
)
console = Console(stderr=True, soft_wrap=True)  # long lines wrap in the terminal, not at 80 in a log

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")]


@app.callback()
def _options(ctx: typer.Context,
             debug: Annotated[bool, typer.Option("--debug", help="Show the traceback of a failure.")] = False) -> None:
    """recloop: continuous retraining for GPU recommenders. Settings come from RECLOOP_* variables."""
    if not sys.warnoptions:  # `python -W ...` still decides for itself
        drop_deprecation_notices()
    debug_option(ctx, debug)


def drop_deprecation_notices() -> None:
    """Libraries' deprecation notices (numpy via Evidently, litestar via Prefect...) are for their callers'
    developers, not for the command's reader. Dropped where warnings are shown, not by a filter: importing
    Feast puts ``simplefilter("once", DeprecationWarning)`` in front of any filter set before."""
    import warnings

    show = warnings.showwarning

    def shown(message, category, filename, lineno, file=None, line=None):
        if not issubclass(category, DeprecationWarning | PendingDeprecationWarning | FutureWarning):
            show(message, category, filename, lineno, file, line)

    if getattr(show, "__name__", "") != "shown":
        warnings.showwarning = shown


def penalties(text: str, flag: str) -> tuple[float, ...]:
    """A comma-separated list of non-negative numbers (``0.1,1.0``; empty: none), or a usage error naming ``flag``."""
    try:
        values = tuple(float(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise fail_usage(f"{flag} {text!r}: comma-separated numbers, such as 0.1,1.0") from None
    if any(not value >= 0 for value in values):
        raise fail_usage(f"{flag} {text!r}: a penalty is a number of 0 or more")
    return values


def fail_usage(message: str, code: int = USAGE_ERROR) -> UserError:
    return fail(message, code)


def drift_day_within(ctx: typer.Context, drift: str, drift_day: int, days: int) -> int:
    """The first drifted day of a world of ``days`` days (counted from 0): a ``--drift-day`` given past the last
    day is refused (the world would hold no drift); the option's default is moved to the last day instead
    (``recloop demo --days 2`` drifts on day 1)."""
    if drift == "none" or drift_day < days:
        return drift_day
    from click.core import ParameterSource

    if ctx.get_parameter_source("drift_day") is ParameterSource.DEFAULT:
        return days - 1
    raise fail_usage(f"--drift-day {drift_day} is past the last simulated day ({days - 1}: days count from 0); "
                     f"the world would hold no drift")


@contextmanager
def progress_bar(description: str, total: int, quiet: bool) -> Iterator[Progress]:
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=quiet, transient=False,
    )
    with progress:
        progress.add_task(description, total=total)
        yield progress


SpecOption = Annotated[str | None, typer.Option(
    "--spec", help="Dataset spec: a shipped name (synthetic, criteo) or a YAML file of any name; default: "
    "RECLOOP_SPEC, else the spec this home last used, else synthetic.")]


def load_spec(settings: Settings, name: str | None):
    """The dataset spec, resolved once (``recloop.datasets``), or exit 2 with the spec's own message."""
    from recloop import datasets
    from recloop.schema import SpecError

    try:
        return datasets.resolve(settings, name)
    except SpecError as err:
        raise fail_usage(str(err)) from err


def parse_time(value: str, option: str = "--start") -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise fail_usage(f"{option} {value!r} is not an ISO date such as 2026-01-01") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def emit(payload: dict) -> None:
    emit_json(payload)


@contextmanager
def no_status() -> Iterator[None]:
    yield


def figure(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"


@contextmanager
def quiet_logs(logging_level: int = logging.WARNING) -> Iterator[None]:
    """MLflow and Prefect log at INFO by default: the demo's own lines are the story."""
    names = ("mlflow", "prefect", "prefect.flow_runs", "prefect.task_runs", "alembic", "httpx", "uvicorn")
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging_level)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels, strict=True):
            logger.setLevel(level)


def main() -> None:  # pragma: no cover - console entry point
    app()

