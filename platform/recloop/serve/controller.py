"""The canary controller: judges the challenger on served traffic and moves the aliases.

State lives on the challenger's model version in MLflow (tags ``canary.share``, ``canary.mode``,
``canary.step_started_at``), so the serving API (which polls them) and this controller (run by
``recloop canary step``, a flow, or the admin API) agree without talking to each other. Traffic comes
from the serving journal. Every decision is logged to an MLflow run of the canary (one run per
challenger: share, guardrail figures per step, each decision as JSON) and as version tags.

Example::

    status(settings)                           # what the controller sees and would decide now
    step(settings, CanaryConfig(bake_seconds=0, min_requests=100, min_feedback=50))
    manual(settings, "rollback", "bad reviews")
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import yaml

from recloop import registry
from recloop.canary import CanaryConfig, CanaryDecision, CanaryState, VariantStats, decide
from recloop.serve.journal import Journal
from recloop.serve.models import MODE_TAG, SHARE_TAG, STARTED_TAG
from recloop.settings import Settings

RUN_TAG = "canary.run_id"
CANARY_STARTED_TAG = "canary.started_at"


class NoCanary(RuntimeError):
    """There is no challenger to act on."""


def load_config(path: str | Path | None) -> CanaryConfig:
    """A CanaryConfig from YAML (keys as the dataclass fields); defaults for what the file leaves out."""
    if path is None:
        return CanaryConfig()
    raw = yaml.safe_load(Path(path).read_text()) or {}
    unknown = set(raw) - set(CanaryConfig.__dataclass_fields__)
    if unknown:
        raise ValueError(f"{path}: unknown canary settings {sorted(unknown)}")
    if "steps" in raw:
        raw["steps"] = tuple(float(s) for s in raw["steps"])
    return CanaryConfig(**raw)


def _challenger(settings: Settings) -> tuple[str, str, dict]:
    challenger = registry.version_by_alias(settings, "challenger")
    champion = registry.version_by_alias(settings, "champion")
    if challenger is None or champion is None:
        raise NoCanary("no canary in progress: there is no 'challenger' (or no 'champion') alias")
    return challenger, champion, registry.version_info(settings, challenger)["tags"]


def start(settings: Settings, config: CanaryConfig, *, mode: str = "canary", now: float | None = None) -> dict:
    """Put the challenger at the first step (called by the gate flow; ``step`` does it when needed)."""
    challenger, _, _ = _challenger(settings)
    now = time.time() if now is None else now
    share = 0.0 if mode == "shadow" else config.steps[0]
    registry.tag(settings, challenger, {SHARE_TAG: share, MODE_TAG: mode, STARTED_TAG: now, CANARY_STARTED_TAG: now})
    return {"version": challenger, "share": share, "mode": mode, "step_started_at": now}


def set_share(settings: Settings, share: float, mode: str | None = None, who: str = "operator") -> dict:
    challenger, _, tags = _challenger(settings)
    mode = mode or tags.get(MODE_TAG, "canary")
    registry.tag(settings, challenger, {SHARE_TAG: share, MODE_TAG: mode, STARTED_TAG: time.time(),
                                        "canary.share_set_by": who})
    return {"version": challenger, "share": share, "mode": mode}


def _journal(settings: Settings) -> Journal:
    return Journal(settings.serving_dir / "journal.db")


def _stats(journal: Journal, version: str, since: float) -> VariantStats:
    traffic = journal.traffic(version, since)
    return VariantStats(requests=traffic.requests, errors=traffic.errors, nan_responses=traffic.nan_responses,
                        p99_ms=traffic.p99_ms, impressions=traffic.impressions, clicks=traffic.clicks,
                        online_auc=traffic.online_auc)


def status(settings: Settings, config: CanaryConfig | None = None, now: float | None = None) -> dict:
    """Versions, share, traffic per variant and the decision the controller would make now (nothing moves)."""
    config = config or CanaryConfig()
    now = time.time() if now is None else now
    aliases = registry.aliases(settings)
    try:
        challenger, champion, tags = _challenger(settings)
    except NoCanary as err:
        return {"active": False, "aliases": aliases, "message": str(err)}
    started = float(tags.get(STARTED_TAG, now))
    state = CanaryState(float(tags.get(SHARE_TAG, config.steps[0])), started)
    journal = _journal(settings)
    try:
        stats = {"champion": _stats(journal, champion, started), "challenger": _stats(journal, challenger, started)}
        if stats["champion"].requests < config.min_requests:
            # At 100 % the champion serves nobody: compare with what it did since the canary began.
            stats["champion"] = _stats(journal, champion, float(tags.get(CANARY_STARTED_TAG, started)))
    finally:
        journal.close()
    if tags.get(MODE_TAG) == "shadow":  # the challenger answered nobody: judge its CTR by the champion's
        stats["challenger"] = _shadowed(stats["challenger"], stats["champion"])
    decision = decide(stats["champion"], stats["challenger"], state, config, now)
    return {"active": True, "aliases": aliases, "challenger": challenger, "champion": champion,
            "share": state.share, "mode": tags.get(MODE_TAG, "canary"), "step_started_at": started,
            "started": STARTED_TAG in tags, "stats": {k: vars(v) | {"ctr": v.ctr, "error_rate": v.error_rate}
                                                      for k, v in stats.items()},
            "decision": decision.to_dict()}


def _shadowed(challenger: VariantStats, champion: VariantStats) -> VariantStats:
    """In shadow mode only errors, NaNs, latency and online AUC (on the champion's feedback) say anything."""
    return VariantStats(requests=challenger.requests, errors=challenger.errors,
                        nan_responses=challenger.nan_responses, p99_ms=challenger.p99_ms,
                        impressions=champion.impressions, clicks=champion.clicks, online_auc=challenger.online_auc)


def step(settings: Settings, config: CanaryConfig | None = None, now: float | None = None) -> dict:
    """Judge the challenger and act: hold, step the share up, promote, or roll back. Logged to MLflow."""
    config = config or CanaryConfig()
    now = time.time() if now is None else now
    current = status(settings, config, now)
    if not current["active"]:
        return {"action": "none", **current}
    if not current["started"]:
        started = start(settings, config, now=now)
        return {**current, "action": "start", "share": started["share"],
                "decision": {"action": "start", "share": started["share"], "figures": {},
                             "reasons": [f"canary started at {started['share']:.0%} of users"]}}
    decision = CanaryDecision(**{**current["decision"], "reasons": tuple(current["decision"]["reasons"])})
    _apply(settings, current["challenger"], decision, current["mode"], who="canary-controller", now=now)
    _log(settings, current, decision)
    return {**current, "action": decision.action, "share": decision.share}


def manual(settings: Settings, action: str, reason: str, who: str = "operator") -> dict:
    """An operator's promote or roll back of the challenger (or, with no challenger, of the champion)."""
    challenger = registry.version_by_alias(settings, "challenger")
    if challenger is None:
        if action == "rollback" and registry.version_by_alias(settings, "previous"):
            return {"action": "rollback", "target": "champion",
                    "aliases": registry.rollback(settings, who=who, why=reason)}
        raise NoCanary(f"nothing to {action}: no challenger" + (" and no previous champion" if action == "rollback"
                                                               else ""))
    current = status(settings)
    decision = CanaryDecision(action, 1.0 if action == "promote" else 0.0, (f"manual {action} by {who}: {reason}",),
                              current.get("decision", {}).get("figures", {}))
    _apply(settings, challenger, decision, current.get("mode", "canary"), who=who, now=time.time())
    _log(settings, current, decision)
    return {"action": action, "target": "challenger", "version": challenger, "aliases": registry.aliases(settings)}


def _apply(settings: Settings, challenger: str, decision: CanaryDecision, mode: str, who: str, now: float) -> None:
    reasons = json.dumps(list(decision.reasons))
    if decision.action == "step":
        registry.tag(settings, challenger, {SHARE_TAG: decision.share, STARTED_TAG: now})
    elif decision.action == "promote":
        # The KPIs it earned in the canary are its baseline: the drift monitor judges decay against them.
        baseline = {f"kpi.baseline_{k}": decision.figures.get(f"challenger_{k}") for k in ("ctr", "auc", "impressions")}
        registry.tag(settings, challenger, {"canary.outcome": "promoted", "canary.reasons": reasons,
                                            **{k: v for k, v in baseline.items() if v is not None and v == v}})
        registry.promote(settings, challenger, who=who, why="; ".join(decision.reasons))
    elif decision.action == "rollback":
        registry.tag(settings, challenger, {"canary.outcome": "rolled_back", "canary.reasons": reasons,
                                            SHARE_TAG: 0.0})
        registry.remove_alias(settings, "challenger")


def _log(settings: Settings, current: dict, decision: CanaryDecision) -> None:
    """Append the decision to the challenger's canary run in MLflow (created on the first decision)."""
    import mlflow
    from mlflow import MlflowClient

    experiment = registry.configure(settings)
    client = MlflowClient()
    version = current["challenger"]
    tags = registry.version_info(settings, version)["tags"]
    run_id = tags.get(RUN_TAG)
    if run_id is None:
        run = client.create_run(experiment, run_name=f"canary-v{version}", tags={
            "recloop.kind": "canary", "recloop.version": version, "recloop.champion": current["champion"]})
        run_id = run.info.run_id
        registry.tag(settings, version, {RUN_TAG: run_id})
    decisions = [m.step for m in client.get_metric_history(run_id, "share")]
    index = len(decisions)
    metrics = {"share": decision.share, "action_code": {"hold": 0, "step": 1, "promote": 2, "rollback": -1}[
        decision.action]}
    metrics.update({("judged_share" if k == "share" else k): float(v) for k, v in decision.figures.items()
                    if isinstance(v, int | float) and v == v})  # "share" stays the share after the decision
    with mlflow.start_run(run_id=run_id):
        mlflow.log_metrics(metrics, step=index)
        mlflow.log_dict({"decision": decision.to_dict(), "stats": current.get("stats"), "at": time.time()},
                        f"canary/decision-{index:03d}.json")
        mlflow.set_tags({"canary.last_action": decision.action, "canary.last_reasons": "; ".join(decision.reasons)})
    registry.tag(settings, version, {"canary.last_action": decision.action,
                                     "canary.last_reasons": "; ".join(decision.reasons)[:4000]})
    if decision.action in ("promote", "rollback"):
        client.set_terminated(run_id, "FINISHED")
