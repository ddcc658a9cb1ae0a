"""The gate's decision, table-driven: every rule can fail on its own, with the right reason."""

from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest

from recloop.evaluate import slice_metrics
from recloop.gate import GateThresholds, ModelScores, decide

GOOD = {"auc": 0.70, "logloss": 0.30, "calibration": 1.0, "nan_predictions": 0, "rows": 5000, "positive_rate": 0.1}
SLICES = {"device=mobile": {"auc": 0.70, "rows": 3000}, "device=tablet": {"auc": 0.68, "rows": 500},
          "user_is_new=True": {"auc": 0.60, "rows": 100}}
CHAMPION = ModelScores(GOOD, SLICES)
T = GateThresholds()


def scores(slices=None, **overall) -> ModelScores:
    return ModelScores({**GOOD, **overall}, {**SLICES, **(slices or {})})


CASES = [
    # id, candidate, champion, mode, passed, reason fragment
    ("first-model-passes-floors", scores(), None, "full", True, None),
    ("first-model-below-auc-floor", scores(auc=0.52), None, "full", False, "auc 0.5200 below the floor 0.55"),
    ("shuffled-labels", scores(auc=0.50, logloss=0.69), CHAMPION, "full", False,
     "logloss 0.6900 above 0.3576 (1.1 × the log loss of predicting the base rate 0.100)"),
    ("the-log-loss-ceiling-follows-the-base-rate", scores(logloss=0.65, positive_rate=0.48), None, "full", True, None),
    ("worse-than-the-base-rate-at-48%", scores(logloss=0.77, positive_rate=0.48), None, "full", False,
     "× the log loss of predicting the base rate 0.480"),
    ("too-few-held-out-rows", scores(rows=13, auc=1.0), None, "full", False, "only 13 held-out rows"),
    ("nan-predictions", scores(auc=math.nan, nan_predictions=12), CHAMPION, "full", False, "12 NaN or infinite"),
    ("miscalibrated", scores(calibration=1.25), CHAMPION, "full", False, "calibration 1.250 outside [0.9, 1.1]"),
    # with the rows' users known, calibration is a test: refused only when its interval lies outside the range
    ("miscalibration-shown", scores(calibration=1.25, calibration_low=1.15, calibration_high=1.36), None, "full",
     False, "calibration 1.250 [1.150, 1.360] outside [0.9, 1.1] (95 % interval over users)"),
    ("a-calibration-gap-within-the-noise", scores(calibration=0.85, calibration_low=0.74, calibration_high=0.98), None,
     "full", True, None),
    ("incremental-small-drop-ok", scores(auc=0.699), CHAMPION, "incremental", True, None),
    ("incremental-drop-too-big", scores(auc=0.695), CHAMPION, "incremental", False, "auc dropped 0.0050"),
    ("full-retrain-must-not-be-worse", scores(auc=0.699), CHAMPION, "full", False, "may drop at most 0.0"),
    ("better-everywhere", scores(auc=0.72), CHAMPION, "full", True, None),
    ("worse-on-one-slice-only", scores(slices={"device=tablet": {"auc": 0.62, "rows": 500}}), CHAMPION, "incremental",
     False, "slice device=tablet: auc dropped 0.0600"),
    ("tiny-slices-are-not-judged", scores(slices={"user_is_new=True": {"auc": 0.40, "rows": 100}}), CHAMPION,
     "incremental", True, None),
]


