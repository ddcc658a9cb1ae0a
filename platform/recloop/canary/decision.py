"""The canary's pure core: which users the challenger serves, and the start / hold / step / promote /
roll-back decision.

Routing is sticky: a user's place in [0, 1) is a hash of their id, and the challenger serves the
users below the current share. Raising the share only adds users, so nobody flips back and forth
between models as the canary grows (5 % → 25 % → 50 % → 100 %).

The controller compares the challenger with the champion over the same period on guardrails, each judged
after the bake time once its own figures rest on enough traffic: error rate and p99 latency
(``min_requests``). Online CTR and online AUC are compared *paired* only (their evidence needs
``min_feedback``): the CTR on interleaved requests or a randomized A/B split (``evidence``), the AUC on both
models' scores for the same impressions (``auc_evidence``), never one model's figure over its users against
the other's over different users (user mix alone moved the pooled AUCs past the margin in a quarter of an
identical challenger's canaries). A failed guardrail then rolls it back
whatever else is still awaited; the other counts and the evidence only hold back a step or a promotion.
Any NaN answer from the challenger rolls it back at once.

Online CTR is judged on paired evidence (``evidence``, a ``recloop.evidence.sequential.Difference``) when
the controller has it: by default the canary *interleaves* (team-draft) the two rankings for the share of
requests, so each such request compares both models on the same user; in ``canary`` (A/B) mode the
per-user CTRs are compared with CUPED and user-cluster errors. Either way the interval is always-valid
(mSPRT), so looking at every step does not inflate the error: the challenger is rolled back when it is
significantly worse (the interval's top below 0) at any step, and is promoted from the last step only
when it is non-inferior (the interval's bottom above ``-min_effect``); held there otherwise, until
``max_users`` without an answer rolls it back as inconclusive. Earlier steps ride on the guardrails and
on "not significantly worse", so traffic grows while the evidence accumulates. Each experiment hashes users with its own salt (``experiment_salt``), and the last step
keeps a champion holdout of ``holdout`` users.

The retriever's canary is an A/B split (interleaving merges rankings, not candidate sets): its evidence is
the same CUPED A/B comparison of the users' CTR under each retriever, used to roll back a retriever that
is significantly worse; its promotion rides on the guardrails (an A/B test at a retriever's traffic rarely
shows non-inferiority within a step, and the raw CTR ratio it replaces rolled back identical challengers).

Example::

    route(user_id=42, share=0.05)                      # 'champion' or 'challenger', always the same
    decide(champion_stats, challenger_stats, state, CanaryConfig(), now=time.time())
"""

from __future__ import annotations

import hashlib
import math
import uuid
from dataclasses import asdict, dataclass
from typing import Literal

from recloop.evidence.variants import VariantStats

Variant = Literal["champion", "challenger"]
Action = Literal["start", "hold", "step", "promote", "rollback"]
Mode = Literal["interleave", "canary", "shadow"]


def experiment_salt(challenger: str, started_at: float) -> str:
    """A new salt per experiment: which users a canary gets is independent of every earlier canary's
    split (a fixed salt put the same heavy user in the champion group every time)."""
    return f"recloop-canary-v{challenger}-{int(started_at * 1000)}-{uuid.uuid4().hex[:8]}"


