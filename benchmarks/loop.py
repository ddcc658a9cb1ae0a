"""The loop's decisions, measured on the synthetic world: canary and gate error rates, with intervals.

    python benchmarks/loop.py [--seeds 10] [--canaries 50] [--gate-candidates 20] [--json out.json]

Canaries are simulated directly on the world's requests (no servers): each look draws a batch of
requests (users by their heavy-tailed activity, 30 candidates by exposure), routes them with the
experiment's salt, serves champion / challenger / their team-draft interleaving, draws clicks from the
true click probabilities at their positions, and hands the journal's figures to the real
``canary.decision.decide`` (with the paired evidence of ``canary.controller.paired_evidence``'s
statistics). Challengers are ``panel.SimulatedModel`` rankers whose expected clicks on the world's panel
are 0 %, −20 % and +10 % against the champion's. Alongside, the rule this replaced (fixed salt, A/B,
raw CTR ratio against ``max_ctr_drop``) on the same worlds.

Gate: per world seed, candidates of random quality around the champion are judged on a logged day of
the world's own events by the gate's paired comparison (grouped AUC per user, paired user bootstrap; overall
hold or beat on the estimate, device slices Holm-significantly worse) and compared with the truth on the
evaluation panel (normalized reward); alternative rules on the same tests and the old fixed thresholds
(pooled AUC drop of at most 0.002, 0.01 per slice); rates over all candidates and outside a ±5 %
indifference zone.

Issue 36: the canary runs the shipped configuration (``canary.decision.shipped``: ``CanaryConfig()``'s margins
at this simulation's pace), with the paired online AUC guardrail (both models' scores on the impressions of
the challenger's requests) beside the CTR evidence; the gate at the shipped non-inferiority margin
(``GateThresholds().auc_margin``), "insufficient evidence" counted apart, with the window's power.

The full loop (``--loop-seeds``): ``recloop demo`` per world seed and scenario, as it ships. A run costs minutes,
so a grid is built over several invocations (and sessions): ``--loop-rows FILE`` appends each finished run as one
JSON line (with the machine and commit it ran on), and ``--loop-table FILE ...`` runs nothing and summarizes every
run in those files (and in earlier ``--json`` results) by scenario and configuration: the paired differences' means
with t intervals over seeds, drift acted on within 2 days and false alarms with Wilson intervals.

    python benchmarks/loop.py --skip canary,gate,concept --loop-seeds 1 --loop-first-seed 7 --scenarios none,gradual \\
        --loop-events-per-day 10000 --loop-requests-per-day 300 --loop-rows grid.jsonl
    python benchmarks/loop.py --loop-table grid.jsonl results/loop-*.json --json table.json

Targets (issue 36): identical challenger rolled back ≤ 5 % (upper bound ≤ 10 %), 10 %-better promoted ≥ 90 %,
10 %-worse promoted ≤ 5 %; gate: ≤ 5 % of panel-better refused, ≤ 5 % of panel-worse passed, or
"insufficient evidence" reported.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
from common import machine, use_source_tree

use_source_tree()

from recloop.canary.decision import (  # noqa: E402
    CanaryConfig,
    CanaryState,
    VariantStats,
    decide,
    experiment_salt,
    position,
    shipped,
)
from recloop.evaluate import auc  # noqa: E402
from recloop.evidence.interleaving import team_draft_batch  # noqa: E402
from recloop.evidence.ranking import holm  # noqa: E402
from recloop.evidence.sequential import ab_difference, interleaving_difference, paired_auc_difference  # noqa: E402
from recloop.gate.decision import GateThresholds  # noqa: E402
from recloop.panel import SimulatedModel, draw_panel, expected_reward, score_panel, true_logits  # noqa: E402
from recloop.simulate import DEVICES, World, WorldConfig  # noqa: E402

K, CANDIDATES = 10, 30
LOOP_DRIFT_DAY = 2  # the full loop's drift day; its figures are read two cycles after it (day 4)
LEGACY_MAX_CTR_DROP = 0.05  # the legacy rule: the challenger's raw CTR at most 5 % below the champion's
CHAMPION_NOISE = 1.5


def proportion_ci(hits: int, n: int) -> tuple[float, float]:
    from statsmodels.stats.proportion import proportion_confint

    low, high = proportion_confint(hits, n, method="wilson") if n else (float("nan"), float("nan"))
    return float(low), float(high)


def mean_ci(values) -> tuple[float, float, float]:
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    if len(values) < 2:
        return float(values.mean()) if len(values) else float("nan"), float("nan"), float("nan")
    half = stats.t.ppf(0.975, len(values) - 1) * values.std(ddof=1) / np.sqrt(len(values))
    return float(values.mean()), float(values.mean() - half), float(values.mean() + half)


# --- challengers of known quality ------------------------------------------------------------------------------


def relative_reward(world: World, champion: SimulatedModel, challenger: SimulatedModel, panel) -> float:
    truth = true_logits(world, panel)
    rewards = [
        expected_reward(truth, np.argsort(-m.scores(world, panel.users, panel.items, truth), axis=1), K).sum()
        for m in (champion, challenger)
    ]
    return rewards[1] / rewards[0] - 1.0


def challenger_for(world: World, champion: SimulatedModel, target: float, panel, seed: int) -> SimulatedModel:
    """A model whose expected clicks on the panel are ``target`` relative to the champion's (bisection on noise)."""
    if target == 0.0:
        return champion  # identical: the same model
    low, high = 0.0, 12.0
    for _ in range(18):
        mid = (low + high) / 2
        if relative_reward(world, champion, SimulatedModel(mid, seed), panel) > target:
            low = mid
        else:
            high = mid
    return SimulatedModel((low + high) / 2, seed)


# --- one simulated canary ------------------------------------------------------------------------------------


