"""The ``recloop`` command.

Human-readable output and progress bars go to stderr; with ``--json`` the command prints exactly one JSON
object on stdout, for scripts and flows. Errors in what the user asked for exit with code 2 and a
one-line message.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from recloop.ingest import FileResult, IngestSummary, ingest
from recloop.schema import SpecError, load_spec
from recloop.settings import Settings
from recloop.simulate import DRIFT_SCENARIOS, SimulationSummary, WorldConfig, simulate

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help="recloop: continuous retraining for GPU recommenders. Settings come from RECLOOP_* variables.",
)
console = Console(stderr=True)

JsonOption = Annotated[bool, typer.Option("--json", help="Print one JSON summary object on stdout.")]


def _fail(message: str) -> typer.Exit:
    console.print(f"[bold red]error:[/] {message}")
    return typer.Exit(code=2)


@contextmanager
def _progress(description: str, total: int, quiet: bool) -> Iterator[Progress]:
    progress = Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, disable=quiet, transient=False,
    )
    with progress:
        progress.add_task(description, total=total)
        yield progress


def _load_spec(name: str):
    """The dataset spec, or exit 2 with the spec's own message."""
    try:
        return load_spec(name)
    except SpecError as err:
        raise _fail(str(err)) from err


def _parse_start(value: str) -> datetime:
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise _fail(f"--start {value!r} is not an ISO date such as 2026-01-01") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def _run_simulation(config: WorldConfig, out: Path, quiet: bool) -> SimulationSummary:
    with _progress("simulating hours", config.days * 24, quiet) as progress:
        return simulate(config, out, on_hour=lambda day, hour: progress.advance(0))


def _run_ingest(source: Path, spec_name: str, settings: Settings, quiet: bool) -> IngestSummary:
    spec = _load_spec(spec_name)
    from recloop.ingest.run import discover

    try:
        total = len(discover(source))
    except FileNotFoundError as err:
        raise _fail(str(err)) from err

    def on_file(result: FileResult) -> None:
        progress.advance(0)
        if result.status == "rejected":
            console.print(f"[yellow]rejected[/] {result.path}: {result.error}")

    with _progress(f"ingesting ({spec.name})", total, quiet) as progress:
        return ingest(source, spec, settings, on_file=on_file)


def _print_ingest(summary: IngestSummary) -> None:
    table = Table(title=f"ingest {summary.source} (spec {summary.spec})", show_edge=False)
    for column in ("files", "ingested", "skipped", "rejected", "rows in", "landed", "quarantined", "seconds"):
        table.add_column(column, justify="right")
    table.add_row(*map(str, (summary.files, summary.files_ingested, summary.files_skipped, summary.files_rejected,
                             summary.rows_in, summary.rows_landed, summary.rows_quarantined, summary.seconds)))
    console.print(table)
    reasons: dict[str, int] = {}
    for result in summary.results:
        for code, count in result.reasons.items():
            reasons[code] = reasons.get(code, 0) + count
    if reasons:
        console.print("quarantined rows by reason: " + ", ".join(f"{k}={v}" for k, v in sorted(reasons.items())))
    if summary.recovered:
        console.print(f"finished {len(summary.recovered)} commit(s) left by an interrupted run")


def _emit(payload: dict) -> None:
    sys.stdout.write(json.dumps(payload, default=str) + "\n")


@app.command("simulate")
def simulate_command(
    out: Annotated[Path | None, typer.Option(help="Output folder (default: $RECLOOP_HOME/landing).")] = None,
    days: Annotated[int, typer.Option(min=1, help="Simulated days.")] = 7,
    events_per_day: Annotated[int, typer.Option(min=1, help="Impressions per day.")] = 100_000,
    seed: Annotated[int, typer.Option(help="Random seed: the world is a function of it.")] = 0,
    drift: Annotated[str, typer.Option(help=f"Drift scenario: {', '.join(DRIFT_SCENARIOS)}.")] = "none",
    drift_day: Annotated[int, typer.Option(min=0, help="First drifted day, counted from 0.")] = 3,
    start: Annotated[str, typer.Option(help="First simulated midnight (UTC), ISO date.")] = "2026-01-01",
    json_out: JsonOption = False,
) -> None:
    """Write a synthetic world's events, one parquet file per simulated hour under OUT/YYYY-MM-DD/."""
    if drift not in DRIFT_SCENARIOS:
        raise _fail(f"--drift {drift!r} is not one of {', '.join(DRIFT_SCENARIOS)}")
    settings = Settings()
    config = WorldConfig(seed=seed, days=days, events_per_day=events_per_day, drift=drift,  # type: ignore[arg-type]
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
    spec: Annotated[str, typer.Option(help="Dataset spec: a shipped name (synthetic, criteo) or a YAML path.")] = (
        "synthetic"
    ),
    json_out: JsonOption = False,
) -> None:
    """Validate and land parquet, CSV or Criteo TSV files into the lake; bad rows go to quarantine."""
    settings = Settings()
    summary = _run_ingest(source or settings.landing_dir, spec, settings, quiet=json_out)
    if json_out:
        _emit(summary.to_dict())
    else:
        _print_ingest(summary)


