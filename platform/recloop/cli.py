"""The ``recloop`` command.

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
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from recloop.cli_boundary import FAILURE, USAGE_ERROR, ErrorBoundary, UserError, debug_option, emit_json, fail
from recloop.settings import Settings

if TYPE_CHECKING:  # imported where used: `recloop --help` stays well under a second (no pandas, no torch)
    from recloop.ingest import FileResult, IngestSummary
    from recloop.simulate import SimulationSummary, WorldConfig


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
        _drop_deprecation_notices()
    debug_option(ctx, debug)


def _drop_deprecation_notices() -> None:
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


def _fail(message: str, code: int = USAGE_ERROR) -> UserError:
    return fail(message, code)


@contextmanager
def _progress(description: str, total: int, quiet: bool) -> Iterator[Progress]:
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


def _load_spec(settings: Settings, name: str | None):
    """The dataset spec, resolved once (``recloop.datasets``), or exit 2 with the spec's own message."""
    from recloop import datasets
    from recloop.schema import SpecError

    try:
        return datasets.resolve(settings, name)
    except SpecError as err:
        raise _fail(str(err)) from err


def _parse_start(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise _fail(f"--start {value!r} is not an ISO date such as 2026-01-01") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _run_simulation(config: WorldConfig, out: Path, quiet: bool) -> SimulationSummary:
    from recloop.simulate import simulate

    with _progress("simulating hours", config.days * 24, quiet) as progress:
        return simulate(config, out, on_hour=lambda day, hour: progress.advance(0))


def _run_ingest(source: Path, spec_name: str | None, settings: Settings, quiet: bool,
                reingest: bool = False) -> IngestSummary:
    spec = _load_spec(settings, spec_name)
    from recloop.ingest.run import discover, ingest

    try:
        total = len(discover(source))
    except FileNotFoundError as err:
        raise _fail(str(err)) from err

    def on_file(result: FileResult) -> None:
        progress.advance(0)
        if result.status in ("rejected", "ignored", "skipped"):
            console.print(f"[yellow]{result.status}[/] {result.path}: {result.error}")

    with _progress(f"ingesting ({spec.name})", total, quiet) as progress:
        return ingest(source, spec, settings, on_file=on_file, reingest=reingest)


def _print_ingest(summary: IngestSummary) -> None:
    table = Table(title=f"ingest {summary.source} (spec {summary.spec})", show_edge=False)
    for column in ("files", "ingested", "skipped", "rejected", "ignored", "rows in", "landed", "quarantined",
                   "seconds"):
        table.add_column(column, justify="right")
    table.add_row(*map(str, (summary.files, summary.files_ingested, summary.files_skipped, summary.files_rejected,
                             summary.files_ignored, summary.rows_in, summary.rows_landed, summary.rows_quarantined,
                             summary.seconds)))
    console.print(table)
    reasons: dict[str, int] = {}
    for result in summary.results:
        for code, count in result.reasons.items():
            reasons[code] = reasons.get(code, 0) + count
    if reasons:
        console.print("quarantined rows by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())))
    not_ingested = [r for r in summary.results if r.status != "ingested"]
    for result in not_ingested[:20]:  # every file not ingested says why (all of them under --json)
        console.print(f"{result.status}: {escape(Path(result.path).name)}: {escape(result.error or '')}")
    if len(not_ingested) > 20:
        console.print(f"... and {len(not_ingested) - 20} more (--json lists every file with its reason)")
    if summary.recovered:
        console.print(f"finished {len(summary.recovered)} commit(s) left by an interrupted run")
    hints = list(dict.fromkeys(h for result in summary.results for h in result.hints))
    for hint in hints:
        console.print(f"[yellow]hint[/]: {hint}")
    if hints or summary.rows_quarantined:
        console.print("after fixing the spec: `recloop quarantine replay --spec SPEC` lands the rows that pass now")


def _emit(payload: dict) -> None:
    emit_json(payload)


@app.command("simulate")
def simulate_command(
    out: Annotated[Path | None, typer.Option(help="Output folder (default: $RECLOOP_HOME/landing).")] = None,
    days: Annotated[int, typer.Option(min=1, help="Simulated days.")] = 7,
    events_per_day: Annotated[int, typer.Option(min=1, help="Impressions per day.")] = 100_000,
    seed: Annotated[int, typer.Option(help="Random seed: the world is a function of it.")] = 0,
    drift: Annotated[Drift, typer.Option(help="Drift scenario.")] = Drift.none,
    drift_day: Annotated[int, typer.Option(min=0, help="First drifted day, counted from 0.")] = 3,
    start: Annotated[str, typer.Option(help="First simulated midnight (UTC), ISO date.")] = "2026-01-01",
    json_out: JsonOption = False,
) -> None:
    """Write a synthetic world's events, one parquet file per simulated hour under OUT/YYYY-MM-DD/."""
    from recloop.simulate import WorldConfig

    settings = Settings()
    config = WorldConfig(seed=seed, days=days, events_per_day=events_per_day, drift=drift.value,  # type: ignore[arg-type]
                         drift_day=drift_day, start=_parse_start(start))
    summary = _run_simulation(config, out or settings.landing_dir, quiet=json_out)
    if json_out:
        _emit({k: v for k, v in summary.to_dict().items() if k != "paths"})
    else:
        console.print(f"wrote {summary.events:,} events ({summary.clicks:,} clicks) in {summary.files} files "
                      f"to {summary.out_dir}")


@app.command("ingest")
def ingest_command(
    source: Annotated[Path | None, typer.Argument(help="File or folder (default: $RECLOOP_HOME/landing).")] = None,
    spec: SpecOption = None,
    reingest: Annotated[bool, typer.Option("--reingest", help="Read SOURCE again even if the ledger has it under "
                                           "this spec (rows already in the lake count as duplicates).")] = False,
    json_out: JsonOption = False,
) -> None:
    """Validate and land parquet, CSV or Criteo files into the lake; bad rows go to quarantine.

    The ledger knows a file by its content and the spec's version: after a fix to the spec the same file
    is read again; --reingest reads it again under an unchanged spec.
    """
    settings = Settings()
    if reingest and source is None:
        raise _fail("--reingest needs the FILE (or folder) to read again")
    summary = _run_ingest(source or settings.landing_dir, spec, settings, quiet=json_out, reingest=reingest)
    if json_out:
        _emit(summary.to_dict())
    else:
        _print_ingest(summary)


@app.command("quarantine")
def quarantine_command(
    action: Annotated[str, typer.Argument(help="replay: quarantined rows through the spec again.")],
    spec: SpecOption = None,
    json_out: JsonOption = False,
) -> None:
    """replay: run quarantined rows through the (fixed) spec; those that pass land, the rest stay quarantined."""
    from recloop.ingest.run import replay_quarantine

    if action != "replay":
        raise _fail(f"unknown action {action!r}: replay")
    settings = Settings()
    dataset = _load_spec(settings, spec)
    summary = replay_quarantine(settings, dataset)
    if json_out:
        _emit(summary.to_dict())
    else:
        _print_ingest(summary)


def _run_features(settings: Settings, dataset, window: dict, quiet: bool, materialize: bool) -> dict:
    """The feature job, then (if the dataset has users and items) Feast apply + materialize."""
    from recloop import pipeline

    with console.status("building features and updating Feast", spinner="dots") if not quiet else _quiet():
        return pipeline.build_features(settings, dataset, window, materialize).to_dict()


def _print_features(summary: dict) -> None:
    if summary["message"]:
        console.print(summary["message"])
    if summary.get("late_from"):
        console.print(f"late events: built again from {summary['late_from']} (events landed since the last run "
                      "with earlier times)")
    if summary["rows"]:
        console.print(f"features {summary['start']} → {summary['end']}: {summary['rows']:,} training rows, "
                      f"entity rows {summary['entity_rows']}, state v{summary['state_version']}, "
                      f"vocabularies {summary['vocabulary_sizes']} ({summary['seconds']} s, {summary['backend']})")
    if summary["materialized"]:
        console.print(f"online store updated: {', '.join(summary['materialized'])}")


@app.command("features")
def features_command(
    start: Annotated[str | None, typer.Option(help="Window start (UTC, ISO); default: where the last run ended "
                                                   "(or the period of an event landed late since).")] = None,
    end: Annotated[str | None, typer.Option(help="Window end (UTC, ISO); default: after the newest event.")] = None,
    spec: SpecOption = None,
    materialize: Annotated[bool, typer.Option(help="Apply the Feast repo if needed and load the online store.")] = True,
    json_out: JsonOption = False,
) -> None:
    """Build features for a window: vocabularies, training rows, entity tables; then update Feast."""
    settings = Settings()
    dataset = _load_spec(settings, spec)
    window = {k: _parse_start(v) for k, v in (("start", start), ("end", end)) if v}
    summary = _run_features(settings, dataset, window, json_out, materialize)
    if json_out:
        _emit(summary)
    else:
        _print_features(summary)


@contextmanager
def _quiet() -> Iterator[None]:
    yield


@app.command("train")
def train_command(
    mode: Annotated[Mode, typer.Option(help="full (from scratch) or incremental (warm start).")] = Mode.full,
    days: Annotated[int, typer.Option(min=1, help="Full: days of training rows before the held-out hours.")] = 7,
    epochs: Annotated[int, typer.Option(min=1, help="Full: passes over the window.")] = 1,
    batch_size: Annotated[int | None, typer.Option(min=1, help="Rows per step (default: 16384 on a GPU, 4096 on a CPU).")] = None,
    validation_hours: Annotated[int, typer.Option(min=1, help="Newest hours held out for validation.")] = 6,
    min_validation_rows: Annotated[int, typer.Option(min=1, help="Fewer held-out rows than this: training is "
                                                     "refused (a model judged on a handful of rows).")] = 200,
    replay: Annotated[float, typer.Option(min=0.0, help="Incremental: older hours replayed, per new hour.")] = 0.0,
    warm_start: Annotated[str | None, typer.Option("--from", help="Incremental: a registered version or a "
                                                   "checkpoint folder to start from (default: the champion).")] = None,
    device: Annotated[Device, typer.Option(help="auto: CUDA if present.")] = Device.auto,
    deterministic: Annotated[bool, typer.Option(help="Results independent of thread scheduling.")] = False,
    track: Annotated[bool, typer.Option(help="Log the run to MLflow and register the model.")] = True,
    nproc: Annotated[int, typer.Option(min=1, help="Processes (one per GPU): runs this command under torchrun, "
                                       "tables sharded and dense layers under DDP.")] = 1,
    json_out: JsonOption = False,
) -> None:
    """Train the ranking model on the features' training rows; resumes an interrupted run."""
    import os

    from rich.progress import TaskProgressColumn

    from recloop import checkpoint, pipeline, tracking
    from recloop.train import TrainConfig, TrainError, train

    mode, device = Mode(mode).value, Device(device).value  # plain strings from here on (checkpoints, JSON)
    if nproc > 1 and "WORLD_SIZE" not in os.environ:
        raise typer.Exit(_under_torchrun(nproc))
    if os.environ.get("RANK", "0") != "0":  # under torchrun only rank 0 tracks and reports
        track, json_out = False, True
    config = TrainConfig(mode=mode, days=days, epochs=epochs, batch_size=batch_size,  # type: ignore[arg-type]
                         validation_hours=validation_hours, replay_fraction=replay, device=device,
                         deterministic=deterministic, min_validation_rows=min_validation_rows)
    progress = Progress(TextColumn("[bold]training"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console, disable=json_out)
    with progress:
        task = progress.add_task("train", total=None, rate="")

        def on_progress(samples: int, total: int, rate: float) -> None:
            progress.update(task, completed=samples, total=total, rate=f"{rate:,.0f} samples/s")

        try:
            base = pipeline.warm_start_checkpoint(Settings(), warm_start) if mode == "incremental" else None
            tracker = tracking.TrainingRun(Settings()) if track else None  # the MLflow run spans the training
            summary = train(Settings(), config, warm_start=base, on_progress=on_progress, tracker=tracker)
        except (TrainError, checkpoint.CheckpointError) as err:
            raise _fail(str(err)) from err
    result = summary.to_dict()
    if track:
        result["mlflow"] = _track(summary)
    if os.environ.get("RANK", "0") != "0":
        return
    if json_out:
        _emit(result)
        return
    oracle = f" (oracle {summary.oracle_auc:.4f})" if summary.oracle_auc is not None else ""
    console.print(f"{summary.mode} run {summary.run_id}: {summary.samples:,} samples in {summary.seconds} s "
                  f"({summary.samples_per_s:,.0f}/s); validation AUC {summary.auc:.4f}{oracle}, log loss "
                  f"{summary.logloss:.4f}, calibration {summary.calibration:.3f} on {summary.validation_rows:,} rows")
    if summary.baselines:
        console.print("baselines on the same rows (AUC): " + ", ".join(
            f"{name} {scores['auc']:.4f}" for name, scores in summary.baselines.items()))
    if summary.grown_tables:
        console.print(f"tables grown: {summary.grown_tables}")
    for override in summary.overrides:
        console.print(f"[yellow]overridden[/]: {override}")
    console.print(f"checkpoint: {summary.checkpoint}")
    if track and result["mlflow"]["duplicate_of"]:
        console.print(f"MLflow: run {result['mlflow']['run_id']} trained the same weights as version "
                      f"{result['mlflow']['duplicate_of']}: no new version registered")
    elif track:
        console.print(f"MLflow: run {result['mlflow']['run_id']}, registered as version {result['mlflow']['version']}")


def _under_torchrun(nproc: int) -> int:
    """This ``recloop train`` command again, as ``nproc`` processes under torchrun (one machine); its exit code."""
    import subprocess

    args, skip = [], False
    for arg in sys.argv[1:]:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            args.append(arg)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               "-m", "recloop.cli", *args]
    return subprocess.run(command, check=False).returncode


def _track(summary) -> dict:
    """Log a training run to MLflow and register its model (once per run: a rerun finds it)."""
    from recloop import pipeline

    logged = pipeline.register_training(Settings(), summary)
    return {"run_id": logged.run_id, "version": logged.version, "model_uri": logged.model_uri,
            "duplicate_of": logged.duplicate_of}


@app.command("gate")
def gate_command(
    candidate: Annotated[str | None, typer.Option(help="Model version to judge (default: the newest).")] = None,
    thresholds: Annotated[Path | None, typer.Option(help="YAML/JSON file of gate thresholds.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Judge a candidate against the champion on the same held-out hours; pass → challenger."""
    from recloop.gate import GateError, load_thresholds, run_gate

    try:
        limits = load_thresholds(thresholds) if thresholds else None
        with console.status("gating", spinner="dots") if not json_out else _quiet():
            outcome = run_gate(Settings(), candidate, limits)
    except (GateError, ValueError, OSError) as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit(outcome.to_dict())
        return
    console.print(outcome.report)
    console.print(f"version {outcome.version}: {outcome.verdict}"
                  + (f", alias {outcome.alias}" if outcome.alias else ""))


@app.command("promote")
def promote_command(
    version: Annotated[str, typer.Argument(help="Model version to make champion.")],
    why: Annotated[str, typer.Option(help="Recorded on the version.")] = "promoted by hand",
    model: Annotated[str, typer.Option(help="Whose version: recloop-ranker or recloop-retriever.")]
    = "recloop-ranker",
    json_out: JsonOption = False,
) -> None:
    """Make VERSION the champion by hand (the old champion becomes 'previous')."""
    from recloop import registry
    from recloop.canary.controller import check_model

    try:
        state = registry.promote(Settings(), version, why=why, model_name=check_model(model))
    except (registry.UnknownVersion, ValueError) as err:
        raise _fail(str(err)) from err
    _emit(state) if json_out else console.print(f"aliases: {state}")


@app.command("rollback")
def rollback_command(
    why: Annotated[str, typer.Option(help="Recorded on the demoted version.")] = "rolled back by hand",
    model: Annotated[str, typer.Option(help="Whose versions: recloop-ranker or recloop-retriever.")]
    = "recloop-ranker",
    json_out: JsonOption = False,
) -> None:
    """Make the 'previous' version champion again."""
    from recloop import registry
    from recloop.canary.controller import check_model

    try:
        state = registry.rollback(Settings(), why=why, model_name=check_model(model))
    except (RuntimeError, ValueError) as err:
        raise _fail(str(err)) from err
    _emit(state) if json_out else console.print(f"aliases: {state}")


@app.command("serve")
def serve_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    spec: SpecOption = None,
) -> None:
    """Run the serving API (/rank, /feedback, /healthz, /metrics, /admin/*) on the registry's models."""
    import uvicorn

    from recloop.serve.app import create_app

    settings = Settings()
    dataset = _load_spec(settings, spec)
    if settings.journal == "postgres":  # the journal is needed to serve at all: a dead one is one line, exit 3
        from recloop import endpoints

        endpoints.require_postgres(settings.postgres_dsn, endpoints.limits_for(settings))
    console.print(f"serving on http://{host}:{port} (models from {settings.resolved_mlflow_tracking_uri()})")
    uvicorn.run(create_app(settings, dataset), host=host, port=port, log_level="warning")


@app.command("canary")
def canary_command(
    action: Annotated[CanaryAction, typer.Argument(help="What to do.")],
    config: Annotated[Path | None, typer.Option(help="YAML with CanaryConfig fields (steps, bake_seconds, ...).")]
    = None,
    reason: Annotated[str, typer.Option(help="Why (promote, rollback): recorded in MLflow.")] = "by an operator",
    shadow: Annotated[bool, typer.Option(help="start: score with the challenger in shadow instead (default: the "
                                              "config's mode, interleave).")] = False,
    model: Annotated[str, typer.Option(help="Whose canary: recloop-ranker or recloop-retriever.")] = "recloop-ranker",
    json_out: JsonOption = False,
) -> None:
    """The canary controller: show the state, judge and act (step), or promote / roll back by hand."""
    from recloop.canary import controller

    action = CanaryAction(action).value
    settings = Settings()
    try:
        name = controller.check_model(model)
        canary_config = controller.load_config(config)
        if action == "status":
            result = controller.status(settings, canary_config, model_name=name).to_dict()
        elif action == "step":
            result = controller.step(settings, canary_config, model_name=name).to_dict()
        elif action == "start":
            result = controller.start(settings, canary_config, mode="shadow" if shadow else None,
                                      model_name=name).to_dict()
        else:
            result = controller.manual(settings, action, reason, model_name=name).to_dict()  # type: ignore[arg-type]
    except (controller.NoCanary, ValueError, FileNotFoundError) as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit(result)
        return
    decision = result.get("decision") or {}
    console.print(f"aliases: {result.get('aliases')}")
    if result.get("active", True) and "share" in result:
        console.print(f"challenger v{result.get('challenger', result.get('version'))} at {result['share']:.0%} "
                      f"({result.get('mode', 'canary')})")
    if decision:
        console.print(f"[bold]{result.get('action', decision.get('action'))}[/]: " + "; ".join(decision["reasons"]))
    elif "message" in result:
        console.print(result["message"])


@app.command("drift")
def drift_command(
    hours: Annotated[int, typer.Option(min=1, help="Newest hours of events to check.")] = 24,
    reference_days: Annotated[int, typer.Option(min=1, help="Reference when there is no champion: days "
                                                "before the checked hours.")] = 7,
    spec: SpecOption = None,
    config: Annotated[Path | None, typer.Option(help="YAML of MonitorConfig fields (thresholds, per-column "
                                                "drift methods, min_rows).")] = None,
    current: Annotated[str | None, typer.Option(help="The checked window START..END (UTC, ISO), instead of the "
                                                "newest --hours.")] = None,
    reference: Annotated[str | None, typer.Option(help="The reference window START..END (UTC, ISO); with "
                                                  "--current.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Check the newest events for drift and broken columns against the champion's training window.

    Below MonitorConfig's min_rows events in either window the answer is insufficient_data (never a retrain).
    Every check, whatever it decides, leaves its snapshots in the Evidently workspace (`recloop up` shows it).
    """
    from recloop import pipeline
    from recloop.monitor.runner import MonitorError, load_config

    dataset = _load_spec(Settings(), spec)
    if (current is None) != (reference is None):
        raise _fail("--current and --reference go together (each START..END)")
    windows = (_window("--reference", reference), _window("--current", current)) if current else None
    try:
        result = pipeline.check_drift(Settings(), dataset, hours=hours, reference_days=reference_days,
                                      config=load_config(config), windows=windows, snapshot=True).to_dict()
    except (MonitorError, ValueError, OSError) as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit(result)
        return
    current, reference = result["current"], result["reference"]
    console.print(f"[bold]{result['decision']}[/] ({current[0]} → {current[1]} vs {reference[0]} → {reference[1]}): "
                  + "; ".join(result["reasons"]))


def _window(option: str, value: str) -> tuple[datetime, datetime]:
    start, sep, end = value.partition("..")
    if not sep:
        raise _fail(f"{option} {value!r} is not START..END (e.g. 2015-01-01..2015-02-01)")
    first, last = _parse_start(start), _parse_start(end)
    if first >= last:
        raise _fail(f"{option} {value!r}: the start must be before the end")
    return first, last


@app.command("retrain")
def retrain_command(
    full: Annotated[bool, typer.Option("--full", help="Full retrain from scratch instead of incremental.")] = False,
    reason: Annotated[str, typer.Option(help="Why: recorded on the flow run.")] = "by hand",
    wait: Annotated[bool, typer.Option(help="With a Prefect server: wait for the run to finish.")] = False,
    spec: SpecOption = None,
    json_out: JsonOption = False,
) -> None:
    """Start a retrain now: the deployment on the Prefect server (RECLOOP_PREFECT_API_URL), else the flow here."""
    import os

    from recloop import datasets
    from recloop.flow_support import configure_prefect

    settings = Settings()
    _load_spec(settings, spec)  # validated (exit 2 on a bad spec) and remembered by this home
    spec_source = datasets.source(settings, spec)
    configure_prefect(settings)
    mode = "full" if full else "incremental"
    if os.environ.get("PREFECT_API_URL"):
        from prefect.deployments import run_deployment

        from recloop import endpoints

        endpoints.require_prefect(os.environ["PREFECT_API_URL"], endpoints.limits_for(settings))

        name = f"retrain/{mode}-retrain"
        # the worker's own spec (RECLOOP_SPEC, its home's) unless --spec names one: this machine's would
        # replace it (a path here, or the shipped default)
        parameters = {"mode": mode, "reason": reason, **({"spec": spec_source} if spec else {})}
        try:
            run = run_deployment(name, parameters=parameters, timeout=None if wait else 0)
        except Exception as err:  # noqa: BLE001 - e.g. not deployed yet: say so in one line
            raise _fail(f"could not start deployment {name!r} ({err}); run `prefect deploy --all` first") from err
        result = deployment_result(name, run, wait)
    else:
        from flows.retrain_flow import retrain_flow
        from recloop.flow_support import in_process_runs, settings_parameter

        # a failure is the boundary's one line: Prefect's ERROR records (with their tracebacks) stay out
        with _quiet_logs(logging_level=logging.CRITICAL), in_process_runs():
            outcome = retrain_flow(mode=mode, reason=reason, spec=spec_source, settings=settings_parameter(settings))
        ingested = {k: outcome["ingest"][k] for k in ("rows_in", "rows_landed", "rows_quarantined")}
        if "skipped" in outcome:  # nothing new since the champion: nothing trained, no version registered
            result = {"mode": mode, "spec": spec_source, "ingest": ingested, "skipped": outcome["skipped"]}
        else:
            result = {"mode": mode, "spec": spec_source, "version": outcome["train"]["mlflow"]["version"],
                      "ingest": ingested, "gate": {k: outcome["gate"][k] for k in ("passed", "alias", "reasons")},
                      "canary": outcome.get("canary")}
            result["retriever"] = _retriever_outcome(outcome.get("retriever") or {})
    if json_out:
        _emit(result)
    else:
        console.print(result)


def deployment_result(name: str, run, wait: bool) -> dict:
    """What ``recloop retrain`` says of a deployment's flow run; with ``--wait``, a run that did not complete
    (failed, crashed, cancelled) is an error (exit 1), not a result."""
    state = run.state
    if wait and (state is None or not state.is_completed()):
        ended = state.name if state else "without a state"
        detail = f": {state.message}" if state and state.message else ""
        raise _fail(f"deployment {name!r}: flow run {run.id} ended {ended}{detail}", code=FAILURE)
    return {"deployment": name, "flow_run_id": str(run.id), "state": state.name if state else None}


def _retriever_outcome(outcome: dict) -> dict:
    """The retrain's retriever part in a few fields: its version and gate, or why it was not trained."""
    if "skipped" in outcome.get("train", {}):
        return {"skipped": outcome["train"]["skipped"]}
    if "gate" not in outcome:
        return {}
    return {"version": outcome["gate"]["version"], **{k: outcome["gate"][k] for k in ("passed", "alias", "reasons")},
            "canary": (outcome.get("canary") or {}).get("action")}


@app.command("up")
def up_command(host: Annotated[str, typer.Option(help="Address the services listen on.")] = "127.0.0.1",
               prefect_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Prefect's port (default: "
                                                               "RECLOOP_UP_PREFECT_PORT, 4200).")] = None,
               mlflow_port: Annotated[int | None, typer.Option(min=1, max=65535, help="MLflow's port (default: "
                                                              "RECLOOP_UP_MLFLOW_PORT, 5000).")] = None,
               evidently_port: Annotated[int | None, typer.Option(min=1, max=65535, help="Evidently's port "
                                                                 "(default: RECLOOP_UP_EVIDENTLY_PORT, 8001).")] = None,
               serving_port: Annotated[int | None, typer.Option(min=1, max=65535, help="The serving API's port "
                                                               "(default: RECLOOP_UP_SERVING_PORT, 8000).")] = None,
               json_out: JsonOption = False) -> None:
    """Start the Prefect, MLflow and Evidently UIs and the serving API in the background; print their addresses.
    Each home can take its own ports, so several run side by side."""
    from recloop import services

    settings = Settings()
    started = services.up(settings, host, services=services.services_for(settings, {
        "prefect": prefect_port, "mlflow": mlflow_port, "evidently": evidently_port, "serving": serving_port}))
    prefect = started.get("prefect", {})
    api_url = f"{prefect.get('url')}/api"
    hint = services.deployments_hint(services.deployment_count(api_url), api_url, services.checkout()) \
        if prefect.get("status") in ("up", "running") else None
    if json_out:
        _emit({**started, "deployments_hint": hint} if hint else started)
        return
    for name, entry in started.items():
        console.print(f"{name:10} {entry['url']:28} {entry['status']} (pid {entry['pid']})")
    if hint:
        console.print(hint, markup=False, highlight=False)
    console.print("stop them with: recloop down")
    if any(entry["status"].startswith("failed") for entry in started.values()):
        raise typer.Exit(1)


@app.command("down")
def down_command(json_out: JsonOption = False) -> None:
    """Stop what `recloop up` started."""
    from recloop import services

    stopped = services.down(Settings())
    _emit(stopped) if json_out else console.print(stopped or "nothing was running")


@app.command("demo")
def demo_command(
    days: Annotated[int, typer.Option(min=2, help="Simulated days (day 0 bootstraps the first model).")] = 5,
    events_per_day: Annotated[int, typer.Option(min=100, help="The world's own impressions per day.")] = 20_000,
    requests_per_day: Annotated[int, typer.Option(min=4, help="Ranking requests simulated users send per day.")]
    = 400,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    drift: Annotated[Drift, typer.Option(help="Drift scenario.")] = Drift.sudden,
    drift_day: Annotated[int, typer.Option(min=1, help="First drifted day, counted from 0.")] = 2,
    twin: Annotated[bool, typer.Option(help="Run the loop again on the no-drift twin world and report the "
                                            "twin-world recovery (about twice the time).")] = True,
    daily_full: Annotated[bool, typer.Option(help="Also train a full model from scratch each day, scored on the "
                                                  "evaluation panel as the upper reference (not served).")] = False,
    full_every_days: Annotated[float, typer.Option(min=0, help="A scheduled retrain starts over from scratch once "
                                                               "the champion's chain of incremental runs spans this "
                                                               "many days (0: never).")] = 3.0,
    json_out: JsonOption = False,
) -> None:
    """The whole loop over simulated days: serving, feedback, canary, drift checks, retrains; table + HTML report."""
    from recloop.demo import DayRecord, DemoConfig, run_demo

    drift = Drift(drift).value
    settings = Settings()
    config = DemoConfig(days=days, events_per_day=events_per_day, requests_per_day=requests_per_day, seed=seed,
                        drift=drift, drift_day=drift_day, twin=twin, daily_full=daily_full,
                        full_every_days=full_every_days)
    if not json_out:
        console.print(f"recloop demo: {days} simulated days, drift '{drift}' from day {drift_day}; "
                      f"home {settings.home.resolve()}")

    live = _StageLine(console, quiet=json_out)

    def on_day(record: DayRecord) -> None:
        if not json_out:
            candidate = f" → v{record.candidate_version} {record.gate}" if record.candidate_version else ""
            retriever = f" v{record.retriever_version}" if record.retriever_version else ""
            live.done(f"day {record.day}: {record.events:,} events, {record.requests} requests, drift "
                      f"{record.drift}, {record.retrain}{candidate}; canary "
                      f"{', '.join(record.canary) or '-'}; retriever{retriever} "
                      f"{record.retriever_gate} (oracle recall {_fmt(record.retriever_oracle_recall)}), "
                      f"/recommend {record.recommend_clicks} clicks ({record.seconds} s)")

    import os

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    with _quiet_logs(), live:
        summary = run_demo(settings, config, on_day=on_day, on_stage=live.stage)
    if json_out:
        _emit(summary)
        return
    width = min(console.width, DEMO_WIDTH) if console.is_terminal else DEMO_WIDTH  # a log file is not 80 wide
    Console(stderr=True, width=width).print(demo_table(summary))
    recovery = (summary.get("recovery") or {}).get("headline")
    if recovery:
        mine, frozen = recovery["champion"], recovery["never_retrained"]
        console.print(f"loop efficacy (twin worlds): on day {summary['recovery']['day']} the champion's normalized "
                      f"reward on the evaluation panel is {mine['recovery']:.1%} [95% CI {mine['low']:.1%}, "
                      f"{mine['high']:.1%}] of the no-drift twin's (never retrained: {frozen['recovery']:.1%} "
                      f"[{frozen['low']:.1%}, {frozen['high']:.1%}]); target ≥ 95% (lower bound): "
                      f"{'met' if summary['recovery']['met'] else 'not met'}")
    efficacy = summary.get("efficacy")
    if efficacy and not recovery:
        console.print(f"loop efficacy: two cycles after the drift the served ranking earns {efficacy['recovery']:.1%} "
                      f"of its pre-drift share of the oracle's clicks (never retrained: "
                      f"{efficacy['never_retrain_recovery']:.1%}); target ≥ 95%: "
                      f"{'met' if efficacy['met'] else 'not met'}")
    console.print(f"freshness (events landed → challenger serving): {summary['freshness_seconds']} s; "
                  f"full retrains triggered by drift: {summary['full_retrains']}; total {summary['seconds']} s")
    console.print(f"report: {summary['report']}")
    console.print("review it all: .venv/bin/recloop up  (Prefect, MLflow and Evidently UIs, the serving API)")


DEMO_WIDTH = 120


def demo_table(summary: dict) -> Table:
    """The demo's per-day table, narrow enough for 120 columns: the AUCs and the drift's reasons are in
    ``--json`` and the HTML report."""
    from rich import box

    table = Table(title="recloop demo", box=box.SIMPLE_HEAD, padding=(0, 0),
                  caption="vs oracle: the served ranking's clicks as a share of the oracle's; frozen: the same for "
                  "the day-0 model never retrained. AUCs, reasons and the recommendation path (each day's line above): "
                  "--json and the report.")
    for column in ("day", "events", "drift", "retrain", "gate", "canary", "champion", "online CTR", "vs oracle",
                   "frozen"):
        table.add_column(column, justify="right" if column in ("day", "events", "vs oracle", "frozen") else "left")
    for day in summary["days"]:
        verdict = day["gate"].replace("passed → ", "→ ")
        table.add_row(str(day["day"]), f"{day['events']:,}", day["drift"], day["retrain"],
                      f"v{day['candidate_version']} {verdict}" if day.get("candidate_version") else verdict,
                      "\n".join(c.split(":")[0] for c in day["canary"]) or "-", f"v{day['champion']}" if day["champion"] else "-",
                      "\n".join(f"v{v}: {c:.3f}" for v, c in day["online_ctr"].items()) or "-",
                      _fmt(day["vs_oracle"]), _fmt(day["baseline_vs_oracle"]))
    return table


class _StageLine:
    """The demo's current stage: one live line on a terminal (``day 2 · features · 14 s``), replaced by each
    day's summary when it ends; a plain line per stage when stderr is not a terminal (logs, CI)."""

    def __init__(self, console: Console, quiet: bool):
        import time

        self.console, self.quiet, self.clock = console, quiet, time.perf_counter
        self.status = None if quiet or not console.is_terminal else console.status("")
        self.began = self.clock()

    def __enter__(self):
        if self.status is not None:
            self.status.__enter__()
        return self

    def __exit__(self, *exc):
        if self.status is not None:
            self.status.__exit__(*exc)

    def stage(self, day: int, what: str) -> None:
        if self.quiet:
            return
        line = f"day {day} · {what} · {self.clock() - self.began:.0f} s"
        if self.status is not None:
            self.status.update(line)
        else:
            self.console.print(line, highlight=False, soft_wrap=True)

    def done(self, line: str) -> None:
        self.console.print(line, highlight=False, soft_wrap=True)


@app.command("replay")
def replay_command(
    data: Annotated[Path, typer.Option(help="Your event log: a parquet/CSV file or a folder of them.")],
    spec: SpecOption = None,
    period: Annotated[str, typer.Option(help="day, week, month (30 days) or auto (from the log's density).")]
    = "auto",
    periods: Annotated[int, typer.Option(min=1, help="Periods replayed after the first model's bootstrap.")] = 6,
    epochs: Annotated[int, typer.Option(min=1, help="Passes of each full retrain.")] = 3,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    json_out: JsonOption = False,
) -> None:
    """Your own timestamped log through the loop, period by period: ingest, features, retrain, gate, drift;
    held-out AUC/NDCG of the models and the simple baselines per period; HTML report."""
    import os

    from recloop.replay import PERIODS, PeriodRecord, ReplayConfig, ReplayError, run_replay

    if period != "auto" and period not in PERIODS:
        raise _fail(f"--period {period!r} is not one of auto, {', '.join(PERIODS)}")
    if not data.exists():
        raise _fail(f"--data {data} does not exist")
    settings = Settings()
    dataset = _load_spec(settings, spec)
    config = ReplayConfig(period=period, periods=periods, epochs=epochs, device=device)  # type: ignore[arg-type]

    def on_period(record: PeriodRecord) -> None:
        if json_out:
            return
        figures = ", ".join(f"{name} {scores['auc']:.4f}" for name, scores in record.scores.items()
                            if scores.get("auc") is not None)
        console.print(f"period {record.period} ({record.start[:10]}): {record.landed:,} events; AUC {figures}; "
                      f"drift {record.drift}; incremental v{record.incremental_version} {record.gate}; "
                      f"full {record.full_retrain} ({record.seconds} s)")

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")
    try:
        with _quiet_logs():
            summary = run_replay(settings, dataset, data, config, on_period=on_period)
    except ReplayError as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit(summary)
        return
    console.print(f"replayed {len(summary['periods'])} {summary['period']}s in {summary['seconds']} s; "
                  f"report: {summary['report']}")


def _fmt(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"


@contextmanager
def _quiet_logs(logging_level: int = logging.WARNING) -> Iterator[None]:
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


if __name__ == "__main__":  # pragma: no cover
    main()
