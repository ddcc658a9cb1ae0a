"""The evaluation panel and the twin-world recovery (recloop.panel): a small world, seconds."""

from __future__ import annotations

import numpy as np
import pytest

from recloop.panel import SimulatedModel, draw_panel, per_request, score_panel, true_logits, twin_recovery
from recloop.simulate import World, WorldConfig


def _scores(world, panel, noise):
    truth = true_logits(world, panel)
    return SimulatedModel(noise, seed=1).scores(world, panel.users, panel.items, truth)


def test_the_panel_scores_policies_between_random_and_the_oracle():
    world = World(WorldConfig(seed=2, days=3, events_per_day=5000))
    panel = draw_panel(world, 1.5, 400, candidates=30, seed=0)
    figures = score_panel(
        world, panel, {"good": _scores(world, panel, 0.5), "bad": _scores(world, panel, 4.0)}, resamples=200
    )
    assert figures["oracle"]["normalized_reward"] == pytest.approx(1.0)
    assert figures["random"]["normalized_reward"] == pytest.approx(0.0)
    assert 1.0 > figures["good"]["normalized_reward"] > figures["bad"]["normalized_reward"]
    assert figures["good"]["low"] < figures["good"]["normalized_reward"] < figures["good"]["high"]
    assert figures["oracle"]["regret"] == 0 and figures["oracle"]["ndcg"] == pytest.approx(1.0)
    assert figures["good"]["ndcg"] > figures["bad"]["ndcg"]
    again = draw_panel(world, 1.5, 400, candidates=30, seed=0)
    assert (again.items == panel.items).all()  # a fixed panel: its own stream


def test_twin_recovery_is_one_before_the_drift_and_falls_for_a_stale_model_after_it():
    drifted = World(WorldConfig(seed=5, days=4, events_per_day=5000, drift="sudden", drift_day=2))
    twin = World(WorldConfig(seed=5, days=4, events_per_day=5000, drift="none", drift_day=2))

    def rewards(world, day):
        panel = draw_panel(world, day, 400, candidates=30, seed=1)
        rows = per_request(world, panel, {"model": _scores(world, panel, 1.0)})
        return {k: v["reward"] for k, v in rows.items()}, panel.users

    before, users = rewards(drifted, 1.5)
    same, twin_users = rewards(twin, 1.5)
    assert (users == twin_users).all()
    result = twin_recovery(before, same, users, "model", resamples=200)
    assert result["recovery"] == pytest.approx(1.0) and result["low"] <= 1.0 <= result["high"]
    after, users = rewards(drifted, 2.5)
    control, _ = rewards(twin, 2.5)
    shifted = twin_recovery(after, control, users, "model", resamples=200)
    assert np.isfinite(shifted["recovery"]) and shifted["low"] < shifted["high"]


def test_the_demos_twin_recovery_reads_both_runs_panels():
    from recloop.demo import DemoConfig
    from recloop.demo.panel import twin_recovery as _twin_recovery

    rng = np.random.default_rng(3)
    users = rng.integers(0, 50, 300)

    def rewards(shift):
        oracle = rng.uniform(1.0, 2.0, 300)
        return {
            "oracle": oracle,
            "random": oracle * 0.3,
            "champion": oracle * (0.6 + shift),
            "never_retrained": oracle * (0.5 + shift),
        }

    panels = {day: {"rewards": rewards(0.0), "users": users} for day in range(1, 5)}
    twin = {
        day: {**{k: v.tolist() for k, v in rewards(0.1).items()}, "users": users.tolist()}
        for day in range(1, 5)
    }
    result = _twin_recovery(panels, twin, DemoConfig(drift_day=2))
    assert sorted(result["per_day"]) == [2, 3, 4] and result["day"] == 4
    headline = result["headline"]["champion"]
    assert headline["recovery"] == pytest.approx((0.6 - 0.3) / (0.7 - 0.3), rel=1e-6)
    assert headline["low"] < headline["recovery"] < headline["high"] and result["met"] is False


def test_the_paired_difference_is_zero_for_the_same_ranking_and_positive_for_a_better_one():
    from recloop.panel import paired_difference

    world = World(WorldConfig(seed=2, days=3, events_per_day=5000))
    panel = draw_panel(world, 1.5, 400, candidates=30, seed=0)
    good, bad = _scores(world, panel, 0.5), _scores(world, panel, 4.0)
    rows = per_request(world, panel, {"good": good, "same": good.copy(), "bad": bad})
    rewards = {k: v["reward"] for k, v in rows.items()}
    same = paired_difference(rewards, panel.users, "same", "good", resamples=200)
    assert same == {"difference": 0.0, "low": 0.0, "high": 0.0}  # paired: every resample cancels exactly
    better = paired_difference(rewards, panel.users, "good", "bad", resamples=200)
    figures = score_panel(world, panel, {"good": good, "bad": bad}, resamples=200)
    assert better["difference"] == pytest.approx(
        figures["good"]["normalized_reward"] - figures["bad"]["normalized_reward"])
    assert 0 < better["low"] < better["difference"] < better["high"]
    # narrower than the two policies' own intervals side by side: the pairing removes the panel's own noise
    assert better["high"] - better["low"] < (figures["good"]["high"] - figures["good"]["low"]) + (
        figures["bad"]["high"] - figures["bad"]["low"])