@pytest.mark.parametrize(("candidate", "champion", "mode", "passed", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(candidate, champion, mode, passed, reason):
    decision = decide(candidate, champion, T, mode)
    assert decision.passed is passed, decision.reasons
    assert decision.first_model is (champion is None)
    if reason:
        assert any(reason in r for r in decision.reasons), decision.reasons
    else:
        assert decision.reasons == ()
    assert decision.figures["auc"]["candidate"] == candidate.overall["auc"] or math.isnan(candidate.overall["auc"])


def test_thresholds_come_from_config():
    lenient = replace(T, max_auc_drop_full=0.01)
    assert decide(scores(auc=0.695), CHAMPION, lenient, "full").passed


def test_thresholds_load_from_a_file(tmp_path):
    from recloop.gate import load_thresholds

    path = tmp_path / "gate.yaml"
    path.write_text("min_auc: 0.6\ncalibration_range: [0.8, 1.2]\n")
    loaded = load_thresholds(path)
    assert loaded.min_auc == 0.6 and loaded.calibration_range == (0.8, 1.2) and loaded.max_logloss == T.max_logloss
    path.write_text("min_acu: 0.6\n")
    with pytest.raises(ValueError, match="unknown GateThresholds settings \\['min_acu'\\]"):
        load_thresholds(path)
    path.write_text("min_auc: high\n")
    with pytest.raises(ValueError, match="min_auc: Input should be a valid number"):
        load_thresholds(path)
    # NaN compares false with everything: a file of .nan thresholds passed a model of AUC 0.505 that the
    # defaults refused for five reasons
    path.write_text("min_auc: .nan\nmax_logloss_ratio: .nan\ncalibration_range: [.nan, .nan]\n")
    with pytest.raises(ValueError, match=r"\['calibration_range', 'max_logloss_ratio', 'min_auc'\]: NaN is not"):
        load_thresholds(path)
    path.write_text("max_logloss: NaN\nmax_logloss_ratio: nan\n")  # text that pydantic reads as NaN
    with pytest.raises(ValueError, match=r"\['max_logloss', 'max_logloss_ratio'\]: NaN is not"):
        load_thresholds(path)
    path.write_text("min_auc: 7\nmin_rows: -5\ncalibration_range: [1.1, 0.9]\n")  # meaningless: accepted before
    with pytest.raises(ValueError, match=r"min_auc 7.0 is not in \[0, 1\]; calibration_range \[1.1, 0.9\].*"
                                         r"min_rows -5 is negative"):
        load_thresholds(path)


def test_slice_metrics_name_and_measure_each_slice():
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 1000)
    device = np.where(rng.random(1000) < 0.7, "mobile", "desktop")
    good = labels * 0.8 + rng.random(1000) * 0.2
    scores_ = np.where(device == "mobile", good, rng.random(1000))  # desktop scores are noise
    out = slice_metrics(labels, scores_, {"device": device})
    assert set(out) == {"device=mobile", "device=desktop"}
    assert out["device=mobile"]["auc"] > 0.95 and abs(out["device=desktop"]["auc"] - 0.5) < 0.1
    assert out["device=mobile"]["rows"] + out["device=desktop"]["rows"] == 1000


def test_the_decision_is_pure_python_without_mlflow():
    """The decision compares numbers: it must import and decide with MLflow unavailable."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['mlflow'] = None\n"
            "from recloop.gate.decision import GateThresholds, ModelScores, decide\n"
            "d = decide(ModelScores({'auc': 0.5, 'logloss': 0.3, 'calibration': 1.0}), None, GateThresholds(), 'full')\n"
            "print(d.passed, d.reasons)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("False ('auc 0.5000 below the floor 0.55',)"), done.stdout


# --- the paired comparison on the same rows ---------------------------------------------------------------------


def _held_out(seed: int, candidate_noise: float, tablet_noise: float | None = None, users: int = 600):
    from recloop.gate.paired import HeldOut

    rng = np.random.default_rng(seed)
    rows_per_user = 20
    user = np.repeat(np.arange(users), rows_per_user)
    group = user * 10 + np.tile(np.repeat(np.arange(4), 5), users)  # four 5-row "requests" per user
    truth = rng.normal(0, 1, len(user)) + np.repeat(rng.normal(0, 1, users), rows_per_user)
    labels = (rng.random(len(user)) < 1 / (1 + np.exp(-(truth - 1.5)))).astype(float)
    device = np.where(np.repeat(rng.random(users), rows_per_user) < 0.1, "tablet", "mobile")
    champion = truth + rng.normal(0, 0.7, len(user))
    candidate = truth + rng.normal(0, candidate_noise, len(user))
    if tablet_noise is not None:
        tablet = device == "tablet"
        candidate[tablet] = truth[tablet] + rng.normal(0, tablet_noise, tablet.sum())
    return HeldOut(labels, candidate, champion, group, user, {"device": device})


MARGIN = 0.01  # GateThresholds().auc_margin: the overall non-inferiority margin


def test_the_paired_gate_passes_a_better_model_and_refuses_a_worse_one():
    from recloop.gate.paired import compare

    better = compare(_held_out(0, 0.6, users=2000), max_drop=MARGIN, max_slice_drop=0.01)
    worse = compare(_held_out(0, 2.0), max_drop=MARGIN, max_slice_drop=0.01)
    assert better.failures == () and better.insufficient == (), (better.failures, better.insufficient)
    assert worse.failures and worse.failures[0].startswith("grouped auc") and "shown worse" in worse.failures[0]
    figures = worse.figures["grouped_auc"]
    assert figures["high"] < 0 and figures["p_worse"] < 0.05
    assert better.figures["grouped_auc"]["low"] > -MARGIN  # shown non-inferior
    decision = decide(scores(), CHAMPION, T, "full", paired=worse)
    assert not decision.passed and decision.verdict == "refused" and any("grouped auc" in r for r in decision.reasons)
    passed = decide(scores(auc=0.69), CHAMPION, T, "full", paired=better)  # pooled AUC drop not judged
    assert passed.passed and passed.verdict == "passed"


def test_overall_the_gate_is_a_non_inferiority_test_with_its_power():
    """Overall the rule is a test, not the point estimate: an equal-quality candidate a little behind the
    champion on a large window is shown within the margin and passes (the estimate rule refused it); on a
    window too small for the margin the same kind of candidate is "insufficient evidence" (neither passed
    nor refused), with the window's power and the users it would need; a clearly worse one is refused on
    either."""
    from recloop.gate.paired import PairedConfig, compare

    behind = None
    for seed in range(20):  # an equal-quality candidate that lands a little behind the champion here
        held = _held_out(seed, 0.7, users=4000)
        probe = compare(held, max_drop=MARGIN, max_slice_drop=0.05, config=PairedConfig(resamples=200))
        if probe.figures["grouped_auc"]["difference"] < 0:
            behind = probe
            break
    assert behind is not None
    overall = behind.figures["grouped_auc"]
    assert behind.failures == () and behind.insufficient == (), (behind.failures, behind.insufficient)
    assert overall["power"] > 0.8 and overall["margin"] == MARGIN
    small = compare(_held_out(3, 0.7, users=40), max_drop=MARGIN, max_slice_drop=0.01)
    tiny = small.figures["grouped_auc"]
    assert small.failures == () and small.insufficient, (small.failures, tiny)
    assert "insufficient evidence" in small.insufficient[0] and tiny["power"] < 0.5
    assert tiny["users_for_power"] > 40 and f"about {int(tiny['users_for_power'])}" in small.insufficient[0]
    decision = decide(scores(), CHAMPION, T, "full", paired=small)
    assert decision.verdict == "insufficient evidence" and not decision.passed and decision.reasons == ()
    assert decision.to_dict()["verdict"] == "insufficient evidence"
    assert compare(_held_out(3, 4.0, users=40), max_drop=MARGIN, max_slice_drop=0.01).failures  # clearly worse


def test_the_overall_test_keeps_its_error_rates():
    """Over seeds: candidates clearly worse than the margin are never passed, equal-or-better ones are never
    refused (each side at most 2.5 % by construction; 12 seeds each here)."""
    from recloop.gate.paired import compare

    worse_passed = sum(compare(_held_out(s, 1.6, users=300), max_drop=MARGIN, max_slice_drop=0.05).failures == ()
                       and not compare(_held_out(s, 1.6, users=300), max_drop=MARGIN,
                                       max_slice_drop=0.05).insufficient for s in range(12))
    better_refused = sum(bool(compare(_held_out(s, 0.65, users=300), max_drop=MARGIN, max_slice_drop=0.05).failures)
                         for s in range(12))
    assert worse_passed == 0 and better_refused == 0


def test_a_slice_is_judged_only_with_the_rows_its_test_needs():
    from recloop.gate.paired import compare

    held = _held_out(1, 0.7, tablet_noise=3.0, users=300)  # a worse tablet slice of ~600 rows
    result = compare(held, max_drop=MARGIN, max_slice_drop=0.03)
    assert any(s.startswith("device=tablet") for s in result.skipped_slices), result.skipped_slices
    assert not any("tablet" in f for f in result.failures)
    big = compare(_held_out(1, 0.7, tablet_noise=3.0, users=6000), max_drop=0.05, max_slice_drop=0.03)
    assert any(f.startswith("slice device=tablet") for f in big.failures), (big.failures, big.skipped_slices)


def test_a_first_model_is_calibrated_on_its_training_rows(champion_home):
    """Platt scaling fitted on training rows only: the champion's held-out calibration is near 1 (the first
    model on modest data was refused at 0.80 before)."""
    from recloop import checkpoint, registry
    from recloop.data import FeatureSchema
    from recloop.demo import DemoConfig
    from recloop.features.definition import FeatureLayout
    from recloop.gate.runner import held_out_files, score_version

    info = registry.version_info(champion_home, "1")
    model, state = checkpoint.load_model(checkpoint.resolve(champion_home, "1"))
    assert model.calibration is not None and state["calibration"] == list(model.calibration)
    files = held_out_files(champion_home, info)
    held = score_version(champion_home, "1", files, FeatureSchema.load(FeatureLayout.for_settings(champion_home).schema))
    # Within the demo's range, not the shipped (0.9, 1.1): the held-out window is the last 12 hours, whose base
    # rate differs from the early-stopping rows' (spread over the window) that Platt is fitted on; this
    # fixture's models land at 1.04-1.18 by seed and ending (uncalibrated: about as far).
    low, high = DemoConfig().gate.calibration_range
    assert low <= held.overall["calibration"] <= high, held.overall


def test_the_off_policy_check_refuses_a_candidate_the_exploration_logs_say_is_worse():
    from recloop.evidence.offpolicy import softmax
    from recloop.gate.offpolicy import check, policy_estimate

    rng = np.random.default_rng(7)
    requests, m = 12000, 20
    truth = rng.uniform(0.01, 0.3, (requests, m))
    logging = softmax(np.log(truth), 1.0)  # a Plackett-Luce top slot: proportional to the champion-like guess
    shown = (logging.cumsum(axis=1) > rng.random((requests, 1))).argmax(axis=1)
    rows = np.arange(requests)
    labels = (rng.random(requests) < truth[rows, shown]).astype(float)
    good = list(np.clip(truth + rng.normal(0, 0.02, truth.shape), 1e-3, 1))
    bad = list(rng.uniform(0.01, 0.3, truth.shape))  # ranks at random
    good_estimate = policy_estimate(labels, logging[rows, shown], shown, good)
    bad_estimate = policy_estimate(labels, logging[rows, shown], shown, bad)
    assert good_estimate.snips > bad_estimate.snips + 0.05
    reason, figures = check(bad_estimate, good_estimate)
    assert reason and "off-policy top-slot CTR" in reason and figures["effective_samples"] >= 200
    assert check(good_estimate, bad_estimate)[0] is None
    assert check(good_estimate, good_estimate)[0] is None


def test_the_gate_report_shows_the_paired_comparison_that_decided():
    """A reviewer reads, in the version's description, what decided: the grouped AUC difference with its
    interval against the non-inferiority margin, the window's power, each judged slice's Holm-adjusted test, the slices too small."""
    from recloop.gate.decision import report_markdown
    from recloop.gate.paired import compare

    worse = compare(_held_out(0, 2.0), max_drop=MARGIN, max_slice_drop=0.01)
    decision = decide(scores(), CHAMPION, T, "full", paired=worse)
    report = report_markdown(decision, scores(), CHAMPION, "7", "6", "full", T)
    overall = worse.figures["grouped_auc"]
    assert "Paired comparison on the same rows (what decided)" in report
    assert f"{overall['difference']:+.4f} [{overall['low']:+.4f}, {overall['high']:+.4f}]" in report
    assert "| overall |" in report and "REFUSED" in report and "non-inferiority: bottom > −0.01" in report
    assert "The window's power" in report
    assert "Slices too small to judge" in report and "device=mobile (10900 rows" in report
    judged = compare(_held_out(0, 2.0), max_drop=MARGIN, max_slice_drop=0.05)  # a drop of 0.05 needs fewer rows
    report = report_markdown(decide(scores(), CHAMPION, T, "full", paired=judged), scores(), CHAMPION, "7", "6",
                             "full", T)
    assert "| device=mobile (10900 rows) |" in report and "not significantly worse by > 0.05 (Holm" in report
    assert "drop ≤ 0.0 vs champion" not in report  # the fixed rule did not decide: not shown as if it had
    better = compare(_held_out(0, 0.6), max_drop=MARGIN, max_slice_drop=0.01)
    passed = report_markdown(decide(scores(), CHAMPION, T, "full", paired=better), scores(), CHAMPION, "8", "6",
                             "full", T)
    assert "| overall |" in passed and "REFUSED" not in passed and "**PASSED**" in passed


def test_the_gate_report_says_no_none():
    """An unset absolute log-loss ceiling printed ``logloss ≤ None`` (and ``max_logloss=None``): the rule the
    log loss was held to is its ratio to the base rate's, and a threshold not set says so."""
    from recloop.gate.decision import report_markdown

    for champion in (CHAMPION, None):
        report = report_markdown(decide(scores(), champion, T, "full"), scores(), champion, "7", "6", "full", T)
        assert "None" not in report, report
        # the thresholds are a table of their own (issue 43): a threshold not set says so in its row
        assert f"≤ {T.max_logloss_ratio} × the base rate's log loss" in report and "| max_logloss | not enforced |" in report


