"""Canary routing (sticky, right share) and the controller's decision, table-driven."""

from __future__ import annotations

import pytest

from recloop.canary import CanaryConfig, CanaryState, VariantStats, decide, route

CONFIG = CanaryConfig(bake_seconds=600, min_requests=500, min_feedback=200)
CHAMPION = VariantStats(requests=10_000, errors=10, p99_ms=20.0, impressions=5000, clicks=500, online_auc=0.70)
HEALTHY = VariantStats(requests=1000, errors=1, p99_ms=22.0, impressions=600, clicks=61, online_auc=0.705)
BAKED = CanaryState(share=0.05, step_started_at=0.0)
NOW = 1000.0


def test_routing_is_sticky_and_matches_the_share():
    users = range(50_000)
    for share in (0.05, 0.25, 0.5):
        assert abs(sum(route(u, share) == "challenger" for u in users) / 50_000 - share) < 0.01
    small = {u for u in users if route(u, 0.05) == "challenger"}
    large = {u for u in users if route(u, 0.25) == "challenger"}
    assert small <= large  # growing the canary never moves a user back to the champion
    assert all(route(u, 0.25) == route(u, 0.25) for u in range(1000))
    assert route(7, 0.0) == "champion" and route(7, 1.0) == "challenger"
    assert {u for u in users if route(u, 0.05, salt="other") == "challenger"} != small


def stats(**changes) -> VariantStats:
    return VariantStats(**{**HEALTHY.__dict__, **changes})


CASES = [
    ("healthy-steps-up", HEALTHY, BAKED, "step", 0.25, "next 25%"),
    ("still-baking", HEALTHY, CanaryState(0.05, 700.0), "hold", 0.05, "baking"),
    ("too-few-requests", stats(requests=100), BAKED, "hold", 0.05, "100/500 challenger requests"),
    ("too-little-feedback", stats(impressions=50, clicks=5), BAKED, "hold", 0.05, "50/200"),
    ("nan-rolls-back-at-once", stats(requests=10, nan_responses=3), CanaryState(0.05, 999.0), "rollback", 0.0, "NaN"),
    ("slow-rolls-back", stats(p99_ms=45.0), BAKED, "rollback", 0.0, "p99 latency 45.0 ms"),
    ("errors-roll-back", stats(errors=30), BAKED, "rollback", 0.0, "error rate 3.00%"),
    # a raw CTR gap between the two variants' own users is no evidence (paired evidence judges the CTR)
    ("raw-ctr-gap-is-not-judged", stats(clicks=40), BAKED, "step", 0.25, "next 25%"),
    # the two variants' pooled AUCs are over different users: reported, never compared (tests/test_canary_paired.py)
    ("pooled-auc-gap-is-not-judged", stats(online_auc=0.65), BAKED, "step", 0.25, "next 25%"),
    ("last-step-promotes", HEALTHY, CanaryState(1.0, 0.0), "promote", 1.0, "held every guardrail up to 100%"),
    # after the bake, a failed guardrail rolls back once its own figures are in, whatever else is awaited:
    # every request failed (and fell back to the champion, so the challenger has no feedback of its own)
    ("failing-without-feedback-rolls-back", stats(errors=1000, impressions=0, clicks=0), BAKED, "rollback", 0.0,
     "error rate 100.00%"),
    ("errors-without-enough-feedback-roll-back", stats(errors=30, impressions=50, clicks=5), BAKED, "rollback",
     0.0, "error rate 3.00%"),
    # a model just loaded may fail or stall its first requests: judged after the bake
    ("errors-while-baking-hold", stats(errors=30), CanaryState(0.05, 700.0), "hold", 0.05, "baking"),
    ("slow-while-baking-holds", stats(p99_ms=45.0), CanaryState(0.05, 700.0), "hold", 0.05, "baking"),
]