def _run_features(settings: Settings, dataset, window: dict, quiet: bool, materialize: bool) -> dict:
    """The feature job, then (if the dataset has users and items) Feast apply + materialize."""
    from recloop import pipeline

    with console.status("building features and updating Feast", spinner="dots") if not quiet else _quiet():
        return pipeline.build_features(settings, dataset.name, window, materialize)


def _print_features(summary: dict) -> None:
    if summary["message"]:
        console.print(summary["message"])
    if summary["rows"]:
        console.print(f"features {summary['start']} → {summary['end']}: {summary['rows']:,} training rows, "
                      f"entity rows {summary['entity_rows']}, state v{summary['state_version']}, "
                      f"vocabularies {summary['vocabulary_sizes']} ({summary['seconds']} s, {summary['backend']})")
    if summary["materialized"]:
        console.print(f"online store updated: {', '.join(summary['materialized'])}")


@app.command("features")
def features_command(
    start: Annotated[str | None, typer.Option(help="Window start (UTC, ISO); default: where the last run ended.")] = None,
    end: Annotated[str | None, typer.Option(help="Window end (UTC, ISO); default: after the newest event.")] = None,
    spec: Annotated[str, typer.Option(help="Dataset spec of the lake's events.")] = "synthetic",
    materialize: Annotated[bool, typer.Option(help="Apply the Feast repo if needed and load the online store.")] = True,
    json_out: JsonOption = False,
) -> None:
    """Build features for a window: vocabularies, training rows, entity tables; then update Feast."""
    settings = Settings()
    dataset = _load_spec(spec)
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
    mode: Annotated[str, typer.Option(help="full (from scratch) or incremental (warm start).")] = "full",
    days: Annotated[int, typer.Option(min=1, help="Full: days of training rows before the held-out hours.")] = 7,
    epochs: Annotated[int, typer.Option(min=1, help="Full: passes over the window.")] = 1,
    batch_size: Annotated[int, typer.Option(min=1, help="Rows per step.")] = 4096,
    validation_hours: Annotated[int, typer.Option(min=1, help="Newest hours held out for validation.")] = 6,
    replay: Annotated[float, typer.Option(min=0.0, help="Incremental: older hours replayed, per new hour.")] = 0.0,
    warm_start: Annotated[Path | None, typer.Option("--from", help="Incremental: checkpoint to start from "
                                                    "(default: the newest completed run).")] = None,
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    deterministic: Annotated[bool, typer.Option(help="Results independent of thread scheduling.")] = False,
    track: Annotated[bool, typer.Option(help="Log the run to MLflow and register the model.")] = True,
    json_out: JsonOption = False,
) -> None:
    """Train the ranking model on the features' training rows; resumes an interrupted run."""
    from rich.progress import TaskProgressColumn

    from recloop.train import TrainConfig, TrainError, train

    if mode not in ("full", "incremental"):
        raise _fail(f"--mode {mode!r} is not one of full, incremental")
    config = TrainConfig(mode=mode, days=days, epochs=epochs, batch_size=batch_size,  # type: ignore[arg-type]
                         validation_hours=validation_hours, replay_fraction=replay, device=device,
                         deterministic=deterministic)
    progress = Progress(TextColumn("[bold]training"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console, disable=json_out)
    with progress:
        task = progress.add_task("train", total=None, rate="")

        def on_progress(samples: int, total: int, rate: float) -> None:
            progress.update(task, completed=samples, total=total, rate=f"{rate:,.0f} samples/s")

        try:
            summary = train(Settings(), config, warm_start=warm_start, on_progress=on_progress)
        except TrainError as err:
            raise _fail(str(err)) from err
    result = summary.to_dict()
    if track:
        result["mlflow"] = _track(summary)
    if json_out:
        _emit(result)
        return
    oracle = f" (oracle {summary.oracle_auc:.4f})" if summary.oracle_auc is not None else ""
    console.print(f"{summary.mode} run {summary.run_id}: {summary.samples:,} samples in {summary.seconds} s "
                  f"({summary.samples_per_s:,.0f}/s); validation AUC {summary.auc:.4f}{oracle}, log loss "
                  f"{summary.logloss:.4f}, calibration {summary.calibration:.3f} on {summary.validation_rows:,} rows")
    if summary.grown_tables:
        console.print(f"tables grown: {summary.grown_tables}")
    console.print(f"checkpoint: {summary.checkpoint}")
    if track:
        console.print(f"MLflow: run {result['mlflow']['run_id']}, registered as version {result['mlflow']['version']}")


def _track(summary) -> dict:
    """Log a training run to MLflow and register its model (once per run: a rerun finds it)."""
    from recloop import pipeline

    return pipeline.register_training(Settings(), summary)


@app.command("gate")
def gate_command(
    candidate: Annotated[str | None, typer.Option(help="Model version to judge (default: the newest).")] = None,
    thresholds: Annotated[Path | None, typer.Option(help="YAML/JSON file of gate thresholds.")] = None,
    json_out: JsonOption = False,
) -> None:
    """Judge a candidate against the champion on the same held-out hours; pass → challenger."""
    from recloop.gate import load_thresholds, run_gate

    try:
        limits = load_thresholds(thresholds) if thresholds else None
        with console.status("gating", spinner="dots") if not json_out else _quiet():
            outcome = run_gate(Settings(), candidate, limits)
    except (RuntimeError, ValueError, OSError) as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit({k: v for k, v in outcome.items() if k != "report"})
        return
    console.print(outcome["report"])
    console.print(f"version {outcome['version']}: {'passed' if outcome['passed'] else 'refused'}"
                  + (f", alias {outcome['alias']}" if outcome["alias"] else ""))


@app.command("promote")
def promote_command(
    version: Annotated[str, typer.Argument(help="Model version to make champion.")],
    why: Annotated[str, typer.Option(help="Recorded on the version.")] = "promoted by hand",
    json_out: JsonOption = False,
) -> None:
    """Make VERSION the champion by hand (the old champion becomes 'previous')."""
    from recloop import registry

    state = registry.promote(Settings(), version, why=why)
    _emit(state) if json_out else console.print(f"aliases: {state}")


@app.command("rollback")
def rollback_command(
    why: Annotated[str, typer.Option(help="Recorded on the demoted version.")] = "rolled back by hand",
    json_out: JsonOption = False,
) -> None:
    """Make the 'previous' version champion again."""
    from recloop import registry

    try:
        state = registry.rollback(Settings(), why=why)
    except RuntimeError as err:
        raise _fail(str(err)) from err
    _emit(state) if json_out else console.print(f"aliases: {state}")


@app.command("serve")
def serve_command(
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    dataset: Annotated[str, typer.Option(help="Dataset spec of the requests' context and of the feedback.")]
    = "synthetic",
) -> None:
    """Run the serving API (/rank, /feedback, /healthz, /metrics, /admin/*) on the registry's models."""
    import uvicorn

    from recloop.serve.app import create_app

    spec = _load_spec(dataset)
    console.print(f"serving on http://{host}:{port} (models from {Settings().resolved_mlflow_tracking_uri()})")
    uvicorn.run(create_app(Settings(), spec), host=host, port=port, log_level="warning")


CANARY_ACTIONS = ("status", "step", "promote", "rollback", "start")


@app.command("canary")
def canary_command(
    action: Annotated[str, typer.Argument(help="status | step | promote | rollback | start")],
    config: Annotated[Path | None, typer.Option(help="YAML with CanaryConfig fields (steps, bake_seconds, ...).")]
    = None,
    reason: Annotated[str, typer.Option(help="Why (promote, rollback): recorded in MLflow.")] = "by an operator",
    shadow: Annotated[bool, typer.Option(help="start: score with the challenger in shadow instead.")] = False,
    json_out: JsonOption = False,
) -> None:
    """The canary controller: show the state, judge and act (step), or promote / roll back by hand."""
    from recloop.serve import controller

    if action not in CANARY_ACTIONS:
        raise _fail(f"unknown action {action!r}: one of {', '.join(CANARY_ACTIONS)}")
    settings = Settings()
    try:
        canary_config = controller.load_config(config)
        if action == "status":
            result = controller.status(settings, canary_config)
        elif action == "step":
            result = controller.step(settings, canary_config)
        elif action == "start":
            result = controller.start(settings, canary_config, mode="shadow" if shadow else "canary")
        else:
            result = controller.manual(settings, action, reason)
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
    spec: Annotated[str, typer.Option(help="Dataset spec of the lake's events.")] = "synthetic",
    json_out: JsonOption = False,
) -> None:
    """Check the newest events for drift and broken columns against the champion's training window."""
    from recloop import pipeline

    _load_spec(spec)
    try:
        result = pipeline.check_drift(Settings(), spec, hours=hours, reference_days=reference_days)
    except ValueError as err:
        raise _fail(str(err)) from err
    if json_out:
        _emit(result)
        return
    current, reference = result["current"], result["reference"]
    console.print(f"[bold]{result['decision']}[/] ({current[0]} → {current[1]} vs {reference[0]} → {reference[1]}): "
                  + "; ".join(result["reasons"]))