def test_the_baselines_are_fitted_once_per_window_and_refitted_when_a_file_changes(champion_home, copy_home, tmp_path):
    """The training run and its gate score the same window: the logistic regression is fitted once and kept
    under features/baselines/ (the gate of the champion's bootstrap read the training run's entry back); the
    entry is what is read; a rewritten held-out file makes a new one, equal to scoring from scratch."""
    import json
    import os

    import pyarrow.parquet as pq

    from recloop import baselines, registry
    from recloop.data import FeatureSchema
    from recloop.evaluate import auc
    from recloop.features.definition import FeatureLayout
    from recloop.gate.runner import held_out_files

    home = copy_home(champion_home, tmp_path / "home")
    layout = FeatureLayout.for_settings(home)
    schema = FeatureSchema.load(layout.schema)
    entries = list((layout.root / "baselines").glob("*.json"))
    assert len(entries) == 1, entries  # train and gate, one window, one fit
    held = held_out_files(home, registry.version_info(home, "1"))
    kept = baselines.window_baselines(layout, held, schema)
    assert kept == json.loads(entries[0].read_text()) and kept["logistic"]["auc"] > 0.55

    entries[0].write_text(json.dumps({"planted": {"auc": 0.123}}))
    assert baselines.window_baselines(layout, held, schema) == {"planted": {"auc": 0.123}}  # read, not refitted

    os.utime(held[-1], ns=(held[-1].stat().st_atime_ns, held[-1].stat().st_mtime_ns + 1_000_000_000))
    refitted = baselines.window_baselines(layout, held, schema)
    before = sorted(p for p in layout.training.glob("*.parquet") if p.stem < held[0].stem)
    fresh = baselines.score_baselines(before, held, schema, json.loads(layout.schema.read_text()).get("user_key"))
    assert refitted == json.loads(json.dumps(fresh)) and "planted" not in refitted
    assert refitted["logistic"]["train_rows"] == min(baselines.MAX_TRAIN_ROWS,
                                                     sum(pq.ParquetFile(f).metadata.num_rows for f in before))
    assert len(list((layout.root / "baselines").glob("*.json"))) == 2
    # each baseline's per-row scores are kept beside its figures, for the gate's paired test on the same rows
    scored = baselines.window_baselines(layout, held, schema, with_scores=True)
    labels = np.concatenate([pq.read_table(f, columns=["label"])["label"].to_numpy() for f in held])
    for name in ("ctr", "logistic"):
        assert abs(auc(labels, scored[name]["scores"]) - refitted[name]["auc"]) < 1e-12
    assert len(list((layout.root / "baselines").glob("*.npz"))) == 2


