"""The canary's online-AUC guardrail is paired: both models on the same impressions, always-valid.

Simulated canaries over many salts (heavy-tailed users with different click rates, so each user mix has its
own pooled AUC): an identical-quality challenger is not rolled back by the users it happens to get, a
clearly worse one is. The old rule (the champion's AUC pooled over every request against the challenger's
over its share of users) is computed beside it on the same canaries, to show the user mix alone moves it
past the margin.
"""

from __future__ import annotations

import numpy as np
import pytest

from recloop.canary import CanaryConfig, CanaryState, VariantStats, decide, position
from recloop.evaluate import auc
from recloop.evidence.sequential import paired_auc_difference

USERS, ITEMS, SHOWN = 600, 200, 10
SHIPPED = CanaryConfig()  # the margins that ship; only the pace is changed below
PACE = dict(bake_seconds=0, min_requests=100, min_feedback=500)


def world(seed: int = 0):
    rng = np.random.default_rng(seed)
    base = rng.normal(-2.0, 1.0, USERS)  # users click at very different rates: pooled AUC depends on the mix
    activity = rng.pareto(1.2, USERS) + 1.0
    quality = rng.normal(0.0, 1.0, ITEMS)
    return rng, base, activity / activity.sum(), quality


def requests(rng, base, activity, quality, n: int):
    users = rng.choice(USERS, size=n, p=activity)
    items = rng.integers(0, ITEMS, size=(n, SHOWN))
    truth = base[users, None] + quality[items]
    labels = (rng.random(truth.shape) < 1 / (1 + np.exp(-truth))).astype(np.int64)
    return users, truth, labels


def scores(rng, truth, noise: float):
    return 1 / (1 + np.exp(-(truth + rng.normal(0.0, noise, truth.shape))))


def canary(salt: str, challenger_noise: float, seed: int, share: float = 0.05, n: int = 6000,
           challenger_seed: int | None = None):
    """One canary's look at ``share``: the champion's and challenger's journal figures as ``Journal.stats``
    computes them (each its own requests' pooled AUC), and the paired AUC on the challenger's users'
    interleaved requests (both scored)."""
    rng, base, activity, quality = world(0)
    draw = np.random.default_rng(seed)
    users, truth, labels = requests(draw, base, activity, quality, n)
    champion = scores(np.random.default_rng(1), truth, 1.0)  # the same model's scores every canary
    challenger = scores(np.random.default_rng(seed + 7 if challenger_seed is None else challenger_seed), truth,
                        challenger_noise)
    place = np.array([position(u, salt) for u in range(USERS)])
    inside = place[users] < share
    stats = {
        "champion": VariantStats(requests=n, impressions=labels.size, clicks=int(labels.sum()),
                                 online_auc=auc(labels.ravel(), champion.ravel())),
        "challenger": VariantStats(requests=int(inside.sum()), impressions=int(labels[inside].size),
                                   clicks=int(labels[inside].sum()),
                                   online_auc=auc(labels[inside].ravel(), challenger[inside].ravel())),
    }
    rows = np.repeat(users[inside], SHOWN)
    evidence = paired_auc_difference(labels[inside].ravel(), champion[inside].ravel(),
                                     challenger[inside].ravel(), rows, tau=SHIPPED.max_auc_drop,
                                     alpha=SHIPPED.alpha)
    return stats, evidence


def judge(stats, evidence, share: float = 0.05):
    config = CanaryConfig(**PACE)
    return decide(stats["champion"], stats["challenger"], CanaryState(share, 0.0), config, now=1.0,
                  auc_evidence=evidence)


