"""Full and incremental training with checkpoints that resume, on the chunked loader and fused kernels.

Windows come from the training files of ``recloop features`` (one per period with events), by time and rows:

- the newest ``validation_hours`` of time are held out (never trained on) and score the model, grown back
  until they hold ``validation_rows`` rows; fewer than ``min_validation_rows`` is refused;
- ``full``: from scratch over the ``days`` before them (grown back to ``train_rows`` rows), ``epochs`` passes;
  without a set batch size, batch and epochs fit the window (``fit_to_data``);
- ``incremental``: warm start from a checkpoint (weights, sparse and dense optimizer state), grow the
  embedding tables for ids that are new since, ``epochs`` passes over the hours it has not seen (plus an
  optional replay sample of older hours).

A run's folder is named by a hash of what it trains (mode, window, base checkpoint, configuration), so
rerunning the same command after a crash finds it and resumes from its last checkpoint; in
deterministic mode the resumed run ends with the same weights as an uninterrupted one. Checkpoints
(safetensors + JSON, never pickle) are written and read by ``recloop.checkpoint``::

    $RECLOOP_HOME/checkpoints/<run id>/step-000400/{model.safetensors, dense_optimizer.safetensors, state.json}

A ``Tracker`` (``recloop.registry.TrainingRun``: an MLflow run) follows the training as it happens: told
when it starts (``RunStart``: parameters, windows), of each loss reading and epoch, and when it ends (the
summary) or fails. Under torchrun only rank 0 has one.

Under torchrun no rank holds every table (``recloop.distributed``): the ranks train, write their last
checkpoint sharded and stop; ``complete`` then, in one process outside them (``recloop train --nproc N``
itself), puts the tables together, validates the model and writes the run's completed checkpoint whole::

    ranks:      train ──▶ step-0000400/  (tables/: one shard file per rank; awaits completion)
    one process: complete ──▶ step-0000400.1/  (whole: calibrated, validated, registered and served)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import shutil
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timedelta
from pathlib import Path
from typing import Literal, Protocol

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import torch
from safetensors.torch import load_file

from recloop import baselines, checkpoint, distributed
from recloop.data import BATCH_PLAN, ChunkLoader, FeatureSchema, training_files
from recloop.data.cold_ids import cold_shares, dropout_rates, key_tables
from recloop.evaluate import metrics, predict, slice_metrics
from recloop.features.definition import FeatureLayout
from recloop.hours import file_hour, hour_after
from recloop.model import (
    ModelConfig,
    RankingModel,
    StepConfig,
    TrainStep,
    default_batch_size,
    dense_optimizer,
)
from recloop.settings import Settings

log = logging.getLogger("recloop.train")
ORACLE_COLUMNS = ("p_click",)
# Columns of the training rows the validation is sliced by (when present): new vs returning users,
# device, item category. The gate compares candidate and champion on each slice.
SLICE_COLUMNS = ("user_is_new", "c_device", "c_category")
TABLES_PREFIX = "sparse_arch.embeddings."  # the model's tables in its state_dict (a table log holds them)


class TrainError(RuntimeError):
    """Training cannot start: no rows, nothing new, or a checkpoint that does not fit the features."""


# A full retrain's early-stopping share and embedding penalty (``TrainConfig``: an incremental run's are 0).
FULL_EARLY_STOPPING_SHARE = 0.1
FULL_EMBEDDING_L2 = 0.01
# the dense layers' Adam rate by mode (``TrainConfig.lr`` None): a run from scratch, a warm-started one
FULL_LR = 2e-2
INCREMENTAL_LR = 5e-3


@dataclass(frozen=True)
class TrainConfig:
    """What a training run does.

    Args:
        mode: ``full`` or ``incremental``.
        days: window of a full retrain: days of time before the held-out rows.
        epochs: passes over the window: a full retrain's days, an incremental run's new (and replayed) hours.
        batch_size: rows per step; None: 16K on a GPU, 4K on a CPU (``recloop.model.default_batch_size``).
        lr: dense (MLP) Adam learning rate up to ``reference_batch`` rows a step (None: by mode, ``FULL_LR`` 0.02
            from scratch, ``INCREMENTAL_LR`` 0.005 warm-started; ``dense_lr``); above it scaled by
            sqrt(batch/reference) and, from scratch, warmed up linearly (``dense_rate``) so large batches stay
            stable. Below it the rate is not scaled down: a small log's run (256-row steps, a few dozen of them
            before early stopping) trained its layers at half the rate, while the tables' optimizer (whose step
            does not depend on the batch) memorized the rows; on 7,200 Criteo rows the model lost to a logistic
            regression on the dense columns alone (benchmarks/RESULTS.md, "Issue 37: training rates"). A full
            run at 0.02 with the model's wide part (``ModelConfig.wide``) was level or ahead of 0.005 without it
            on every log measured (Criteo, MovieLens, the synthetic world at 40k and 400k rows; RESULTS.md,
            "Issue 37: a wide part and faster layers by default"); an incremental run keeps 0.005 (unmeasured).
        warmup_steps, warmup_share: the warm-up lasts ``warmup_share`` of the run's planned steps, at most
            ``warmup_steps`` (20 steps were half of a 38-step run).
        validation_hours: the newest hours of time held out for validation (whole feature files).
        validation_rows: the held-out window grows back in time, a file at a time, until it holds this many
            rows (a sparse log's newest 6 hours may hold a handful).
        max_validation_share: ... but never beyond this share of all the rows (a small log keeps most of its
            rows to train on).
        min_validation_rows: fewer held-out rows than this: training is refused (a version validated on 13
            rows says nothing; the gate's ``min_rows`` refuses it too).
        replay_fraction: incremental only: older hours replayed, as a fraction of the new hours, drawn at random
            from the window a full retrain would train on (``days``, grown to ``train_rows``). Each day's run of the loop's chain then sees its
            history again instead of only the newest rows (measured in benchmarks/incremental.py --chain).
        checkpoint_every: steps between checkpoints.
        warm_state_decay: incremental only: the embedding optimizer's accumulated state is multiplied by
            this at warm start. Adagrad's sums only grow, so without decay a model trained for long takes
            ever smaller steps on new data. 0.25 along the loop's chain of daily runs: +0.020 [0.008, 0.032]
            normalized reward on the evaluation panel over no decay, 17 of 18 world-days better, 6 worlds
            (``benchmarks/incremental.py --chain 1:1.0,1:1.0:0.25``; benchmarks/RESULTS.md).
        deterministic: results that do not depend on thread scheduling (and equal after a resume).
        device: ``auto`` (CUDA if present), ``cpu`` or ``cuda``.
        compile: ``torch.compile`` backend for the model (``inductor``, ``aot_eager``...), ``off``, or
            ``auto``: inductor on a GPU, where every batch but an epoch's last has the same shape and launch
            overhead matters; eager on a CPU. The embedding kernels are torch.library ops, so the model
            compiles whole around them.
        data_shards: the rows are split into this many shards of row groups, each read in its own order; a
            step takes ``batch_size / data_shards`` rows of each (0: one shard per process, so one alone
            reads as before). Under torchrun each rank reads its shards only (``recloop.distributed``).
        row_wise_above: under several processes, tables with more rows are sharded row-wise over the ranks,
            the others table-wise (0: one rank's share of all rows).
        early_stopping_share: the newest files of the training window holding this share of its rows are held
            aside (``held_aside``: spread over the window, never trained on) as the **early-stopping rows**:
            scored ``early_stopping_checks`` times an epoch, the run keeps the weights of the check with the
            lowest log loss on them and stops after ``patience`` epochs of checks without a better one; Platt
            scaling (slope and intercept) is fitted on them afterwards. 0: none. None (the default): 0.1 for a full
            retrain, 0 for an incremental run (``held_aside_share``): an incremental run's window is the new hours,
            and holding a tenth of them aside (the second-newest hour among them) cost its candidate AUC against
            the champion it started from (tests/test_registry.py's world, mean over three champion seeds: -0.016
            with both this and ``embedding_l2``, +0.002 without early-stopping rows, +0.007 without either;
            benchmarks/RESULTS.md).
        early_stopping_rows: ``spread`` (the default: every k-th file, see ``held_aside``) or ``newest``: the newest
            files holding that share of the rows, forward in time like what the model will next score. Spread rows
            share their hours' users and sessions with the rows trained on, so they cannot see a model that learnt
            its ids' past too well: on MovieLens 1M they preferred an embedding penalty of 0.01 (best check 0.5437
            against 0.5507 at 1.0) while the next week's rows preferred 1.0 (AUC 0.7684 against 0.7612). Used to
            choose ``embedding_l2`` (``embedding_l2_choices``); the run that is kept holds spread rows aside.
        early_stopping_min_rows: fewer early-stopping rows than this (or a window of one file): none are held
            aside, every epoch runs, and the calibration falls back to a base-rate correction on training rows.
            200: at 1000 a 3,600-row Criteo sample held none aside, ran all its 10 epochs and scored a held-out
            log loss of 1.18 (base rate 0.50).
        patience: epochs without a lower early-stopping log loss before the run stops.
        restore_z: the best check's weights replace the last ones when the last are worse on the early-stopping
            rows by at least this many standard errors of the paired per-row log-loss difference; closer than
            that, the difference is noise and the run keeps what it trained. On the README walkthrough's 241
            early-stopping rows the second epoch's last weights scored 0.6976 against the first epoch's 0.6936,
            and restoring those made a two-epoch run register as the one-epoch run's version.
        early_stopping_checks: checks of the early-stopping rows an epoch (the last at its end), from the end of
            the first epoch on: a run keeps at least one whole pass over its training rows. Checked inside it, the
            README walkthrough's runs (2,311 rows, 9 steps an epoch, all inside the 20-step warm-up) kept the
            weights of step 3, barely moved from their initialization, so a second run came out identical to
            the first; and a retrain on new rows must not return with some of them never trained on.
        average_checks: the run ends with the mean of its weights at every early-stopping check after the first
            (a uniform average along the trajectory, as stochastic weight averaging), in place of the last
            weights; the best check still replaces it when the average does worse by ``restore_z``. A run of
            one epoch has one check: nothing to average. On 10,000-event days, two full retrains of the same
            rows differing only in their seed land 0.05 apart on the evaluation panel; the average raised the
            panel by about 0.01 and narrowed that spread (benchmarks/RESULTS.md, "One retrain is one draw").
        average_max_bytes: no average (one more copy of the weights) for a model whose floating-point weights
            take more than this.
        calibration_rows: Platt scaling (``recloop.evidence.calibration``) is fitted on up to this many of the
            early-stopping rows (without them: the newest *training* rows, intercept only) and kept with the
            checkpoint's JSON, so its probabilities are those of data it has not seen; 0: none.
        calibration_slope: without early-stopping rows, fit Platt's slope on the training rows too. Off by
            default: fitted on rows the model has seen, the slope learns its training-set confidence (1.40 on
            the test suite's first model) and raised the held-out log loss from 0.341 to 0.352.
        embedding_l2: weight of the embedding penalty (the mean squared norm of the rows a batch looks up;
            ``recloop.model.StepConfig``): a rare id's row stays near zero unless its rows say otherwise. From
            scratch it warms up with the dense learning rate (``warmup_steps``): at full weight from the first
            step, while the layers that read the embeddings barely move, rowwise Adagrad (which normalizes each
            row's step) pulls the rows toward zero at its full rate. Held-out AUC, seeds 0/1: the 50-step run of
            tests/test_train.py 0.623/0.579 at full weight, 0.629/0.600 warmed up (0.628 without a penalty);
            the 19-step run of tests/test_dynamic_loop.py 0.550/0.573 and 0.552/0.581 (0.571/0.579). The
            penalty still costs runs this short some AUC; at 100k rows it gained (benchmarks/RESULTS.md).
            None (the default): 0.01 for a full retrain, 0 for an incremental run (``embedding_penalty``) unless its
            base was given or chose one, which it continues with (``chain_penalty``): a warm
            start takes it at full weight from its first step, on rows the champion already shaped under it (on
            the world above, without early-stopping rows: +0.002 with it, +0.007 without).
        embedding_l2_choices: a full run from scratch first trains once with the configured penalty and once with
            each of these, its newest rows held aside (``early_stopping_rows`` ``newest``), and then trains as
            configured with the choice that scored those rows best, if it beat the configured penalty there by
            ``selection_z`` (2) standard errors of the paired per-row difference (the summary's ``selection`` and
            ``overrides`` say which and why). Empty (the default): ``embedding_l2`` as given. What the ids should
            be allowed to learn depends on the log: on MovieLens 1M a 100x stronger penalty took the ranker from
            behind the user + item CTR baseline to ahead of it; on Criteo's sample and the synthetic world it cost
            AUC (benchmarks/RESULTS.md, issue 37). Costs a training per choice and one with the configured penalty.
        id_dropout: the rate at which a training row's user and item ids (vocabulary tables of the spec's keys)
            are replaced by the out-of-vocabulary id (``recloop.model.fit.drop_ids``), so the model learns to score
            rows whose ids it will not know from their other inputs. None (the default): a full run measures it on
            its window (the share of its newest tenth of rows whose id the rows before them do not hold, at most
            0.5: ``recloop.data.cold_ids``); an incremental run continues its base's rates. 0: none. On MovieLens 1M
            (77 % of a week's rows from users new that week) the held-out AUC rose from 0.7713 to 0.7793; the rates
            a run used are in its summary's ``id_dropout``. Applied in one process (not under torchrun).
        selection_z: how many standard errors of the paired per-row log-loss difference on the newest rows a
            choice must beat the configured penalty by (on Criteo's 3,600-row sample the 300 to 570 newest rows
            picked by noise without it, and the replay lost 0.03 AUC against the logistic regression).
        weight_decay: decoupled weight decay of the dense layers (AdamW).
        min_steps: see ``fit_to_data`` (0: batch size and epochs exactly as given).
        train_rows: a full run's window grows back in time beyond ``days`` until it holds this many rows (a
            sparse log's last 7 days may hold a few hundred).
        table_log_full_every: with dynamic tables (row budgets), each periodic checkpoint writes the tables
            to the run's table log (``recloop.checkpoint.write_tables``: the rows, slots and map positions
            changed since the last one, a full copy every this many) and the step folder without them, so an
            hourly checkpoint of a huge table costs what changed; the completed checkpoint (registered and
            served) holds everything. 0: every checkpoint whole.
        baselines: score the simple baselines on the held-out rows too (``recloop.baselines.window_baselines``:
            learnt from the rows before the window, kept for the gate that judges this run).
    """

    mode: Literal["full", "incremental"] = "full"
    days: int = 7
    epochs: int = 1
    batch_size: int | None = None
    lr: float | None = None
    reference_batch: int = 1024
    warmup_steps: int = 20
    warmup_share: float = 0.05
    validation_hours: int = 6
    validation_rows: int = 2000
    max_validation_share: float = 0.25
    min_validation_rows: int = 200
    replay_fraction: float = 0.0
    checkpoint_every: int = 200
    warm_state_decay: float = 0.25
    seed: int = 0
    deterministic: bool = False
    device: str = "auto"
    table_log_full_every: int = 0
    compile: str = "auto"
    data_shards: int = 0
    row_wise_above: int = 0
    early_stopping_share: float | None = None
    early_stopping_rows: Literal["spread", "newest"] = "spread"
    early_stopping_min_rows: int = 200
    patience: int = 1
    restore_z: float = 2.0
    early_stopping_checks: int = 4
    average_checks: bool = True
    average_max_bytes: int = 1 << 30
    calibration_rows: int = 200_000
    calibration_slope: bool = False
    embedding_l2: float | None = None
    embedding_l2_choices: tuple[float, ...] = ()
    selection_z: float = 2.0
    id_dropout: float | None = None
    weight_decay: float = 0.0
    baselines: bool = True
    min_steps: int = 100
    train_rows: int = 200_000
    model: ModelConfig = field(default_factory=ModelConfig)

    def to_dict(self) -> dict:
        out = asdict(self)
        # settings added after runs were first identified by this dict: at their defaults they leave it as it
        # was (a run started before them resumes under its own id)
        for name in ("early_stopping_rows", "embedding_l2_choices", "selection_z"):
            if out[name] == getattr(TrainConfig, name):
                del out[name]
        if "embedding_l2_choices" in out:
            out["embedding_l2_choices"] = list(out["embedding_l2_choices"])
        return out

    @property
    def dense_lr(self) -> float:
        """``lr`` as this run uses it (None: by mode)."""
        if self.lr is not None:
            return self.lr
        return FULL_LR if self.mode == "full" else INCREMENTAL_LR

    @property
    def held_aside_share(self) -> float:
        """``early_stopping_share`` as this run uses it (None: by mode)."""
        if self.early_stopping_share is not None:
            return self.early_stopping_share
        return FULL_EARLY_STOPPING_SHARE if self.mode == "full" else 0.0

    @property
    def embedding_penalty(self) -> float:
        """``embedding_l2`` as this run uses it (None: by mode)."""
        if self.embedding_l2 is not None:
            return self.embedding_l2
        return FULL_EMBEDDING_L2 if self.mode == "full" else 0.0


@dataclass
class TrainSummary:
    mode: str
    run_id: str
    checkpoint: str
    samples: int = 0
    steps: int = 0
    samples_per_s: float = 0.0
    seconds: float = 0.0
    auc: float = float("nan")
    logloss: float = float("nan")
    calibration: float = float("nan")
    oracle_auc: float | None = None
    validation_rows: int = 0
    ndcg: float = float("nan")  # NDCG@10 per user on the held-out rows (NaN without a user key)
    baselines: dict[str, dict] = field(default_factory=dict)  # recloop.baselines on the same rows
    slices: dict[str, dict[str, float]] = field(default_factory=dict)
    loss_curve: list[list[float]] = field(default_factory=list)  # [step, training loss] every 10 steps
    train_hours: list[str] = field(default_factory=list)
    validation_hours: list[str] = field(default_factory=list)
    trained_until: str = ""
    # the first hour the chain's last full retrain had not seen: this run's ``trained_until`` for a full run,
    # the warm start's for an incremental one ("": unknown, a chain begun before it was recorded)
    full_trained_until: str = ""
    state_version: int = 0
    warm_start: str | None = None
    grown_tables: dict[str, list[int]] = field(default_factory=dict)
    resumed_from_step: int = 0
    resume_note: str = ""  # a resume that could not continue its epoch where it stopped says why
    # what the trainer did instead of what it was asked (epochs raised by ``fit_to_data``, a ``days`` window
    # grown back to ``train_rows`` or cut at the first training file): said, never silent
    overrides: list[str] = field(default_factory=list)
    # the early-stopping rows' log loss after each epoch, the epoch kept and the rows (empty: none held aside)
    early_stopping: dict = field(default_factory=dict)
    # ``embedding_l2_choices``: each choice's log loss on the newest rows, its z against the configured penalty,
    # and the penalty kept (empty: no choice made)
    selection: dict = field(default_factory=dict)
    # table -> the rate its ids were dropped at in training (``TrainConfig.id_dropout``)
    id_dropout: dict[str, float] = field(default_factory=dict)
    # trained by several ranks, not validated yet: the figures above are the training's alone and
    # ``checkpoint`` is the ranks' last (sharded) one, which ``complete`` turns into the run's completed one
    awaits_completion: bool = False

    def to_dict(self) -> dict:
        out = asdict(self)
        out["train_hours"] = [self.train_hours[0], self.train_hours[-1]] if self.train_hours else []
        return out


@dataclass(frozen=True)
class RunStart:
    """What a training run is about to do, told to its tracker before the first step.

    ``params``: the training and model configurations (nested dicts); ``train_rows``/``validation_rows``: the
    rows of the windows' files; ``example``: a few training rows (their schema is the datasets' profile);
    ``resumed_from_step``: a run taken up again from its last checkpoint (0: from the start).
    """

    run_id: str
    mode: str
    params: dict
    train_hours: list[str]
    validation_hours: list[str]
    train_rows: int
    validation_rows: int
    example: pd.DataFrame
    state_version: int
    warm_start: str | None
    resumed_from_step: int = 0


class Tracker(Protocol):
    """Follows one training run as it happens (``recloop.registry.TrainingRun`` records it in MLflow)."""

    def started(self, start: RunStart) -> None:
        """Before the first step (or the first step after a resume)."""

    def progress(self, step: int, figures: dict[str, float]) -> None:
        """Figures as they come: the training loss at each reading, the epoch and throughput at its end."""

    def trained(self, summary: TrainSummary) -> None:
        """The training ended: its validation figures."""

    def flush(self) -> None:
        """Every figure told so far recorded: a rank hands its run over to the process that completes it."""

    def failed(self, error: BaseException) -> None:
        """The training stopped on ``error`` (a crash, an interrupt): it resumes from its last checkpoint."""


def _device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def checkpoints_dir(settings: Settings) -> Path:
    return settings.home.resolve() / "checkpoints"


@dataclass(frozen=True)
class Windows:
    """What a run trains on and is judged on: hourly training files, and the held-out validation hours."""

    train: list[Path]
    validation: list[Path]
    epochs: int
    overrides: tuple[str, ...] = ()  # what differs from what the configuration asked, and why
    tuning: tuple[Path, ...] = ()  # the early-stopping rows: the newest files of the window, not trained on


def held_aside(windows: Windows, config: TrainConfig) -> Windows:
    """Every k-th training file (k = 1 / ``held_aside_share``), counting back from the second newest, moved
    to ``tuning``: early-stopping rows spread over the window (the newest file is always trained on). Unchanged
    when they would hold fewer than ``early_stopping_min_rows`` rows or the window has one file.

    Spread rather than the newest files: held out at the end, the newest tenth of a MovieLens window (the rows
    closest to what the model will score) was never trained on, and the Platt scaling fitted there carried
    that stretch's base rate: held-out log loss 0.5094 and calibration 1.06, against 0.5059 and 1.00 spread
    (ml-latest-small, 10,099 held-out rows; benchmarks/RESULTS.md)."""
    if config.held_aside_share <= 0 or len(windows.train) < 2:
        return windows
    rows = [_rows(f) for f in windows.train]
    if config.early_stopping_rows == "newest":  # the newest files holding the share (one file stays to train on)
        first, held = len(rows), 0
        while first > 1 and held < config.held_aside_share * sum(rows):
            first -= 1
            held += rows[first]
        picked = set(range(first, len(rows)))
    else:
        every = max(2, round(1 / config.held_aside_share))
        picked = set(range(len(rows) - 2, -1, -every))
    if sum(rows[i] for i in picked) < config.early_stopping_min_rows:
        return windows
    return replace(windows, train=[f for i, f in enumerate(windows.train) if i not in picked],
                   tuning=tuple(f for i, f in enumerate(windows.train) if i in picked))


def _rows(path: Path) -> int:
    return pq.ParquetFile(path).metadata.num_rows


def held_out_from(files: list[Path], config: TrainConfig, trained_until: str | None = None) -> int:
    """Where the held-out files start: the newest ``validation_hours`` of time, grown back a file at a time
    until they hold ``validation_rows`` rows or ``max_validation_share`` of all rows (at least one file stays
    to train on). ``trained_until``: an incremental run's base's; growing, the held-out files take at most half
    of the rows the base has not seen, so the run has new rows to train on (on a sparse log the 2,000 rows
    reached back past everything new, and ml-latest-small's replay ended with "nothing new to train on")."""
    newest = file_hour(files[-1])
    cut = len(files) - 1
    while cut > 0 and file_hour(files[cut - 1]) > newest - timedelta(hours=config.validation_hours):
        cut -= 1
    held = sum(_rows(f) for f in files[cut:])
    cap = config.max_validation_share * sum(_rows(f) for f in files)
    if trained_until is not None:
        cap = min(cap, sum(_rows(f) for f in files if f.stem >= trained_until) / 2)
    while held < config.validation_rows and cut > 1 and held + _rows(files[cut - 1]) <= cap:
        cut -= 1
        held += _rows(files[cut])
    return cut


def choose_windows(files: list[Path], config: TrainConfig, base: dict | None) -> Windows:
    """Held out: the files of the newest ``validation_hours`` of time, grown back in time (a file at a time)
    until they hold ``validation_rows`` rows; fewer than ``min_validation_rows`` is refused. A full run trains
    on the ``days`` of time before them (whatever the files' period, empty hours included), an incremental one
    on the files its base has not seen (plus a replay sample of older ones)."""
    if len(files) < 2:
        raise TrainError(f"only {len(files)} period(s) of training rows: one is held out for validation, so "
                         "nothing is left to train on")
    cut = held_out_from(files, config, base["trained_until"] if base is not None else None)
    if cut == 0:
        raise TrainError(f"the {config.validation_hours} hours held out for validation cover all {len(files)} "
                         "files of training rows: nothing is left to train on")
    held = sum(_rows(f) for f in files[cut:])
    if held < config.min_validation_rows:
        raise TrainError(f"only {held} rows to hold out for validation (at least {config.min_validation_rows} "
                         "are needed to judge a model): build features over a longer stretch of events, or "
                         "lower it knowingly (`recloop train --min-validation-rows N`)")
    validation, trainable = files[cut:], files[:cut]
    since = file_hour(validation[0]) - timedelta(days=config.days)
    first = next((i for i, f in enumerate(trainable) if file_hour(f) >= since), len(trainable))
    rows = sum(_rows(f) for f in trainable[first:])
    asked = first
    while first > 0 and rows < config.train_rows:
        first -= 1
        rows += _rows(trainable[first])
    if base is None:
        return Windows(trainable[first:], validation, config.epochs, _days_overrides(trainable, first, asked, since,
                                                                                     rows, config))
    new = unseen(trainable, base)
    if not new:
        raise TrainError(f"nothing new to train on: the checkpoint has seen every hour up to {base['trained_until']}")
    older = [f for f in trainable[first:] if f.stem < base["trained_until"]]  # replayed: a full run's window only
    replay_count = min(len(older), math.ceil(len(new) * config.replay_fraction))
    replay = sorted(np.random.default_rng(config.seed).choice(len(older), replay_count, replace=False).tolist())
    return Windows([older[i] for i in replay] + new, validation, config.epochs)


def _days_overrides(trainable: list[Path], first: int, asked: int, since: datetime, rows: int,
                    config: TrainConfig) -> tuple[str, ...]:
    """Why a full run's window is not the ``days`` asked for: grown back to ``train_rows``, or the days reach
    before the first training file (then more days change nothing)."""
    span = (file_hour(trainable[-1]) + timedelta(hours=1) - file_hour(trainable[first])) / timedelta(days=1)
    if first < asked:
        return (f"days {config.days} → {span:.1f}: the window grew back to reach train_rows ({config.train_rows:,}"
                f" rows; it holds {rows:,})",)
    if first == 0 and file_hour(trainable[0]) > since:
        return (f"days {config.days} → {span:.1f}: no training rows before {trainable[0].stem} (a longer --days "
                "trains on the same rows)",)
    return ()


# The most epochs ``fit_to_data`` raises a run to when no early-stopping rows watch it.
UNCHECKED_EPOCHS = 3


def fit_to_data(config: TrainConfig, windows: Windows, device: torch.device) -> tuple[TrainConfig, Windows]:
    """Steps that suit the window's size, when no batch size is set: one that gives an epoch at least
    ``min_steps`` steps (a power of two, 256 up to the device's default), and a full run at least ``min_steps``
    steps in all, adding epochs. A small log trained in a handful of large-batch steps (a 20,000-row log is 5
    steps of 4096 rows, inside the learning-rate warm-up) loses to a logistic regression. A batch size given
    explicitly is kept, with its epochs.

    Without early-stopping rows (a window too small to hold ``early_stopping_min_rows`` aside) the epochs are
    raised to at most ``UNCHECKED_EPOCHS``: nothing would stop the run memorizing its rows. Criteo's published
    200-row sample (150 training rows, one step an epoch) was raised to 100 epochs and scored a held-out log loss
    of 2.1 against 0.65 at 3 (benchmarks/RESULTS.md, "Issue 37: training rates")."""
    rows = sum(_rows(f) for f in windows.train)
    if rows == 0 or config.min_steps <= 0 or config.batch_size is not None:
        return config, windows
    fitting = 2 ** int(math.floor(math.log2(max(rows / config.min_steps, 1))))
    config = replace(config, batch_size=int(min(max(fitting, 256), default_batch_size(device))))
    if config.mode == "full":
        steps_per_epoch = math.ceil(rows / config.batch_size)
        epochs = max(windows.epochs, math.ceil(config.min_steps / steps_per_epoch))
        why = f"a full run makes at least min_steps ({config.min_steps})"
        if not windows.tuning and epochs > max(windows.epochs, UNCHECKED_EPOCHS):
            epochs = max(windows.epochs, UNCHECKED_EPOCHS)
            why += f", up to {UNCHECKED_EPOCHS} epochs without early-stopping rows"
        if epochs != windows.epochs:
            windows = replace(windows, epochs=epochs, overrides=(*windows.overrides, (
                f"epochs {windows.epochs} → {epochs}: {steps_per_epoch} steps of {config.batch_size} rows an epoch, "
                f"{why}; set a batch size to keep the epochs")))
    return config, windows


def resume_position(resumed: dict | None) -> tuple[dict, str]:
    """Where a run takes up (a new one: the start) and, when its epoch has to start over, why.

    A checkpoint's batch count names the same rows only under the loader's batch plan that wrote it
    (``recloop.data.loader.BATCH_PLAN``): skipping that many batches of another plan would skip some of the
    epoch's rows and repeat others. Such an epoch restarts from its first batch instead (its rows trained
    before the checkpoint get a second pass), and the summary says so."""
    if not resumed:
        return {"step": 0, "epoch": 0, "batch": 0, "samples": 0, "batch_plan": BATCH_PLAN}, ""
    position = {**resumed, "batch_plan": BATCH_PLAN}
    plan = resumed.get("batch_plan", 1)  # checkpoints before the plan was recorded: plan 1
    if resumed["batch"] == 0 or plan == BATCH_PLAN:
        return position, ""
    position["batch"] = 0
    return position, (f"epoch {resumed['epoch']} restarts from its first batch: the checkpoint at step "
                      f"{resumed['step']} was written {resumed['batch']} batches into it by a loader that batched "
                      f"rows differently (batch plan {plan}, now {BATCH_PLAN})")


def unseen(files: list[Path], base: dict) -> list[Path]:
    """The hourly files a checkpoint has not trained on (from its ``trained_until`` hour on)."""
    return [f for f in files if f.stem >= base["trained_until"]]


def trainable_files(settings: Settings, config: TrainConfig) -> list[Path]:
    """The training files a run may train on: all but the held-out ones (``choose_windows``)."""
    files = training_files(FeatureLayout.for_settings(settings).training)
    return files[:held_out_from(files, config)] if len(files) >= 2 else []


def chain_origin(state: dict) -> str:
    """Where a checkpoint's chain of incremental runs begins: the first hour its last full retrain had not
    seen ("" when unknown: an incremental checkpoint written before this was recorded)."""
    if state.get("full_trained_until"):
        return state["full_trained_until"]
    return state["trained_until"] if (state.get("train") or {}).get("mode") == "full" else ""


def train(settings: Settings, config: TrainConfig, *, warm_start: Path | None = None,
          on_progress: Callable[[int, int, float], None] | None = None,
          on_step: Callable[[int], None] | None = None, tracker: Tracker | None = None) -> TrainSummary:
    """Train (or resume) a run; returns its summary. Raises ``TrainError`` on bad input.

    Under ``torchrun`` every rank calls it: tables sharded (each rank allocates its shards only), dense layers
    under DDP, each rank reading its own row groups; every rank writes its table rows of each checkpoint and
    rank 0 the rest (``recloop.distributed``), and rank 0 alone tells ``tracker``. Every rank returns rank 0's
    summary of the training, which ``awaits_completion``: no rank validates the model (that needs every
    table); ``complete`` does, in one process, once the ranks are done.

    Args:
        warm_start: incremental only, and required there: the checkpoint to start from (the loop passes
            the champion's, resolved through the registry: ``pipeline.warm_start_checkpoint``).
        on_progress: ``(samples, total_samples, samples_per_s)``, every few steps.
        on_step: ``(step)`` after each step (tests use it to simulate a crash).
        tracker: follows the run from its first step to its summary (not told about a run found completed).
    """
    if config.embedding_l2_choices and config.mode == "full":
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise TrainError("embedding_l2_choices: the choice is made in one process (train with it, then under "
                             "torchrun with the penalty it kept)")
        return _train_selected(settings, config, on_progress, on_step, tracker)
    ranks, joined = distributed.join(config.device)
    try:
        return _train(settings, replace(config, data_shards=config.data_shards or ranks.world), ranks,
                      warm_start, on_progress, on_step, tracker if ranks.leader else None)
    finally:
        distributed.leave(joined)


def _train_selected(settings: Settings, config: TrainConfig, on_progress, on_step, tracker) -> TrainSummary:
    """``embedding_l2_choices``: a trial with the configured penalty and one with each choice, each holding the
    newest rows aside; then the run itself with the choice whose trial scored those rows best, when it beat the
    configured penalty's trial there by ``selection_z`` standard errors of the paired per-row log-loss difference
    (fewer rows, or a closer call, keep the configured one: on Criteo's 3,600-row sample, 300 to 570 newest rows
    picked by noise and cost the replay 0.03 AUC). Every trial is a run of its own (rerun: found completed)."""
    from recloop.checkpoint import load_model

    configured = config.embedding_penalty
    choices = [configured] + [c for c in config.embedding_l2_choices if c != configured]
    plain = replace(config, embedding_l2_choices=(), selection_z=TrainConfig.selection_z)  # one run, no choosing
    layout = FeatureLayout.for_settings(settings)
    losses: dict[float, np.ndarray] = {}
    for choice in choices:
        trial = train(settings, replace(plain, embedding_l2=choice, early_stopping_rows="newest", baselines=False))
        held = (trial.early_stopping or {}).get("files") or []
        if not held:  # too few rows to hold any aside: nothing to choose on
            break
        model, _ = load_model(trial.checkpoint)
        losses[choice] = _row_losses(model, [layout.training / f"{stem}.parquet" for stem in held],
                                     FeatureSchema.load(layout.schema), distributed.device_for(config.device, distributed.Ranks()))
    figures: dict[str, dict] = {}
    kept, best_z = configured, float(config.selection_z)
    if len(losses) == len(choices):
        for choice in choices[1:]:
            gain = losses[configured] - losses[choice]  # per row: > 0 where the choice scored better
            z = float(gain.mean() / (gain.std(ddof=1) / math.sqrt(len(gain)))) if gain.std() > 0 else 0.0
            figures[f"{choice:g}"] = {"logloss": float(losses[choice].mean()), "z": z}
            if z >= best_z:
                kept, best_z = choice, z
        figures[f"{configured:g}"] = {"logloss": float(losses[configured].mean()), "z": 0.0}
    # The default kept by default stays unset, so the run is the one no choosing would have made and the chain's
    # incremental runs train at their own default; a choice is set, so they continue with it (``chain_penalty``).
    explicit = kept if kept != configured or config.embedding_l2 is not None else None
    summary = train(settings, replace(plain, embedding_l2=explicit), on_progress=on_progress,
                    on_step=on_step, tracker=tracker)
    if not figures:
        why = f"embedding_l2 {configured:g} kept: too few rows to hold the newest aside and judge the choices"
    else:
        said = ", ".join(f"{k}: {v['logloss']:.4f} (z {v['z']:+.1f})" for k, v in figures.items())
        why = (f"embedding_l2 {kept:g} {'kept' if kept == configured else 'chosen'} from {choices} on the "
               f"{len(losses[configured]):,} newest rows' log loss ({said}; a choice needs z >= {config.selection_z:g})")
    return replace(summary, selection={"embedding_l2": figures, "kept": kept}, overrides=[*summary.overrides, why])


def chain_penalty(config: TrainConfig, base: dict | None) -> tuple[TrainConfig, str | None]:
    """An incremental run given no ``embedding_l2`` continues with the one its base was given or chose
    (``embedding_l2_choices``), and says so; without one set along the chain it trains at its mode's default (0).

    Along MovieLens 1M's replay, whose full retrains chose 1.0, incremental runs at 0 let the id rows learn their
    past again: continuing with the chain's penalty moved the replay from 0.0009 to 0.0001 AUC behind the user +
    item CTR baseline and from +0.0016 to +0.0024 ahead of the logistic regression (benchmarks/RESULTS.md)."""
    if config.mode != "incremental" or config.embedding_l2 is not None or base is None:
        return config, None
    chain = (base.get("train") or {}).get("embedding_l2")
    if chain is None:
        return config, None
    return (replace(config, embedding_l2=float(chain)),
            f"embedding_l2 {float(chain):g}: the penalty its chain was given or chose (by mode: 0)")


def id_dropout_rates(config: TrainConfig, layout: FeatureLayout, schema: FeatureSchema, files: list[Path],
                     base: dict | None, dynamic: tuple[str, ...] = ()) -> dict[str, float]:
    """The rate each key table's ids are dropped at in this run's training rows (``TrainConfig.id_dropout``):
    as configured; else an incremental run's base's; else measured on the training ``files``."""
    tables = [t for t in key_tables(schema, json.loads(layout.schema.read_text())) if t not in dynamic]
    if config.id_dropout is not None:
        return {table: float(config.id_dropout) for table in tables} if config.id_dropout > 0 else {}
    if config.mode == "incremental":
        return {table: rate for table, rate in ((base or {}).get("id_dropout") or {}).items() if table in tables}
    return dropout_rates(cold_shares(files, tables))


def _train(settings: Settings, config: TrainConfig, ranks: distributed.Ranks, warm_start: Path | None,
           on_progress: Callable[[int, int, float], None] | None,
           on_step: Callable[[int], None] | None, tracker: Tracker | None) -> TrainSummary:
    layout = FeatureLayout.for_settings(settings)
    files = training_files(layout.training)
    if not files:
        raise TrainError(f"no training rows under {layout.training}: run `recloop features` first")
    schema = _schema(layout, files)
    base = None
    if config.mode == "incremental":
        if warm_start is None:
            raise TrainError("incremental training needs a checkpoint to start from (the champion's, or --from)")
        try:
            base = checkpoint.read(warm_start)
        except checkpoint.CheckpointError as err:
            raise TrainError(str(err)) from err
    config, inherited = chain_penalty(config, base)
    windows = choose_windows(files, config, base)
    if inherited:
        windows = replace(windows, overrides=(*windows.overrides, inherited))
    if ranks.world == 1 and config.data_shards <= 1:  # (the sharded loop has no early stopping)
        windows = held_aside(windows, config)
    config, windows = fit_to_data(config, windows, distributed.device_for(config.device, ranks))
    full_trained_until = chain_origin(base) if base else hour_after(windows.train[-1].stem)

    identity = {"mode": config.mode, "files": [f.stem for f in windows.train], "base": base["path"] if base else None,
                "tuning": [f.stem for f in windows.tuning],
                "config": config.to_dict(), "state_version": schema.state_version}
    run_id = f"{config.mode}-{hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]}"
    run_dir = checkpoints_dir(settings) / run_id
    done = checkpoint.completed_run(run_dir)
    if done is not None:
        return TrainSummary(**done["summary"])
    if checkpoint.awaiting_completion(run_dir) is not None:  # its ranks trained it to the end already
        if ranks.world > 1:
            return TrainSummary(**checkpoint.read(run_dir)["summary"])
        return complete(settings, run_dir, tracker)

    if config.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    if (config.data_shards > 1 or ranks.world > 1) and config.id_dropout:
        raise TrainError("id_dropout: ids are dropped in one data shard's training only; leave it unset or 0 with "
                         "data_shards or under torchrun")
    device = distributed.device_for(config.device, ranks)
    model, optimizer, grown, resumed = _build(config, schema, device, run_dir, base, windows.train, ranks)
    position, resume_note = resume_position(resumed)
    if resume_note:
        log.warning("%s: %s", run_id, resume_note)
    sharded = config.data_shards > 1 or ranks.world > 1
    if sharded and model.dynamic_tables:
        raise TrainError(f"tables {list(model.dynamic_tables)} have row budgets: dynamic tables train in one process "
                         "with one data shard (sharding them is not built yet)")
    trained = distributed.wrap(model, ranks) if sharded else model
    dropout = {} if sharded else id_dropout_rates(config, layout, schema, windows.train, base, model.dynamic_tables)
    held = distributed.held_tables(model, ranks) if ranks.world > 1 else None  # what each rank holds of the tables

    def save(completed: bool, summary: TrainSummary | None = None, awaits_completion: bool = False) -> Path:
        staged = None
        if ranks.world > 1:  # each rank writes its own table shards: none holds them all
            from recloop.model.sharded_checkpoint import save_tables

            staged = _stage_checkpoint(run_dir, position["step"])
            save_tables(staged / checkpoint.TABLES, model.embeddings)
        if not ranks.leader:
            return run_dir
        info = {"model": model.config.to_dict(), "train": config.to_dict(),
                "tables": [[n, r] for n, r in zip(model.table_names, model.embeddings.layout.rows, strict=True)],
                "dense": list(schema.dense), "state_version": schema.state_version, "position": dict(position),
                "trained_until": hour_after(windows.train[-1].stem),
                "full_trained_until": full_trained_until,
                "calibration": list(model.calibration) if model.calibration else None,
                "grown_tables": grown,  # (a resumed run's summary says it too)
                "id_dropout": dropout,
                "summary": asdict(summary) if summary else None,
                **({"sharding": held} if held else {})}
        if config.table_log_full_every and model.dynamic_tables and not completed:
            entry = checkpoint.write_tables(run_dir / "tables", model.embeddings, config.table_log_full_every)
            info["table_log"] = entry["number"]
            return checkpoint.save(run_dir, position["step"], model, optimizer, info, completed,
                                   without=TABLES_PREFIX)
        return checkpoint.save(run_dir, position["step"], model, optimizer, info, completed, staged=staged,
                               sharded_tables=staged is not None, awaits_completion=awaits_completion)

    start = _run_start(run_id, config, model.config.to_dict(), windows, schema, base["path"] if base else None,
                       resumed["step"] if resumed else 0) if tracker is not None else None
    with _followed(tracker, start):
        started = time.perf_counter()
        if sharded:
            loss_curve = _fit_sharded(trained, optimizer, windows, schema, config, device, position, base is not None,
                                      save, ranks, on_progress, on_step, tracker)
        else:
            loss_curve = _fit(model, optimizer, windows, schema, config, device, position, warm=base is not None,
                              save=save, on_progress=on_progress, on_step=on_step, tracker=tracker,
                              run_dir=run_dir, id_dropout=dropout)
        seconds = time.perf_counter() - started
        samples_this_run = position["samples"] - (resumed["samples"] if resumed else 0)
        # the training's figures; the validation's are added below (or, under several ranks, by ``complete``)
        trained_summary = TrainSummary(
            mode=config.mode, run_id=run_id, checkpoint=str(checkpoint.step_folder(run_dir, position["step"])),
            samples=position["samples"], steps=position["step"],
            samples_per_s=round(samples_this_run / seconds, 1) if seconds > 0 else 0.0, seconds=round(seconds, 3),
            train_hours=[f.stem for f in windows.train], validation_hours=[f.stem for f in windows.validation],
            trained_until=hour_after(windows.train[-1].stem), full_trained_until=full_trained_until,
            state_version=schema.state_version, warm_start=base["path"] if base else None, grown_tables=grown,
            resumed_from_step=resumed["step"] if resumed else 0, resume_note=resume_note, loss_curve=loss_curve,
            overrides=list(windows.overrides), id_dropout=dropout)
        if sharded and ranks.world > 1:  # every rank writes its rows of the last checkpoint; one process completes it
            trained_summary.awaits_completion = True
            save(completed=False, summary=trained_summary, awaits_completion=True)
            if tracker is not None:  # the losses it holds back (flushed every few seconds) before the rank ends
                tracker.flush()
            # rank 0's summary, sent once its checkpoint is in place: no rank returns before it is
            return TrainSummary(**distributed.share_summary(asdict(trained_summary) if ranks.leader else None, ranks))

        model.calibration = _fit_calibration(model, list(windows.tuning) or windows.train, schema, config, device,
                                             held_aside=bool(windows.tuning))
        figures, slices = _validate(model, windows.validation, schema, layout, config, device)
        # not on a thread beside the loop: on 2 CPU cores the GIL made both slower (an incremental run 14.9 s
        # beside against 9.8 s after; benchmarks/RESULTS.md)
        baseline_figures = baselines.window_baselines(layout, windows.validation, schema) if config.baselines else {}
        summary = replace(
            trained_summary, auc=figures["auc"], logloss=figures["logloss"], calibration=figures["calibration"],
            oracle_auc=figures.get("oracle_auc"), validation_rows=figures["rows"], slices=slices,
            ndcg=figures["ndcg"], baselines=baseline_figures,
            early_stopping={**(position.get("early_stopping") or {}), "files": [f.stem for f in windows.tuning]}
            if windows.tuning else {})
        save(completed=True, summary=summary)
    if tracker is not None:
        tracker.trained(summary)
    return summary


def complete(settings: Settings, run: Path | str, tracker: Tracker | None = None) -> TrainSummary:
    """Complete, in this one process, a run that its ranks trained to the end: its tables put together from the
    ranks' shards of its last checkpoint (``checkpoint.load_weights``), calibrated and validated on the run's
    held-out hours as one process's run is, written whole as the run's completed checkpoint (the one registered
    and served), and the run's tracker told. No rank ever holds every table; this process does, as the one
    that registers the model (``recloop train --nproc N`` calls it once its ranks are done).

    Args:
        run: the run's folder, or the checkpoint a rank's ``train`` returned (its summary ``awaits_completion``).
        tracker: the run's tracker (``TrainingRun``: it takes up the MLflow run rank 0 kept while it trained).
    Returns:
        The run's summary (a completed run's, unchanged, when it was completed already).
    """
    state = checkpoint.read(run)
    run_dir = Path(state["path"]).parent
    done = checkpoint.completed_run(run_dir)
    if done is not None:
        return TrainSummary(**done["summary"])
    if not state.get(checkpoint.AWAITS_COMPLETION):
        raise TrainError(f"{state['path']} is not the last checkpoint of a run its ranks trained to the end: run "
                         "the same training again to resume it")
    layout = FeatureLayout.for_settings(settings)
    files = training_files(layout.training)
    schema = _schema(layout, files) if files else None
    if schema is None or schema.state_version != state["state_version"]:
        raise TrainError(f"the features changed since run {run_dir.name} trained (vocabulary version "
                         f"{schema.state_version if schema else None}, it trained on {state['state_version']}): "
                         "its held-out hours are not the ones it was meant to be judged on; train it again")
    config = TrainConfig(**{**state["train"], "model": ModelConfig.from_dict(state["train"]["model"])})
    trained = TrainSummary(**state["summary"])
    by_hour = {f.stem: f for f in files}
    lost = [hour for hour in (*trained.train_hours, *trained.validation_hours) if hour not in by_hour]
    if lost:
        raise TrainError(f"run {run_dir.name}'s training files {lost[:3]} are gone: it cannot be validated")
    windows = Windows([by_hour[h] for h in trained.train_hours], [by_hour[h] for h in trained.validation_hours],
                      config.epochs, tuple(trained.overrides))
    device = _device(config.device)
    model = RankingModel(ModelConfig.from_dict(state["model"]), len(state["dense"]),
                         [tuple(t) for t in state["tables"]], device=device, seed=config.seed)
    checkpoint.load_weights(model, Path(state["path"]), device)  # every rank's rows, put together here
    optimizer = dense_optimizer(model, config.dense_lr, device, config.weight_decay)
    checkpoint.load_optimizer(optimizer, state["path"], device)
    start = _run_start(trained.run_id, config, state["model"], windows, schema, trained.warm_start,
                       trained.resumed_from_step) if tracker is not None else None
    with _followed(tracker, start):
        model.calibration = _fit_calibration(model, windows.train, schema, config, device)
        figures, slices = _validate(model, windows.validation, schema, layout, config, device)
        baseline_figures = baselines.window_baselines(layout, windows.validation, schema) if config.baselines else {}
        summary = replace(trained, auc=figures["auc"], logloss=figures["logloss"], calibration=figures["calibration"],
                          oracle_auc=figures.get("oracle_auc"), validation_rows=figures["rows"], slices=slices,
                          ndcg=figures["ndcg"], baselines=baseline_figures, awaits_completion=False,
                          checkpoint=str(checkpoint.step_folder(run_dir, trained.steps)))  # where save puts it
        info = {key: value for key, value in state.items()
                if key not in ("optimizer", "completed", "path", checkpoint.AWAITS_COMPLETION)}
        info.update(calibration=list(model.calibration) if model.calibration else None, summary=asdict(summary))
        checkpoint.save(run_dir, trained.steps, model, optimizer, info, completed=True)
    if tracker is not None:
        tracker.trained(summary)
    return summary


def _schema(layout: FeatureLayout, files: list[Path]) -> FeatureSchema:
    """The features' schema, with the extra columns (oracle, slices) the training files carry."""
    present = set(pq.read_schema(files[0]).names)
    return FeatureSchema.load(layout.schema, extra=tuple(c for c in (*ORACLE_COLUMNS, *SLICE_COLUMNS) if c in present))


def _run_start(run_id: str, config: TrainConfig, model: dict, windows: Windows, schema: FeatureSchema,
               warm_start: str | None, resumed_from_step: int) -> RunStart:
    return RunStart(
        run_id=run_id, mode=config.mode, params={"train": config.to_dict(), "model": model},
        train_hours=[f.stem for f in windows.train], validation_hours=[f.stem for f in windows.validation],
        train_rows=sum(_rows(f) for f in windows.train), validation_rows=sum(_rows(f) for f in windows.validation),
        example=pq.read_table(windows.train[-1]).slice(0, 5).to_pandas(), state_version=schema.state_version,
        warm_start=warm_start, resumed_from_step=resumed_from_step)


def _stage_checkpoint(run_dir: Path, step: int) -> Path:
    """This step's staging folder, made empty by rank 0 and named to every rank (collective)."""
    import torch.distributed as dist

    box = [None]
    if dist.get_rank() == 0:
        staging = checkpoint.staging_folder(run_dir, checkpoint.step_folder(run_dir, step))
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        box = [str(staging)]
    dist.broadcast_object_list(box, src=0)
    return Path(box[0])


@contextmanager
def _followed(tracker: Tracker | None, start: RunStart | None):
    """The tracker told of the run's start, and of its failure if it stops on an error."""
    if tracker is None:
        yield
        return
    tracker.started(start)
    try:
        yield
    except BaseException as error:
        tracker.failed(error)
        raise


def dense_rate(config: TrainConfig, batch_size: int) -> float:
    """The dense layers' Adam rate at ``batch_size`` rows a step: ``config.dense_lr``, scaled by sqrt(batch/reference)
    above ``reference_batch`` (never down below it: see ``TrainConfig.lr``)."""
    return config.dense_lr * math.sqrt(max(batch_size, config.reference_batch) / config.reference_batch)


def warmup_factor(config: TrainConfig, planned_steps: int, warm: bool) -> Callable[[int], float]:
    """step → the warm-up's share of the rate (and of the embedding penalty): linear over ``warmup_share`` of the
    planned steps, at most ``warmup_steps``; 1 throughout for a warm-started model (already past its warm-up)."""
    length = max(1, min(config.warmup_steps, math.ceil(config.warmup_share * planned_steps)))
    return lambda step: 1.0 if warm else min(1.0, (step + 1) / length)


def _fit_sharded(trained: torch.nn.Module, optimizer: torch.optim.Optimizer, windows: Windows, schema: FeatureSchema,
                 config: TrainConfig, device: torch.device, position: dict, warm: bool, save: Callable[[bool], Path],
                 ranks: distributed.Ranks, on_progress: Callable[[int, int, float], None] | None,
                 on_step: Callable[[int], None] | None, tracker: Tracker | None) -> list[list[float]]:
    """``_fit`` over data shards: this rank's shards of the row groups (``recloop.distributed``)."""
    if config.data_shards % ranks.world:
        raise TrainError(f"data_shards={config.data_shards} must be a multiple of the {ranks.world} processes")
    per_rank = config.data_shards // ranks.world
    shards = distributed.shard_row_groups(windows.train, config.data_shards)[ranks.rank * per_rank:
                                                                           (ranks.rank + 1) * per_rank]
    batch_size = config.batch_size or default_batch_size(device)
    local_batch = max(1, batch_size // config.data_shards)
    loaders = [distributed.ShardLoader(pieces, schema, local_batch, seed=config.seed + ranks.rank * per_rank + k,
                                       device=device) for k, pieces in enumerate(shards)]
    planned = math.ceil(sum(loader.num_rows for loader in loaders) * ranks.world / batch_size) * windows.epochs
    warmup = warmup_factor(config, planned, warm)

    def lr(step: int) -> float:
        return dense_rate(config, batch_size) * warmup(step)

    return distributed.fit(trained, optimizer, loaders, len(schema.tables), windows.epochs, ranks, lr, position,
                           save, config.checkpoint_every, on_progress, on_step,
                           tracker.progress if tracker is not None else None)


def _fit(model: RankingModel, optimizer: torch.optim.Optimizer, windows: Windows, schema: FeatureSchema,
         config: TrainConfig, device: torch.device, position: dict, warm: bool, save: Callable[[bool], Path],
         on_progress: Callable[[int, int, float], None] | None,
         on_step: Callable[[int], None] | None, tracker: Tracker | None = None,
         run_dir: Path | None = None, id_dropout: dict[str, float] | None = None) -> list[list[float]]:
    """The training loop from ``position`` (updated in place) to the last epoch, or to early stopping; returns
    the loss curve (``[step, loss]`` every 10 steps). Checkpoints every ``checkpoint_every`` steps through
    ``save``; the tracker gets each loss reading as it lands and each epoch's end.

    With early-stopping rows (``windows.tuning``) each epoch ends with their log loss (and, after the first,
    ``early_stopping_checks`` checks within it); the best check's weights are kept in
    ``run_dir/best.safetensors`` and its figures in ``position["early_stopping"]`` (so a resumed run knows
    them), and restored at the end when the last weights did worse beyond noise (``restore_z``)."""
    batch_size = config.batch_size or default_batch_size(device)
    # On a GPU, ids are padded to a few bucketed lengths (the loader's default) so the step replays CUDA graphs.
    loader = ChunkLoader(windows.train, schema, batch_size, device=device, seed=config.seed)
    total = loader.num_rows * windows.epochs
    rate = dense_rate(config, batch_size)
    warmup_at = warmup_factor(config, math.ceil(loader.num_rows / batch_size) * windows.epochs, warm)
    started, first_samples = time.perf_counter(), position["samples"]
    model.train()
    # One compiled graph, nothing read back per step: the loss every 10 steps and the id checks are
    # read at intervals (recloop.model.fit).
    dropped = tuple((model.table_names.index(table), rate) for table, rate in (id_dropout or {}).items() if rate > 0)
    step = TrainStep(model, optimizer, StepConfig(compile=config.compile, embedding_l2=config.embedding_penalty,
                                                  id_dropout=dropped, seed=config.seed), device,
                     first_step=position["step"])
    told = 0  # loss readings told to the tracker
    checking = bool(windows.tuning) and run_dir is not None
    steps_per_epoch = math.ceil(loader.num_rows / batch_size)
    check_every = math.ceil(steps_per_epoch / max(config.early_stopping_checks, 1))
    average = _WeightAverage(model, config.average_max_bytes) if checking and config.average_checks else None
    if average is not None:
        average.resume(run_dir, position["step"], device)

    def check(averaged: bool) -> bool:
        """An early-stopping check (whether to stop); its weights join the average unless it is the first."""
        stopped = _early_stopping(model, windows, schema, config, device, position, run_dir)
        if average is not None and averaged:
            average.add(model)
        return stopped

    stop = False
    for epoch in range(position["epoch"], windows.epochs):
        skip = position["batch"] if epoch == position["epoch"] else 0
        for batch_index, batch in enumerate(loader.epoch(epoch, skip_batches=skip), start=skip):
            warmup = warmup_at(position["step"])
            # the touched embedding rows update in the backward; their penalty warms up with the dense rate
            step(batch, rate * warmup, penalty_scale=warmup)
            position.update(step=position["step"] + 1, epoch=epoch, batch=batch_index + 1,
                            samples=position["samples"] + batch.size)
            if checking and epoch > 0 and (batch_index + 1) % check_every == 0 and batch_index + 1 < steps_per_epoch:
                stop = check(averaged=True)
            if position["step"] % config.checkpoint_every == 0:
                step.finish()  # the outstanding id check first: never checkpoint a run that met bad ids
                save(False)
                if average is not None:
                    average.persist(run_dir, position["step"])
            if position["step"] % 10 == 0 and on_progress:  # (``rate`` is the learning rate: not reused here)
                speed = (position["samples"] - first_samples) / (time.perf_counter() - started)
                on_progress(position["samples"], total, speed)
            if tracker is not None and len(step.loss_curve) > told:
                told = _tell_losses(tracker, step.loss_curve, told)
            if on_step:
                on_step(position["step"])
            if stop:
                break
        if not stop:
            position.update(epoch=epoch + 1, batch=0)
            if checking:
                stop = check(averaged=epoch > 0)
        if tracker is not None:
            stats = loader.stats  # where the epoch went: a loop that waited for chunks was data-bound
            figures = {"epoch": epoch + 1, "samples_per_s": round(
                (position["samples"] - first_samples) / max(time.perf_counter() - started, 1e-9), 1),
                "loader_wait_share": round(stats.consumer_wait_s / max(stats.epoch_s, 1e-9), 4),
                "loader_batching_share": round(stats.batching_s / max(stats.epoch_s, 1e-9), 4)}
            if checking and position.get("early_stopping"):
                figures["early_stopping_logloss"] = position["early_stopping"]["checks"][-1][1]
            tracker.progress(position["step"], figures)
        if stop:
            break
    step.finish()
    if average is not None and average.count >= 2:
        average.load_into(model)
        position.setdefault("early_stopping", {})["averaged_checks"] = average.count
    elif average is not None and average.why_not:
        position.setdefault("early_stopping", {})["averaged_checks"] = f"none: {average.why_not}"
    if windows.tuning and run_dir is not None:
        _restore_best(model, windows, schema, config, device, position, run_dir)
    if tracker is not None:
        _tell_losses(tracker, step.loss_curve, told)
    return step.loss_curve


BEST_WEIGHTS = "best.safetensors"
AVERAGE_WEIGHTS = "average.safetensors"


class _WeightAverage:
    """The running mean of a model's floating-point weights at the checks it is given (``add``); other
    tensors (ids, counters) keep the model's own values when the mean is loaded (``load_into``). One copy of
    the weights in their own dtype; none above ``max_bytes`` (``TrainConfig.average_max_bytes``), and none
    once a table changes shape (a table that grew mid-run). ``persist`` / ``resume``: the mean as of a
    checkpoint, so a resumed run ends on the same average as an uninterrupted one."""

    def __init__(self, model: torch.nn.Module, max_bytes: int = 1 << 30):
        state = {k: v for k, v in model.state_dict().items() if v.is_floating_point()}
        self.count = 0
        self.why_not = None
        if sum(v.numel() * v.element_size() for v in state.values()) > max_bytes:
            self.why_not = f"the weights exceed average_max_bytes ({max_bytes:,})"
        self.mean = {} if self.why_not else {k: torch.zeros_like(v) for k, v in state.items()}

    def add(self, model: torch.nn.Module) -> None:
        if not self.mean:
            return
        state = model.state_dict()
        if any(state.get(key) is None or state[key].shape != mean.shape for key, mean in self.mean.items()):
            self.mean, self.count = {}, 0
            self.why_not = "a table changed shape during the run"
            return
        self.count += 1
        with torch.no_grad():
            for key, mean in self.mean.items():
                mean.add_(state[key].detach() - mean, alpha=1.0 / self.count)

    def load_into(self, model: torch.nn.Module) -> None:
        model.load_state_dict({**model.state_dict(), **self.mean})

    def persist(self, run_dir: Path, step: int) -> None:
        from safetensors.torch import save_file

        if not self.mean or not self.count:
            return
        partial = run_dir / f".{AVERAGE_WEIGHTS}.{os.getpid()}.tmp"
        save_file({k: v.contiguous() for k, v in self.mean.items()}, partial,
                  metadata={"step": str(step), "count": str(self.count)})
        os.replace(partial, run_dir / AVERAGE_WEIGHTS)

    def resume(self, run_dir: Path, step: int, device: torch.device) -> None:
        """The mean persisted at checkpoint ``step``, if there is one (a later file belongs to checks this run
        makes again)."""
        from safetensors import safe_open

        path = run_dir / AVERAGE_WEIGHTS
        if not self.mean or step == 0 or not path.exists():
            return
        with safe_open(str(path), framework="pt", device=str(device)) as handle:
            meta = handle.metadata() or {}
            if meta.get("step") != str(step) or set(handle.keys()) != set(self.mean):
                return
            for key in self.mean:
                self.mean[key].copy_(handle.get_tensor(key))
        self.count = int(meta["count"])


def _early_stopping(model: RankingModel, windows: Windows, schema: FeatureSchema, config: TrainConfig,
                    device: torch.device, position: dict, run_dir: Path) -> bool:
    """Score the early-stopping rows now; keep the weights when they are the best yet. Returns whether to stop
    (``patience`` epochs' worth of checks without a lower log loss)."""
    from safetensors.torch import save_file

    losses = _tuning_losses(model, windows, schema, config, device)
    value = float(losses.mean()) if len(losses) else math.nan
    record = position.setdefault("early_stopping", {"rows": int(len(losses)), "checks": [], "best_step": 0,
                                                    "best_logloss": None})
    record["checks"].append([position["step"], round(float(value), 6)])
    best = record["best_logloss"] if record["best_logloss"] is not None else math.inf
    if math.isfinite(value) and value < best:
        record.update(best_step=position["step"], best_logloss=round(float(value), 6))
        run_dir.mkdir(parents=True, exist_ok=True)
        partial = run_dir / f".{BEST_WEIGHTS}.{os.getpid()}.tmp"
        save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, partial)
        os.replace(partial, run_dir / BEST_WEIGHTS)  # a reader sees the whole file or none
    since = sum(1 for at, _ in record["checks"] if at > record["best_step"])
    return since >= config.patience * max(config.early_stopping_checks, 1)


def _tuning_losses(model: RankingModel, windows: Windows, schema: FeatureSchema, config: TrainConfig,
                   device: torch.device) -> np.ndarray:
    """The log loss of each early-stopping row (N,) under ``model``, uncalibrated (the row order is fixed)."""
    return _row_losses(model, list(windows.tuning), schema, device,
                       max(config.batch_size or default_batch_size(device), 8192))


def _row_losses(model: RankingModel, files: list[Path], schema: FeatureSchema, device: torch.device,
                batch_size: int = 8192) -> np.ndarray:
    """The log loss of each row of ``files`` (N,) under ``model``, uncalibrated (the row order is fixed)."""
    loader = ChunkLoader(files, schema, batch_size, device=device, shuffle=False)
    was_calibrated, model.calibration = model.calibration, None
    labels, scores, _ = predict(model, loader.epoch(0))
    model.calibration = was_calibrated
    p = np.clip(scores.astype(np.float64), 1e-7, 1 - 1e-7)
    return -(labels * np.log(p) + (1 - labels) * np.log1p(-p))


LAST_WEIGHTS = "last.safetensors"


def _restore_best(model: RankingModel, windows: Windows, schema: FeatureSchema, config: TrainConfig,
                  device: torch.device, position: dict, run_dir: Path) -> None:
    """The best check's weights back into ``model`` when the last weights are worse on the early-stopping rows
    by ``restore_z`` standard errors of the paired per-row difference; otherwise the last weights stay
    (``position["early_stopping"]["restore_z"]`` says by how much)."""
    from safetensors.torch import save_file

    record = position.get("early_stopping") or {}
    if not (record.get("best_step") and record["best_step"] < position["step"] and (run_dir / BEST_WEIGHTS).exists()):
        return
    last = _tuning_losses(model, windows, schema, config, device)
    kept = run_dir / f".{LAST_WEIGHTS}.{os.getpid()}.tmp"
    save_file({k: v.detach().contiguous() for k, v in model.state_dict().items()}, kept)
    model.load_state_dict(load_file(run_dir / BEST_WEIGHTS, device=str(device)))
    difference = last - _tuning_losses(model, windows, schema, config, device)  # (N,) last minus best
    spread = float(difference.std(ddof=1)) / math.sqrt(len(difference)) if len(difference) > 1 else 0.0
    z = float(difference.mean()) / spread if spread > 0 else (math.inf if difference.mean() > 0 else 0.0)
    record["restore_z"] = round(z, 3) if math.isfinite(z) else z
    if z >= config.restore_z:
        record["restored_step"] = record["best_step"]
    else:
        model.load_state_dict(load_file(kept, device=str(device)))
    kept.unlink()


def _tell_losses(tracker: Tracker, curve: list[list[float]], told: int) -> int:
    """The loss readings after the first ``told`` to the tracker; returns how many it has been told."""
    for at, loss in curve[told:]:
        tracker.progress(int(at), {"train_loss": loss})
    return len(curve)


def _fit_calibration(model: RankingModel, files: list[Path], schema: FeatureSchema, config: TrainConfig,
                     device: torch.device, held_aside: bool = False) -> tuple[float, float] | None:
    """Platt scaling on the newest rows of ``files`` (up to ``config.calibration_rows``), never the held-out ones:
    slope and intercept on early-stopping rows (``held_aside``: the model never trained on them), else the
    intercept alone (``calibration_slope``: the slope too) on training rows."""
    from recloop.evidence.calibration import fit_platt

    if config.calibration_rows <= 0 or not files:
        return None
    model.calibration = None
    batch = max(config.batch_size or default_batch_size(device), 8192)
    # The newest rows (the base rate the model will serve at): the newest files holding calibration_rows, read
    # in order with their oldest batches skipped. An incremental run's files start with its replayed hours.
    newest, rows = [], 0
    for path in reversed(files[-24:]):
        newest.insert(0, path)
        rows += pq.ParquetFile(path).metadata.num_rows
        if rows >= config.calibration_rows:
            break
    loader = ChunkLoader(newest, schema, batch, device=device, shuffle=False)
    skip = max(0, rows - config.calibration_rows) // batch
    labels, scores, _ = predict(model, loader.epoch(0, skip_batches=skip))
    if len(labels) < 100 or labels.min() == labels.max() or not np.isfinite(scores).all():
        return None
    return fit_platt(labels, scores, slope=held_aside or config.calibration_slope)


def _validate(model: RankingModel, files: list[Path], schema: FeatureSchema, layout: FeatureLayout,
              config: TrainConfig, device: torch.device) -> tuple[dict, dict[str, dict[str, float]]]:
    """Metrics on the held-out hours, overall and per slice."""
    loader = ChunkLoader(files, schema, max(config.batch_size or default_batch_size(device), 8192), device=device,
                         shuffle=False)
    labels, scores, extras = predict(model, loader.epoch(0))
    figures = metrics(labels, scores, extras.get("p_click"))
    groups = user_groups(files, layout, len(labels))
    figures["ndcg"] = baselines.ndcg_by_group(labels, scores, groups)
    return figures, slice_metrics(labels, scores, slice_values(extras, layout))


def _user_key(layout: FeatureLayout) -> str | None:
    return json.loads(layout.schema.read_text()).get("user_key") if layout.schema.exists() else None


def user_groups(files: list[Path], layout: FeatureLayout, rows: int) -> np.ndarray | None:
    """The user key of each held-out row, in the order the loader reads them (None: no user key)."""
    user_key = _user_key(layout)
    if not user_key or not files or user_key not in pq.read_schema(files[0]).names:
        return None
    values = np.concatenate([pq.read_table(f, columns=[user_key])[user_key].to_numpy(zero_copy_only=False)
                             for f in files])
    return values if len(values) == rows else None


def slice_values(extras: dict[str, np.ndarray], layout: FeatureLayout) -> dict[str, np.ndarray]:
    """Readable slice labels per validation row: user new/returning, device and category by name."""
    from recloop.features.state import StateStore

    out = {}
    if "user_is_new" in extras:
        out["user"] = np.where(extras["user_is_new"].astype(bool), "new", "returning")
    state = StateStore(layout.state).latest()
    for column in ("c_device", "c_category"):
        if column not in extras:
            continue
        names = {}
        vocabulary = state.vocabularies.get(column[2:]) if state else None
        if vocabulary is not None:
            admitted = vocabulary.admitted().to_pydict()
            names = dict(zip(admitted["index"], admitted["value"], strict=True))
        out[column[2:]] = np.array([str(names.get(int(i), f"#{int(i)}")) for i in extras[column]])
    return out


def dense_sample(files: list[Path], schema: FeatureSchema, max_rows: int = 200_000) -> torch.Tensor:
    """The dense columns of the newest ``max_rows`` rows of ``files`` (N, n_dense), float32."""
    if not schema.dense or not files:
        return torch.zeros(0, len(schema.dense))
    return torch.from_numpy(baselines.dense_matrix(files, schema, max_rows))


def _build(config: TrainConfig, schema: FeatureSchema, device: torch.device, run_dir: Path, base: dict | None,
           train_files: list[Path] = (), ranks: distributed.Ranks | None = None):
    """The model and dense optimizer: resumed from this run, warm-started from ``base``, or new (its dense
    inputs standardized by the newest training rows'). Under several ranks, each rank's model holds its shards
    of the tables only (``distributed.rank_model``: its rows of what one process would start from)."""
    ranks = ranks or distributed.Ranks()
    # Row budgets: the features' (per column) and the model configuration's (per table; it wins).
    budgets = tuple({**dict(schema.budgets), **dict(config.model.max_rows)}.items())
    model_config = ModelConfig.from_dict({**config.model.to_dict(), "multi_hot_columns": tuple(schema.multi_hot),
                                          "max_rows": budgets})
    tables = schema.tables
    dynamic = {name for name, _ in budgets}
    source, resumed = None, None
    if (run_dir / "latest.json").exists():
        source = checkpoint.read(run_dir)
        resumed = source["position"]
    elif base is not None:
        source = base
        if base["state_version"] > schema.state_version:
            raise TrainError(f"checkpoint {base['path']} was trained on vocabulary version {base['state_version']}, "
                             f"newer than the features' version {schema.state_version}")
    grown: dict[str, list[int]] = {}
    budgeted = [name for name, _ in tables if name in dynamic]
    if ranks.world > 1 and budgeted:
        raise TrainError(f"tables {budgeted} have row budgets: dynamic tables train in one process with one data "
                         "shard (sharding them is not built yet)")
    row_wise_above = config.row_wise_above or None
    if source is None:
        model = distributed.rank_model(model_config, len(schema.dense), tables, device, config.seed, ranks,
                                       row_wise_above) if ranks.world > 1 else \
            RankingModel(model_config, len(schema.dense), tables, device=device, seed=config.seed)
        model.dense_arch.standardize_from(dense_sample(train_files, schema).to(device))
    else:
        old_tables = [tuple(t) for t in source["tables"]]
        current = dict(tables)
        source_config = ModelConfig.from_dict(source["model"])
        if {name for name, _ in source_config.max_rows} != dynamic:
            raise TrainError(f"checkpoint {source['path']} has row budgets on {sorted(dict(source_config.max_rows))}, "
                             f"the features and model configuration on {sorted(dynamic)}; retrain with --mode full")
        # A dynamic table's rows are a budget, not a vocabulary's size: nothing to compare or grow.
        current.update({name: rows for name, rows in old_tables if name in dynamic})
        rehashed = [name for name, rows in old_tables if name in schema.hashed and current.get(name) != rows]
        if rehashed:  # a vocabulary grows (new ids get new rows); buckets renumber every id when their count moves
            raise TrainError(f"checkpoint {source['path']} hashed {rehashed} into other bucket counts "
                             f"({[dict(old_tables)[n] for n in rehashed]} vs {[current[n] for n in rehashed]} rows): "
                             "every id's row moved; retrain with --mode full")
        if [name for name, _ in old_tables] != [name for name, _ in tables] or any(
                rows > current[name] for name, rows in old_tables) or source["dense"] != list(schema.dense):
            raise TrainError(f"checkpoint {source['path']} does not match the features: its tables "
                             f"{old_tables} vs {tables} (vocabulary version {source['state_version']} vs "
                             f"{schema.state_version}); retrain with --mode full")
        if ranks.world > 1:  # this rank's rows of the source's tables, the grown rows as one process draws them
            model = distributed.rank_model(source_config, len(schema.dense), [(n, current[n]) for n, _ in old_tables],
                                           device, config.seed, ranks, row_wise_above, start=old_tables,
                                           source=Path(source["path"]), resumed=resumed is not None)
        else:
            model = RankingModel(source_config, len(schema.dense), old_tables, device=device, seed=config.seed)
            if source.get("table_log"):  # a periodic checkpoint: its tables are in the run's table log
                tensors = load_file(Path(source["path"]) / "model.safetensors", device=str(device))
                missing, unexpected = model.load_state_dict(tensors, strict=False)
                if unexpected or any(not key.startswith(TABLES_PREFIX) for key in missing):
                    raise TrainError(f"checkpoint {source['path']} does not fit the model: {missing + unexpected}")
                checkpoint.restore_tables(Path(source["path"]).parent / "tables", model.embeddings,
                                          upto=source["table_log"], drop_later=resumed is not None)
            else:
                checkpoint.load_weights(model, Path(source["path"]), device)
        if resumed is not None:  # the run's own checkpoint: its tables grew from the base already (it says how)
            grown = {name: list(change) for name, change in (source.get("grown_tables") or {}).items()}
        for name, rows in old_tables:
            if current[name] > rows:
                if ranks.world == 1:  # (a rank's shards were built at the new size)
                    model.embeddings.grow(name, current[name])
                grown[name] = [grown.get(name, [rows])[0], current[name]]
        if resumed is None and config.warm_state_decay != 1.0:
            held = model.embeddings.local if ranks.world > 1 else model.embeddings
            with torch.no_grad():
                if held is not None:
                    held.state1.mul_(config.warm_state_decay)
    optimizer = dense_optimizer(model, config.dense_lr, device, config.weight_decay)  # fused AdamW on a GPU
    if source is not None:
        checkpoint.load_optimizer(optimizer, source["path"], device)
    return model, optimizer, grown, resumed