def test_the_gate_report_renders_cleanly_and_names_each_auc():
    """The version's description in MLflow showed ``≤ None`` (no fixed log-loss ceiling), ``nan`` (a
    figure the champion lacked) and the thresholds as one long cut-off line; the training run's AUC and the
    gate's for the same model differed with no word why. Every cell is a figure, a rule or ``-``, every table
    row has its header's columns, the thresholds are a table, and both AUCs are named with their rows."""
    import re

    from recloop.gate.decision import report_markdown
    from recloop.gate.paired import compare

    champion = ModelScores({**GOOD, "calibration": float("nan")}, SLICES)
    for paired in (None, compare(_held_out(0, 0.6), max_drop=0.0, max_slice_drop=0.01)):
        decision = decide(scores(), champion, T, "full", paired=paired)
        report = report_markdown(decision, scores(), champion, "8", "6", "full", T, run_auc=0.6574)
        assert not re.search(r"\bNone\b|\bnan\b|\binf\b", report), report
        table = []
        for line in report.splitlines() + [""]:
            if line.startswith("|"):
                table.append(line)
                continue
            if table:  # every row as many cells as the header: nothing cut off or spilled over
                cells = {len(re.split(r"(?<!\\)\|", row)) for row in table}
                assert len(cells) == 1, table
            table = []
        assert "| logloss |" in report and "≤ 1.1 × the base rate's log loss" in report
        assert "| calibration_range | [0.9, 1.1] |" in report and "| max_logloss | not enforced |" in report
        assert "Thresholds: " not in report  # no longer one line
        assert "training run's `auc` metric (0.6574)" in report and "`gate_auc`" in report
        assert f"pooled over the {int(GOOD['rows'])} held-out rows" in report