def position(user_id: int | str, salt: str = "recloop-canary") -> float:
    """A user's fixed place in [0, 1): a hash of the id (a new salt reshuffles everybody)."""
    digest = hashlib.blake2b(f"{salt}:{user_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


def route(user_id: int | str, share: float, salt: str = "recloop-canary") -> Variant:
    """``challenger`` for the users whose place is below ``share``, ``champion`` for the others."""
    return "challenger" if position(user_id, salt) < share else "champion"


@dataclass(frozen=True)
class CanaryConfig:
    """Guardrails and pace of a canary.

    Args:
        steps: the challenger's share of users, step by step; the last step reached means promote.
        bake_seconds: time at a step before it is judged.
        min_requests, min_feedback: traffic the challenger must have seen at a step to be judged.
        max_error_rate_increase: absolute increase of the error rate allowed over the champion.
        max_p99_ratio: challenger p99 scoring latency (the model's own time per request) at most this
            multiple of the champion's.
        max_auc_drop: the online AUC margin: the challenger is rolled back when its AUC *on the same
            impressions as the champion's* (paired: interleaved, shadowed or paired requests) is shown, by
            the always-valid interval, more than this below the champion's (also the test's mixing scale).
        mode: ``interleave`` (default for rankers: team-draft interleaving of both rankings for the share
            of requests), ``canary`` (A/B by user) or ``shadow``.
        min_effect: the smallest relative CTR difference that matters: the always-valid test is tuned to
            it, and a challenger whose interval's bottom is above ``-min_effect`` is non-inferior.
        alpha: the sequential test's error rate over every look of the experiment.
        max_users: users with evidence after which an undecided challenger is rolled back as inconclusive.
        holdout: the share of users the champion keeps at the last step (promotion is judged against them).
    """

    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    bake_seconds: float = 600.0
    min_requests: int = 500
    min_feedback: int = 200
    max_error_rate_increase: float = 0.01
    max_p99_ratio: float = 1.5
    max_auc_drop: float = 0.01
    mode: Mode = "interleave"
    min_effect: float = 0.05
    alpha: float = 0.05
    max_users: int = 200_000
    holdout: float = 0.05

    def schedule(self) -> tuple[float, ...]:
        """The shares step by step: the last one (100 %) keeps the champion holdout."""
        last = self.steps[-1]
        return (*self.steps[:-1], last - self.holdout) if last >= 1.0 and self.holdout > 0 else self.steps


# What a canary judges by (the shipped values are ``CanaryConfig()``'s) and what only sets its pace: a
# deployment (the demo, a benchmark, a busy or a quiet site) may change the pace, never the margins, so every
# canary promotes and rolls back by the same standard (the demo once ran at a 30 % minimum effect and no AUC
# guardrail, and promoted a quarter of 10 %-worse challengers).
MARGINS = ("max_error_rate_increase", "max_p99_ratio", "max_auc_drop", "min_effect", "alpha")
PACE = ("steps", "bake_seconds", "min_requests", "min_feedback", "max_users", "holdout", "mode")


def shipped(**pace) -> CanaryConfig:
    """The shipped canary (``CanaryConfig()``'s margins) at a pace of one's own (``PACE`` fields only).

    Example::

        shipped(steps=(0.5, 1.0), bake_seconds=0, min_requests=15)   # the demo's small world
    """
    margins = sorted(set(pace) - set(PACE))
    if margins:
        raise ValueError(f"{margins} are the canary's margins, the same for every deployment: only "
                         f"{', '.join(PACE)} set a canary's pace")
    return CanaryConfig(**pace)


@dataclass(frozen=True)
class CanaryState:
    share: float
    step_started_at: float


@dataclass(frozen=True)
class CanaryDecision:
    """What to do with the challenger, the share of users it serves afterwards, why, and the figures."""

    action: Action
    share: float
    reasons: tuple[str, ...]
    figures: dict[str, float | None]

    def to_dict(self) -> dict:
        out = asdict(self)
        out["reasons"] = list(self.reasons)
        return out


def start(config: CanaryConfig, mode: Mode | None = None) -> CanaryDecision:
    """Put a new challenger at the first step (in shadow mode it serves nobody and scores everyone)."""
    mode = mode or config.mode
    share = 0.0 if mode == "shadow" else config.steps[0]
    return CanaryDecision("start", share, (f"{mode} started at {share:.0%} of users",), {})


def decide(champion: VariantStats, challenger: VariantStats, state: CanaryState, config: CanaryConfig,
           now: float, load_error: str | None = None, evidence=None,
           require_non_inferiority: bool = True, auc_evidence=None, shown_offline: bool = False) -> CanaryDecision:
    """Hold, step the share up, promote (after the last step) or roll back; with reasons and figures.

    ``load_error``: why a serving process could not load the challenger; it is rolled back at once.
    ``evidence``: the paired CTR comparison (a ``Difference``: relative challenger − champion with its
    always-valid interval); the online CTR is judged on it alone. Without it (shadow: the challenger served
    nobody) the CTR is not judged: the two variants' CTRs are over different users, and their raw ratio
    rolled back identical challengers on user mix alone.
    ``auc_evidence``: the paired online AUC comparison (a ``Difference`` of challenger − champion AUC on
    the same impressions, ``evidence.sequential.paired_auc_difference``); the AUC guardrail is judged on it
    alone. The two variants' own pooled AUCs (``VariantStats.online_auc``, over different users) are
    reported in the figures, never compared.
    ``require_non_inferiority``: promotion from the last step needs the evidence to show non-inferiority
    (the ranker's rule). False (the retriever's A/B canary): the evidence only rolls back a challenger it
    shows significantly worse, and promotion rides on the guardrails.
    ``shown_offline``: the gate showed the challenger non-inferior on the held-out window (its paired test
    passed, not "insufficient evidence"): non-inferiority need not be shown a second time online, where a
    day of modest traffic cannot reach a 5 % margin (a challenger +45 % [−5 %, +95 %] after three simulated
    days was held for ever and the loop kept its day-0 model). The online evidence still rolls back what it
    shows significantly worse, on CTR or on the paired AUC; only a challenger that reached the canary on
    insufficient offline evidence must show non-inferiority online.
    """
    require_non_inferiority = require_non_inferiority and not shown_offline
    figures = {
        "share": state.share, "challenger_requests": challenger.requests, "champion_requests": champion.requests,
        "challenger_error_rate": challenger.error_rate, "champion_error_rate": champion.error_rate,
        "challenger_p99_ms": challenger.p99_ms, "champion_p99_ms": champion.p99_ms,
        "challenger_p99_low_ms": challenger.p99_low_ms,
        "champion_p99_high_ms": None if champion.p99_high_ms == math.inf else champion.p99_high_ms,
        "challenger_ctr": challenger.ctr, "champion_ctr": champion.ctr,
        "challenger_impressions": challenger.impressions, "champion_impressions": champion.impressions,
        "challenger_auc": challenger.online_auc, "champion_auc": champion.online_auc,
    }

    def verdict(action: Action, reasons: list[str], share: float | None = None) -> CanaryDecision:
        return CanaryDecision(action, state.share if share is None else share, tuple(reasons), figures)

    if load_error:
        return verdict("rollback", [f"challenger does not load in serving: {load_error}"], 0.0)
    if challenger.nan_responses:
        return verdict("rollback", [f"challenger returned NaN scores {challenger.nan_responses} times"], 0.0)
    # After the bake (a model just loaded answers its first requests slowly, or times out), a guardrail is
    # judged as soon as its own figures rest on enough traffic, whatever else is still awaited: the
    # evidence and the other counts only hold back a step or a promotion, never a rollback (a challenger
    # failing 40 % of its requests was held at 95 % of users until max_users, waiting for non-inferiority).
    # A challenger's failed request is answered by the champion, so the feedback it gets is the champion's:
    # the error and latency guardrails must not wait for feedback (a challenger failing every request had
    # none, and was held for ever).
    baked = now - state.step_started_at
    judged = baked >= config.bake_seconds
    enough_requests = challenger.requests >= config.min_requests
    enough_feedback = challenger.impressions >= config.min_feedback
    failures = []
    if judged and enough_requests and challenger.error_rate - champion.error_rate > config.max_error_rate_increase:
        failures.append(f"error rate {challenger.error_rate:.2%} vs champion {champion.error_rate:.2%}")
    # Latency on evidence, not on two maxima: the challenger's p99 is surely (95 %) above the allowed multiple
    # of the champion's surely-not-exceeded p99 (``evidence.variants.p99_bounds``; hand-built figures without
    # bounds compare the point p99s).
    slow_low = challenger.p99_ms if challenger.p99_low_ms is None else challenger.p99_low_ms
    fast_high = champion.p99_ms if champion.p99_high_ms is None else champion.p99_high_ms
    if judged and enough_requests and champion.p99_ms > 0 and slow_low > config.max_p99_ratio * fast_high:
        failures.append(f"p99 latency {challenger.p99_ms:.1f} ms vs champion {champion.p99_ms:.1f} ms "
                        f"(at most {config.max_p99_ratio}x; 95 % bounds: at least {slow_low:.1f} ms against at "
                        f"most {fast_high:.1f} ms)")
    if auc_evidence is not None:
        figures.update({"auc_effect": auc_evidence.estimate, "auc_effect_low": auc_evidence.low,
                        "auc_effect_high": auc_evidence.high, "auc_evidence_users": auc_evidence.units})
        # paired on the same impressions, always-valid: judged at any look (no bake), like the CTR evidence
        if auc_evidence.high < -config.max_auc_drop and enough_requests and enough_feedback:
            failures.append(f"online AUC significantly worse on the same impressions ({auc_evidence.method}): "
                            f"{auc_evidence.estimate:+.4f} [{auc_evidence.low:+.4f}, {auc_evidence.high:+.4f}], "
                            f"more than {config.max_auc_drop} below the champion, always-valid at alpha "
                            f"{config.alpha}")
    if evidence is not None:
        figures.update({"ctr_effect": evidence.estimate, "ctr_effect_low": evidence.low,
                        "ctr_effect_high": evidence.high, "evidence_users": evidence.units,
                        "evidence_method": evidence.method})
        # always-valid (mSPRT): a look at any time keeps its error rate, so no bake is needed to act on it
        if evidence.high < 0 and enough_requests and enough_feedback:
            failures.append(f"online CTR significantly worse ({evidence.method}): {evidence.estimate:+.1%} "
                            f"[{evidence.low:+.1%}, {evidence.high:+.1%}], always-valid at alpha {config.alpha}")
    if failures:
        return verdict("rollback", failures, 0.0)

    waiting = []
    if baked < config.bake_seconds:
        waiting.append(f"baking: {config.bake_seconds - baked:.0f} s left at {state.share:.0%}")
    if not enough_requests:
        waiting.append(f"{challenger.requests}/{config.min_requests} challenger requests")
    if not enough_feedback:
        waiting.append(f"{challenger.impressions}/{config.min_feedback} challenger feedback events")
    if evidence is not None:
        last_step = not [s for s in config.schedule() if s > state.share + 1e-9]
        if require_non_inferiority and last_step and not evidence.low > -config.min_effect:  # promotion
            if evidence.units >= config.max_users:  # needs non-inferiority shown (steps ride on guardrails)
                return verdict("rollback", [f"inconclusive after {evidence.units} users: online CTR "
                                            f"{evidence.estimate:+.1%} [{evidence.low:+.1%}, {evidence.high:+.1%}] "
                                            f"not shown within {config.min_effect:.0%} of the champion"], 0.0)
            waiting.append(f"online CTR {evidence.estimate:+.1%} [{evidence.low:+.1%}, {evidence.high:+.1%}]: "
                           f"not yet shown within {config.min_effect:.0%} of the champion")
    if waiting:
        return verdict("hold", waiting)
    later = [s for s in config.schedule() if s > state.share + 1e-9]
    # The evidence that allowed the move is named in its reason: a promotion decided by the paired comparison
    # while the raw CTRs (different users, mixed lists) read the other way must say so on its own.
    shown = []
    if evidence is not None:
        rule = (f"non-inferior: its bottom is above −{config.min_effect:.0%}"
                if require_non_inferiority and not later else "not significantly worse" + (
                    " (non-inferiority shown offline by the gate)" if shown_offline and not later else ""))
        shown = [f"online CTR ({evidence.method}) {evidence.estimate:+.1%} [{evidence.low:+.1%}, "
                 f"{evidence.high:+.1%}] over {evidence.units} users: {rule}"]
    if not later:
        return verdict("promote", [*shown, f"held every guardrail up to {state.share:.0%} of users"], 1.0)
    return verdict("step", [*shown, f"held every guardrail at {state.share:.0%}: next {later[0]:.0%}"], later[0])