def test_an_identical_challenger_is_not_rolled_back_by_the_users_it_gets():
    # fixed salts, shaped as experiment_salt's (which adds a random part): every run judges the same canaries
    salts = [f"recloop-canary-v2-{i}000-{i:08x}" for i in range(60)]
    old_rule, rolled = 0, []
    for i, salt in enumerate(salts):
        stats, evidence = canary(salt, challenger_noise=1.0, seed=i)
        # the unpaired comparison this replaced: two populations' pooled AUCs, judged on the same margin
        old_rule += stats["champion"].online_auc - stats["challenger"].online_auc > SHIPPED.max_auc_drop
        decision = judge(stats, evidence)
        assert "auc_effect" in decision.figures and decision.figures["auc_effect"] == evidence.estimate
        rolled.append(decision.action == "rollback")
    assert old_rule >= 6, old_rule  # user mix alone moved the unpaired figures past the margin
    assert sum(rolled) == 0, [i for i, r in enumerate(rolled) if r]


def test_the_same_model_as_challenger_has_no_auc_difference_at_all():
    stats, evidence = canary("recloop-canary-v2-0-00000000", challenger_noise=1.0, seed=3, challenger_seed=1)
    assert evidence.estimate == 0.0 and evidence.high == pytest.approx(0.0, abs=1e-9)
    assert judge(stats, evidence).action == "step"


def test_a_clearly_worse_challenger_is_rolled_back_on_the_paired_auc():
    rolled = []
    for i in range(20):
        # at the second step (25 %): a few dozen users at 5 % rarely show it beyond the margin yet
        stats, evidence = canary(f"recloop-canary-v2-{i}000-{i:08x}", challenger_noise=3.0, seed=i, share=0.25)
        assert evidence.estimate < -0.04  # clearly worse on the same impressions
        decision = judge(stats, evidence, share=0.25)
        rolled.append(decision.action == "rollback" and "online AUC significantly worse" in decision.reasons[0])
    assert sum(rolled) >= 19, rolled


def test_the_paired_auc_matches_the_two_aucs_and_its_interval_covers_zero_for_equals():
    """The estimate is exactly AUC(challenger) − AUC(champion) on the rows given; for same-quality models its
    always-valid interval covers 0 in (nearly) every canary, and its variance is a user-cluster one."""
    rng, base, activity, quality = world(3)
    covered = 0
    for seed in range(40):
        users, truth, labels = requests(np.random.default_rng(100 + seed), base, activity, quality, 400)
        a = scores(np.random.default_rng(seed), truth, 1.0)
        b = scores(np.random.default_rng(1000 + seed), truth, 1.0)
        rows = np.repeat(users, SHOWN)
        found = paired_auc_difference(labels.ravel(), a.ravel(), b.ravel(), rows, tau=0.01)
        assert found.estimate == pytest.approx(auc(labels.ravel(), b.ravel()) - auc(labels.ravel(), a.ravel()))
        covered += found.low <= 0.0 <= found.high
        assert found.units == len(np.unique(users))
    assert covered >= 39
    one_user = paired_auc_difference([0, 1, 0, 1], [0.1, 0.9, 0.2, 0.8], [0.2, 0.7, 0.3, 0.9], [5, 5, 5, 5],
                                     tau=0.01)
    assert one_user.low == -np.inf and one_user.high == np.inf  # one user: no evidence at all


def test_decide_never_compares_the_two_pooled_aucs():
    """The variants' own pooled AUCs (different users) are reported, not judged: a gap of 0.1 between them
    with paired evidence of no difference steps the canary up."""
    from recloop.evidence.sequential import Difference

    config = CanaryConfig(**PACE)
    champion = VariantStats(requests=5000, impressions=50_000, clicks=5000, online_auc=0.80)
    challenger = VariantStats(requests=500, impressions=5000, clicks=500, online_auc=0.70)
    even = Difference(0.0, 1e-6, -0.004, 0.004, 300, "paired online AUC, user clusters")
    decision = decide(champion, challenger, CanaryState(0.05, 0.0), config, now=1.0, auc_evidence=even)
    assert decision.action == "step", decision.reasons
    assert decision.figures["challenger_auc"] == 0.70 and decision.figures["champion_auc"] == 0.80
    worse = Difference(-0.05, 1e-5, -0.06, -0.04, 300, "paired online AUC, user clusters")
    assert decide(champion, challenger, CanaryState(0.05, 0.0), config, now=1.0, auc_evidence=worse).action == \
        "rollback"
    # worse, but not shown worse by more than the margin: not a rollback on the AUC
    small = Difference(-0.006, 1e-6, -0.009, -0.003, 300, "paired online AUC, user clusters")
    assert decide(champion, challenger, CanaryState(0.05, 0.0), config, now=1.0, auc_evidence=small).action == \
        "step"