def test_a_report_longer_than_mlflow_keeps_is_cut_between_blocks_and_says_where_the_rest_is():
    """MLflow's SQL stores keep 5000 characters of a version's description (a PostgreSQL store refused a longer
    gate report): the description is the report's first blocks, never a table cut in its middle, and a last line
    naming the artifact with all of it."""
    import re

    from recloop.gate.decision import report_markdown
    from recloop.registry import DESCRIPTION_CHARACTERS, fit_description, spaced_cells

    many = {f"category={i}": {"auc": 0.6 + i / 1000, "rows": 400 + i} for i in range(150)}
    candidate, champion = ModelScores(GOOD, many), ModelScores(GOOD, many)
    report = report_markdown(decide(candidate, champion, T, "full"), candidate, champion, "8", "6", "full", T)
    assert len(report) > DESCRIPTION_CHARACTERS
    shown = fit_description(report, "artifact gate_report_v8.md of the training run")
    assert len(shown) <= DESCRIPTION_CHARACTERS and report.startswith(shown.rsplit("\n\n", 1)[0])
    assert shown.endswith("the whole report is the artifact gate_report_v8.md of the training run.*")
    assert "| auc | 0.7000 | 0.7000 |" in shown  # the verdict's table is kept
    for block in shown.split("\n\n"):  # each table whole: a header, its rule, rows of its width
        rows = [line for line in block.splitlines() if line.startswith("|")]
        if rows:
            assert rows[1].startswith("| ---") and len({len(re.split(r"(?<!\\)\|", r)) for r in rows}) == 1, block
    assert fit_description("short", "x") == "short"
    # MLflow's page renders tables with no cell padding (and strips style attributes): each cell is followed by a gap
    spaced = spaced_cells(shown)
    assert "| metric&nbsp;&nbsp;&nbsp; | candidate&nbsp;&nbsp;&nbsp; |" in spaced and "| --- | --- | --- | --- |" in spaced
    assert spaced.replace("&nbsp;", "").replace("  |", " |") == shown.replace("  |", " |")


