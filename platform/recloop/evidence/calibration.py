"""Platt scaling: ``p = sigmoid(a * logit(score) + b)`` fitted by maximum likelihood on training rows.

A model trained on modest data is often mis-calibrated (mean prediction / base rate 0.8 or 1.4) while it
ranks well; fitting two numbers on the *training* rows (never on the held-out window the gate scores)
corrects the level without touching the order.

Example::

    a, b = fit_platt(train_labels, train_scores)
    calibrated = apply_platt(scores, a, b)
"""

from __future__ import annotations

import numpy as np
from scipy import optimize


def _logit(p):
    p = np.clip(np.asarray(p, dtype=np.float64), 1e-7, 1 - 1e-7)
    return np.log(p / (1 - p))


def fit_platt(labels, scores, max_rows: int = 500_000, seed: int = 0, slope: bool = True) -> tuple[float, float]:
    """The (a, b) that minimise log loss of ``sigmoid(a * logit(scores) + b)`` on these rows.

    ``slope=False`` fits ``b`` only (a = 1): the base-rate correction. Fitted on rows the model was trained
    on, a slope learns the model's confidence *on its own training data* and over-sharpens it on new data;
    the intercept only moves the level to the training base rate."""
    y = np.asarray(labels, dtype=np.float64)
    x = _logit(scores)
    if len(y) > max_rows:
        pick = np.random.default_rng(seed).choice(len(y), max_rows, replace=False)
        y, x = y[pick], x[pick]
    if not len(y) or y.min() == y.max():
        return 1.0, 0.0

    def loss(params):
        a, b = (params[0], params[1]) if slope else (1.0, params[0])
        z = a * x + b
        value = np.logaddexp(0, z) - y * z
        p = 1 / (1 + np.exp(-z))
        gradient = [((p - y) * x).mean(), (p - y).mean()] if slope else [(p - y).mean()]
        return value.mean(), np.array(gradient)

    done = optimize.minimize(loss, np.array([1.0, 0.0] if slope else [0.0]), jac=True, method="L-BFGS-B")
    return (float(done.x[0]), float(done.x[1])) if slope else (1.0, float(done.x[0]))


def apply_platt(scores, a: float, b: float) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-(a * _logit(scores) + b)))
