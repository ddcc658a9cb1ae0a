"""The loop's stages as plain functions over ``Settings``: what the CLI and the Prefect flows call.

Each stage returns its typed result; the callers turn it into a dict only at their edge (JSON output,
Prefect task results and artifacts). No stage knows about Prefect; ``flows/`` wraps them as tasks.

Example::

    ingest_new(settings)                                   # landing/ → lake
    build_features(settings)                               # lake → features, Feast online store
    trained = train_and_register(settings, TrainConfig(mode="incremental"))
    gate(settings, trained.version)
    retriever = train_and_register_retriever(settings, RetrievalTrainConfig(mode="incremental"))
    gate_retriever(settings, retriever.version)
    check_drift(settings, hours=24)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from recloop import datasets
from recloop.hours import hour_after, parse_hour
from recloop.schema import DatasetSpec
from recloop.settings import Settings

if TYPE_CHECKING:
    from recloop.features.job import FeatureRunSummary
    from recloop.gate import GateOutcome, GateThresholds
    from recloop.gate.retrieval import RetrievalThresholds
    from recloop.ingest import IngestSummary
    from recloop.monitor.decision import MonitorConfig
    from recloop.monitor.runner import MonitorReport
    from recloop.registry import LoggedModel
    from recloop.retrieval.train import RetrievalSummary, RetrievalTrainConfig
    from recloop.train import TrainConfig, TrainSummary


SpecArg = DatasetSpec | str | Path | None  # a spec, a shipped name or a YAML path; None: see recloop.datasets


def ingest_new(settings: Settings, spec: SpecArg = None, source: Path | None = None) -> IngestSummary:
    """Ingest what is new in the landing zone (or ``source``); a file seen before is skipped."""
    from recloop.ingest import ingest

    if source is None:  # the home's own landing zone: nothing landed yet is an empty zone, not an error
        settings.landing_dir.mkdir(parents=True, exist_ok=True)
    return ingest(source or settings.landing_dir, datasets.resolve(settings, spec), settings)


def build_features(settings: Settings, spec: SpecArg = None, window: dict | None = None,
                   materialize: bool = True) -> FeatureRunSummary:
    """Feast apply (the repo generated from the spec's keys), the feature job, then incremental materialize.

    Feast is applied before the job's work, so a registry or definition that fails leaves the feature state
    where it was (a rerun starts from the same window); materialization after the job continues from where
    each view's last one ended (or from the first period a late-event rebuild wrote again), so a failure there
    is caught up by the next run.
    """
    from recloop.features import store
    from recloop.features.config import FeatureConfig
    from recloop.features.job import build_features as run_job

    dataset = datasets.resolve(settings, spec)
    config = FeatureConfig.for_spec(dataset)
    publish = materialize and bool(dataset.user_key or dataset.item_key)
    applied = False
    if publish:
        store.require_services(settings)  # a dead Redis or registry database: named before the job's work
        applied = store.apply_repo(settings, dataset)
    summary = run_job(settings, dataset, config, **(window or {}))
    if not (publish and summary.rows):
        return replace(summary, feast_applied=applied)

    # a rebuild for late events rewrote rows the online store already holds: from its first period
    since = datetime.fromisoformat(summary.late_from) if summary.late_from else None
    materialized = store.materialize(settings, datetime.fromisoformat(summary.end), timedelta(seconds=config.ttl_seconds),
                                     since=since)
    return replace(summary, feast_applied=applied, materialized=list(materialized))


@dataclass(frozen=True)
class TrainedVersion:
    """A training run and the model version it registered."""

    summary: TrainSummary
    logged: LoggedModel

    @property
    def version(self) -> str:
        return self.logged.version

    def to_dict(self) -> dict:
        return {**self.summary.to_dict(), "mlflow": {"run_id": self.logged.run_id, "version": self.logged.version,
                                                     "model_uri": self.logged.model_uri,
                                                     "duplicate_of": self.logged.duplicate_of}}


def warm_start_checkpoint(settings: Settings, source: str | Path | None = None) -> Path:
    """Where an incremental run starts: ``source`` (a registered version number, or a checkpoint folder),
    else the champion's checkpoint, fetched through the registry. The one rule for the CLI and the flows."""
    from recloop import checkpoint, registry
    from recloop.train import TrainError

    if source is not None and str(source).isdigit():
        return checkpoint.resolve(settings, str(source))
    if source is not None:
        return Path(source)
    champion = registry.version_by_alias(settings, "champion")
    if champion is None:
        raise TrainError("incremental training starts from the champion, and there is none yet: train --mode full "
                         "and gate it, or pass --from VERSION|CHECKPOINT")
    return checkpoint.resolve(settings, champion)


@dataclass(frozen=True)
class Pending:
    """What an incremental run from the champion would train on: the hours it has not seen (held-out hours
    excluded). ``hours`` empty: nothing new, and a retrain would register a model of hours already seen."""

    champion: str | None
    trained_until: str | None
    hours: list[str]
    full_trained_until: str | None = None  # where the champion's chain of incremental runs begins ("": unknown)

    @property
    def nothing_new(self) -> bool:
        return self.champion is not None and not self.hours

    @property
    def chain_hours(self) -> float | None:
        """Hours of data since the champion's last full retrain, counting the pending ones: how long the chain
        of incremental runs would be after this run (None: unknown, or no champion)."""
        if not self.champion or not self.full_trained_until or not self.trained_until:
            return None
        return (parse_hour(self.until or self.trained_until) - parse_hour(self.full_trained_until)).total_seconds() / 3600

    @property
    def until(self) -> str | None:
        """The first hour an incremental run over the pending hours would not have seen (None: nothing pending)."""

        return hour_after(self.hours[-1]) if self.hours else None

    def to_dict(self) -> dict:
        return {"champion": self.champion, "trained_until": self.trained_until, "hours": len(self.hours),
                "first": self.hours[0] if self.hours else None, "last": self.hours[-1] if self.hours else None,
                "full_trained_until": self.full_trained_until, "chain_hours": self.chain_hours}


def pending_hours(settings: Settings, config: TrainConfig) -> Pending:
    """The hours an incremental run from the champion would train on (no champion: ``champion`` is None)."""
    from recloop import checkpoint, registry
    from recloop.train import chain_origin, trainable_files, unseen

    champion = registry.version_by_alias(settings, "champion")
    if champion is None:
        return Pending(None, None, [])
    base = checkpoint.read(checkpoint.resolve(settings, champion))
    return Pending(champion, base["trained_until"], [f.stem for f in unseen(trainable_files(settings, config), base)],
                   chain_origin(base))


def periodic_full_due(settings: Settings, pending: Pending, every_hours: float | None) -> str | None:
    """Why this scheduled incremental run should be a full retrain from scratch instead (None: it should not).

    A chain of incremental runs trails a full retrain over the same hours on the simulator's evaluation panel
    (``benchmarks/incremental.py --chain``, benchmarks/RESULTS.md "The chain against a daily full retrain, on
    the panel"), and a periodic full retrain brings it back. So the loop starts over from scratch once the
    champion's chain spans ``every_hours`` hours of data (or its beginning is unknown), at most once per
    ``every_hours`` hours of data: after ``record_periodic_full`` (a periodic retrain that trained, whatever
    the gate then said), the next is not due until that many more hours have landed.
    """
    import json

    if not every_hours or pending.champion is None or not pending.hours:
        return None
    chain = pending.chain_hours
    if chain is not None and chain < every_hours:
        return None
    path = _periodic_path(settings)
    last = json.loads(path.read_text()).get("until") if path.exists() else None
    if last is not None and (parse_hour(pending.until) - parse_hour(last)).total_seconds() / 3600 < every_hours:
        return None
    since = (f"its chain of incremental runs spans {chain:g} hours since its last full retrain" if chain is not None
             else "where its chain of incremental runs begins is not recorded")
    return f"periodic full retrain: champion v{pending.champion}'s {since} (every {every_hours:g} hours)"


def record_periodic_full(settings: Settings, pending: Pending) -> None:
    """Remember that a periodic full retrain trained on data up to ``pending``'s newest hour (atomically)."""
    import json
    import os

    path = _periodic_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"until": pending.until, "champion": pending.champion,
                               "chain_hours": pending.chain_hours}) + "\n")
    os.replace(tmp, path)