def test_the_retriever_gate_report_has_no_nan():
    from recloop.gate.decision import GateDecision
    from recloop.gate.retrieval import report_markdown
    from recloop.retrieval.evaluate import RetrievalScores

    candidate = RetrievalScores({"recall@100": 0.4, "ndcg@100": float("nan")}, {"device=mobile": {
        "recall@100": float("nan"), "clicks": 3}}, popularity={"recall@100": float("nan")})
    report = report_markdown(GateDecision(True, (), {}, True), candidate, None, "2", None, "full")
    assert "nan" not in report and "| ndcg@100 | - | - | - |" in report


def test_the_smoke_checks_latency_is_judged_against_the_champions_in_the_same_process():
    """A busy host slows candidate and champion alike: judged by their ratio, never a fixed wall-clock figure
    (500 ms per 256 rows refused the demo's first model twice under load). A first model, with no champion,
    is judged by the thresholds file's budget when it sets one."""
    from recloop.gate.runner import smoke_latency_failure

    busy = smoke_latency_failure(1800.0, 1500.0, T)  # 1.8 s for 256 rows: slow host, same model speed
    assert busy is None
    slow = smoke_latency_failure(900.0, 100.0, T)
    assert slow and "9.0x the champion's 100 ms in the same process (at most 3.0x)" in slow
    assert smoke_latency_failure(5000.0, None, T) is None  # first model, no budget set: reported only
    budget = GateThresholds(smoke_budget_ms=2000.0)
    assert "budget" in smoke_latency_failure(5000.0, None, budget)
    assert smoke_latency_failure(1500.0, None, budget) is None