@pytest.mark.parametrize(("challenger", "state", "action", "share", "reason"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_decide(challenger, state, action, share, reason):
    decision = decide(CHAMPION, challenger, state, CONFIG, NOW)
    assert (decision.action, decision.share) == (action, share), decision.reasons
    assert any(reason in r for r in decision.reasons), decision.reasons
    assert decision.figures["challenger_requests"] == challenger.requests


def test_an_interleaved_promotion_sets_the_kpi_baseline_from_the_champions_own_ctr():
    """Interleaved lists mix both teams: their CTR is not the challenger's. The baseline the monitor judges
    decay against is the champion's own CTR moved by the interleaving's effect at its lower bound (what the
    evidence showed at least); an A/B canary's is the challenger's own traffic's. Nor is the challenger's AUC
    over interleaved lists (half the other team's picks) its AUC over the lists it serves alone: held to it,
    a no-drift world's new champion was "0.05-0.06 below the baseline" the next day in 2 of 6 seeds, a full
    retrain for nothing (issue 36); an interleaved promotion sets no AUC baseline."""
    from recloop.canary.controller import kpi_baseline_at_promotion

    figures = {"challenger_ctr": 0.15, "challenger_auc": 0.71, "challenger_impressions": 9000,
               "champion_ctr": 0.10, "champion_impressions": 4000, "ctr_effect": 0.60, "ctr_effect_low": 0.20}
    interleaved = kpi_baseline_at_promotion(figures, "interleave")
    assert interleaved == {"ctr": pytest.approx(0.12), "impressions": 4000.0}
    assert kpi_baseline_at_promotion(figures, "canary") == {"ctr": 0.15, "auc": 0.71, "impressions": 9000.0}
    # shadowed, it answered nobody and scored only the champion's lists: no AUC of its own lists either
    assert "auc" not in kpi_baseline_at_promotion(figures, "shadow")
    # no interleaving evidence: no CTR level at all rather than the mixed lists'
    assert "ctr" not in kpi_baseline_at_promotion({**figures, "ctr_effect_low": None}, "interleave")
    held = kpi_baseline_at_promotion({**figures, "ctr_effect_low": -0.25}, "interleave")
    assert held["ctr"] == pytest.approx(0.075)  # shown no worse than 25 % below the champion: held to that


def test_the_retrievers_ab_evidence_rolls_back_on_harm_and_promotes_on_the_guardrails():
    """Without non-inferiority required (the retriever's A/B canary), inconclusive evidence at the last step
    promotes on the guardrails instead of holding; evidence of harm still rolls back; the ranker's rule holds."""
    from recloop.evidence.sequential import Difference

    config = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=10, min_effect=0.05)
    stats = VariantStats(requests=100, impressions=1000, clicks=100)
    worse_raw = VariantStats(requests=100, impressions=1000, clicks=80)  # 20 % lower CTR, not shown by evidence
    unsure = Difference(estimate=-0.2, variance=0.02, low=-0.5, high=0.1, units=200, method="A/B (CUPED)")
    harm = Difference(estimate=-0.3, variance=0.01, low=-0.5, high=-0.1, units=200, method="A/B (CUPED)")
    last = CanaryState(1.0, 0.0)
    retriever = decide(stats, worse_raw, last, config, now=10.0, evidence=unsure, require_non_inferiority=False)
    assert retriever.action == "promote", retriever.reasons  # a raw CTR gap (20 %) does not decide
    ranker = decide(stats, worse_raw, last, config, now=10.0, evidence=unsure)
    assert ranker.action == "hold" and "not yet shown within 5%" in ranker.reasons[0]
    rolled = decide(stats, worse_raw, last, config, now=10.0, evidence=harm, require_non_inferiority=False)
    assert rolled.action == "rollback" and "significantly worse" in rolled.reasons[0]


def test_a_ranker_the_gate_showed_non_inferior_is_promoted_unless_shown_worse_online():
    """The gate's paired test passed: the canary does not ask for non-inferiority again (a day of modest
    traffic cannot reach a 5 % margin: +45 % [-5 %, +95 %] was held for three simulated days and the loop kept
    its day-0 model). Online harm still rolls it back; insufficient offline evidence still needs it online."""
    from recloop.evidence.sequential import Difference

    config = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=10, min_effect=0.05)
    stats = VariantStats(requests=100, impressions=1000, clicks=100)
    promising = Difference(estimate=0.45, variance=0.06, low=-0.05, high=0.95, units=120, method="interleaving")
    harm = Difference(estimate=-0.3, variance=0.01, low=-0.5, high=-0.1, units=200, method="interleaving")
    last, middle = CanaryState(1.0, 0.0), CanaryState(0.5, 0.0)
    held = decide(stats, stats, last, config, now=10.0, evidence=promising)  # insufficient offline evidence
    assert held.action == "hold" and "not yet shown within 5%" in held.reasons[0]
    promoted = decide(stats, stats, last, config, now=10.0, evidence=promising, shown_offline=True)
    assert promoted.action == "promote", promoted.reasons
    assert "non-inferiority shown offline by the gate" in promoted.reasons[0]
    assert decide(stats, stats, middle, config, now=10.0, evidence=promising, shown_offline=True).action == "step"
    rolled = decide(stats, stats, last, config, now=10.0, evidence=harm, shown_offline=True)
    assert rolled.action == "rollback" and "significantly worse" in rolled.reasons[0]
    few = VariantStats(requests=5, impressions=5, clicks=1)  # the guardrails' minimum traffic still applies
    assert decide(stats, few, last, config, now=10.0, evidence=promising, shown_offline=True).action == "hold"


