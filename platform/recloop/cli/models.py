"""Commands over models: train, gate, promote and roll back by hand, serve, the canary."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from recloop.cli.base import (
    CanaryAction,
    Device,
    JsonOption,
    Mode,
    SpecOption,
    app,
    console,
    emit,
    fail_usage,
    load_spec,
    no_status,
    penalties,
)
from recloop.cli_boundary import REFUSED, stderr
from recloop.settings import Settings


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
    seed: Annotated[int, typer.Option(help="Seeds the initialization and the batch order: another seed trains "
                                      "another model on the same rows.")] = 0,
    embedding_l2_choices: Annotated[str, typer.Option(help="Full: embedding penalties to try besides the default, "
                                                      "comma-separated (0.1,1.0): each trains once on all but the "
                                                      "newest rows, and one that scores those rows better by 2 "
                                                      "standard errors is used (costs a training each).")] = "",
    id_dropout: Annotated[float | None, typer.Option(min=0.0, max=1.0, help="Share of training rows whose user "
                                                     "and item ids are replaced by the unknown id, so the model "
                                                     "learns to score ids it will not know (default: full: the "
                                                     "share of the window's newest rows whose ids the rows before "
                                                     "them lack, at most 0.5; incremental: its base's; 0: none; "
                                                     "one process only).")] = None,
    track: Annotated[bool, typer.Option(help="Log the run to MLflow and register the model.")] = True,
    nproc: Annotated[int, typer.Option(min=1, help="Processes (one per GPU): runs this command under torchrun, "
                                       "tables sharded and dense layers under DDP, then completes the run here "
                                       "(validates it, writes it whole, registers it).")] = 1,
    complete: Annotated[bool, typer.Option("--complete", help="Complete the newest run of this home that ranks "
                                           "trained under a bare torchrun (nothing else is trained).")] = False,
    json_out: JsonOption = False,
) -> None:
    """Train the ranking model on the features' training rows; resumes an interrupted run."""
    import os

    from recloop import checkpoint, tracking
    from recloop.train import TrainConfig, TrainError

    mode, device = Mode(mode).value, Device(device).value  # plain strings from here on (checkpoints, JSON)
    rank = os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None
    if rank is not None and rank != "0":  # under torchrun only rank 0 tracks the training
        track, json_out = False, True
    choices = penalties(embedding_l2_choices, "--embedding-l2-choices")
    config = TrainConfig(mode=mode, days=days, epochs=epochs, batch_size=batch_size,  # type: ignore[arg-type]
                         validation_hours=validation_hours, replay_fraction=replay, device=device,
                         deterministic=deterministic, min_validation_rows=min_validation_rows, seed=seed,
                         embedding_l2_choices=choices, id_dropout=id_dropout)
    try:
        if complete or (nproc > 1 and rank is None):  # this process completes what ranks trained
            summary = _completed(nproc if not complete else 0, tracking.TrainingRun(Settings()) if track else None)
        else:
            summary = _trained(config, warm_start, tracking.TrainingRun(Settings()) if track else None, json_out)
    except (TrainError, checkpoint.CheckpointError) as err:
        raise fail_usage(str(err)) from err
    if rank is not None:  # a rank: the process that launched the ranks, or `recloop train --complete`, reports
        if rank == "0":
            _tell_launcher(summary, quiet=json_out)
        return
    result = summary.to_dict()
    if track:
        result["mlflow"] = _track(summary)
    if json_out:
        emit(result)
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
    if summary.id_dropout:
        console.print("ids dropped from training rows: " + ", ".join(
            f"{table} {rate:.0%}" for table, rate in summary.id_dropout.items()))
    for override in summary.overrides:
        console.print(f"[yellow]overridden[/]: {override}")
    console.print(f"checkpoint: {summary.checkpoint}")
    if track and result["mlflow"]["duplicate_of"]:
        console.print(f"MLflow: run {result['mlflow']['run_id']} trained the same weights as version "
                      f"{result['mlflow']['duplicate_of']}: no new version registered")
    elif track:
        console.print(f"MLflow: run {result['mlflow']['run_id']}, registered as version {result['mlflow']['version']}")


RANKS_REPORT = "RECLOOP_RANKS_REPORT"  # where rank 0 writes its summary for the process that launched the ranks


def _trained(config, warm_start: str | None, tracker, quiet: bool):
    """``train`` here, with a progress bar (a rank of several: its share of the training)."""
    from rich.progress import TaskProgressColumn

    from recloop import pipeline
    from recloop.train import train

    progress = Progress(TextColumn("[bold]training"), BarColumn(), TaskProgressColumn(),
                        TextColumn("{task.fields[rate]}"), TimeElapsedColumn(), console=console, disable=quiet)
    with progress:
        task = progress.add_task("train", total=None, rate="")

        def on_progress(samples: int, total: int, rate: float) -> None:
            progress.update(task, completed=samples, total=total, rate=f"{rate:,.0f} samples/s")

        base = pipeline.warm_start_checkpoint(Settings(), warm_start) if config.mode == "incremental" else None
        return train(Settings(), config, warm_start=base, on_progress=on_progress, tracker=tracker)