def test_the_demo_hints_at_more_events_only_when_data_is_the_cause():
    from recloop.demo.loop import first_model_hint

    assert "--events-per-day" in first_model_hint(["only 120 held-out rows: at least 200 are needed to judge"])
    assert "--events-per-day" in first_model_hint(["auc 0.5100 below the floor 0.55"])
    serving = first_model_hint(["serving check: the model does not load in a fresh process: boom"])
    assert "--events-per-day helps" not in serving and "would not change" in serving


def test_a_challenger_on_insufficient_evidence_is_judged_again_on_the_hours_landed_since(champion_home, copy_home,
                                                                                       tmp_path):
    """Issue 36: at a few hundred requests a day the canary cannot show an undecided challenger non-inferior
    online, and the loop served one champion for days. The hours that land after its gate are more rows neither
    model trained on: judged on its window and those, a challenger shown non-inferior becomes a gate pass (its
    canary then promotes it on its guardrails); nothing is judged before any hour lands."""
    from recloop import pipeline, registry
    from recloop.canary.controller import gate_passed
    from recloop.gate import run_gate
    from recloop.gate.runner import grown_evidence
    from recloop.train import TrainConfig, train

    home = copy_home(champion_home, tmp_path / "home", feast=True)
    # the champion carried on from its own checkpoint (an incremental run over the hours it held out: a model
    # as good, scoring nearly as it does), judged on a 2-hour window against a margin no window that small can
    # show: "insufficient evidence", handed to the canary
    from recloop import checkpoint

    trained = train(home, TrainConfig(mode="incremental", days=3, batch_size=512, validation_hours=2, device="cpu",
                                      seed=1), warm_start=checkpoint.resolve(home, "1"))
    version = pipeline.register_training(home, trained).version
    tight = GateThresholds(auc_margin=0.005, calibration_range=(0.5, 2.0), baseline_auc_margin=None,
                           baseline_logloss_margin=None, max_slice_auc_drop=1.0)
    outcome = run_gate(home, version, tight, smoke_check=False)
    assert outcome.verdict == "insufficient evidence" and outcome.alias == "challenger", (outcome.reasons,
                                                                                         outcome.insufficient)
    assert grown_evidence(home, tight) is None  # no hour has landed after its window yet
    pipeline.build_features(home)  # day four lands: hours neither model trained on
    assert not gate_passed(registry.version_info(home, version).tags)
    shown = grown_evidence(home, tight)  # its window and day four: a day's rows show it within the margin
    assert shown.verdict == "passed" and shown.version == version and shown.champion == "1", shown
    window = list(registry.version_info(home, version).validation_window)
    assert shown.hours[0] == window[0] and shown.hours[1] > window[1] and "every hour landed since" in shown.interval
    record = registry.gate_record(registry.version_info(home, version).tags)
    assert gate_passed(registry.version_info(home, version).tags) and record["grown_from"] == window
    assert grown_evidence(home, tight) is None  # judged: a pass now, nothing left to decide offline


