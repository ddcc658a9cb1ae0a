"""``recloop replay``: the loop over a user's own timestamped log, replayed period by period.

The log (parquet/CSV files under ``--data``, described by ``--spec``) is first read into a source lake under
``$RECLOOP_HOME/replay/source`` (the same ingestion: bad rows are quarantined there, with reasons). Everything
before the last ``periods`` periods bootstraps the first model (ingest → features → full train → gate →
champion). Then each period, in time order, goes through the loop as if it had just happened:

1. its events land in the landing zone and are **ingested**, their **features** built (Feast updated);
2. the models trained before it are **scored on it** (it is held out from all of them): the champion, the
   newest incremental candidate, the newest full retrain, and the simple **baselines** (base rate, user +
   item CTR, logistic regression on the model's inputs; ``recloop.baselines``): AUC, log loss, NDCG@10 per user;
3. **drift**: the period against the one before (``insufficient_data`` below the monitor's minimum);
4. **retrain**: an incremental candidate from the champion (registered, **gated**; a pass is promoted:
   a replay has no live traffic for a canary) and a full retrain from scratch (scored on the next period;
   registered, gated and promoted instead when the drift check asked for a full retrain); the **retriever**
   too (an incremental run, gated, promoted on a pass).
5. **the canary, on logged rows**: a candidate the gate could not decide on ("insufficient evidence": its
   held-out window too small for the margin) goes where the loop sends it, to the canary, which a replay
   runs on the periods that follow: each period the canary and the champion score the same logged rows and
   the gate's paired test (non-inferiority within ``gate.auc_margin``) is run on every row the canary has met
   so far. Shown non-inferior: promoted at the period's end; shown worse: rolled back; still undecided after
   ``canary_periods`` periods: rolled back as inconclusive. One canary at a time (the loop's retrains wait
   for a running one, here: a later undecided candidate is not served), except that a full retrain asked
   for by drift replaces an incremental canary of the same period; a canary whose champion changed under it
   ends. Without it an undecided candidate was simply dropped, and on a log of 900-row days the first model
   was never replaced (Criteo: benchmarks/RESULTS.md, issue 37).

Before a period is ingested, its **recommendations** are measured (``recommend_k``, 10): each user who liked
an item in it (up to ``recommend_users``, drawn at random) asks the serving API's ``POST /recommend`` as of the
period's first instant (retrieve → filter → rank → order, the champions as they stand, the lake as it was),
and the list is scored against the items the user went on to like in the period that they had not met before
(``recloop.evidence.topk``: recall@k and NDCG@k), beside two baselines learnt from the same lake
(``recloop.retrieval.baselines``: the period before's most liked items, and item-to-item co-likes), each with
the seen items left out, and the paired differences with 95 % intervals over users.

The period is a day, a week or 30 days: given, or the shortest in which every replayed period holds at
least ``min_period_rows`` events. The result is a table per period and an HTML report
(``$RECLOOP_HOME/reports/replay.html``).

Example::

    summary = run_replay(settings, load_spec("ratings.yaml"), Path("ratings/"), ReplayConfig(periods=4))
    summary["periods"][0]["scores"]["model"]["auc"]
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from recloop.gate import GateThresholds
from recloop.hours import US, hour_of_us
from recloop.monitor.decision import MonitorConfig
from recloop.schema import DatasetSpec
from recloop.settings import Settings

PERIODS = {"day": timedelta(days=1), "week": timedelta(days=7), "month": timedelta(days=30)}


class ReplayError(ValueError):
    """The log cannot be replayed as asked (too few events, too short)."""


@dataclass(frozen=True)
class ReplayConfig:
    """Args:
    period: ``day``, ``week``, ``month`` (30 days) or ``auto`` (see the module docstring).
    periods: periods replayed after the bootstrap.
    min_period_rows: ``auto`` picks the shortest period in which every replayed period holds this many events.
    min_bootstrap_rows: events the bootstrap needs before the first model is trained.
    epochs: passes of each full retrain (an incremental run makes one).
    embedding_l2_choices: the ranker's full retrains try these embedding penalties besides the trainer's default
        and keep one that scores the newest rows better by ``TrainConfig.selection_z`` standard errors
        (``TrainConfig.embedding_l2_choices``; empty: the default, untried). On MovieLens 1M's last four weeks
        this took the ranker from 0.0048 AUC behind the user + item CTR baseline (significant) to level with it
        and ahead of the logistic regression on log loss; ml-latest-small and Criteo's sample kept the default
        in every retrain (benchmarks/RESULTS.md, issue 37). Costs three trainings per full retrain.
    batch_size: rows per step (None: the device's default).
    device: ``auto``, ``cpu`` or ``cuda``.
    materialize: publish each period's entity features through Feast (the online store serving reads).
    smoke_check: load each gated version in a fresh process too, as the loop's gate does (seconds each).
    gate, monitor: the gate's thresholds and the drift monitor's settings.
    model: the ranking model's configuration (None: the default).
    recommend_k: the length of the recommendation lists scored each period (0, or a spec without a user and an
        item key: recommendations not measured, no retriever trained).
    recommend_users: users asked per period, at most (drawn at random among those who liked an item in it).
    canary_periods: periods a canary may stay undecided before it is rolled back as inconclusive (step 5 of
        the module docstring).
    """

    period: Literal["auto", "day", "week", "month"] = "auto"
    periods: int = 6
    min_period_rows: int = 500
    min_bootstrap_rows: int = 1000
    epochs: int = 3
    embedding_l2_choices: tuple[float, ...] = (0.1, 1.0)
    batch_size: int | None = None
    device: str = "auto"
    materialize: bool = True
    smoke_check: bool = False
    gate: GateThresholds = field(
        default_factory=lambda: GateThresholds(
            max_auc_drop_incremental=0.01,
            max_auc_drop_full=0.005,
            max_slice_auc_drop=0.03,
            calibration_range=(0.75, 1.33),
        )
    )
    monitor: MonitorConfig = field(default_factory=lambda: MonitorConfig(sample_rows=20_000))
    model: object | None = None
    recommend_k: int = 10
    recommend_users: int = 300
    canary_periods: int = 3


@dataclass
class PeriodRecord:
    period: int
    start: str
    end: str
    landed: int = 0
    quarantined: int = 0
    champion: str | None = None
    scores: dict[str, dict] = field(default_factory=dict)
    drift: str = "-"
    drift_reasons: list[str] = field(default_factory=list)
    incremental_version: str | None = None
    gate: str = "-"
    gate_reasons: list[str] = field(default_factory=list)
    full_retrain: str = "-"
    # the embedding penalty the period's full retrain trained with, chosen among ``embedding_l2_choices``
    full_embedding_l2: float | None = None
    canary: str = "-"  # what the canary did at the period's end (step 5): promoted, rolled back, held, started
    # /recommend against popularity and co-occurrence, asked as of the period's start (``_recommend_period``)
    recommend: dict = field(default_factory=dict)
    retriever_version: str | None = None
    retriever_gate: str = "-"
    seconds: float = 0.0


def choose_period(ts_us: np.ndarray, periods: int, min_rows: int) -> str:
    """The shortest period whose last ``periods`` periods each hold at least ``min_rows`` events."""
    end = int(ts_us.max()) + 1
    for name, length in PERIODS.items():
        step = int(length.total_seconds() * US)
        edges = end - step * np.arange(periods, -1, -1)
        counts = np.histogram(ts_us, bins=edges)[0]
        if counts.min() >= min_rows:
            return name
    return "month"


def run_replay(
    settings: Settings,
    spec: DatasetSpec,
    data: Path,
    config: ReplayConfig,
    on_period: Callable[[PeriodRecord], None] | None = None,
) -> dict:
    """Replay the log under ``data`` through the loop (see the module docstring); returns the summary."""
    from recloop import datasets
    from recloop.ingest import ingest
    from recloop.ingest.lake import read_window

    began = time.perf_counter()
    datasets.keep(settings, spec)
    source = Settings(**{**settings.model_dump(), "home": settings.home / "replay" / "source"})
    loaded = ingest(data, spec, source, wait_for_writers=False)  # a finished log: every file read now
    events = read_window(source, spec, None, None)
    if events.num_rows == 0:
        raise ReplayError(
            f"no valid events under {data} (read {loaded.rows_in} rows, quarantined "
            f"{loaded.rows_quarantined}: see {source.quarantine_dir})"
        )
    events = events.sort_by(spec.timestamp)
    ts_us = events[spec.timestamp].cast(pa.int64()).to_numpy()
    period = (
        config.period
        if config.period != "auto"
        else choose_period(ts_us, config.periods, config.min_period_rows)
    )
    step = int(PERIODS[period].total_seconds() * US)
    end = int(ts_us.max()) + 1
    starts = [end - step * k for k in range(config.periods, 0, -1)]
    bootstrap_rows = int((ts_us < starts[0]).sum())
    if bootstrap_rows < config.min_bootstrap_rows:
        raise ReplayError(
            f"only {bootstrap_rows} events before the {config.periods} replayed {period}s: the "
            f"first model needs {config.min_bootstrap_rows} (replay fewer periods, or a shorter "
            "period)"
        )

    landing = settings.landing_dir / "replay"
    records: list[PeriodRecord] = []
    lineage = _Lineage()
    bootstrap = _land(events, ts_us, None, starts[0], spec, landing / "bootstrap.parquet")
    _ingest_and_build(settings, spec, bootstrap, config)
    lineage.full = first_model = _train(settings, config, "full")
    first = _register_and_gate(settings, lineage.full, config)
    if not first.passed and all("baseline's" in r for r in first.reasons):
        # A first model that loses to a baseline is measured, not served: the replay's periods say by how much
        # (the gate refuses it, and every candidate after it, in a loop that serves).
        _promote(settings, first.version, "replay: the first model, measured against the baselines that beat it")
    elif not first.passed:
        raise ReplayError(f"the first model did not pass the gate: {'; '.join(first.reasons)}")
    lineage.incremental = lineage.full
    canary: _Canary | None = None
    # recommendations need users and items to recommend (a Criteo log names neither: scored rows only)
    recommending = config.recommend_k > 0 and bool(spec.user_key and spec.item_key)
    pooled: dict[str, list[np.ndarray]] = {}  # each list's per-user recall and NDCG, every period's users
    pooled_rows: dict = {}  # the champion's and the baselines' scores on every period's rows (_pool_rows)
    if recommending:
        _first_retriever(settings, config)
    for index, start in enumerate(starts):
        stop = start + step
        began_period = time.perf_counter()
        record = PeriodRecord(index, _iso(start), _iso(stop))
        if recommending:  # before the period lands: the lake, features and models as of its start
            record.recommend = _recommend_period(settings, spec, events, ts_us, (start - step, start, stop), config,
                                                 pooled)
        landed = _land(events, ts_us, start, stop, spec, landing / f"period-{index:03d}.parquet")
        ingested = _ingest_and_build(settings, spec, landed, config)
        record.landed, record.quarantined = ingested.rows_landed, ingested.rows_quarantined
        record.champion = _champion(settings)
        notes = []
        if canary is not None and canary.champion != record.champion:
            notes.append(f"v{canary.version} ended: the champion changed to v{record.champion}")
            canary = None
        per_row: dict = {}
        record.scores = _score_period(settings, lineage, start, stop, canary, per_row)
        _pool_rows(pooled_rows, per_row)
        if canary is not None:
            note, verdict = canary.judge(per_row, config)
            notes.append(note)
            if verdict == "promote":
                _promote(settings, canary.version, f"replay: the canary, {note}")
            if verdict != "hold":
                canary = None
        if index > 0:
            drift = _drift(settings, spec, (starts[index - 1], start), (start, stop), config)
            record.drift, record.drift_reasons = drift.decision, list(drift.reasons)
        incremental = _train(settings, config, "incremental")
        outcome = _register_and_gate(settings, incremental, config)
        lineage.incremental = incremental
        record.incremental_version, record.gate, record.gate_reasons = (
            outcome.version,
            outcome.verdict,  # insufficient evidence: no live traffic for a canary to decide, so not promoted
            list(outcome.reasons),
        )
        if outcome.passed:
            _promote(settings, outcome.version, "replay: passed the gate (no live traffic for a canary)")
        elif outcome.verdict == "insufficient evidence":
            canary, note = _Canary.offer(canary, outcome.version, "incremental", index, _champion(settings))
            notes.append(note)
        if recommending:
            record.retriever_version, record.retriever_gate = _next_retriever(settings, config)
        lineage.full = _train(settings, config, "full")
        record.full_embedding_l2 = _penalty(lineage.full)
        if record.drift in ("drift", "kpi_decay"):
            full = _register_and_gate(settings, lineage.full, config)
            record.full_retrain = f"v{full.version} {full.verdict}"
            if full.passed:
                _promote(settings, full.version, f"replay: full retrain after {record.drift}")
                if canary is not None:  # the champion changed under it
                    notes.append(f"v{canary.version} ended: the champion changed to v{full.version}")
                    canary = None
            elif full.verdict == "insufficient evidence":
                canary, note = _Canary.offer(canary, full.version, "full", index, _champion(settings))
                notes.append(note)
        record.canary = "; ".join(notes) or "-"
        record.seconds = round(time.perf_counter() - began_period, 1)
        records.append(record)
        if on_period:
            on_period(record)
    summary = {
        "spec": spec.name,
        "data": str(data),
        "period": period,
        "bootstrap_rows": bootstrap_rows,
        "bootstrap_gate": {"version": first.version, "verdict": first.verdict, "reasons": list(first.reasons),
                           "embedding_l2": _penalty(first_model)},
        "source": {
            "rows_in": loaded.rows_in,
            "rows_landed": loaded.rows_landed,
            "rows_quarantined": loaded.rows_quarantined,
        },
        "periods": [asdict(r) for r in records],
        "scores_overall": _scores_overall(pooled_rows),
        "recommend_overall": _recommend_overall(pooled, config.recommend_k) if pooled else {},
        "seconds": round(time.perf_counter() - began, 1),
    }
    summary["report"] = str(write_report(settings, summary))
    path = settings.home.resolve() / "reports" / "replay.json"
    path.write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    return summary


@dataclass
class _Lineage:
    """The newest checkpoints of each kind of training (scored on the next period before it is trained on)."""

    incremental: object | None = None
    full: object | None = None


@dataclass
class _Canary:
    """A candidate the gate could not decide on, served as the canary on the periods after its gate (module
    docstring, step 5): the rows it has met, with its and the champion's scores on them."""

    version: str
    kind: str  # incremental | full
    started: int  # the period of its gate
    champion: str | None
    labels: list = field(default_factory=list)
    candidate: list = field(default_factory=list)
    reference: list = field(default_factory=list)
    units: list = field(default_factory=list)
    periods: int = 0

    @classmethod
    def offer(cls, running: _Canary | None, version: str, kind: str, period: int,
              champion: str | None) -> tuple[_Canary | None, str]:
        """The canary after an undecided candidate is offered: it starts when none runs, replaces an
        incremental canary of the same period when it is a full retrain (drift asked for it), else waits out."""
        if running is None or (kind == "full" and running.kind == "incremental" and running.started == period):
            replaced = f" (replaces v{running.version})" if running is not None else ""
            return cls(version, kind, period, champion), f"v{version} starts as the canary{replaced}"
        return running, f"v{version} not served: canary v{running.version} still runs"

    def judge(self, per_row: dict, config: ReplayConfig) -> tuple[str, str]:
        """Add this period's rows (``_score_period``'s ``per_row``) and decide: ``promote``, ``rollback`` or
        ``hold``, with the reason."""
        from recloop.gate.paired import HeldOut, PairedConfig, compare

        scored = per_row.get("scored", {})
        if "canary" not in scored or "model" not in scored:
            return f"v{self.version} held: no rows this period", "hold"
        labels, mine = scored["canary"]
        self.labels.append(labels)
        self.candidate.append(mine)
        self.reference.append(scored["model"][1])
        groups = per_row.get("groups")
        # rows without a user key are their own units (``paired_intervals`` does the same)
        self.units.append(np.asarray(groups) if groups is not None else
                          np.arange(len(labels)) + sum(len(u) for u in self.units))
        self.periods += 1
        units = np.concatenate(self.units)
        held = HeldOut(np.concatenate(self.labels), np.concatenate(self.candidate), np.concatenate(self.reference),
                       units, units)
        result = compare(held, config.gate.auc_margin, config.gate.max_slice_auc_drop, PairedConfig())
        overall = result.figures["grouped_auc"]
        interval = (f"auc {overall['difference']:+.4f} [{overall['low']:+.4f}, {overall['high']:+.4f}] vs the "
                    f"champion over {len(held.labels):,} logged rows of {self.periods} period(s)")
        if result.failures:
            return f"v{self.version} rolled back: shown worse, {interval}", "rollback"
        if not result.insufficient:
            return f"v{self.version} promoted: shown non-inferior (margin {config.gate.auc_margin}), {interval}", \
                "promote"
        if self.periods >= config.canary_periods:
            return f"v{self.version} rolled back: inconclusive after {self.periods} period(s), {interval}", \
                "rollback"
        return f"v{self.version} held: insufficient evidence so far, {interval}", "hold"


def _iso(t_us: int) -> str:
    return datetime.fromtimestamp(t_us / US, tz=UTC).isoformat()


def _json_default(value):
    return None if isinstance(value, float) and not math.isfinite(value) else str(value)


def _land(
    events: pa.Table, ts_us: np.ndarray, start: int | None, stop: int, spec: DatasetSpec, path: Path
) -> Path:
    """The events of ``[start, stop)`` as one landing file in the spec's columns."""
    keep = ts_us < stop if start is None else (ts_us >= start) & (ts_us < stop)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(events.filter(pa.array(keep)).select(spec.names), path)
    return path


def _ingest_and_build(settings: Settings, spec: DatasetSpec, path: Path, config: ReplayConfig):
    from recloop import pipeline

    ingested = pipeline.ingest_new(settings, spec, path)
    pipeline.build_features(settings, spec, materialize=config.materialize)
    return ingested


def _train(settings: Settings, config: ReplayConfig, mode: str):
    from recloop import pipeline
    from recloop.train import TrainConfig, train

    extra = {"model": config.model} if config.model is not None else {}
    train_config = TrainConfig(
        mode=mode,
        days=100_000 if mode == "full" else 7,  # type: ignore[arg-type]
        # an incremental run makes one pass over its new period (as documented): given the full retrain's
        # epochs, a 900-row Criteo day was trained on 10 times and scored a log loss of 1.2-2.3
        epochs=config.epochs if mode == "full" else 1,
        embedding_l2_choices=config.embedding_l2_choices if mode == "full" else (),
        batch_size=config.batch_size,
        device=config.device,
        baselines=False,
        **extra,
    )
    base = pipeline.warm_start_checkpoint(settings) if mode == "incremental" else None
    return train(settings, train_config, warm_start=base)


def _penalty_note(period: dict) -> str:
    """`` (penalty 1)`` after a period's full retrain in the report, when it chose one."""
    kept = period.get("full_embedding_l2")
    return "" if kept is None else f" (penalty {kept:g})"


def _penalty(summary) -> float | None:
    """The embedding penalty a full retrain kept among its choices (None: no choice made)."""
    return (summary.selection or {}).get("kept")


def _register_and_gate(settings: Settings, summary, config: ReplayConfig):
    from recloop import pipeline
    from recloop.gate import run_gate

    logged = pipeline.register_training(settings, summary)
    return run_gate(settings, logged.version, config.gate, smoke_check=config.smoke_check)


def _retriever_config(settings: Settings, config: ReplayConfig, mode: str):
    from recloop import datasets
    from recloop.retrieval.train import RetrievalTrainConfig

    return RetrievalTrainConfig(
        mode=mode,  # type: ignore[arg-type]
        days=100_000,  # a full run learns from the whole log before the period, as the ranker's does
        epochs=config.epochs,
        batch_size=config.batch_size or 512,
        device=config.device,
        eval_ks=(config.recommend_k, 100),
        spec=str(datasets.home_copy(settings)),
    )


def _first_retriever(settings: Settings, config: ReplayConfig) -> str:
    """The first retriever, trained on the bootstrap and made champion whatever its gate says (as the first
    ranker: measured in every period, against the baselines, rather than never served)."""
    from recloop import pipeline, registry

    trained = pipeline.train_and_register_retriever(settings, _retriever_config(settings, config, "full"))
    outcome = pipeline.gate_retriever(settings, trained.logged.version)
    if outcome.get("alias") != "champion":
        registry.promote(settings, trained.logged.version, who="replay", model_name=registry.RETRIEVER_NAME,
                         why="replay: the first retriever, measured against the baselines each period")
    return trained.logged.version


def _next_retriever(settings: Settings, config: ReplayConfig) -> tuple[str | None, str]:
    """An incremental retriever over the period just landed, gated; a pass is promoted (no canary in a replay)."""
    from recloop import pipeline, registry
    from recloop.retrieval.train import RetrievalTrainError

    try:
        trained = pipeline.train_and_register_retriever(settings, _retriever_config(settings, config, "incremental"))
    except RetrievalTrainError as err:  # nothing new to train on (a period without a click): said, not fatal
        return None, f"not trained: {err}"
    outcome = pipeline.gate_retriever(settings, trained.logged.version)
    passed = bool(outcome.get("passed"))
    if passed:
        registry.promote(settings, trained.logged.version, who="replay", model_name=registry.RETRIEVER_NAME,
                         why="replay: passed the retriever gate (no live traffic for a canary)")
    return trained.logged.version, "passed" if passed else "refused: " + "; ".join(outcome.get("reasons") or [])


def _recommend_period(settings: Settings, spec: DatasetSpec, events: pa.Table, ts_us: np.ndarray,
                      bounds: tuple[int, int, int], config: ReplayConfig,
                      pooled: dict[str, list[np.ndarray]] | None = None) -> dict:
    """``/recommend``, popularity and co-occurrence lists for the period's users, asked as of its start, scored
    against what each went on to like in it (module docstring). ``bounds``: (the period before's start, this
    period's start, its end). Each list's per-user (recall, NDCG) are appended to ``pooled`` (for the figures
    over every period's users, ``_recommend_overall``)."""
    from recloop.evidence.topk import paired_difference, per_user
    from recloop.features.seen import SeenConfig, seen_items
    from recloop.retrieval.baselines import cooccurrence_lists, popularity_lists

    previous, start, stop = bounds
    k = config.recommend_k
    users = events[spec.user_key].to_numpy(zero_copy_only=False).astype(np.int64)
    items = events[spec.item_key].to_numpy(zero_copy_only=False).astype(np.int64)
    labels = events[spec.label].to_numpy(zero_copy_only=False).astype(np.float64)
    before = ts_us < start
    # the rule serving applies (``features.seen``): what the feature job published as of the period's start
    seen = seen_items(events.filter(pa.array(before)), spec, start, SeenConfig.for_settings(settings, spec))
    inside = np.flatnonzero((ts_us >= start) & (ts_us < stop) & (labels > 0))
    relevant: dict[int, list[int]] = {}
    for row in inside:
        user, item = int(users[row]), int(items[row])
        if item not in relevant.get(user, ()) and not np.isin(item, seen.get(user, ())).item():
            relevant.setdefault(user, []).append(item)
    if not relevant:
        return {"users": 0, "reason": "no user liked an item they had not met before in this period"}
    asked = sorted(relevant)
    if len(asked) > config.recommend_users:
        asked = sorted(np.random.default_rng(start % (2**32)).choice(asked, config.recommend_users,
                                                                     replace=False).tolist())
    relevant = {u: relevant[u] for u in asked}
    first_rows = {}
    for row in np.flatnonzero((ts_us >= start) & (ts_us < stop)):
        first_rows.setdefault(int(users[row]), int(row))
    served, errors = _ask_recommend(settings, spec, events, first_rows, asked, start, k)
    recent = before & (ts_us >= previous)
    lists = {
        "recommend": served,
        "popularity": popularity_lists(items[recent], labels[recent], asked, seen, k),
        "cooccurrence": cooccurrence_lists(users[before], items[before], labels[before], asked, seen, k),
    }
    scores = {name: per_user(found, relevant, k) for name, found in lists.items()}
    if pooled is not None:
        for name, (recall, ndcg) in scores.items():
            pooled.setdefault(f"{name} recall", []).append(recall)
            pooled.setdefault(f"{name} ndcg", []).append(ndcg)
    out: dict = {"k": k, "users": len(asked), "liked": int(sum(len(v) for v in relevant.values())),
                 "errors": errors}
    for name, (recall, ndcg) in scores.items():
        out[name] = {f"recall@{k}": round(float(recall.mean()), 4), f"ndcg@{k}": round(float(ndcg.mean()), 4)}
    for name in ("popularity", "cooccurrence"):
        out["recommend"][f"versus {name}"] = {
            metric: [round(x, 4) for x in paired_difference(scores["recommend"][j], scores[name][j])]
            for j, metric in enumerate((f"recall@{k}", f"ndcg@{k}"))}
    return out


def _recommend_overall(pooled: dict[str, list[np.ndarray]], k: int) -> dict:
    """The lists' figures over every replayed period's users together (each user-period one unit), with the
    paired intervals: a period holds a dozen users on a small log, too few to tell lists apart alone."""
    from recloop.evidence.topk import paired_difference

    joined = {key: np.concatenate(parts) for key, parts in pooled.items()}
    out: dict = {"k": k, "users": int(len(joined["recommend recall"]))}
    for name in ("recommend", "popularity", "cooccurrence"):
        out[name] = {f"recall@{k}": round(float(joined[f"{name} recall"].mean()), 4),
                     f"ndcg@{k}": round(float(joined[f"{name} ndcg"].mean()), 4)}
    for name in ("popularity", "cooccurrence"):
        out["recommend"][f"versus {name}"] = {
            f"{metric}@{k}": [round(x, 4) for x in paired_difference(joined[f"recommend {metric}"],
                                                                     joined[f"{name} {metric}"])]
            for metric in ("recall", "ndcg")}
    return out


def _ask_recommend(settings: Settings, spec: DatasetSpec, events: pa.Table, first_rows: dict[int, int],
                   users: list[int], start: int, k: int) -> tuple[dict[int, list[int]], dict[str, dict]]:
    """Each user's ``POST /recommend`` answer (item ids) from a serving API started on this home, as of
    ``start``: the request's context is the user's first event in the period, cut to the columns the
    retriever's user tower reads (device, history...; never the item's own columns). Answers that are not 200
    count under their status (their user gets an empty list)."""
    import httpx

    from recloop.serve.app import ServerThread, create_app

    # the journal's seen rule is off: the replay's own earlier requests were never shown to anyone (with daily
    # periods, the day before's answers would be dropped from /recommend's lists alone); the lake's rule stays
    app = create_app(Settings(**{**settings.model_dump(), "recommend_seen_hours": 0}), spec)
    lists: dict[int, list[int]] = {}
    errors: dict[str, dict] = {}  # status → {"count", "first": the first answer's text}
    with ServerThread(app) as server, httpx.Client(base_url=server.url, timeout=60) as client:
        retriever = app.state.service.retrievers.live.champion
        wanted = [c.split("_", 1)[1] for c in (*retriever.retriever.features.context,
                                              *retriever.retriever.features.history)] if retriever else []
        columns = {c: events[c] for c in wanted if c in events.column_names}
        when = datetime.fromtimestamp(start / US, tz=UTC).isoformat()
        for user in users:
            row = first_rows[user]
            context = {c: _plain(values[row].as_py()) for c, values in columns.items()}
            answer = client.post("/recommend", json={"user_id": user, "k": k, "ts": when,
                                                     "context": {c: v for c, v in context.items() if v is not None}})
            if answer.status_code == 200:
                lists[user] = [item["item_id"] for item in answer.json()["items"]]
            else:  # how many, and the first answer's reason
                errors.setdefault(str(answer.status_code), {"count": 0, "first": answer.text[:300]})["count"] += 1
    return lists, errors


def _plain(value):
    """A context value as JSON carries it (timestamps and the like as text)."""
    return value if value is None or isinstance(value, (int, float, str, list)) else str(value)


def _champion(settings: Settings) -> str | None:
    from recloop import registry

    return registry.version_by_alias(settings, "champion")


def _promote(settings: Settings, version: str, why: str) -> None:
    from recloop import registry

    registry.promote(settings, version, who="replay", why=why)


def _score_period(settings: Settings, lineage: _Lineage, start: int, stop: int, canary: _Canary | None = None,
                  per_row: dict | None = None) -> dict[str, dict]:
    """The champion, the newest incremental and full models, the canary (if one runs) and the baselines on the
    period's feature rows. ``per_row``, when given, receives each model's (labels, scores) under ``scored`` and the
    rows' users under ``groups`` (None without a user key)."""
    from recloop import baselines, checkpoint
    from recloop.data import ChunkLoader, FeatureSchema
    from recloop.evaluate import metrics, predict
    from recloop.features.definition import FeatureLayout
    from recloop.train import user_groups

    layout = FeatureLayout.for_settings(settings)
    first, last = _stem(start), _stem(stop)
    files = sorted(p for p in layout.training.glob("*.parquet") if first <= p.stem < last)
    if not files:
        return {}
    schema = FeatureSchema.load(layout.schema)
    rows = sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    groups = user_groups(files, layout, rows)
    out: dict[str, dict] = {}

    scored: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def score(name: str, path) -> dict:
        model, _ = checkpoint.load_model(path)
        labels, scores, _ = predict(model, ChunkLoader(files, schema, 8192, shuffle=False).epoch(0))
        scored[name] = (labels, scores)
        return _figures(metrics(labels, scores), baselines.ndcg_by_group(labels, scores, groups))

    champion = _champion(settings)
    if champion:
        out["model"] = score("model", checkpoint.resolve(settings, champion))
    for name, summary in (("incremental", lineage.incremental), ("full", lineage.full)):
        if summary is not None:
            out[name] = score(name, summary.checkpoint)
    if canary is not None:
        out["canary"] = score("canary", checkpoint.resolve(settings, canary.version))
    if per_row is not None:
        per_row.update(scored=scored, groups=groups)
    # The baselines as the gate scores them (learnt from the rows before the period), with their per-row scores
    # for the paired intervals (the replay's own fit on the period's rows, not the gate's cached window).
    before = sorted(p for p in layout.training.glob("*.parquet") if p.stem < files[0].stem)
    user_key = json.loads(layout.schema.read_text()).get("user_key") if layout.schema.exists() else None
    found = baselines.score_baselines(before, files, schema, user_key, with_scores=True)
    for name, figures in found.items():
        out[f"baseline:{name}"] = _figures(figures, figures.get("ndcg"))
    if "model" in scored:
        out["model"]["versus"] = paired_intervals(*scored["model"], found, groups)
    if per_row is not None:
        per_row["baselines"] = found
    return out


def _pool_rows(pooled: dict, per_row: dict) -> None:
    """Add a period's champion and baseline scores (``_score_period``'s ``per_row``) to ``pooled``."""
    if "model" not in per_row.get("scored", {}):
        return
    labels, scores = per_row["scored"]["model"]
    groups = per_row.get("groups")
    pooled.setdefault("labels", []).append(labels)
    pooled.setdefault("model", []).append(scores)
    pooled.setdefault("groups", []).append(np.asarray(groups) if groups is not None and len(groups) == len(labels)
                                           else None)
    for name, figures in per_row.get("baselines", {}).items():
        other = figures.get("scores")
        if other is not None and len(other) == len(labels):
            pooled.setdefault("baselines", {}).setdefault(name, []).append(
                (np.asarray(other), figures.get("logloss") is not None))


def _scores_overall(pooled: dict) -> dict:
    """The champion − each baseline over every replayed period's rows together (AUC over all of them, log loss
    their mean), paired intervals over users (rows without a user key): each period alone holds a few hundred
    rows on a small log, whose intervals span ±0.03 AUC."""
    if not pooled.get("labels"):
        return {}
    labels = np.concatenate(pooled["labels"])
    groups = None if any(g is None for g in pooled["groups"]) else np.concatenate(pooled["groups"])
    periods = len(pooled["labels"])
    found = {}
    for name, parts in pooled.get("baselines", {}).items():
        if len(parts) == periods:  # a baseline every period scored
            # ``paired_intervals`` compares log loss where the baseline's figures have one (a probability)
            found[name] = {"scores": np.concatenate([p for p, _ in parts]),
                           "logloss": 0.0 if all(has for _, has in parts) else None}
    return {"rows": int(len(labels)), "periods": periods,
            "versus": paired_intervals(labels, np.concatenate(pooled["model"]), found, groups)}


def paired_intervals(labels: np.ndarray, scores: np.ndarray, found: dict[str, dict],
                     groups: np.ndarray | None, resamples: int = 1000) -> dict[str, dict]:
    """The model − each baseline on the same rows: AUC difference (and log loss difference where the baseline
    predicts probabilities), with 95 % paired bootstrap intervals over users (over rows without a user key).

    ``{"logistic": {"auc": [difference, low, high], "logloss": [...], "units": 312, "over": "users"}, ...}``
    """
    from recloop.evidence.ranking import paired_bootstrap, paired_logloss

    units = groups if groups is not None and len(groups) == len(labels) else np.arange(len(labels))
    out = {}
    for name, figures in found.items():
        other = figures.get("scores")
        if other is None or len(other) != len(labels) or name == "base_rate":
            continue
        result = {"units": int(len(np.unique(units))), "over": "users" if units is groups else "rows"}
        auc = paired_bootstrap(labels, scores, other, units, metric="auc", resamples=resamples)
        result["auc"] = [round(auc.difference, 4), round(auc.low, 4), round(auc.high, 4)]
        if figures.get("logloss") is not None:
            loss = paired_logloss(labels, scores, other, units, resamples=resamples)
            result["logloss"] = [round(loss.difference, 4), round(loss.low, 4), round(loss.high, 4)]
        out[name] = result
    return out


def _figures(scores: dict, ndcg: float | None) -> dict:
    return {  # (a baseline's per-row scores stay out: the summary is JSON)
        "auc": scores.get("auc"),
        "logloss": scores.get("logloss"),
        "ndcg": ndcg if ndcg is not None else scores.get("ndcg"),
        "rows": scores.get("rows"),
    }


def _stem(t_us: int) -> str:
    return hour_of_us(t_us)


def _drift(
    settings: Settings,
    spec: DatasetSpec,
    reference: tuple[int, int],
    current: tuple[int, int],
    config: ReplayConfig,
):
    from recloop.monitor import runner

    windows = tuple(
        (datetime.fromtimestamp(a / US, tz=UTC), datetime.fromtimestamp(b / US, tz=UTC))
        for a, b in (reference, current)
    )
    report = runner.check(settings, spec, config=config.monitor, kpis={}, baseline={}, windows=windows)
    return report.decision


def write_report(settings: Settings, summary: dict) -> Path:
    """An HTML page: per period, the models' and baselines' held-out AUC and NDCG, drift and gate."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    periods = summary["periods"]
    names = sorted(
        {name for p in periods for name in p["scores"]}, key=lambda n: (n.startswith("baseline"), n)
    )
    figure = make_subplots(
        rows=2,
        cols=1,
        shared_xaxes=True,
        vertical_spacing=0.12,
        subplot_titles=("AUC on each period before training on it", "NDCG@10 per user"),
    )
    x = [p["start"][:10] for p in periods]
    for name in names:
        dash = "dot" if name.startswith("baseline") else None
        for row, metric in ((1, "auc"), (2, "ndcg")):
            figure.add_trace(
                go.Scatter(
                    x=x,
                    y=[p["scores"].get(name, {}).get(metric) for p in periods],
                    name=name,
                    legendgroup=name,
                    showlegend=row == 1,
                    mode="lines+markers",
                    line={"dash": dash},
                ),
                row=row,
                col=1,
            )
    figure.update_layout(
        height=700, width=1100, title=f"recloop replay — {summary['spec']}, by {summary['period']}"
    )
    header = "".join(f"<th>{n} AUC</th><th>{n} NDCG</th>" for n in names)
    rows = "".join(
        f"<tr><td>{p['period']}</td><td>{p['start'][:16]}</td><td>{p['landed']:,}</td><td>{p['quarantined']}</td>"
        + "".join(
            f"<td>{_f(p['scores'].get(n, {}).get('auc'))}</td><td>{_f(p['scores'].get(n, {}).get('ndcg'))}</td>"
            for n in names
        )
        + f"<td>{_versus(p['scores'].get('model', {}).get('versus', {}))}</td>"
        + f"<td>{p['drift']}</td><td>v{p['incremental_version']} {p['gate']}</td><td>{p['full_retrain']}{_penalty_note(p)}</td>"
        f"<td>{p.get('canary', '-')}</td><td>{p['champion'] or '-'}</td></tr>"
        for p in periods
    )
    recommend_rows = "".join(_recommend_row(p) for p in periods if p.get("recommend", {}).get("users"))
    if summary.get("recommend_overall", {}).get("users"):
        failed: dict[str, dict] = {}
        for p in periods:
            for status, error in p.get("recommend", {}).get("errors", {}).items():
                failed.setdefault(status, {"count": 0})["count"] += error["count"]
        recommend_rows += _recommend_row({"period": "all", "recommend": {**summary["recommend_overall"],
                                                                          "errors": failed}})
    recommend_table = (
        "<h2>Recommendations: /recommend against popularity and co-occurrence</h2><p>Each user who liked an "
        "item in the period (up to a sample) asks <code>POST /recommend</code> as of the period's first instant; "
        "a hit is an item in the list the user liked in the period and had not met before. Differences are "
        "/recommend minus the baseline, per user, with 95 % bootstrap intervals over users.</p>"
        "<table><tr><th>period</th><th>users</th><th>/recommend recall, NDCG</th><th>popularity</th>"
        "<th>co-occurrence</th><th>− popularity (recall)</th><th>− co-occurrence (recall)</th>"
        f"<th>failed requests</th></tr>{recommend_rows}</table>" if recommend_rows else "")
    overall = summary.get("scores_overall") or {}
    overall_scores = (f"<p>Over every replayed period's {overall['rows']:,} rows together (the champion each "
                      f"period had), champion − baseline with 95 % paired intervals:<br>{_versus(overall['versus'])}"
                      "</p>") if overall.get("versus") else ""
    html = f"""<!doctype html><html><head><meta charset="utf-8"><title>recloop replay</title>
<style>body{{font-family:sans-serif;margin:24px}}table{{border-collapse:collapse;font-size:13px}}
td,th{{border:1px solid #ccc;padding:4px 8px;text-align:right}}</style></head><body>
<h1>recloop replay: {summary["spec"]}</h1>
<p>{summary["source"]["rows_landed"]:,} events ({summary["source"]["rows_quarantined"]} quarantined); the first
model trained on the {summary["bootstrap_rows"]:,} before the replayed {summary["period"]}s. Each period is scored
before any model trains on it.</p>
<table><tr><th>period</th><th>start</th><th>landed</th><th>quarantined</th>{header}
<th>champion − baseline (95 % paired bootstrap)</th><th>drift</th>
<th>incremental → gate</th><th>full retrain (its embedding penalty)</th><th>canary (on the period's logged rows)</th>
<th>champion</th></tr>{rows}</table>
{overall_scores}
{recommend_table}
{figure.to_html(full_html=False, include_plotlyjs=True)}
<p>Total {summary["seconds"]} s.</p></body></html>"""
    path = settings.home.resolve() / "reports" / "replay.html"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(html)
    return path


def _recommend_row(period: dict) -> str:
    """One period's recommendation figures as a table row."""
    figures = period["recommend"]
    k = figures["k"]

    def pair(name: str) -> str:
        return f"{_f(figures[name][f'recall@{k}'])}, {_f(figures[name][f'ndcg@{k}'])}"

    def versus(name: str) -> str:
        difference, low, high = figures["recommend"][f"versus {name}"][f"recall@{k}"]
        return " ".join((_signed(difference), f"[{_signed(low)}, {_signed(high)}]"))

    failed = ", ".join(f"{status}: {e['count']}" for status, e in figures["errors"].items()) or "none"
    return (f"<tr><td>{period['period']}</td><td>{figures['users']}</td><td>{pair('recommend')}</td>"
            f"<td>{pair('popularity')}</td><td>{pair('cooccurrence')}</td><td>{versus('popularity')}</td>"
            f"<td>{versus('cooccurrence')}</td><td>{failed}</td></tr>")


def _signed(value: float) -> str:
    """``+0.0123``; zero as ``+0.0000``, never ``-0.0000``."""
    return f"{round(value, 4) + 0.0:+.4f}"


def _versus(versus: dict) -> str:
    """``logistic: AUC +0.012 [+0.004, +0.020], log loss −0.008 [...]`` per baseline, one line each."""
    lines = []
    for name, figures in versus.items():
        parts = [f"{metric} {v[0]:+.4f} [{v[1]:+.4f}, {v[2]:+.4f}]" for metric, v in figures.items()
                 if metric in ("auc", "logloss")]
        lines.append(f"{name}: {', '.join(parts)} over {figures['units']} {figures['over']}")
    return "<br>".join(lines) or "-"


def _f(value) -> str:
    return "-" if value is None or value != value else f"{value:.4f}"


__all__ = [
    "PERIODS",
    "PeriodRecord",
    "ReplayConfig",
    "ReplayError",
    "choose_period",
    "run_replay",
    "write_report",
]