def test_the_controller_reads_the_gates_verdict_from_the_version_tags():
    from recloop import registry
    from recloop.canary.controller import gate_passed

    assert gate_passed(registry.gate_tag(True, champion="1", reasons=[]))
    insufficient = registry.gate_tag(False, champion="1", insufficient_evidence=["window too small"], reasons=[])
    assert not gate_passed(insufficient)
    assert not gate_passed(registry.gate_tag(False, champion="1", reasons=["AUC worse"]))
    assert not gate_passed({})  # made challenger by hand: no verdict


def test_guardrails_roll_back_while_the_evidence_is_still_inconclusive():
    """At the last step a challenger waits for non-inferiority; a guardrail it fails meanwhile rolls it back
    (it was held, at 95 % of users, until max_users)."""
    from recloop.evidence.sequential import Difference

    unsure = Difference(estimate=0.0, variance=0.01, low=-0.2, high=0.2, units=5000, method="interleaving")
    last = CanaryState(0.95, 0.0)
    assert decide(CHAMPION, HEALTHY, last, CONFIG, NOW, evidence=unsure).action == "hold"
    worse_auc = Difference(estimate=-0.1, variance=1e-5, low=-0.12, high=-0.08, units=5000, method="paired AUC")
    for bad, auc_evidence, reason in ((stats(errors=400), None, "error rate"), (stats(p99_ms=100.0), None,
                                      "p99 latency"), (HEALTHY, worse_auc, "online AUC")):
        decision = decide(CHAMPION, bad, last, CONFIG, NOW, evidence=unsure, auc_evidence=auc_evidence)
        assert decision.action == "rollback" and reason in decision.reasons[0], decision.reasons


def test_a_promotion_names_the_interleaved_evidence_that_decided_it_even_against_the_raw_ctr():
    """The demo promoted v2 while its raw online CTR (0.170) was below v1's (0.209), and its reason read "held
    every guardrail": the interleaved credit that decided it was nowhere. The reason names the evidence and
    its interval, and the explained row says why the raw CTR does not decide."""
    from recloop.canary import explain
    from recloop.evidence.sequential import Difference

    config = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=10, min_effect=0.3)
    champion = VariantStats(requests=300, p99_ms=5.0, impressions=2000, clicks=418)
    challenger = VariantStats(requests=300, p99_ms=6.0, impressions=2000, clicks=340)  # raw CTR 0.170 < 0.209
    credit = Difference(estimate=0.12, variance=0.01, low=-0.08, high=0.35, units=240, method="interleaving")
    promoted = decide(champion, challenger, CanaryState(1.0, 0.0), config, now=10.0, evidence=credit)
    assert promoted.action == "promote"
    assert "online CTR (interleaving) +12.0% [-8.0%, +35.0%] over 240 users: non-inferior" in promoted.reasons[0]
    row = explain.decision_row(3, promoted.action, promoted.share, promoted.figures, promoted.reasons)
    assert row["online CTR evidence (what decides)"] == "interleaving: +12.0% [-8.0%, +35.0%], 240 users"
    assert row["raw CTR champion / challenger"] == "0.209 / 0.170"
    assert "raw CTR is lower than the champion's" in row["why"] and "interleaved credit" in row["why"]
    assert row["guardrails (champion / challenger)"].startswith("errors 0.0% / 0.0%; p99 5 / 6 ms")
    stepped = decide(champion, challenger, CanaryState(0.5, 0.0), config, now=10.0, evidence=credit)
    assert stepped.action == "step" and "not significantly worse" in stepped.reasons[0]
    table = explain.markdown_header() + explain.markdown_row(row)
    assert table.count("\n") == 3 and all(line.count(" | ") == len(explain.COLUMNS) - 1
                                          for line in table.splitlines() if "---" not in line)


def test_the_canary_run_in_mlflow_describes_each_decision_with_its_evidence(settings):
    """The canary's MLflow run showed a tag of joined reasons; its description (the run page's text) is now a
    table with a row per decision: action, share, the interleaved evidence and interval, guardrails, why."""
    from mlflow import MlflowClient

    from recloop import registry
    from recloop.canary.controller import EXPERIMENT, CanaryStatus, _log
    from recloop.evidence.sequential import Difference

    registry.configure(settings)
    run_id = MlflowClient().create_run(registry.experiment(settings, EXPERIMENT)).info.run_id
    config = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=10, min_effect=0.3)
    champion = VariantStats(requests=300, p99_ms=5.0, impressions=2000, clicks=418)
    challenger = VariantStats(requests=300, p99_ms=6.0, impressions=2000, clicks=340)
    credit = Difference(estimate=0.12, variance=0.01, low=-0.08, high=0.35, units=240, method="interleaving")
    current = CanaryStatus(True, {"champion": "1", "challenger": "2"}, challenger="2", champion="1",
                           mode="interleave")
    for share in (0.5, 1.0):
        _log(run_id, current, decide(champion, challenger, CanaryState(share, 0.0), config, 10.0, evidence=credit))
    note = MlflowClient().get_run(run_id).data.tags["mlflow.note.content"]
    assert note.startswith("# Canary of recloop-ranker v2 against champion v1")
    rows = [line for line in note.splitlines() if line.startswith("| ") and "---" not in line]
    assert len(rows) == 3 and rows[0].startswith("| step | action")  # the header, then one row per decision
    assert rows[1].startswith("| 0 | step | 95% | interleaving: +12.0% [-8.0%, +35.0%], 240 users")
    assert rows[2].startswith("| 1 | promote | 100% |") and "raw CTR is lower" in rows[2]
    assert "None" not in note and "nan" not in note