def ModelConfigSmall():  # noqa: N802 - the fixtures' small model
    from conftest import SMALL_MODEL_DIMS

    from recloop.model import ModelConfig

    return ModelConfig(**SMALL_MODEL_DIMS)


def test_the_calibration_interval_covers_the_truth_and_narrows_with_users():
    """Predictions 26 % low on a first model's window (2,500 rows, ~9 % clicks) are within the noise of a
    floor at 0.75; on 40x the rows the same gap is shown. The interval is over users: one user's many rows
    are one unit of evidence."""
    from recloop.gate.decision import calibration_interval

    rng = np.random.default_rng(0)
    covered, widths = 0, []
    for _ in range(200):
        users = rng.integers(0, 900, 2500)
        p = np.full(2500, 0.09)
        labels = rng.random(2500) < p
        ratio, low, high = calibration_interval(labels, 0.738 * p, users)
        covered += low <= 0.738 <= high
        widths.append(high - low)
    assert 0.90 <= covered / 200 <= 0.99, covered
    assert 0.15 < np.mean(widths) < 0.4  # about ±13 %: a floor of 0.75 cannot refuse 0.738 here
    big = rng.integers(0, 36_000, 100_000)
    labels = rng.random(100_000) < 0.09
    ratio, low, high = calibration_interval(labels, np.full(100_000, 0.09 * 0.738), big)
    assert high < 0.75 and abs(ratio - 0.738) < 0.03
    # clustered: users click at their own rates, so 20 users' 4,000 rows say less than 2,000 users' 4,000
    for users in (20, 2000):
        rates = np.repeat(rng.beta(1, 4, users), 4000 // users)
        labels = rng.random(4000) < rates
        _, low, high = calibration_interval(labels, np.full(4000, labels.mean()), np.repeat(np.arange(users),
                                                                                             4000 // users))
        widths.append(high - low)
    assert widths[-2] > 2 * widths[-1], widths[-2:]
    assert all(np.isnan(calibration_interval(np.zeros(10), np.full(10, 0.1), np.arange(10))[1:]))


def test_a_serving_check_process_started_ahead_and_never_taken_is_stopped():
    """The retrain flow starts the gate's fresh process before training; when no gate takes it (training failed,
    the gate skipped) it does not outlive the block."""
    from recloop.gate.runner import _AHEAD, smoke_process_ahead

    with smoke_process_ahead() as ahead:
        assert [ahead] == _AHEAD and ahead.poll() is None
    assert ahead.poll() is not None and ahead.returncode != 0 and not _AHEAD
