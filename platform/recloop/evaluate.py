"""Offline metrics of a click model: AUC, log loss, calibration, and the oracle's AUC on the same rows.

Pure functions over arrays, plus ``predict`` that runs a model over a loader.

Example::

    labels, scores, extra = predict(model, loader)
    metrics(labels, scores, oracle=extra.get("p_click"))
    # {'rows': 20000, 'auc': 0.71, 'logloss': 0.29, 'calibration': 1.02, 'oracle_auc': 0.74, ...}
"""

from __future__ import annotations

import numpy as np
import torch


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the ROC curve (scikit-learn's; ties count half). NaN if one class only."""
    from sklearn.metrics import roc_auc_score

    labels = np.asarray(labels).astype(bool)
    if labels.all() or not labels.any():
        return float("nan")
    return float(roc_auc_score(labels, np.asarray(scores, dtype=np.float64)))


def log_loss(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> float:
    """Mean binary cross-entropy (scikit-learn's), predictions clipped to ``[eps, 1 - eps]`` first."""
    from sklearn.metrics import log_loss as sklearn_log_loss

    p = np.clip(np.asarray(probabilities, dtype=np.float64), eps, 1 - eps)
    return float(sklearn_log_loss(np.asarray(labels, dtype=np.float64), p, labels=[0.0, 1.0]))


def metrics(labels: np.ndarray, probabilities: np.ndarray, oracle: np.ndarray | None = None) -> dict[str, float]:
    """AUC, log loss, calibration (mean prediction / mean label), NaN count, and the oracle's AUC."""
    labels = np.asarray(labels, dtype=np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64)
    bad = ~np.isfinite(probabilities)
    out = {
        "rows": int(len(labels)),
        "nan_predictions": int(bad.sum()),
        "positive_rate": float(labels.mean()) if len(labels) else float("nan"),
    }
    if bad.any() or not len(labels):
        out.update(auc=float("nan"), logloss=float("nan"), calibration=float("nan"))
    else:
        out.update(auc=auc(labels, probabilities), logloss=log_loss(labels, probabilities),
                   calibration=float(probabilities.mean() / max(labels.mean(), 1e-12)))
    if oracle is not None:  # known for simulated events only: served traffic fed back has none
        oracle = np.asarray(oracle, dtype=np.float64)
        known = np.isfinite(oracle)
        out["oracle_auc"] = auc(labels[known], oracle[known]) if known.any() else float("nan")
        out["auc_vs_oracle"] = out["auc"] / out["oracle_auc"] if out["oracle_auc"] == out["oracle_auc"] else float("nan")
    return out


@torch.no_grad()
def predict(model: torch.nn.Module, batches) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """Click probabilities of ``model`` over ``batches`` (an iterable of loader batches)."""
    was_training = model.training
    model.eval()
    labels, scores, extra = [], [], {}
    for batch in batches:
        with torch.autocast(batch.dense.device.type, dtype=torch.bfloat16, enabled=batch.dense.is_cuda):
            logits = model(batch.dense, batch.values, batch.offsets)
        scores.append(torch.sigmoid(logits.float()).cpu().numpy())
        labels.append(batch.label.cpu().numpy())
        for key, value in batch.extra.items():
            extra.setdefault(key, []).append(value.cpu().numpy())
    model.train(was_training)
    join = (lambda parts: np.concatenate(parts)) if labels else (lambda parts: np.array([]))
    return join(labels), join(scores), {k: np.concatenate(v) for k, v in extra.items()}


def slice_metrics(labels: np.ndarray, probabilities: np.ndarray, slices: dict[str, np.ndarray],
                  top_k: int = 5) -> dict[str, dict[str, float]]:
    """Metrics per slice, so a regression on one slice cannot hide in the average.

    Args:
        slices: per slicing column, the value of every row (e.g. ``{"device": [...], "user_is_new": [...]}``);
            each of the ``top_k`` most frequent values of a column is one slice, named ``column=value``.
    """
    out = {}
    for column, values in slices.items():
        values = np.asarray(values)
        kinds, counts = np.unique(values, return_counts=True)
        for value in kinds[np.argsort(-counts, kind="stable")][:top_k]:
            mask = values == value
            out[f"{column}={value}"] = metrics(np.asarray(labels)[mask], np.asarray(probabilities)[mask])
    return out