def run_canary(
    world: World,
    champion: SimulatedModel,
    challenger: SimulatedModel,
    config: CanaryConfig,
    *,
    rng: np.random.Generator,
    legacy: bool,
    requests_per_look: int,
    max_looks: int,
    day: float,
    draw: int,
    shown_offline: bool = False,
    plain_ab: bool = False,
) -> dict:
    """Look after look until promote or roll back (an undecided canary at ``max_looks`` is rolled back as
    inconclusive, as ``max_users`` does in the controller). ``shown_offline``: the challenger passed the
    gate's non-inferiority test, so the canary promotes unless the online evidence shows it worse.
    ``plain_ab``: the A/B evidence as it was before its small-sample guards (no impressions cap, no leverage
    or Student's t correction), the baseline of ``benchmarks/ab_validity.py``."""
    users_all = np.arange(len(world.user_taste))
    salt = "recloop-canary" if legacy else experiment_salt("2", float(draw))
    place = np.array([position(int(u), salt) for u in users_all])
    share = config.steps[0]
    log: dict[str, list] = {
        k: [] for k in ("user", "a", "b", "arm", "clicks", "auc_label", "auc_a", "auc_b", "auc_user")
    }
    pre = None
    if (
        not legacy and config.mode == "canary"
    ):  # CUPED covariate: each user's CTR on a pre-period under the champion
        panel = draw_panel(world, day - 1, requests_per_look * 2, CANDIDATES, seed=10_000 + draw)
        truth = true_logits(world, panel)
        clicks = _clicks(
            truth, np.argsort(-champion.scores(world, panel.users, panel.items, truth), axis=1)[:, :K], rng
        )
        users, index = np.unique(panel.users, return_inverse=True)
        pre = dict(
            zip(
                users.tolist(),
                (np.bincount(index, clicks.sum(axis=1)) / np.bincount(index) / K).tolist(),
                strict=True,
            )
        )
    exposed = 0
    for look in range(max_looks):
        panel = draw_panel(world, day, requests_per_look, CANDIDATES, seed=draw * 1000 + look)
        truth = true_logits(world, panel)
        score_a = champion.scores(world, panel.users, panel.items, truth)
        score_b = challenger.scores(world, panel.users, panel.items, truth)
        a = np.argsort(-score_a, axis=1, kind="stable")
        b = np.argsort(-score_b, axis=1, kind="stable")
        inside = place[panel.users] < share
        exposed += int(inside.sum())
        if config.mode == "interleave" and not legacy:
            shown, teams = team_draft_batch(a[inside], b[inside], K, rng)
            clicks = _clicks(truth[inside], shown, rng)
            _log_paired(log, panel.users[inside], shown, clicks, score_a[inside], score_b[inside])
            log["user"].append(panel.users[inside])
            log["a"].append((clicks * (teams == 0)).sum(axis=1))
            log["b"].append((clicks * (teams == 1)).sum(axis=1))
            users = np.concatenate(log["user"])
            credit_a, credit_b = np.concatenate(log["a"]), np.concatenate(log["b"])
            evidence = interleaving_difference(
                credit_a, credit_b, users, tau=config.min_effect, alpha=config.alpha
            )
            n = len(users)
            stats_a = VariantStats(requests=n, impressions=n * K, clicks=int(credit_a.sum() * 2))
            stats_b = VariantStats(requests=n, impressions=n * K, clicks=int(credit_b.sum() * 2))
        else:
            order = np.where(inside[:, None], b, a)[:, :K]
            shown_clicks = _clicks(truth, order, rng)
            clicks = shown_clicks.sum(axis=1)
            if not legacy:  # the champion scores the challenger's requests too (serving does): paired AUC
                _log_paired(log, panel.users[inside], order[inside], shown_clicks[inside], score_a[inside],
                            score_b[inside])
            log["user"].append(panel.users)
            log["arm"].append(inside)
            log["clicks"].append(clicks)
            users, arm, c = (np.concatenate(log[key]) for key in ("user", "arm", "clicks"))
            stats_a = VariantStats(
                requests=int((~arm).sum()), impressions=int((~arm).sum()) * K, clicks=int(c[~arm].sum())
            )
            stats_b = VariantStats(
                requests=int(arm.sum()), impressions=int(arm.sum()) * K, clicks=int(c[arm].sum())
            )
            evidence = None
            if not legacy:
                covariates = None
                if pre is not None:
                    covariates = [
                        np.array([pre.get(u, 0.0) for u in np.unique(users[side])]) for side in (~arm, arm)
                    ]
                evidence = ab_difference(
                    c[~arm],
                    np.full((~arm).sum(), K),
                    users[~arm],
                    c[arm],
                    np.full(arm.sum(), K),
                    users[arm],
                    tau=config.min_effect,
                    alpha=config.alpha,
                    pre_a=covariates[0] if covariates else None,
                    pre_b=covariates[1] if covariates else None,
                    **({"cap_quantile": None, "small_sample": False} if plain_ab else {}),
                )
        auc_evidence = None
        if not legacy and log["auc_user"]:
            auc_evidence = paired_auc_difference(
                *(np.concatenate(log[key]) for key in ("auc_label", "auc_a", "auc_b", "auc_user")),
                tau=config.max_auc_drop,
                alpha=config.alpha,
            )
        decision = decide(
            stats_a, stats_b, CanaryState(share, 0.0), config, now=1e12, evidence=evidence, auc_evidence=auc_evidence,
            shown_offline=shown_offline,
        )
        if legacy and stats_b.impressions >= config.min_feedback and stats_a.ctr > 0 and \
                stats_b.ctr < stats_a.ctr * (1 - LEGACY_MAX_CTR_DROP):  # the raw ratio the canary once ran
            return {"outcome": "rollback", "looks": look + 1, "challenger_requests": exposed,
                    "reason": f"online CTR {stats_b.ctr:.4f} vs champion {stats_a.ctr:.4f}"}
        if decision.action in ("promote", "rollback"):
            return {
                "outcome": decision.action,
                "looks": look + 1,
                "challenger_requests": exposed,
                "reason": decision.reasons[0],
            }
        share = decision.share if decision.action == "step" else share
        if decision.action == "step" and legacy:  # a new step judges only its own traffic in the legacy rule
            log = {k: [] for k in log}
    return {
        "outcome": "rollback",
        "looks": max_looks,
        "challenger_requests": exposed,
        "reason": "inconclusive",
    }