def test_the_demos_paired_efficacy_headline_is_two_cycles_after_the_drift():
    from recloop.demo import DemoConfig
    from recloop.demo.panel import paired_efficacy

    rng = np.random.default_rng(4)
    users = rng.integers(0, 50, 300)
    oracle = rng.uniform(1.0, 2.0, 300)
    rewards = {"oracle": oracle, "random": oracle * 0.3, "champion": oracle * 0.8, "never_retrained": oracle * 0.5}
    panels = {day: {"rewards": rewards, "users": users} for day in range(1, 6)}
    result = paired_efficacy(panels, DemoConfig(drift_day=2))
    assert result["day"] == 4 and sorted(result["per_day"]) == [1, 2, 3, 4, 5]
    headline = result["headline"]["champion - never_retrained"]
    assert headline["difference"] == pytest.approx((0.8 - 0.3) / 0.7 - (0.5 - 0.3) / 0.7)
    assert headline["low"] <= headline["difference"] <= headline["high"]
    assert paired_efficacy(panels, DemoConfig(drift="none"))["day"] == 5  # no drift: the last day


def test_a_reference_of_several_seeds_is_the_mean_of_their_rewards_request_by_request():
    """The loop grid's daily full retrain is one draw of a training; ``averaged`` makes it the mean of several
    seeds' (request by request, so the paired differences against it stay paired)."""
    world = World(WorldConfig(seed=2, days=3, events_per_day=5000))
    panel = draw_panel(world, 1.5, 400, candidates=30, seed=0)
    scores = {"a": _scores(world, panel, 0.5), "b": _scores(world, panel, 4.0), "c": _scores(world, panel, 1.0)}
    rows = per_request(world, panel, scores, averaged={"mean": ["a", "b"]})
    assert np.allclose(rows["mean"]["reward"], (rows["a"]["reward"] + rows["b"]["reward"]) / 2)
    assert np.allclose(rows["mean"]["ndcg"], (rows["a"]["ndcg"] + rows["b"]["ndcg"]) / 2)
    assert not np.allclose(rows["mean"]["reward"], rows["a"]["reward"])  # not one of its members
    figures = score_panel(world, panel, scores, resamples=100, averaged={"mean": ["a", "b"]})
    # the normalized reward is linear in the rewards: the mean's is the mean of its members'
    assert figures["mean"]["normalized_reward"] == pytest.approx(
        (figures["a"]["normalized_reward"] + figures["b"]["normalized_reward"]) / 2)
    assert figures["mean"]["low"] < figures["mean"]["normalized_reward"] < figures["mean"]["high"]


def test_the_panel_as_served_routes_each_user_as_the_canary_does():
    """While a canary runs, what users are shown is not the champion alone: ``served`` gives the users the
    experiment's salt puts in the challenger's share the challenger's ranking (``canary``) or the team-draft
    interleaving of both (``interleave``), and the others the champion's."""
    from recloop.canary.decision import route
    from recloop.demo.panel import served_scores

    world = World(WorldConfig(seed=2, days=3, events_per_day=5000))
    panel = draw_panel(world, 1.5, 400, candidates=30, seed=0)
    champion, challenger = _scores(world, panel, 4.0), _scores(world, panel, 0.3)

    def orders(scores):
        return np.argsort(-scores, axis=1, kind="stable")

    def reward(scores):
        return per_request(world, panel, {"x": scores})["x"]["reward"]

    salt = "recloop-canary-v2-test"
    routed = np.array([route(int(u), 0.5, salt) == "challenger" for u in panel.users])
    assert 0.3 < routed.mean() < 0.7
    half = orders(served_scores(champion, challenger, panel.users, 0.5, salt, interleave=False, k=10, seed=0))
    assert (half[routed] == orders(challenger)[routed]).all()
    assert (half[~routed] == orders(champion)[~routed]).all()
    nobody = served_scores(champion, challenger, panel.users, 0.0, salt, interleave=False, k=10, seed=0)
    assert (orders(nobody) == orders(champion)).all()

    # interleaved for half the users: the others keep the champion's order, the routed ones get the team draft
    from recloop.evidence.interleaving import team_draft_batch

    mixed = orders(served_scores(champion, challenger, panel.users, 0.5, salt, interleave=True, k=10, seed=7))
    assert (mixed[~routed] == orders(champion)[~routed]).all()
    drafted, _ = team_draft_batch(orders(champion)[routed], orders(challenger)[routed], 10, np.random.default_rng(7))
    assert (mixed[routed][:, :10] == drafted).all()

    everybody = served_scores(champion, challenger, panel.users, 1.0, salt, interleave=True, k=10, seed=0)
    top = orders(everybody)[:, :10]
    # each shown item is the best one of the champion's or of the challenger's not shown above it
    for row, shown in enumerate(top[:50]):
        for slot, item in enumerate(shown):
            above = set(shown[:slot].tolist())
            firsts = [next(i for i in orders(s)[row] if i not in above) for s in (champion, challenger)]
            assert item in firsts
    # the interleaving shows half of each: its reward lies between the two rankings' (on average)
    low, mid, high = reward(champion).mean(), reward(everybody).mean(), reward(challenger).mean()
    assert low < mid < high


def test_a_demo_config_refuses_a_drift_past_its_last_day():
    """`DemoConfig(days=2)` drifting on day 2 ran a world with no drift under the name `sudden` (the CLI refused
    such a `--drift-day`; benchmarks/demo_stages.py --days 2 built the config itself)."""
    from recloop.demo import DemoConfig

    with pytest.raises(ValueError, match="drift_day 2 is outside the 2 simulated days"):
        DemoConfig(days=2, drift_day=2)
    assert DemoConfig(days=2, drift_day=1).drift_day == 1
    assert DemoConfig(days=1, drift="none").days == 1  # no drift: any day
