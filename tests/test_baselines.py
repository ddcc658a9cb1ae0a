"""The gate's baseline rule as a paired test (``recloop.baselines.paired_failures``): a model is refused for a
baseline only when it is shown behind it on the same rows, not when a window's noise puts it a hair below."""

from __future__ import annotations

import numpy as np

from recloop.baselines import failures, paired_failures
from recloop.evaluate import auc, log_loss


def _rows(seed: int = 0, rows: int = 4000, users: int = 400):
    rng = np.random.default_rng(seed)
    user = rng.integers(0, users, rows)
    signal = rng.normal(size=rows) + rng.normal(size=users)[user]
    labels = (rng.random(rows) < 1 / (1 + np.exp(-(signal - 1)))).astype(np.float64)
    logistic = 1 / (1 + np.exp(-(signal - 1)))  # the true probabilities: a baseline as good as it gets here
    return labels, user, signal, logistic


def test_a_model_level_with_a_baseline_is_not_refused_on_the_noise_of_its_window():
    labels, users, signal, logistic = _rows()
    rng = np.random.default_rng(1)
    ctr = signal + rng.normal(scale=0.3, size=len(signal))
    logistic = 1 / (1 + np.exp(-(signal + rng.normal(scale=0.3, size=len(signal)) - 1)))  # the same noise
    model = 1 / (1 + np.exp(-(signal + rng.normal(scale=0.31, size=len(signal)) - 1)))  # as good, by its own noise
    baselines = {"ctr": {"auc": auc(labels, ctr), "scores": ctr},
                 "logistic": {"auc": auc(labels, logistic), "logloss": log_loss(labels, logistic), "scores": logistic}}
    model_auc = auc(labels, model)
    assert model_auc < baselines["ctr"]["auc"]  # a hair behind on these rows ...
    assert failures(model_auc, baselines, 0.0)  # ... which the point estimate refused
    reasons, figures = paired_failures(labels, model, users, baselines, 0.0, None)
    assert reasons == [], reasons  # not shown behind: level within the window's noise
    ctr_figure = figures["ctr"]["auc"]
    assert ctr_figure["low"] < ctr_figure["difference"] < 0 < ctr_figure["high"] and ctr_figure["users"] == 400


def test_a_model_shown_behind_a_baseline_on_auc_or_log_loss_is_refused_with_the_interval():
    labels, users, signal, logistic = _rows()
    rng = np.random.default_rng(2)
    worse = 1 / (1 + np.exp(-(signal + rng.normal(scale=2.0, size=len(signal)) - 1)))
    baselines = {"logistic": {"auc": auc(labels, logistic), "scores": logistic}}
    reasons, figures = paired_failures(labels, worse, users, baselines, 0.0, 0.0)
    assert any(r.startswith("auc ") and "is shown below the logistic baseline's" in r and "resampled by user" in r
               for r in reasons), reasons
    assert any(r.startswith("log loss ") and "is shown worse than the logistic baseline's" in r for r in reasons)
    assert figures["logistic"]["auc"]["high"] < 0 < figures["logistic"]["logloss"]["low"]
    # a margin wider than the shortfall lets it through; None checks nothing
    assert paired_failures(labels, worse, users, baselines, 0.5, None)[0] == []
    assert paired_failures(labels, worse, users, baselines, None, None) == ([], {})


def test_without_a_user_key_every_row_is_its_own_unit():
    """The gate's rows carry user 0 everywhere when the spec has no user key (Criteo's): one unit, an interval of
    ±inf, and nothing was ever refused. Rows are resampled instead."""
    labels, _, signal, logistic = _rows()
    worse = 1 / (1 + np.exp(-(signal + np.random.default_rng(3).normal(scale=2.0, size=len(signal)) - 1)))
    reasons, figures = paired_failures(labels, worse, np.zeros(len(labels)), {"logistic": {"scores": logistic}},
                                       0.0, None)
    assert any("resampled by row" in r for r in reasons), reasons
    assert np.isfinite(figures["logistic"]["auc"]["low"]) and figures["logistic"]["auc"]["users"] == len(labels)