@app.command("demo")
def demo_command(
    days: Annotated[int, typer.Option(min=1, help="Simulated days.")] = 3,
    events_per_day: Annotated[int, typer.Option(min=1, help="Impressions per day.")] = 50_000,
    seed: Annotated[int, typer.Option(help="Random seed.")] = 0,
    drift: Annotated[str, typer.Option(help=f"Drift scenario: {', '.join(DRIFT_SCENARIOS)}.")] = "sudden",
    drift_day: Annotated[int, typer.Option(min=0, help="First drifted day, counted from 0.")] = 2,
    json_out: JsonOption = False,
) -> None:
    """Run the loop on embedded defaults. Today: simulate, ingest, features (and Feast), train, register, gate.

    Later stages (canary, drift monitor) join this command as they land.
    """
    if drift not in DRIFT_SCENARIOS:
        raise _fail(f"--drift {drift!r} is not one of {', '.join(DRIFT_SCENARIOS)}")
    settings = Settings()
    config = WorldConfig(seed=seed, days=days, events_per_day=events_per_day, drift=drift,  # type: ignore[arg-type]
                         drift_day=drift_day)
    simulated = _run_simulation(config, settings.landing_dir, quiet=json_out)
    ingested = _run_ingest(settings.landing_dir, "synthetic", settings, quiet=json_out)
    features = _run_features(settings, load_spec("synthetic"), {}, json_out, materialize=True)
    from recloop.train import TrainConfig, TrainError, train

    gated: dict = {}
    try:
        with console.status("training the ranking model", spinner="dots") if not json_out else _quiet():
            summary = train(settings, TrainConfig(mode="full", days=days, batch_size=2048))
        trained = summary.to_dict()
        with console.status("registering and gating the model", spinner="dots") if not json_out else _quiet():
            trained["mlflow"] = _track(summary)
            from recloop.gate import run_gate

            try:
                gated = {k: v for k, v in run_gate(settings, trained["mlflow"]["version"]).items() if k != "report"}
            except RuntimeError as err:  # e.g. this exact model is already the champion (a rerun)
                gated = {"skipped": str(err)}
    except TrainError as err:
        trained = {"error": str(err)}
    if json_out:
        _emit({"home": str(settings.home), "simulate": {k: v for k, v in simulated.to_dict().items() if k != "paths"},
               "ingest": {k: v for k, v in ingested.to_dict().items() if k != "files_detail"},
               "features": features, "train": trained, "gate": gated})
        return
    console.print(f"simulated {simulated.events:,} events over {simulated.days} days "
                  f"(drift: {simulated.drift} from day {simulated.drift_day}) into {simulated.out_dir}")
    _print_ingest(ingested)
    _print_features(features)
    if "error" in trained:
        console.print(f"training skipped: {trained['error']}")
    else:
        console.print(f"trained {trained['samples']:,} samples ({trained['samples_per_s']:,.0f}/s): validation AUC "
                      f"{trained['auc']:.4f} vs the oracle's {trained['oracle_auc']:.4f}; checkpoint "
                      f"{trained['checkpoint']}; MLflow version {trained['mlflow']['version']}")
        if "skipped" in gated:
            console.print(f"gate: {gated['skipped']}")
        elif gated:
            verdict = f"passed → {gated['alias']}" if gated["passed"] else "refused: " + "; ".join(gated["reasons"])
            console.print(f"gate: version {gated['version']} {verdict}")
        console.print(f"review: .venv/bin/mlflow ui --backend-store-uri "
                      f"{settings.resolved_mlflow_tracking_uri()}")
    console.print(f"lake: {settings.lake_events_dir}   quarantine: {settings.quarantine_dir}   "
                  f"features: {settings.home / 'features'}")


def main() -> None:  # pragma: no cover - console entry point
    app()


if __name__ == "__main__":  # pragma: no cover
    main()