def _completed(nproc: int, tracker):
    """The run ``nproc`` ranks train under torchrun (launched here), or (``nproc`` 0) the newest run of this home
    that ranks trained under a bare torchrun, completed in this process (``recloop.train.complete``)."""
    import json
    import os
    import tempfile

    from recloop import checkpoint
    from recloop.train import TrainError, TrainSummary, checkpoints_dir, complete

    if nproc:
        with tempfile.TemporaryDirectory(prefix="recloop-ranks-") as folder:
            report = Path(folder) / "rank-0.json"
            code = _under_torchrun(nproc, {**os.environ, RANKS_REPORT: str(report)})
            if code:
                raise typer.Exit(code)
            trained = TrainSummary(**json.loads(report.read_text()))
        return complete(Settings(), trained.checkpoint, tracker) if trained.awaits_completion else trained
    waiting = checkpoint.runs_awaiting_completion(checkpoints_dir(Settings()))
    if not waiting:
        raise TrainError(f"no run under {checkpoints_dir(Settings())} awaits completion (its ranks trained it to "
                         "the end and nothing completed it yet)")
    return complete(Settings(), waiting[-1], tracker)


def _tell_launcher(summary, quiet: bool) -> None:
    """Rank 0's summary, for the process that launched the ranks (``RANKS_REPORT``); under a bare torchrun, how
    to complete the run."""
    import json
    import os
    from dataclasses import asdict

    report = os.environ.get(RANKS_REPORT)
    if report:
        Path(report).write_text(json.dumps(asdict(summary)))
    elif summary.awaits_completion and not quiet:
        console.print(f"{summary.mode} run {summary.run_id}: trained by the ranks ({summary.steps} steps), checkpoint "
                      f"{summary.checkpoint}; complete it in one process: recloop train --complete")


def _under_torchrun(nproc: int, env: dict[str, str]) -> int:
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
    return subprocess.run(command, env=env, check=False).returncode


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
    """Judge a candidate against the champion on the same held-out hours; pass → challenger (insufficient
    evidence: challenger too, its canary decides). Exit 0 when it is champion or challenger, 4 when refused."""
    from recloop.gate import GateError, load_thresholds, run_gate

    try:
        limits = load_thresholds(thresholds) if thresholds else None
        with console.status("gating", spinner="dots") if not json_out else no_status():
            outcome = run_gate(Settings(), candidate, limits)
    except (GateError, ValueError, OSError) as err:
        raise fail_usage(str(err)) from err
    if json_out:
        emit(outcome.to_dict())
    else:
        console.print(outcome.report)
        console.print(f"version {outcome.version}: {outcome.verdict}"
                      + (f", alias {outcome.alias}" if outcome.alias else ""))
    if outcome.verdict == "refused":  # a script's `recloop gate && recloop promote …` must stop here
        raise typer.Exit(REFUSED)


@app.command("promote")
def promote_command(
    version: Annotated[str, typer.Argument(help="Model version to make champion.")],
    why: Annotated[str, typer.Option(help="Recorded on the version.")] = "promoted by hand",
    model: Annotated[str, typer.Option(help="Whose version: recloop-ranker or recloop-retriever.")]
    = "recloop-ranker",
    json_out: JsonOption = False,
) -> None:
    """Make VERSION the champion by hand (the old champion becomes 'previous'). The challenger is promoted
    through its canary (`recloop canary promote`'s decision), so its canary ends as promoted."""
    from recloop import registry
    from recloop.canary import controller

    settings = Settings()
    try:
        name = controller.check_model(model)
        version = registry.require_version(settings, version, name)
        if registry.version_by_alias(settings, "challenger", name) == version:
            # (promoted by alias alone, its canary tag still said "running" at its last share)
            state = controller.manual(settings, "promote", why, who="operator", model_name=name,
                                      expected=version).aliases
        else:
            state = registry.promote(settings, version, why=why, model_name=name)
    except (registry.UnknownVersion, ValueError, controller.NoCanary) as err:
        raise fail_usage(str(err)) from err
    gate = registry.gate_record(registry.version_info(settings, version, name).tags) or {}
    if gate.get("verdict") == "failed":  # an operator may overrule the gate; the line says they did
        undecided = gate.get("insufficient_evidence")
        reasons = "; ".join(str(r) for r in undecided or gate.get("reasons") or ()) or "see its gate tag"
        said = "could not decide on" if undecided else "refused"
        stderr.print(f"note: the gate {said} v{version} ({escape(reasons)}); promoted by hand as asked")
    emit(state) if json_out else console.print(f"aliases: {state}")


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
        raise fail_usage(str(err)) from err
    emit(state) if json_out else console.print(f"aliases: {state}")


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
    dataset = load_spec(settings, spec)
    # A journal (PostgreSQL) or registry (MLflow) down at start-up does not stop serving: the models come from the
    # verified cache, requests are kept until the journal answers; /healthz lists what is degraded.
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
        raise fail_usage(str(err)) from err
    if json_out:
        emit(result)
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