def test_a_long_canarys_decisions_table_drops_its_oldest_rows_whole_and_counts_them():
    """MLflow keeps 8000 characters of a run's description: a canary held hour after hour was cut in the middle of
    a row, and every later row was appended to the cut one. The oldest rows give way, whole, and a line before the
    table counts every row dropped so far."""
    from recloop.canary import explain

    row = {column: "figures " * 8 for column in explain.COLUMNS}
    note = "# Canary of recloop-ranker v2 against champion v1\n\nMode: interleave.\n\n" + explain.markdown_header()
    for step in range(60):
        note = explain.fit_note(note + explain.markdown_row({**row, "step": str(step)}))
        assert len(note) <= explain.NOTE_CHARACTERS
    lines = note.splitlines()
    rows = [line for line in lines if line.startswith("| ") and not line.startswith(("| step", "| ---"))]
    first = int(rows[0].split("|")[1])
    assert rows[-1].startswith("| 59 |") and [int(r.split("|")[1]) for r in rows] == list(range(first, 60))
    assert f"*The first {first} decisions are not shown here" in note and note.count("are not shown here") == 1
    assert lines[0].startswith("# Canary of") and sum(line.startswith("| step |") for line in lines) == 1
    assert explain.fit_note("short") == "short"


# --- the latency guardrail on evidence (issue 36: the demo rolled a healthy retriever back on 126 ms vs 65 ms) --


def test_p99_bounds_are_order_statistics_and_wait_for_enough_latencies():
    import math

    import numpy as np

    from recloop.evidence.variants import p99_bounds

    low, high = p99_bounds(np.arange(1.0, 16.0))  # 15 latencies, 1..15 ms
    assert low == 14.0  # the 14th smallest: P(Binomial(15, 0.99) >= 14) = 0.990 >= 0.95, >= 15 only 0.860
    assert high == math.inf  # an upper bound on a p99 at 95 % needs 299 latencies
    assert p99_bounds(np.ones(299))[1] == 1.0 and p99_bounds(np.ones(298))[1] == math.inf
    true_p99 = 10.0 * math.log(100)  # exponential latencies of mean 10 ms
    lows, highs = [], []
    for seed in range(300):
        low, high = p99_bounds(np.random.default_rng(seed).exponential(10.0, 600))
        lows.append(low <= true_p99)
        highs.append(high >= true_p99)
    assert sum(lows) / 300 >= 0.93 and sum(highs) / 300 >= 0.93  # each bound holds at its 95 %


def test_the_latency_guardrail_needs_evidence_not_two_maxima():
    import numpy as np

    from recloop.canary.decision import shipped
    from recloop.evidence.variants import p99_bounds

    config = shipped(steps=(0.5, 1.0), bake_seconds=0, min_requests=15)  # the demo's small world

    def variant(latencies, **more):
        low, high = p99_bounds(latencies)
        return VariantStats(requests=len(latencies), p99_ms=float(np.percentile(latencies, 99)), p99_low_ms=low,
                            p99_high_ms=high, **more)

    def contended(rng, n):  # a model's time per request while training shares the cores: some requests stall
        return np.where(rng.random(n) < 0.1, rng.exponential(40.0, n), rng.exponential(10.0, n))

    rolled_back, point_rule = 0, 0
    for seed in range(200):  # the demo's traffic: ~200 champion and ~20 challenger requests a step, same model speed
        rng = np.random.default_rng(seed)
        champion, challenger = variant(contended(rng, 200)), variant(contended(rng, 20))
        rolled_back += decide(champion, challenger, CanaryState(0.5, 0.0), config, 10.0).action == "rollback"
        point_rule += challenger.p99_ms > config.max_p99_ratio * champion.p99_ms
    assert point_rule >= 6  # the old rule (two point p99s) rolled a healthy challenger back this often (11 of 200)
    assert rolled_back == 0
    # a challenger three times slower, on enough requests, is rolled back; the reason names the bounds
    rng = np.random.default_rng(1)
    slow = decide(variant(rng.exponential(10.0, 2000)), variant(rng.exponential(30.0, 600)), CanaryState(0.5, 0.0),
                  config, 10.0)
    assert slow.action == "rollback" and "95 % bounds" in slow.reasons[0]
