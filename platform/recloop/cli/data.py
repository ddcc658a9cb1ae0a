"""Commands over data: simulate a world, ingest files, replay the quarantine, build features."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.markup import escape
from rich.table import Table

from recloop.cli.base import (
    Drift,
    JsonOption,
    SpecOption,
    app,
    console,
    drift_day_within,
    emit,
    fail_usage,
    load_spec,
    no_status,
    parse_time,
    progress_bar,
)
from recloop.settings import Settings

if TYPE_CHECKING:  # imported where used: `recloop --help` stays well under a second (no pandas, no torch)
    from recloop.ingest import FileResult, IngestSummary
    from recloop.simulate import SimulationSummary, WorldConfig




def _run_simulation(config: WorldConfig, out: Path, quiet: bool) -> SimulationSummary:
    from recloop.simulate import simulate

    with progress_bar("simulating hours", config.days * 24, quiet) as progress:
        return simulate(config, out, on_hour=lambda day, hour: progress.advance(0))


def _run_ingest(source: Path, spec_name: str | None, settings: Settings, quiet: bool,
                reingest: bool = False) -> IngestSummary:
    spec = load_spec(settings, spec_name)
    from recloop.ingest.run import discover, ingest

    try:
        total = len(discover(source))
    except FileNotFoundError as err:
        raise fail_usage(str(err)) from err

    def on_file(result: FileResult) -> None:
        progress.advance(0)
        if result.status in ("rejected", "ignored", "skipped"):
            console.print(f"[yellow]{result.status}[/] {result.path}: {result.error}")

    with progress_bar(f"ingesting ({spec.name})", total, quiet) as progress:
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
    if summary.rows_quarantined:  # (a hint about a file's name alone quarantined nothing: nothing to replay)
        console.print("after fixing the spec: `recloop quarantine replay --spec SPEC` lands the rows that pass now")


@app.command("simulate")
def simulate_command(
    ctx: typer.Context,
    out: Annotated[Path | None, typer.Option(help="Output folder (default: $RECLOOP_HOME/landing).")] = None,
    days: Annotated[int, typer.Option(min=1, help="Simulated days.")] = 7,
    events_per_day: Annotated[int, typer.Option(min=1, help="Impressions per day.")] = 100_000,
    seed: Annotated[int, typer.Option(min=0, help="Random seed: the world is a function of it.")] = 0,
    drift: Annotated[Drift, typer.Option(help="Drift scenario.")] = Drift.none,
    drift_day: Annotated[int, typer.Option(min=0, help="First drifted day, counted from 0.")] = 3,
    start: Annotated[str, typer.Option(help="First simulated midnight (UTC), ISO date.")] = "2026-01-01",
    json_out: JsonOption = False,
) -> None:
    """Write a synthetic world's events, one parquet file per simulated hour under OUT/YYYY-MM-DD/."""
    from recloop.simulate import WorldConfig

    settings = Settings()
    drift_day = drift_day_within(ctx, drift.value, drift_day, days)
    config = WorldConfig(seed=seed, days=days, events_per_day=events_per_day, drift=drift.value,  # type: ignore[arg-type]
                         drift_day=drift_day, start=parse_time(start))
    target = out or settings.landing_dir
    if target.exists() and not target.is_dir():  # (NotADirectoryError, exit 1, after the world was built)
        raise fail_usage(f"--out {target} is a file, not a folder")
    summary = _run_simulation(config, target, quiet=json_out)
    if json_out:
        emit({k: v for k, v in summary.to_dict().items() if k != "paths"})
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
        raise fail_usage("--reingest needs the FILE (or folder) to read again")
    summary = _run_ingest(source or settings.landing_dir, spec, settings, quiet=json_out, reingest=reingest)
    if json_out:
        emit(summary.to_dict())
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
        raise fail_usage(f"unknown action {action!r}: replay")
    settings = Settings()
    dataset = load_spec(settings, spec)
    summary = replay_quarantine(settings, dataset)
    if json_out:
        emit(summary.to_dict())
    else:
        _print_ingest(summary)


def _run_features(settings: Settings, dataset, window: dict, quiet: bool, materialize: bool) -> dict:
    """The feature job, then (if the dataset has users and items) Feast apply + materialize."""
    from recloop import pipeline

    with console.status("building features and updating Feast", spinner="dots") if not quiet else no_status():
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
    dataset = load_spec(settings, spec)
    window = {k: parse_time(v, f"--{k}") for k, v in (("start", start), ("end", end)) if v}
    if len(window) == 2 and window["start"] >= window["end"]:  # (it said "empty window" and exited 0)
        raise fail_usage(f"--start {start} is not before --end {end}")
    summary = _run_features(settings, dataset, window, json_out, materialize)
    if json_out:
        emit(summary)
    else:
        _print_features(summary)