def _log_paired(log: dict, users, shown, clicks, score_a, score_b) -> None:
    """The impressions both models scored, as the journal keeps them for the paired online AUC."""
    log["auc_label"].append(clicks.ravel())
    log["auc_a"].append(np.take_along_axis(score_a, shown, axis=1).ravel())
    log["auc_b"].append(np.take_along_axis(score_b, shown, axis=1).ravel())
    log["auc_user"].append(np.repeat(users, shown.shape[1]))


def _clicks(truth: np.ndarray, shown: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    logit = (
        np.take_along_axis(truth, shown, axis=1) - 0.35 * np.log(np.arange(1, shown.shape[1] + 1))[None, :]
    )
    return (rng.random(logit.shape) < 1.0 / (1.0 + np.exp(-logit))).astype(np.int64)


def canary_rates(
    seeds: int,
    canaries: int,
    requests_per_look: int,
    max_looks: int,
    events_per_day: int,
    modes: tuple[str, ...],
) -> dict:
    # the shipped canary (CanaryConfig()'s margins, the paired online AUC guardrail included) at the
    # simulation's pace: what prefect.yaml's canary-check and the demo run
    # a mode named "<mode>+offline": the same canary for a challenger the gate showed non-inferior offline
    # (the retriever's A/B canary always is: its promotion rides on the guardrails); "+plain": the A/B
    # evidence without its small-sample guards, the baseline they replaced
    for mode in modes:
        if "+plain" in mode and not mode.startswith("canary"):
            raise SystemExit(f"--modes {mode}: '+plain' is the A/B evidence's baseline, for the canary mode only")
    config_new = {
        mode: shipped(bake_seconds=0, min_requests=200, min_feedback=1000, mode=mode.split("+")[0])
        for mode in modes
    }
    legacy = CanaryConfig(
        bake_seconds=0,
        min_requests=200,
        min_feedback=1000,
        mode="canary",
        holdout=0.0,
        steps=(0.05, 0.25, 0.5, 1.0),
    )
    results: dict[str, dict[str, list]] = {}
    for seed in range(seeds):
        world = World(WorldConfig(seed=seed, days=3, events_per_day=events_per_day))
        champion = SimulatedModel(CHAMPION_NOISE, seed=1)
        panel = draw_panel(world, 1.0, 3000, CANDIDATES, seed=99)
        for label, target in (("identical", 0.0), ("10% worse", -0.10), ("20% worse", -0.20), ("10% better", 0.10)):
            challenger = challenger_for(world, champion, target, panel, seed=2)
            measured = relative_reward(
                world, champion, challenger, draw_panel(world, 1.0, 3000, CANDIDATES, seed=98)
            )
            per_seed = max(1, canaries // seeds)
            for name, config, is_legacy in [
                *((m, config_new[m], False) for m in modes),
                ("legacy A/B", legacy, True),
            ]:
                rng = np.random.default_rng([seed, len(label), len(name)])
                for draw in range(per_seed):
                    outcome = run_canary(
                        world,
                        champion,
                        challenger,
                        config,
                        rng=rng,
                        legacy=is_legacy,
                        requests_per_look=requests_per_look,
                        max_looks=max_looks,
                        day=1.0,
                        draw=seed * 10_000 + draw,
                        shown_offline="+offline" in name,
                        plain_ab="+plain" in name,
                    )
                    entry = results.setdefault(name, {}).setdefault(label, [])
                    entry.append({**outcome, "true_effect": measured})
                done = results[name][label][-per_seed:]
                print(
                    f"  seed {seed} {name} {label}: rolled back {sum(r['outcome'] == 'rollback' for r in done)}"
                    f"/{len(done)}",
                    flush=True,
                )
    summary = {}
    for name, by_label in results.items():
        summary[name] = {}
        for label, runs in by_label.items():
            n = len(runs)
            rolled = sum(r["outcome"] == "rollback" for r in runs)
            promoted = n - rolled
            summary[name][label] = {
                "canaries": n,
                "rolled_back": rolled / n,
                "rolled_back_ci": proportion_ci(rolled, n),
                "promoted": promoted / n,
                "promoted_ci": proportion_ci(promoted, n),
                "inconclusive": sum(r["reason"] == "inconclusive" for r in runs) / n,
                "mean_challenger_requests": float(np.mean([r["challenger_requests"] for r in runs])),
                "mean_looks": float(np.mean([r["looks"] for r in runs])),
                "true_effect": float(np.mean([r["true_effect"] for r in runs])),
            }
    return summary


# --- the gate -------------------------------------------------------------------------------------------------


GATE_RULES = ("gate", "point estimate (before)", "not shown worse", "one Holm family", "legacy")


def gate_rates(seeds: int, candidates: int, events_per_day: int, resamples: int, zone: float = 0.05,
               margin: float | None = None) -> dict:
    """Per world seed, candidates of random quality around the champion judged on a logged day of the
    world's own events, against the truth on the evaluation panel (normalized reward). Four rules on the
    same candidates and tests: the gate's (``gate.paired.compare``: overall the estimate must hold or beat
    the champion, device slices refuse when Holm-significantly worse), "not shown worse" (the overall test
    significant at alpha instead of the estimate), the same tests in one Holm family (the rule before), and
    the legacy fixed thresholds. Error rates over all candidates and outside an indifference zone of ``zone``
    (relative normalized reward): a candidate within a few percent of the champion is neither. ``margin``: the
    gate's non-inferiority margin (default: the shipped ``GateThresholds().auc_margin``)."""
    from recloop.gate.paired import HeldOut, PairedConfig, compare

    margin = GateThresholds().auc_margin if margin is None else margin

    records = []
    for seed in range(seeds):
        world = World(WorldConfig(seed=seed, days=3, events_per_day=events_per_day))
        for hour in range(24):  # warm the histories like a real day
            world.hour_events(0, hour)
        logged = [world.hour_events(1, hour) for hour in range(24)]
        users = np.concatenate([t["user_id"].to_numpy() for t in logged])
        items = np.concatenate([t["item_id"].to_numpy() for t in logged])
        labels = np.concatenate([t["label"].to_numpy() for t in logged])
        p = np.concatenate([t["p_click"].to_numpy() for t in logged])
        device = np.concatenate([t["device"].to_numpy(zero_copy_only=False) for t in logged])
        truth = np.log(p) - np.log1p(-p)
        panel = draw_panel(world, 1.5, 3000, CANDIDATES, seed=5)
        panel_truth = true_logits(world, panel)
        champion = SimulatedModel(CHAMPION_NOISE, seed=1)
        rng = np.random.default_rng(seed)
        champ_scores = champion.scores(world, users, items, truth)
        champ_panel = champion.scores(world, panel.users, panel.items, panel_truth)
        for c in range(candidates):
            candidate = SimulatedModel(float(CHAMPION_NOISE * np.exp(rng.normal(0, 0.25))), seed=100 + c)
            scored = score_panel(
                world,
                panel,
                {
                    "champion": champ_panel,
                    "candidate": candidate.scores(world, panel.users, panel.items, panel_truth),
                },
                resamples=10,
            )
            effect = scored["candidate"]["normalized_reward"] / scored["champion"]["normalized_reward"] - 1.0
            cand_scores = candidate.scores(world, users, items, truth)
            # the gate's own comparison at ``margin`` (the shipped GateThresholds().auc_margin unless given), users
            # as the groups
            held = HeldOut(labels, cand_scores, champ_scores, users, users, {"device": device})
            result = compare(held, max_drop=margin, max_slice_drop=0.01, config=PairedConfig(resamples=resamples))
            overall = result.figures["grouped_auc"]
            slices = [v for k, v in result.figures.items() if k.startswith("slice ")]
            # the old rule: pooled AUC may drop 0.002 (incremental), 0.01 per slice of >= 200 rows
            drop = auc(labels, champ_scores) - auc(labels, cand_scores)
            slice_drop = max(
                auc(labels[device == d], champ_scores[device == d])
                - auc(labels[device == d], cand_scores[device == d])
                for d in DEVICES
            )
            records.append(
                {
                    "seed": seed,
                    "effect": float(effect),
                    "auc_difference": overall["difference"],
                    "power": overall["power"],
                    "insufficient": {rule: False for rule in GATE_RULES} | {"gate": bool(result.insufficient)},
                    "refused": {
                        "gate": bool(result.failures),
                        "point estimate (before)": bool(
                            overall["difference"] < 0.0 or any(v["p_worse_holm"] < 0.05 for v in slices)
                        ),
                        "not shown worse": bool(
                            overall["p_worse"] < 0.05 or any(v["p_worse_holm"] < 0.05 for v in slices)
                        ),
                        "one Holm family": bool(
                            (holm([overall["p_worse"], *(v["p_worse"] for v in slices)]) < 0.05).any()
                        ),
                        "legacy": bool(drop > 0.002 or slice_drop > 0.01),
                    },
                }
            )
        print(f"  gate seed {seed}: {candidates} candidates judged", flush=True)
    out: dict = {"zone": zone, "margin": margin, "candidates": records}
    for rule in GATE_RULES:
        out[rule] = {}
        for label, width in (("all", 0.0), (f"outside ±{zone:.0%}", zone)):
            better = [r for r in records if r["effect"] > width]
            worse = [r for r in records if r["effect"] < -width]
            refused = sum(r["refused"][rule] for r in better)
            passed = sum(not r["refused"][rule] and not r["insufficient"][rule] for r in worse)
            undecided = sum(r["insufficient"][rule] for r in records if abs(r["effect"]) > width)
            out[rule][label] = {
                "better": len(better),
                "worse": len(worse),
                "insufficient_evidence": undecided / max(len(better) + len(worse), 1),
                "mean_power": float(np.mean([r["power"] for r in records])),
                "better_refused": refused / max(len(better), 1),
                "better_refused_ci": proportion_ci(refused, len(better)),
                "worse_passed": passed / max(len(worse), 1),
                "worse_passed_ci": proportion_ci(passed, len(worse)),
            }
    return out


# --- concept drift: the monitor's served-feedback check on a stale champion ------------------------------------


def concept_rates(seeds: int, scenarios: tuple[str, ...], requests_per_day: int, days_after: int = 3) -> dict:
    """Per seed and scenario: a champion that knows the world as it was the day before the drift (its true
    click probabilities then: perfectly calibrated until the drift) serves ``requests_per_day`` requests a
    day (top 10 of 30 candidates); each day's predictions on the shown items and the clicks they got go to
    ``monitor.concept.concept_findings`` with every day it served before as the baseline (the monitor's
    rule: the same champion's served history; calibration and online CTR per device). Detection delay (days after
    onset) and false alarms."""
    from recloop.monitor import MonitorConfig
    from recloop.monitor.concept import concept_findings

    config = MonitorConfig()
    drift_day = 3
    out = {}
    for scenario in scenarios:
        delays, alarms, checks = [], 0, 0
        for seed in range(seeds):
            world = World(
                WorldConfig(
                    seed=seed,
                    days=drift_day + days_after,
                    events_per_day=20_000,
                    drift=scenario,
                    drift_day=drift_day,
                )
            )
            rng = np.random.default_rng([seed, 3])
            found_on, before = None, None
            for day in range(drift_day - 2, drift_day + days_after):
                panel = draw_panel(world, day + 0.5, requests_per_day, CANDIDATES, seed=500 + day)
                n, m = panel.items.shape
                stale = world.click_probability(
                    drift_day - 0.5,
                    np.repeat(panel.users, m),
                    panel.items.ravel(),
                    np.repeat(panel.devices, m),
                    np.ones(n * m),
                ).reshape(n, m)
                order = np.argsort(-stale, axis=1)[:, :K]
                items = np.take_along_axis(panel.items, order, axis=1)
                positions = np.tile(np.arange(1, K + 1), (n, 1))
                users = np.repeat(panel.users, K)
                devices = np.repeat(panel.devices, K)
                predicted = world.click_probability(
                    drift_day - 0.5, users, items.ravel(), devices, positions.ravel()
                )
                actual = world.click_probability(day + 0.5, users, items.ravel(), devices, positions.ravel())
                labels = (rng.random(len(actual)) < actual).astype(float)
                window = (labels, predicted, users, {"device": np.asarray(DEVICES)[devices]})
                if before is None:
                    before = window
                    continue
                findings, _ = concept_findings(*window[:3], window[3], config, baseline=before)
                before = (  # its whole served history before the checked day
                    *(np.concatenate([a, b]) for a, b in zip(before[:3], window[:3], strict=True)),
                    {"device": np.concatenate([before[3]["device"], window[3]["device"]])},
                )
                checks += 1
                if findings and (scenario == "none" or day < drift_day):
                    alarms += 1
                if findings and day >= drift_day and found_on is None:
                    found_on = day
            delays.append(None if found_on is None else found_on - drift_day)
        out[scenario] = {
            "seeds": seeds,
            "detected_within_2_days": sum(d is not None and d <= 1 for d in delays) / seeds,
            "detected_ci": proportion_ci(sum(d is not None and d <= 1 for d in delays), seeds),
            "delays": delays,
            "false_alarms": alarms,
            "checks_without_drift": checks if scenario == "none" else seeds,
        }
    return out


# --- the loop itself: seeds × scenarios (the demo, twin worlds) -------------------------------------------------


def loop_grid(
    seeds: int, scenarios: tuple[str, ...], days: int, events_per_day: int, requests_per_day: int, root: str,
    first_seed: int = 0, twin: bool = False, rows_path: str | None = None, reference_seeds: int = 1,
    seeded_training: bool = False,
) -> dict:
    """``recloop demo`` per world seed and scenario, as it ships (``DemoConfig``'s canary, gate and monitor),
    with the daily full retrain as the panel's upper reference: the paired same-panel differences loop −
    never retrained and loop − daily full two cycles after the drift (each run's user-cluster interval; mean
    and t interval across seeds: the primary figures), the day drift was first acted on (detection delay)
    and false alarms on ``none``. With ``twin`` each drifted run also runs its no-drift twin for the twin-world
    recovery (twice the time; its interval across seeds only). ``rows_path``: each finished run is appended there
    as a JSON line (``loop_table`` summarizes such files). ``reference_seeds``: the daily full retrain is the
    mean of this many seeds' retrains (``DemoConfig.reference_seeds``). ``seeded_training``: the loop's and the
    reference's training seed is the world seed (``DemoConfig.train_seed``), so seed effects average out over the
    grid instead of one training seed's luck sitting in every run."""
    from pathlib import Path

    from recloop.cli.base import drop_deprecation_notices
    from recloop.demo import DemoConfig, run_demo
    from recloop.settings import Settings

    drop_deprecation_notices()  # as `recloop demo` does: libraries' notices to their own callers stay out of the log
    runs: dict[str, list[dict]] = {}
    for scenario in scenarios:
        for seed in range(first_seed, first_seed + seeds):
            train_seed = seed if seeded_training else 0
            home = Path(root) / f"{scenario}-{seed}" / "home"
            config = DemoConfig(
                days=days,
                events_per_day=events_per_day,
                requests_per_day=requests_per_day,
                seed=seed,
                drift=scenario,
                drift_day=LOOP_DRIFT_DAY,
                twin=twin and scenario != "none",
                daily_full=True,
                reference_seeds=reference_seeds,
                train_seed=train_seed,
            )
            began = time.perf_counter()
            summary = run_demo(Settings(home=home, frame_backend="pandas"), config)
            decisions = [(d["day"], d["drift"]) for d in summary["days"] if d["day"] > 0]
            acted = [day for day, decision in decisions if decision in ("drift", "kpi_decay") and day >= 2]
            headline = (summary.get("recovery") or {}).get("headline") or {}
            panel = {d["day"]: d["panel"] for d in summary["days"] if d.get("panel")}
            day = config.drift_day + 2 if config.drift_day + 2 in panel else max(panel)
            row = {
                "seed": seed,
                "seconds": time.perf_counter() - began,
                "recovery": headline.get("champion", {}).get("recovery"),
                "recovery_low": headline.get("champion", {}).get("low"),
                "recovery_high": headline.get("champion", {}).get("high"),
                "never_retrained_recovery": headline.get("never_retrained", {}).get("recovery"),
                "loop_minus_frozen": panel[day]["champion"]["normalized_reward"]
                - panel[day]["never_retrained"]["normalized_reward"],
                "loop_minus_daily_full": panel[day]["champion"]["normalized_reward"]
                - panel[day]["daily_full"]["normalized_reward"],
                # the same for the deployment as of the panel (after the day's last canary check): the champion,
                # or within a running canary's share the challenger's ranking or the interleaving
                # (``demo.panel.served_scores``)
                "served_minus_frozen": panel[day]["served"]["normalized_reward"]
                - panel[day]["never_retrained"]["normalized_reward"],
                "served_minus_daily_full": panel[day]["served"]["normalized_reward"]
                - panel[day]["daily_full"]["normalized_reward"],
                # the same differences with the run's own paired user-cluster interval (``demo.paired_efficacy``)
                "paired": (summary.get("paired") or {}).get("per_day", {}).get(day),
                "detection_delay_days": (min(acted) - config.drift_day) if acted else None,
                "false_alarms": sum(decision in ("drift", "kpi_decay") for _, decision in decisions)
                if scenario == "none"
                else None,
                # what the loop decided: the ranker champion each day, its canaries' promotions, retrains
                "champions": [d.get("champion") for d in summary["days"]],
                "promotions": sum(str(c).startswith("promote v") for d in summary["days"] for c in d.get("canary", [])),
                "retrains": [d.get("retrain") for d in summary["days"]],
                # why the monitor decided what it did each day (a false alarm's reason says which check fired)
                "monitor_reasons": [list(d.get("drift_reasons") or []) for d in summary["days"]],
                # each day's canary moves (start, step, promote, rollback, held), and every day's panel by model:
                # where the loop trails the reference, whether a challenger was still in its canary says why
                "canaries": [list(d.get("canary", [])) for d in summary["days"]],
                "panel_by_day": {str(d): {name: figures["normalized_reward"] for name, figures in models.items()
                                      if isinstance(figures, dict) and "normalized_reward" in figures}
                                 for d, models in panel.items()},
            }
            runs.setdefault(scenario, []).append(row)
            print(f"loop {scenario} seed {seed}: {json.dumps(row, default=float)}", flush=True)
            if rows_path:
                line = {"scenario": scenario, **row, "days": days, "events_per_day": events_per_day,
                        "requests_per_day": requests_per_day, "reference_seeds": reference_seeds,
                        "train_seed": train_seed, "seeded_training": seeded_training,
                        "machine": machine()}
                with open(rows_path, "a") as out:
                    out.write(json.dumps(line, default=float) + "\n")
    return {scenario: summarize_scenario(scenario, rows, days) for scenario, rows in runs.items()}


def loop_lanes(args, scratch: str) -> dict:
    """The grid's runs ``--loop-lanes`` at a time, each in a process of its own (``loop.py --loop-seeds 1``) with
    one intra-op thread: on 2 cores, two demos with torch's default two threads each spent much of their time
    in thread pools waiting for a core (a run took ~800 s against ~390 s with one thread each,
    benchmarks/RESULTS.md, issue 36's grid). Seed by seed, so a grid cut short holds every scenario. Each run's
    row goes to ``--loop-rows`` (a file in ``scratch`` if not given); the summary is over this grid's runs."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    rows_path = args.loop_rows or str(Path(scratch) / "rows.jsonl")
    scenarios = tuple(args.scenarios.split(","))
    seeds = range(args.loop_first_seed, args.loop_first_seed + args.loop_seeds)
    jobs = [(scenario, seed) for seed in seeds for scenario in scenarios]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    running: list[tuple[subprocess.Popen, str, int, object]] = []
    while jobs or running:
        while jobs and len(running) < args.loop_lanes:
            scenario, seed = jobs.pop(0)
            log = open(Path(scratch) / f"{scenario}-{seed}.log", "w")  # noqa: SIM115 - closed when the run ends
            command = [sys.executable, __file__, "--skip", "canary,gate,concept", "--loop-seeds", "1",
                       "--loop-first-seed", str(seed), "--scenarios", scenario, "--loop-days", str(args.loop_days),
                       "--loop-events-per-day", str(args.loop_events_per_day),
                       "--loop-requests-per-day", str(args.loop_requests_per_day), "--loop-rows", rows_path,
                       "--loop-reference-seeds", str(args.loop_reference_seeds)]
            command += ["--loop-seeded-training"] if args.loop_seeded_training else []
            command += ["--loop-twin"] if args.loop_twin else []
            command += ["--loop-root", args.loop_root] if args.loop_root else []
            running.append((subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env), scenario, seed,
                            log))
        time.sleep(2)
        for job in list(running):
            process, scenario, seed, log = job
            if process.poll() is None:
                continue
            running.remove(job)
            log.close()
            if process.returncode:
                tail = Path(log.name).read_text()[-2000:]
                print(f"loop {scenario} seed {seed}: failed (exit {process.returncode}); its log ends:\n{tail}",
                      flush=True)
    wanted = {(scenario, seed) for scenario in scenarios for seed in seeds}
    found: dict[tuple[str, int], dict] = {}  # a seed run again in the same file: the newest line counts
    for row in read_runs(rows_path) if Path(rows_path).exists() else []:
        if (row["scenario"], row["seed"]) in wanted:
            found[(row["scenario"], row["seed"])] = row
    rows: dict[str, list[dict]] = {}
    for (scenario, seed), row in sorted(found.items()):
        rows.setdefault(scenario, []).append(row)
        print(f"loop {scenario} seed {seed}: {json.dumps(row, default=float)}", flush=True)
    return {scenario: summarize_scenario(scenario, mine, args.loop_days) for scenario, mine in rows.items()}


def summarize_scenario(scenario: str, rows: list[dict], days: int) -> dict:
    """One scenario's runs: the paired differences' means with t intervals over seeds, the share of runs whose
    drift was acted on within 2 days (Wilson interval), and false alarms on ``none`` (each day after the first
    is a check)."""
    entry: dict = {"runs": rows, "seeds": [r["seed"] for r in rows]}
    rows = [{**r, "newest_minus_daily_full": newest_minus_daily_full(r),
             "served_minus_daily_full_every_day": served_every_day(r)} for r in rows]
    for key in ("recovery", "loop_minus_frozen", "loop_minus_daily_full", "served_minus_frozen",
                "served_minus_daily_full", "newest_minus_daily_full", "served_minus_daily_full_every_day"):
        values = [r[key] for r in rows if r.get(key) is not None]
        if values:
            entry[key] = dict(zip(("mean", "low", "high"), mean_ci(values), strict=True))
    acted = sum(r["detection_delay_days"] is not None and r["detection_delay_days"] <= 1 for r in rows)
    entry["detected_within_2_days"] = acted / len(rows)
    entry["detected_ci"] = proportion_ci(acted, len(rows))
    if scenario == "none":
        entry["false_alarm_checks"] = sum(r["false_alarms"] or 0 for r in rows)
        entry["checks"] = len(rows) * (days - 1)
        entry["false_alarm_ci"] = proportion_ci(entry["false_alarm_checks"], entry["checks"])
    return entry


def newest_minus_daily_full(row: dict) -> float | None:
    """On the headline day's panel, the newest ranker the loop has put in front of users (the running canary's
    challenger, else the champion) minus the daily full retrain: the loop's training against the reference,
    without the day a canary holds a new model back. None for rows without the daily panels or written before
    the panel kept the challenger's figure (their champion would pass for the newest model)."""
    panels = row.get("panel_by_day") or {}
    if not panels:
        return None
    day = LOOP_DRIFT_DAY + 2 if str(LOOP_DRIFT_DAY + 2) in panels else max(int(d) for d in panels)
    panel = panels[str(day)]
    if "daily_full" not in panel or "served" not in panel:  # rows from before the panel kept the challenger
        return None
    return panel.get("challenger", panel["champion"]) - panel["daily_full"]


def served_every_day(row: dict) -> float | None:
    """The loop as served − the daily full retrain, the mean over every day's panel after the first model's
    (days 1..): the headline day alone is often served by the periodic full retrain, the reference's own rows
    and seed (``none``, ``gradual``), so it says more about the canary than about the incremental days between.
    None for rows without the daily panels."""
    panels = row.get("panel_by_day") or {}
    gaps = [p["served"] - p["daily_full"] for p in panels.values() if "served" in p and "daily_full" in p]
    return float(np.mean(gaps)) if gaps else None


def loop_table(paths: list[str]) -> dict:
    """Every full-loop run in ``paths`` (``--loop-rows`` JSON lines, or ``--json`` results with a ``loop`` part)
    summarized by scenario and configuration (days, events and requests a day); a seed found twice counts once
    (the later file wins). Prints a markdown table, with the hosts and commits the runs came from: give it the
    files of one shipped configuration (runs of older defaults are not told apart by their sizes)."""
    found: dict[tuple, dict[int, dict]] = {}
    for path in paths:
        for line in read_runs(path):
            key = (line["scenario"], line["days"], line["events_per_day"], line["requests_per_day"],
                   line.get("reference_seeds", 1), bool(line.get("seeded_training")))
            found.setdefault(key, {})[line["seed"]] = {**line, "source": path.rsplit("/", 1)[-1]}
    order = {name: i for i, name in enumerate(("none", "gradual", "sudden", "covariate"))}
    table = {}
    print("| scenario (days × events, requests a day) | seeds | loop − daily full, mean [t 95 %] | loop as served − "
          "daily full | as served − daily full, mean of every day | newest model − daily full | loop − never "
          "retrained | drift acted on within 2 days | false alarms | hosts at commits |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for key in sorted(found, key=lambda k: (k[1:], order.get(k[0], 9), k[0])):
        scenario, days, events, requests, references, seeded = key
        rows = [found[key][seed] for seed in sorted(found[key])]
        entry = summarize_scenario(scenario, rows, days)
        table[f"{scenario} {days}x{events} {requests}" + (f" reference of {references} seeds" if references > 1
                                                           else "") + (" seeded training" if seeded else "")] = entry
        full, frozen = entry.get("loop_minus_daily_full", {}), entry.get("loop_minus_frozen", {})
        acted = "—" if scenario == "none" else (
            f"{entry['detected_within_2_days']:.0%} [{entry['detected_ci'][0]:.0%}, {entry['detected_ci'][1]:.0%}]")
        alarms = "—" if scenario != "none" else (
            f"{entry['false_alarm_checks']} of {entry['checks']} [{entry['false_alarm_ci'][0]:.0%}, "
            f"{entry['false_alarm_ci'][1]:.0%}]")
        hosts = ", ".join(sorted({f"{(r.get('machine') or {}).get('cpu', '?')} at {(r.get('machine') or {}).get('commit', '?')}"
                                  for r in rows}))
        print(f"| `{scenario}` ({days} × {events:,}, {requests}"
              + (f"; reference: mean of {references} seeds" if references > 1 else "")
              + ("; training seed = world seed" if seeded else "") + f") | {len(rows)} | {_interval(full)} | "
              f"{_interval(entry.get('served_minus_daily_full', {}))} | "
              f"{_interval(entry.get('served_minus_daily_full_every_day', {}))} | "
              f"{_interval(entry.get('newest_minus_daily_full', {}))} | {_interval(frozen)} | {acted} | {alarms} | "
              f"{hosts} |")
    return table


def read_runs(path: str) -> list[dict]:
    """The full-loop runs in one file, each a ``--loop-rows`` line: the file's lines (``.jsonl``), or the ``loop``
    part of a ``--json`` result with its arguments' sizes and machine added."""
    with open(path) as handle:
        text = handle.read()
    if path.endswith(".jsonl"):
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    result = json.loads(text)
    arguments = result.get("arguments", {})
    return [{"scenario": scenario, **row, "days": arguments.get("loop_days", 5),
             "events_per_day": arguments.get("loop_events_per_day"),
             "requests_per_day": arguments.get("loop_requests_per_day"), "machine": result.get("machine")}
            for scenario, entry in result.get("loop", {}).items() for row in entry["runs"]]


def _interval(figure: dict) -> str:
    if not figure:  # a figure older rows do not have
        return "—"
    nan = float("nan")
    return f"{figure.get('mean', nan):+.3f} [{figure.get('low', nan):+.3f}, {figure.get('high', nan):+.3f}]"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=10)
    parser.add_argument(
        "--canaries", type=int, default=50, help="simulated canaries per challenger and method"
    )
    parser.add_argument("--requests-per-look", type=int, default=4000)
    parser.add_argument("--max-looks", type=int, default=40)
    parser.add_argument("--events-per-day", type=int, default=50_000)
    parser.add_argument("--gate-candidates", type=int, default=20, help="candidates per world seed")
    parser.add_argument("--gate-seeds", type=int, default=None)
    parser.add_argument("--gate-margin", type=float, default=None,
                        help="the gate's AUC non-inferiority margin (default: the shipped GateThresholds().auc_margin)")
    parser.add_argument("--resamples", type=int, default=300)
    parser.add_argument("--modes", default="interleave,canary")
    parser.add_argument("--skip", default="", help="comma-separated parts to skip: canary, gate, concept")
    parser.add_argument(
        "--loop-seeds",
        type=int,
        default=0,
        help="world seeds of the full-loop grid (0: skip it; each run is a `recloop demo` with a daily full retrain)",
    )
    parser.add_argument("--loop-first-seed", type=int, default=0, help="the grid's world seeds start here")
    parser.add_argument("--loop-twin", action="store_true", help="each drifted run also runs its no-drift twin "
                        "(the twin-world recovery; twice the time)")
    parser.add_argument("--scenarios", default="sudden,gradual,covariate,none")
    parser.add_argument(
        "--concept-requests", type=int, default=400, help="served requests a day (concept drift)"
    )
    parser.add_argument("--loop-days", type=int, default=5)
    parser.add_argument("--loop-events-per-day", type=int, default=20_000)
    parser.add_argument("--loop-requests-per-day", type=int, default=400)
    parser.add_argument(
        "--loop-root", default=None, help="where the runs' homes go (default: a temporary folder)"
    )
    parser.add_argument("--loop-reference-seeds", type=int, default=1,
                        help="the daily full retrain (the panel's reference) as the mean of this many seeds' retrains")
    parser.add_argument("--loop-seeded-training", action="store_true",
                        help="train the loop and its reference with the world seed as the training seed")
    parser.add_argument("--loop-lanes", type=int, default=1,
                        help="full-loop runs at a time, each a process of its own with one intra-op thread")
    parser.add_argument("--loop-rows", default=None, help="append each finished full-loop run here (JSON lines)")
    parser.add_argument("--loop-table", nargs="+", default=None, metavar="FILE",
                        help="run nothing: summarize the full-loop runs in these files (--loop-rows, --json)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.loop_table:
        table = loop_table(args.loop_table)
        if args.json:
            with open(args.json, "w") as out:
                json.dump({"machine": machine(), "files": args.loop_table, "loop": table}, out, indent=2, default=float)
        return
    skip = set(filter(None, args.skip.split(",")))
    started = time.perf_counter()
    result: dict = {"machine": machine(), "arguments": vars(args)}
    if "canary" not in skip:
        result["canary"] = canary_rates(
            args.seeds,
            args.canaries,
            args.requests_per_look,
            args.max_looks,
            args.events_per_day,
            tuple(args.modes.split(",")),
        )
        for name, rows in result["canary"].items():
            for label, row in rows.items():
                print(
                    f"canary {name:>10} | {label:>10} (true {row['true_effect']:+.1%}): rolled back "
                    f"{row['rolled_back']:.0%} [{row['rolled_back_ci'][0]:.0%}, {row['rolled_back_ci'][1]:.0%}], "
                    f"promoted {row['promoted']:.0%}, inconclusive {row['inconclusive']:.0%}, "
                    f"{row['mean_challenger_requests']:,.0f} challenger requests, n={row['canaries']}",
                    flush=True,
                )
    if "gate" not in skip:
        result["gate"] = gate_rates(
            args.gate_seeds or args.seeds, args.gate_candidates, args.events_per_day, args.resamples,
            margin=args.gate_margin,
        )
        for rule in GATE_RULES:
            for label, row in result["gate"][rule].items():
                print(
                    f"gate {rule:>16} | {label:>12}: panel-better refused {row['better_refused']:.0%} "
                    f"[{row['better_refused_ci'][0]:.0%}, {row['better_refused_ci'][1]:.0%}] of {row['better']}, "
                    f"panel-worse passed {row['worse_passed']:.0%} [{row['worse_passed_ci'][0]:.0%}, "
                    f"{row['worse_passed_ci'][1]:.0%}] of {row['worse']}, insufficient evidence "
                    f"{row['insufficient_evidence']:.0%} (mean power {row['mean_power']:.0%})",
                    flush=True,
                )
    if "concept" not in skip:
        result["concept"] = concept_rates(args.seeds, tuple(args.scenarios.split(",")), args.concept_requests)
        for scenario, row in result["concept"].items():
            print(
                f"concept {scenario:>9}: detected within 2 days {row['detected_within_2_days']:.0%} "
                f"[{row['detected_ci'][0]:.0%}, {row['detected_ci'][1]:.0%}], delays {row['delays']}, "
                f"false alarms {row['false_alarms']} of {row['checks_without_drift']} checks",
                flush=True,
            )
    if args.loop_seeds:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="recloop-loop-") as scratch:
            result["loop"] = loop_lanes(args, scratch) if args.loop_lanes > 1 else loop_grid(
                args.loop_seeds,
                tuple(args.scenarios.split(",")),
                args.loop_days,
                args.loop_events_per_day,
                args.loop_requests_per_day,
                args.loop_root or scratch,
                args.loop_first_seed,
                args.loop_twin,
                args.loop_rows,
                args.loop_reference_seeds,
                args.loop_seeded_training,
            )
        for scenario, entry in result["loop"].items():
            print(
                f"loop {scenario}: recovery {entry.get('recovery')}, loop − frozen {entry.get('loop_minus_frozen')}, "
                f"loop − daily full {entry.get('loop_minus_daily_full')}, "
                f"detected within 2 days {entry['detected_within_2_days']:.0%}",
                flush=True,
            )
    result["seconds"] = time.perf_counter() - started
    print(f"{result['seconds']:.0f} s")
    if args.json:
        with open(args.json, "w") as out:
            json.dump(result, out, indent=2, default=float)


if __name__ == "__main__":
    main()
