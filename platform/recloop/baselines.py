"""Simple baselines scored on the same held-out window as the model: what the model has to beat.

- ``base_rate``: every row gets the training rows' positive rate (AUC 0.5; its log loss is the floor
  any model must get under);
- ``ctr``: a ranking by the user's smoothed click-through rate plus the item's (``d_user_ctr + d_item_ctr``,
  features the feature job computes strictly before each event); without entities, the item's popularity;
- ``logistic``: a scikit-learn logistic regression on the model's own inputs (the dense ``d_*`` columns,
  one-hot ``c_*`` ids and bags of ``m_*`` ids), fitted on the newest training rows before the window.

Each is reported with AUC, log loss (where it predicts probabilities) and NDCG@10 per user (where the rows
carry the user key). The gate report and the training summary list them next to the model (``recloop gate``,
``recloop train``, the replay's report).

What the model has to beat does not depend on how it was trained: ``window_baselines`` learns from the
newest rows *before* the held-out window, whatever the run trained on (a full window, or one day and its
replayed hours), and keeps its figures in ``features/baselines/`` under a key of the files' names, sizes and
modification times. The training run and the gate that judges it score the same window, so the loop fits
the logistic regression once per window, not twice; a rewritten feature file changes the key.

Example::

    figures = score_baselines(train_files, held_out_files, schema, user_key="customer")
    figures["logistic"]["auc"]
    window_baselines(FeatureLayout.for_settings(settings), held_out_files, schema)  # the same, cached
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from recloop.evaluate import auc, log_loss

if TYPE_CHECKING:
    from recloop.features.definition import FeatureLayout

MAX_TRAIN_ROWS = 200_000
NDCG_K = 10
CACHE_ENTRIES = 64  # windows kept in features/baselines/ (a day of hourly gates and retrains, twice over)


def ndcg_by_group(
    labels: np.ndarray, scores: np.ndarray, groups: np.ndarray | None, k: int = NDCG_K
) -> float:
    """Mean NDCG@k over groups (users) with at least one positive and two rows; NaN when there are none."""
    if groups is None or len(labels) == 0:
        return math.nan
    order = np.lexsort((-scores, groups))
    g, y = groups[order], labels[order]
    starts = np.flatnonzero(np.r_[True, g[1:] != g[:-1]])
    ends = np.r_[starts[1:], len(g)]
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    values = []
    for start, end in zip(starts, ends, strict=True):
        gains = y[start:end]
        if end - start < 2 or gains.sum() == 0:
            continue
        top = gains[:k]
        ideal = np.sort(gains)[::-1][:k]
        values.append(float((top * discounts[: len(top)]).sum() / (ideal * discounts[: len(ideal)]).sum()))
    return float(np.mean(values)) if values else math.nan


def figures(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray | None, probabilities: bool) -> dict:
    """AUC, log loss (for probabilities), NDCG@10 per group and the row count of one set of scores."""
    out = {
        "auc": auc(labels, scores),
        "ndcg": ndcg_by_group(labels, scores, groups),
        "rows": int(len(labels)),
    }
    out["logloss"] = log_loss(labels, scores) if probabilities else None
    return out


def _newest(files: Sequence[Path], max_rows: int) -> list[Path]:
    """The newest of ``files`` (in their order) that together hold ``max_rows`` rows."""
    files = list(files)
    total, first = 0, len(files)
    while first > 0 and total < max_rows:
        first -= 1
        total += pq.ParquetFile(files[first]).metadata.num_rows
    return files[first:]


def _read(files: Sequence[Path], columns: list[str], max_rows: int | None = None) -> pa.Table:
    """The columns of the files (the newest ``max_rows`` rows when given), in file order."""
    import pyarrow.dataset as ds

    files = _newest(files, max_rows) if max_rows is not None else list(files)
    if not files:
        return pa.table({})
    present = [c for c in columns if c in pq.read_schema(files[-1]).names]
    # One schema for all: files with int32 ids (formats.id_dtype) next to older int64 ones read as int64.
    schema = pa.unify_schemas([pq.read_schema(f) for f in files], promote_options="permissive")
    table = ds.dataset([str(f) for f in files], schema=schema, format="parquet").to_table(columns=present)
    return table.slice(max(0, table.num_rows - max_rows)) if max_rows is not None else table


def dense_matrix(files: Sequence[Path], schema, max_rows: int) -> np.ndarray:
    """The dense columns of the newest ``max_rows`` rows of ``files`` as a float32 matrix, NaN as 0."""
    table = _read(files, list(schema.dense), max_rows)
    return np.column_stack([np.nan_to_num(table[c].to_numpy(zero_copy_only=False).astype(np.float32))
                            for c in schema.dense]) if table.num_rows else np.zeros((0, len(schema.dense)), np.float32)


def _design(table: pa.Table, schema) -> tuple:
    """The logistic regression's inputs: dense columns, then one-hot ids and bags of list ids (sparse).

    float32: L-BFGS's 100 iterations over 200k rows took 3.0 s against 7.4 s in float64, held-out AUC
    0.6317 against 0.6306 (benchmarks/RESULTS.md)."""
    from scipy import sparse

    n = table.num_rows
    blocks = []
    if schema.dense:
        dense = np.column_stack(
            [np.nan_to_num(table[c].to_numpy(zero_copy_only=False).astype(np.float32)) for c in schema.dense]
        )
        blocks.append(sparse.csr_matrix(np.clip(dense, -10, 10)))
    for name, size in schema.categorical.items():
        ids = np.clip(table[name].to_numpy(zero_copy_only=False).astype(np.int64), 0, size - 1)
        blocks.append(sparse.csr_matrix((np.ones(n, dtype=np.float32), (np.arange(n), ids)), shape=(n, size)))
    for name, size in schema.multi_hot.items():
        lists = table[name].combine_chunks()
        flat = np.clip(pc.list_flatten(lists).to_numpy(zero_copy_only=False).astype(np.int64), 0, size - 1)
        rows = pc.list_parent_indices(lists).to_numpy()
        lengths = np.maximum(pc.list_value_length(lists).fill_null(0).to_numpy(), 1).astype(np.float32)
        blocks.append(sparse.csr_matrix((1.0 / lengths[rows], (rows, flat)), shape=(n, size)))
    return (sparse.hstack(blocks, format="csr", dtype=np.float32) if blocks
            else sparse.csr_matrix((n, 0), dtype=np.float32))


def score_baselines(
    train_files: Sequence[Path],
    held_out: Sequence[Path],
    schema,
    user_key: str | None = None,
    max_train_rows: int = MAX_TRAIN_ROWS,
    with_scores: bool = False,
) -> dict[str, dict]:
    """The baselines' figures on ``held_out`` (see the module docstring); the logistic regression and the base
    rate learn from the newest ``max_train_rows`` rows of ``train_files``. ``with_scores``: each baseline's
    entry also holds its per-row ``scores`` (held-out rows in file order; arrays, so not JSON)."""
    from sklearn.linear_model import LogisticRegression

    inputs = [schema.label, *schema.dense, *schema.categorical, *schema.multi_hot]
    extra = [user_key] if user_key else []
    test = _read(held_out, inputs + extra)
    train = _read(train_files, inputs, max_train_rows)
    y_test = test[schema.label].to_numpy(zero_copy_only=False).astype(np.float64)
    y_train = (
        train[schema.label].to_numpy(zero_copy_only=False).astype(np.float64) if train.num_rows else y_test
    )
    groups = (
        test[user_key].to_numpy(zero_copy_only=False) if user_key and user_key in test.column_names else None
    )
    rate = float(y_train.mean()) if len(y_train) else 0.5
    out = {"base_rate": {**figures(y_test, np.full(len(y_test), rate), groups, True), "rate": rate}}

    names = set(test.column_names)
    if {"d_user_ctr", "d_item_ctr"} <= names:
        ctr = test["d_user_ctr"].to_numpy(zero_copy_only=False) + test["d_item_ctr"].to_numpy(
            zero_copy_only=False
        )
        out["ctr"] = {
            **figures(y_test, ctr.astype(np.float64), groups, False),
            "inputs": "d_user_ctr + d_item_ctr",
            **({"scores": ctr.astype(np.float64)} if with_scores else {}),
        }
    elif "d_item_ctr" in names:
        out["ctr"] = {
            **figures(
                y_test, test["d_item_ctr"].to_numpy(zero_copy_only=False).astype(np.float64), groups, False
            ),
            "inputs": "d_item_ctr",
            **({"scores": test["d_item_ctr"].to_numpy(zero_copy_only=False).astype(np.float64)}
               if with_scores else {}),
        }

    if train.num_rows >= 20 and 0 < y_train.sum() < len(y_train):
        # L-BFGS at its 100 iterations: on the demo's 107k training rows 0.8 s and held-out AUC 0.686, where
        # liblinear to convergence took 7.7 s for 0.684 (two thirds of a training run's wall time went here);
        # on float32 inputs (``_design``)
        model = LogisticRegression(C=1.0, solver="lbfgs", max_iter=100)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # convergence warnings: the figures say how good it is
            model.fit(_design(train, schema), y_train)
            p = model.predict_proba(_design(test, schema))[:, 1]
        out["logistic"] = {**figures(y_test, p, groups, True), "train_rows": int(train.num_rows),
                           **({"scores": p} if with_scores else {})}
    return out


def window_baselines(layout: FeatureLayout, held_out: Sequence[Path], schema,
                     max_train_rows: int = MAX_TRAIN_ROWS, with_scores: bool = False) -> dict[str, dict]:
    """``score_baselines`` on ``held_out``, learning from the layout's training files before its first hour;
    read from ``features/baselines/`` when the same files (names, sizes, modification times) were scored
    before (the figures as JSON, each baseline's per-row scores beside them as ``.npz``). ``{}`` without
    held-out files. ``with_scores``: each entry with per-row scores holds them (``scores``, rows in file order)."""
    held_out = sorted(Path(f) for f in held_out)
    if not held_out:
        return {}
    before = sorted(p for p in layout.training.glob("*.parquet") if p.stem < held_out[0].stem)
    user_key = json.loads(layout.schema.read_text()).get("user_key") if layout.schema.exists() else None
    learned_from = _newest(before, max_train_rows)
    identity = {
        "train": [_stamp(f) for f in learned_from], "held_out": [_stamp(f) for f in held_out],
        "max_train_rows": max_train_rows, "user_key": user_key, "label": schema.label, "dense": list(schema.dense),
        "categorical": dict(schema.categorical), "multi_hot": dict(schema.multi_hot),
    }
    key = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:24]
    cache = layout.root / "baselines"
    path = cache / f"{key}.json"
    found = _cached(path, with_scores)
    if found is None:  # not scored yet (or a torn file from a crash, or figures kept before their scores were)
        found = score_baselines(before, held_out, schema, user_key, max_train_rows, with_scores=True)
        _keep(path, found)
    if not with_scores:
        return {name: {k: v for k, v in entry.items() if k != "scores"} for name, entry in found.items()}
    return found


def _cached(path: Path, with_scores: bool) -> dict[str, dict] | None:
    """``window_baselines``' cache entry at ``path`` (with the per-row scores beside it when asked), or None."""
    try:
        figures_ = json.loads(path.read_text())
        if with_scores:
            with np.load(path.with_suffix(".npz"), allow_pickle=False) as saved:
                figures_ = {name: {**entry, **({"scores": saved[name]} if name in saved.files else {})}
                            for name, entry in figures_.items()}
        return figures_
    except (OSError, ValueError, KeyError):
        return None


def _keep(path: Path, scored: dict[str, dict]) -> None:
    """Write ``scored`` (entries with per-row ``scores``) as the cache entry at ``path``: the scores as ``.npz``
    first, then the figures as JSON, each atomically (figures found mean their scores are there); the oldest
    entries beyond ``CACHE_ENTRIES`` go."""
    cache = path.parent
    cache.mkdir(parents=True, exist_ok=True)
    partial = cache / f"{path.stem}.{os.getpid()}.tmp.npz"
    np.savez_compressed(partial, **{name: entry["scores"] for name, entry in scored.items() if "scores" in entry})
    partial.replace(path.with_suffix(".npz"))
    partial = path.with_suffix(f".{os.getpid()}.tmp")
    partial.write_text(json.dumps({name: {k: v for k, v in entry.items() if k != "scores"}
                                   for name, entry in scored.items()}, allow_nan=True))
    partial.replace(path)
    for stale in sorted(cache.glob("*.json"), key=lambda p: p.stat().st_mtime)[:-CACHE_ENTRIES]:
        stale.unlink(missing_ok=True)
        stale.with_suffix(".npz").unlink(missing_ok=True)
    for orphan in cache.glob("*.npz"):  # scores whose figures were never written (a crash between the two)
        if not orphan.with_suffix(".json").exists() and orphan.stat().st_mtime < time.time() - 3600:
            orphan.unlink(missing_ok=True)


def _stamp(path: Path) -> list:
    stat = path.stat()
    return [path.name, stat.st_size, stat.st_mtime_ns]


def best_auc(baselines: dict[str, dict]) -> tuple[str | None, float]:
    """The baseline with the highest AUC, and that AUC (NaN when none scored)."""
    scored = [
        (v["auc"], k) for k, v in baselines.items() if v.get("auc") is not None and math.isfinite(v["auc"])
    ]
    if not scored:
        return None, math.nan
    value, name = max(scored)
    return name, value


def paired_failures(labels: np.ndarray, model: np.ndarray, units: np.ndarray | None, baselines: dict[str, dict],
                    margin: float | None, logloss_margin: float | None = None,
                    resamples: int = 500) -> tuple[list[str], dict[str, dict]]:
    """Why the model loses to the baselines, judged on the same rows as a paired test: its AUC shown below a
    baseline's by more than ``margin`` (the paired bootstrap's 95 % interval over ``units``, users, entirely
    below ``-margin``), its log loss shown above the logistic regression's by more than ``logloss_margin``
    (None: that one is not checked). ``baselines``: entries with per-row ``scores`` on ``model``'s rows (in
    their order; ``window_baselines(..., with_scores=True)``). Returns the reasons and, per baseline, each
    comparison's model − baseline difference and interval (``{"ctr": {"auc": {...}}, "logistic": {"auc": ...,
    "logloss": ...}}``) for the report.

    The rule it replaces compared the point estimates, so a window's noise decided: on MovieLens 1M's replay
    it refused the first model at 0.7391 against the CTR baseline's 0.7393 on 2,000 rows (a model that went on
    to score 0.7813 against 0.7795 and the logistic regression's 0.7778 on the next week's 44,874 rows), and a
    full retrain at 0.7568 against 0.7571 (benchmarks/RESULTS.md)."""
    from recloop.evidence.ranking import paired_bootstrap, paired_logloss

    over = "user"
    if units is None or len(units) != len(labels) or len(np.unique(units)) < 2:  # no user key: every row its own
        units, over = np.arange(len(labels)), "row"
    reasons: list[str] = []
    figures_: dict[str, dict] = {}
    for name in ("ctr", "logistic"):
        scores = (baselines.get(name) or {}).get("scores")
        if margin is None or scores is None or len(scores) != len(labels):
            continue
        result = paired_bootstrap(labels, model, np.asarray(scores, dtype=np.float64), units, units, metric="auc",
                                  margin=margin, resamples=resamples)
        figures_.setdefault(name, {})["auc"] = _interval(result)
        if result.high < -margin:
            reasons.append(f"auc {result.candidate:.4f} is shown below the {name} baseline's {result.champion:.4f} "
                           f"on the same rows: {result.difference:+.4f} [{result.low:+.4f}, {result.high:+.4f}], "
                           f"resampled by {over}" + (f" (margin {margin})" if margin else ""))
    logistic = (baselines.get("logistic") or {}).get("scores")
    if logloss_margin is not None and logistic is not None and len(logistic) == len(labels):
        result = paired_logloss(labels, model, logistic, units, resamples=resamples)
        figures_.setdefault("logistic", {})["logloss"] = _interval(result)
        if result.low > logloss_margin:
            reasons.append(f"log loss {result.candidate:.4f} is shown worse than the logistic baseline's "
                           f"{result.champion:.4f} on the same rows: {result.difference:+.4f} [{result.low:+.4f}, "
                           f"{result.high:+.4f}], resampled by {over}" + (f" (margin {logloss_margin})" if logloss_margin else ""))
    return reasons, figures_


def _interval(result) -> dict:
    return {"difference": round(result.difference, 6), "low": round(result.low, 6), "high": round(result.high, 6),
            "users": result.units}


def failures(model_auc: float, baselines: dict[str, dict], margin: float | None, model_logloss: float = math.nan,
             logloss_margin: float | None = None) -> list[str]:
    """Why the model does not beat the baselines by their point estimates: its AUC below the best baseline's
    minus ``margin``, its log loss above the logistic regression's plus ``logloss_margin`` (None: that one is
    not checked). Where the rows' scores are at hand the gate judges by ``paired_failures`` instead."""
    out = []
    name, value = best_auc(baselines)
    if margin is not None and name is not None and math.isfinite(model_auc) and model_auc < value - margin:
        out.append(f"auc {model_auc:.4f} does not beat the {name} baseline's {value:.4f} on the same rows"
                   + (f" (margin {margin})" if margin else ""))
    logistic = (baselines.get("logistic") or {}).get("logloss")
    if logloss_margin is not None and logistic is not None and math.isfinite(logistic) and \
            math.isfinite(model_logloss) and model_logloss > logistic + logloss_margin:
        out.append(f"log loss {model_logloss:.4f} is worse than the logistic baseline's {logistic:.4f} on the same "
                   "rows" + (f" (margin {logloss_margin})" if logloss_margin else ""))
    return out


def report_markdown(model_figures: dict, baselines: dict[str, dict]) -> str:
    """The model next to the baselines, one row each (for the gate report, the training run, the replay)."""

    def cell(value) -> str:
        return (
            "-"
            if value is None or (isinstance(value, float) and not math.isfinite(value))
            else f"{value:.4f}"
        )

    def interval(figure: dict | None) -> str:
        return "-" if not figure else f"{figure['difference']:+.4f} [{figure['low']:+.4f}, {figure['high']:+.4f}]"

    paired = any("paired" in scores for scores in baselines.values())
    lines = [
        "",
        "## Baselines on the same held-out rows",
        "",
        "| model | AUC | log loss | NDCG@10 |" + (" model − it, AUC | model − it, log loss |" if paired else ""),
        "| --- | --- | --- | --- |" + (" --- | --- |" if paired else ""),
        f"| **model** | {cell(model_figures.get('auc'))} | {cell(model_figures.get('logloss'))} | "
        f"{cell(model_figures.get('ndcg'))} |" + (" | |" if paired else ""),
    ]
    for name, scores in baselines.items():
        mine = scores.get("paired") or {}
        lines.append(
            f"| {name} | {cell(scores.get('auc'))} | {cell(scores.get('logloss'))} | "
            f"{cell(scores.get('ndcg'))} |" + (f" {interval(mine.get('auc'))} | {interval(mine.get('logloss'))} |"
                                              if paired else "")
        )
    if paired:
        lines += ["", "Differences paired on the gate's rows, 95 % intervals resampled by user: a baseline refuses "
                  "the model only when the model is shown behind it (the whole interval below the margin)."]
    return "\n".join(lines) + "\n"
