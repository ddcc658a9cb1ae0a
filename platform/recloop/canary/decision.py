"""The canary's pure core: which users the challenger serves, and the start / hold / step / promote /
roll-back decision.

Routing is sticky: a user's place in [0, 1) is a hash of their id, and the challenger serves the
users below the current share. Raising the share only adds users, so nobody flips back and forth
between models as the canary grows (5 % → 25 % → 50 % → 100 %).

The controller compares the challenger with the champion over the same period, after a bake time and
enough requests and feedback, on guardrails: error rate, p99 latency, online CTR and online AUC. Any
NaN answer from the challenger rolls it back at once.

Example::

    route(user_id=42, share=0.05)                      # 'champion' or 'challenger', always the same
    decide(champion_stats, challenger_stats, state, CanaryConfig(), now=time.time())
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import asdict, dataclass
from typing import Literal

Variant = Literal["champion", "challenger"]
Action = Literal["start", "hold", "step", "promote", "rollback"]


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
        max_ctr_drop: relative drop of online CTR allowed (0.05 = 5 %).
        max_auc_drop: absolute drop of online AUC allowed (when both have one).
    """

    steps: tuple[float, ...] = (0.05, 0.25, 0.5, 1.0)
    bake_seconds: float = 600.0
    min_requests: int = 500
    min_feedback: int = 200
    max_error_rate_increase: float = 0.01
    max_p99_ratio: float = 1.5
    max_ctr_drop: float = 0.05
    max_auc_drop: float = 0.02


@dataclass(frozen=True)
class VariantStats:
    """What one model version did over a period, from the serving journal: its evaluations (requests,
    errors, NaN answers, p99 of its own scoring time), the feedback on requests it served (impressions,
    clicks) and its online AUC over every impression it scored."""

    requests: int = 0
    errors: int = 0
    nan_responses: int = 0
    p99_ms: float = 0.0
    impressions: int = 0
    clicks: int = 0
    online_auc: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0

    @property
    def ctr(self) -> float:
        return self.clicks / self.impressions if self.impressions else math.nan

    def to_dict(self) -> dict:
        return {**asdict(self), "ctr": None if math.isnan(self.ctr) else self.ctr, "error_rate": self.error_rate}


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


def start(config: CanaryConfig, mode: Literal["canary", "shadow"] = "canary") -> CanaryDecision:
    """Put a new challenger at the first step (in shadow mode it serves nobody and scores everyone)."""
    share = 0.0 if mode == "shadow" else config.steps[0]
    return CanaryDecision("start", share, (f"{mode} started at {share:.0%} of users",), {})


def decide(champion: VariantStats, challenger: VariantStats, state: CanaryState, config: CanaryConfig,
           now: float) -> CanaryDecision:
    """Hold, step the share up, promote (after the last step) or roll back; with reasons and figures."""
    figures = {
        "share": state.share, "challenger_requests": challenger.requests, "champion_requests": champion.requests,
        "challenger_error_rate": challenger.error_rate, "champion_error_rate": champion.error_rate,
        "challenger_p99_ms": challenger.p99_ms, "champion_p99_ms": champion.p99_ms,
        "challenger_ctr": challenger.ctr, "champion_ctr": champion.ctr,
        "challenger_impressions": challenger.impressions, "champion_impressions": champion.impressions,
        "challenger_auc": challenger.online_auc, "champion_auc": champion.online_auc,
    }

    def verdict(action: Action, reasons: list[str], share: float | None = None) -> CanaryDecision:
        return CanaryDecision(action, state.share if share is None else share, tuple(reasons), figures)

    if challenger.nan_responses:
        return verdict("rollback", [f"challenger returned NaN scores {challenger.nan_responses} times"], 0.0)
    baked = now - state.step_started_at
    waiting = []
    if baked < config.bake_seconds:
        waiting.append(f"baking: {config.bake_seconds - baked:.0f} s left at {state.share:.0%}")
    if challenger.requests < config.min_requests:
        waiting.append(f"{challenger.requests}/{config.min_requests} challenger requests")
    if challenger.impressions < config.min_feedback:
        waiting.append(f"{challenger.impressions}/{config.min_feedback} challenger feedback events")
    if waiting:
        return verdict("hold", waiting)

    failures = []
    if challenger.error_rate - champion.error_rate > config.max_error_rate_increase:
        failures.append(f"error rate {challenger.error_rate:.2%} vs champion {champion.error_rate:.2%}")
    if champion.p99_ms > 0 and challenger.p99_ms > config.max_p99_ratio * champion.p99_ms:
        failures.append(f"p99 latency {challenger.p99_ms:.1f} ms vs champion {champion.p99_ms:.1f} ms "
                        f"(at most {config.max_p99_ratio}x)")
    if champion.ctr > 0 and challenger.ctr < champion.ctr * (1 - config.max_ctr_drop):
        failures.append(f"online CTR {challenger.ctr:.4f} vs champion {champion.ctr:.4f} "
                        f"(at most {config.max_ctr_drop:.0%} lower)")
    if challenger.online_auc is not None and champion.online_auc is not None and \
            champion.online_auc - challenger.online_auc > config.max_auc_drop:
        failures.append(f"online AUC {challenger.online_auc:.4f} vs champion {champion.online_auc:.4f}")
    if failures:
        return verdict("rollback", failures, 0.0)
    later = [s for s in config.steps if s > state.share]
    if not later:
        return verdict("promote", [f"held every guardrail up to {state.share:.0%} of users"], 1.0)
    return verdict("step", [f"held every guardrail at {state.share:.0%}: next {later[0]:.0%}"], later[0])