def _periodic_path(settings: Settings) -> Path:
    return settings.home.resolve() / "loop" / "periodic_full.json"


def register_training(settings: Settings, summary: TrainSummary) -> LoggedModel:
    """Log a training run to MLflow and register its model (once per run: a rerun finds it)."""

    from recloop import tracking
    from recloop.features.definition import FeatureLayout

    files = sorted(FeatureLayout.for_settings(settings).training.glob("*.parquet"))
    return tracking.log_training(settings, summary, example_rows(files))


def example_rows(files: list[Path], rows: int = 5, look_back: int = 48):
    """The model's input example: the first ``rows`` rows of the newest of ``files`` (up to ``look_back`` of
    them) whose list columns (``m_*``) are all non-empty, else the newest file's first rows. MLflow infers the
    signature's list types from the example: on ml-latest-small's replay the newest file's rows were movies
    without genres, every list empty, and MLflow warned that it could not infer the schema and that the
    example failed its own check."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    found: list[pd.DataFrame] = []
    for path in reversed(files[-look_back:]):
        table = pq.read_table(path)
        full = np.ones(table.num_rows, dtype=bool)
        for name in (c for c in table.column_names if c.startswith("m_")):
            full &= pc.list_value_length(table[name]).fill_null(0).to_numpy(zero_copy_only=False) > 0
        found.append(table.filter(pa.array(full)).slice(0, rows - sum(len(f) for f in found)).to_pandas())
        if sum(len(f) for f in found) >= rows:
            return pd.concat(found, ignore_index=True)
    if any(len(f) for f in found):
        return pd.concat([f for f in found if len(f)], ignore_index=True)
    return pq.read_table(files[-1]).slice(0, rows).to_pandas()


def train_and_register(settings: Settings, config: TrainConfig, warm_start: str | Path | None = None
                       ) -> TrainedVersion:
    """Train (full, or incremental from ``warm_start_checkpoint``) and register the model in MLflow; the MLflow
    run is opened when the training starts and follows it (``tracking.TrainingRun``)."""
    from recloop import tracking
    from recloop.train import train

    base = warm_start_checkpoint(settings, warm_start) if config.mode == "incremental" else None
    summary = train(settings, config, warm_start=base, tracker=tracking.TrainingRun(settings))
    return TrainedVersion(summary, register_training(settings, summary))


def gate(settings: Settings, version: str | None = None, thresholds: GateThresholds | None = None,
         smoke_check: bool = True) -> GateOutcome:
    from recloop.gate import run_gate

    return run_gate(settings, version, thresholds, smoke_check=smoke_check)


def check_drift(settings: Settings, spec: SpecArg = None, hours: int = 24, reference_days: int = 7,
                config: MonitorConfig | None = None, log: bool = False, windows: tuple | None = None,
                snapshot: bool = False) -> MonitorReport:
    """The drift and KPI monitor over the newest ``hours`` of the lake (``recloop.monitor.runner.check``)."""
    from recloop.monitor import runner

    return runner.check(settings, datasets.resolve(settings, spec), hours=hours, reference_days=reference_days,
                        config=config, log=log, windows=windows, snapshot=snapshot)


# --- the retriever: trained, registered and gated beside the ranker ------------------------------------------


@dataclass(frozen=True)
class TrainedRetriever(TrainedVersion):
    """A retriever training run and the ``recloop-retriever`` version it registered."""

    summary: RetrievalSummary


def retriever_warm_start(settings: Settings, source: str | Path | None = None) -> Path | None:
    """Where an incremental retriever run starts: ``source`` (a registered version number or a folder), else
    the retriever champion's folder, fetched through the registry; None when there is no champion yet."""
    from recloop import checkpoint, registry

    if source is not None and str(source).isdigit():
        return checkpoint.resolve(settings, str(source), registry.RETRIEVER_NAME)
    if source is not None:
        return Path(source)
    champion = registry.version_by_alias(settings, "champion", registry.RETRIEVER_NAME)
    return None if champion is None else checkpoint.resolve(settings, champion, registry.RETRIEVER_NAME)


def train_and_register_retriever(settings: Settings, config: RetrievalTrainConfig,
                                 warm_start: str | Path | None = None) -> TrainedRetriever:
    """Train the retriever (incremental from ``retriever_warm_start``; full while there is no retriever
    champion to start from), build its index and register it as a ``recloop-retriever`` version."""
    from recloop.retrieval.publish import log_retriever
    from recloop.retrieval.train import train_retriever

    base = retriever_warm_start(settings, warm_start) if config.mode == "incremental" else None
    if config.mode == "incremental" and base is None:
        config = replace(config, mode="full")  # the first retriever: nothing to warm-start from
    summary = train_retriever(settings, config, warm_start=base)
    return TrainedRetriever(summary, log_retriever(settings, summary))


def gate_retriever(settings: Settings, version: str, thresholds: RetrievalThresholds | None = None) -> dict:
    """The retriever's gate on its held-out hours against the retriever champion (pass → challenger)."""
    from recloop.gate.retrieval_runner import run_retrieval_gate

    return run_retrieval_gate(settings, version, thresholds)