def test_every_deployment_runs_the_shipped_margins():
    """``CanaryConfig()`` is the shipped canary: prefect.yaml's canary-check runs it (no config file), the demo
    and benchmarks/loop.py change only its pace; a margin given as pace is refused."""
    from pathlib import Path

    import yaml

    from recloop.canary.decision import MARGINS, shipped
    from recloop.demo import DemoConfig

    shipped_margins = {name: getattr(CanaryConfig(), name) for name in MARGINS}
    assert shipped_margins["min_effect"] <= 0.05 and shipped_margins["max_auc_drop"] <= 0.01
    demo = DemoConfig().canary
    assert {name: getattr(demo, name) for name in MARGINS} == shipped_margins
    root = Path(__file__).resolve().parents[1]
    deployments = {d["name"]: d for d in yaml.safe_load((root / "prefect.yaml").read_text())["deployments"]}
    assert not deployments["canary-check"]["parameters"].get("config_path")
    assert "shipped(" in (root / "benchmarks" / "loop.py").read_text()
    with pytest.raises(ValueError, match="margins"):
        shipped(min_effect=0.3)
    assert shipped(bake_seconds=0).min_effect == CanaryConfig().min_effect


def test_the_journal_hands_the_canary_only_impressions_both_models_scored(tmp_path):
    """``Journal.paired_scores``: the impressions of requests both versions scored (interleaved, or an A/B
    challenger's the champion scored too); the champion's own requests, which the challenger never scored,
    are left out, so the paired AUC rests on the same impressions for both."""
    import json

    from recloop.canary.controller import paired_auc_evidence
    from recloop.journal import SqliteJournal

    journal = SqliteJournal(tmp_path / "journal.db")
    rng = np.random.default_rng(5)
    labels, a_scores, b_scores, users = [], [], [], []
    try:
        for i in range(300):
            user, items = int(rng.integers(0, 50)), [1, 2, 3, 4]
            both = i % 3 == 0
            a = rng.random(4).round(6).tolist()
            b = rng.random(4).round(6).tolist()
            scores = {"1": a, "2": b} if both else {"1": a}
            payload = {"item_ids": items, "ranked": items, "scores": scores, "context": {}, "per_candidate": {}}
            journal.record((f"r{i}", 100.0 + i, 1_000_000 * i, user, "interleave" if both else "champion",
                            "2" if both else "1", 1.0, json.dumps(payload)), [])
            clicked = [it for it in items if rng.random() < 0.3]
            journal.add_feedback(f"r{i}", impressions=items, clicks=clicked)
            if both:
                labels += [int(it in clicked) for it in items]
                a_scores += a
                b_scores += b
                users += [user] * 4
        found = journal.paired_scores("1", "2", since=0.0)
        assert len(found[0]) == len(labels) == 400
        assert sorted(zip(*(x.tolist() for x in found), strict=True)) == sorted(
            zip(labels, a_scores, b_scores, users, strict=True))
        evidence = paired_auc_evidence(journal, "1", "2", 0.0, CanaryConfig())
        assert evidence.estimate == pytest.approx(auc(np.array(labels), np.array(b_scores))
                                                  - auc(np.array(labels), np.array(a_scores)))
        assert journal.paired_scores("1", "2", since=1e9)[0].size == 0  # only since the canary began
    finally:
        journal.close()
