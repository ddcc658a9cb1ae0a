"""The canary controller (IO): judges the challenger on served traffic and moves the aliases.

State lives on the challenger's model version in MLflow, in one JSON tag ``canary`` (``canary.tag``:
state, share, mode, salt, when each step began, the last decision), so the serving API (which polls it)
and this controller (run by ``recloop canary step``, a flow, or the admin API) agree without talking to
each other; each change is one tag write. Traffic comes from the serving journal. Every decision is
logged to an MLflow run of the canary in the ``recloop-canary`` experiment (one run per challenger:
share, guardrail figures per step, each decision as JSON). The decision itself is
``canary.decision.decide``.

Example::

    status(settings)                           # what the controller sees and would decide now
    step(settings, CanaryConfig(bake_seconds=0, min_requests=100, min_feedback=50))
    manual(settings, "rollback", "bad reviews")
    step(settings, model_name="recloop-retriever")   # the retriever's canary, independent of the ranker's

Every function takes ``model_name``: the ranker (``recloop-ranker``, the default) and the retriever
(``recloop-retriever``) each have their own challenger, tag, share and canary run. The retriever is
judged on its own journal rows (``Journal.retriever_stats``: its retrievals' errors and latency, the
clicks of the answers it retrieved for); the guardrails are the same ``decide``.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import numpy as np

from recloop import registry
from recloop.canary.decision import (
    CanaryConfig,
    CanaryDecision,
    CanaryState,
    VariantStats,
    decide,
    experiment_salt,
)
from recloop.canary.decision import start as first_step
from recloop.canary.tag import (
    KPI_BASELINE_TAG,
    LOAD_FAILED_TAG,
    CanaryTag,
    Mode,
    kpi_baseline_tag,
    load_failure,
)
from recloop.journal import open_journal
from recloop.registry import MODEL_NAME, RETRIEVER_NAME
from recloop.settings import Settings

EXPERIMENT = "recloop-canary"
__all__ = ["LOAD_FAILED_TAG", "KPI_BASELINE_TAG", "CanaryStatus", "CanaryStep", "ManualResult", "NoCanary",
           "manual", "running", "set_share", "start", "status", "step"]
PRE_PERIOD_SECONDS = 7 * 86400  # CUPED's covariate: each user's clicks in this long before the canary


class NoCanary(RuntimeError):
    """There is no challenger to act on."""


class CanaryModeError(ValueError):
    """A mode the model's challenger cannot serve in."""


def load_config(path: str | Path | None) -> CanaryConfig:
    """A CanaryConfig from YAML/JSON (keys as the dataclass fields); defaults for what the file leaves out."""
    from recloop.config_files import load_dataclass

    return CanaryConfig() if path is None else load_dataclass(path, CanaryConfig)


@dataclass(frozen=True)
class CanaryStatus:
    """What the controller sees: the versions, the challenger's share and mode, each variant's traffic
    since the step began, and the decision it would make now (``None`` when no canary is in progress)."""

    active: bool
    aliases: dict[str, str | None]
    message: str = ""
    challenger: str | None = None
    champion: str | None = None
    share: float = 0.0
    mode: Mode = "canary"
    step_started_at: float | None = None
    started: bool = False
    stats: dict[str, VariantStats] = field(default_factory=dict)
    decision: CanaryDecision | None = None
    evidence: dict | None = None
    model: str = MODEL_NAME
    auc_evidence: dict | None = None  # the paired online AUC comparison (the ranker's)

    def to_dict(self) -> dict:
        return {"model": self.model, "active": self.active, "aliases": self.aliases, "message": self.message,
                "challenger": self.challenger, "champion": self.champion, "share": self.share, "mode": self.mode,
                "step_started_at": self.step_started_at, "started": self.started,
                "stats": {name: stats.to_dict() for name, stats in self.stats.items()},
                "evidence": _json_ready(self.evidence), "auc_evidence": _json_ready(self.auc_evidence),
                "decision": _json_ready(self.decision.to_dict()) if self.decision else None}


@dataclass(frozen=True)
class CanaryStep:
    """What one controller step did: the status it judged and the decision it acted on (``None``: there
    was no canary to act on)."""

    status: CanaryStatus
    decision: CanaryDecision | None

    @property
    def action(self) -> str:
        return self.decision.action if self.decision else "none"

    def to_dict(self) -> dict:
        share = self.decision.share if self.decision else self.status.share
        return {**self.status.to_dict(), "action": self.action, "share": share,
                "decision": _json_ready(self.decision.to_dict()) if self.decision else None}


def _json_ready(value):
    """NaN (a CTR with no impressions) as null: the output is JSON, not Python's repr of it."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _json_ready(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_ready(v) for v in value]
    return value


def check_model(model_name: str) -> str:
    """``model_name`` if the canary knows it (the ranker or the retriever), else a ValueError."""
    if model_name not in (MODEL_NAME, RETRIEVER_NAME):
        raise ValueError(f"no model {model_name!r} here: choose {MODEL_NAME} or {RETRIEVER_NAME}")
    return model_name


def _challenger(settings: Settings, model_name: str = MODEL_NAME) -> tuple[str, str, dict]:
    challenger = registry.version_by_alias(settings, "challenger", model_name)
    champion = registry.version_by_alias(settings, "champion", model_name)
    if challenger is None or champion is None:
        raise NoCanary(f"no canary of {model_name} in progress: there is no 'challenger' (or no 'champion') alias")
    return challenger, champion, registry.version_info(settings, challenger, model_name).tags


def running(settings: Settings, model_name: str = MODEL_NAME) -> str | None:
    """The challenger version whose canary is in progress (started, not yet promoted or rolled back), else None.

    Cheap (aliases and one version's tags, no journal): the retrain flow asks it before a scheduled incremental
    retrain, which waits for the decision rather than replace the challenger and reset its evidence.

    Example::

        version = running(settings)                          # "2" while v2's canary runs
        running(settings, model_name=RETRIEVER_NAME)         # the retriever's, independently
    """
    found = running_tag(settings, model_name)
    return found[0] if found is not None else None


def running_tag(settings: Settings, model_name: str = MODEL_NAME) -> tuple[str, CanaryTag] | None:
    """``running``'s version with its canary tag (share, start time), from the same one read of its tags."""
    try:
        challenger, _, tags = _challenger(settings, check_model(model_name))
    except NoCanary:
        return None
    tag = CanaryTag.from_tags(tags)
    return (challenger, tag) if tag is not None and tag.state == "running" else None


def _update(settings: Settings, version: str, model_name: str, **changes) -> CanaryTag:
    """Set fields of the version's ``canary`` tag: read it, change it, write it back in one tag write."""
    current = CanaryTag.from_tags(registry.version_info(settings, version, model_name).tags) or CanaryTag()
    updated = replace(current, **changes)
    registry.tag(settings, version, updated.to_tag(), model_name)
    return updated


def _mode_for(mode: Mode, model_name: str) -> Mode:
    """``mode`` as ``model_name``'s canary can run it: interleaving merges two rankings, the ranker's; a
    retriever's canary is then an A/B split."""
    return "canary" if mode == "interleave" and model_name != MODEL_NAME else mode


def set_challenger(settings: Settings, version: str, *, who: str | None = None, why: str = "",
                   model_name: str = MODEL_NAME) -> None:
    """Make ``version`` the challenger. A challenger it replaces whose canary was still running is marked
    ``superseded`` in its ``canary`` tag (share 0, the reason), so no version is left saying "running"."""
    old = registry.version_by_alias(settings, "challenger", model_name)
    if old is not None and old != version:
        tag_ = CanaryTag.from_tags(registry.version_info(settings, old, model_name).tags)
        if tag_ is not None and tag_.state == "running":
            registry.tag(settings, old, replace(tag_, state="superseded", share=0.0, reasons=(
                f"superseded by v{version} before a decision ({who or 'unknown'}: {why})",)).to_tag(), model_name)
    registry.set_alias(settings, "challenger", version, who=who, why=why, model_name=model_name)


def start(settings: Settings, config: CanaryConfig, *, mode: Mode | None = None, now: float | None = None,
          model_name: str = MODEL_NAME) -> CanaryStep:
    """Put the challenger at the first step (the retrain flow does it after a passed gate), with a new
    salt for this experiment's split of users; ``mode`` defaults to the config's (interleave)."""
    challenger, champion, _ = _challenger(settings, check_model(model_name))
    now = time.time() if now is None else now
    mode = _mode_for(mode or config.mode, model_name)
    decision = first_step(config, mode)
    registry.tag(settings, challenger, CanaryTag(share=decision.share, mode=mode, salt=experiment_salt(challenger, now),
                                                 started_at=now, step_started_at=now).to_tag(), model_name)
    started = CanaryStatus(True, registry.aliases(settings, model_name), "", challenger, champion, decision.share,
                           mode, now, True, model=model_name)
    return CanaryStep(started, decision)


def set_share(settings: Settings, share: float, mode: Mode | None = None, who: str = "operator",
              model_name: str = MODEL_NAME) -> dict:
    challenger, _, tags = _challenger(settings, check_model(model_name))
    current = CanaryTag.from_tags(tags)
    mode = mode or (current.mode if current else "canary")
    if mode == "interleave" and model_name != MODEL_NAME:
        raise CanaryModeError(f"{model_name}'s challenger cannot interleave: interleaving merges two rankings, "
                              "the ranker's; use canary or shadow")
    _update(settings, challenger, model_name, share=share, mode=mode, step_started_at=time.time(), share_set_by=who)
    return {"version": challenger, "share": share, "mode": mode}


def _variant_stats(journal, model_name: str, version: str, since: float) -> VariantStats:
    """A version's traffic: the ranker's by the versions that scored, the retriever's by its own rows."""
    if model_name == RETRIEVER_NAME:
        return journal.retriever_stats(version, since=since)
    return journal.stats(version, since=since)


def status(settings: Settings, config: CanaryConfig | None = None, now: float | None = None,
           model_name: str = MODEL_NAME) -> CanaryStatus:
    """Versions, share, traffic per variant and the decision the controller would make now (nothing moves)."""
    config = config or CanaryConfig()
    now = time.time() if now is None else now
    aliases = registry.aliases(settings, check_model(model_name))
    try:
        challenger, champion, tags = _challenger(settings, model_name)
    except NoCanary as err:
        return CanaryStatus(active=False, aliases=aliases, message=str(err), model=model_name)
    tag = CanaryTag.from_tags(tags)
    started = tag.step_started_at if tag and tag.step_started_at is not None else now
    state = CanaryState(tag.share if tag else config.steps[0], started)
    mode: Mode = tag.mode if tag else _mode_for(config.mode, model_name)  # not started: as it will start
    canary_started = tag.started_at if tag and tag.started_at is not None else started
    journal = open_journal(settings)  # every replica's traffic when the journal is PostgreSQL
    evidence = auc_evidence = None
    try:
        stats = {"champion": _variant_stats(journal, model_name, champion, started),
                 "challenger": _variant_stats(journal, model_name, challenger, started)}
        if stats["champion"].requests < config.min_requests:
            # At 100 % the champion serves nobody: compare with what it did since the canary began.
            stats["champion"] = _variant_stats(journal, model_name, champion, canary_started)
        if mode != "shadow" and model_name == MODEL_NAME:  # accumulates over the whole experiment (always-valid)
            evidence = paired_evidence(journal, mode, champion, challenger, canary_started, config)
        elif mode == "canary" and model_name == RETRIEVER_NAME:  # A/B: the users' CTR under each retriever
            evidence = retriever_evidence(journal, champion, challenger, canary_started, config)
        if model_name == MODEL_NAME:  # the ranker's online AUC: both models on the same impressions
            auc_evidence = paired_auc_evidence(journal, champion, challenger, canary_started, config)
    finally:
        journal.close()
    if mode == "shadow":  # the challenger answered nobody: judge its CTR by the champion's
        stats["challenger"] = _shadowed(stats["challenger"], stats["champion"])
    decision = decide(stats["champion"], stats["challenger"], state, config, now, load_error=load_failure(tags),
                      evidence=evidence, require_non_inferiority=model_name == MODEL_NAME,
                      auc_evidence=auc_evidence, shown_offline=gate_passed(tags))
    return CanaryStatus(True, aliases, "", challenger, champion, state.share, mode, started, tag is not None,
                        stats, decision, evidence.to_dict() if evidence else None, model=model_name,
                        auc_evidence=auc_evidence.to_dict() if auc_evidence else None)


def gate_passed(tags: dict[str, str]) -> bool:
    """Whether the gate showed this version non-inferior to the champion on its held-out window: its verdict
    ``passed`` (a version handed to the canary on insufficient evidence is tagged ``failed`` with
    ``insufficient_evidence``; one made challenger by hand carries no verdict)."""
    found = registry.gate_record(tags)
    return bool(found) and found.get("verdict") == "passed"


def paired_auc_evidence(journal, champion: str, challenger: str, since: float, config: CanaryConfig):
    """The challenger − champion online AUC since the canary began, on the impressions both scored, with its
    user-cluster always-valid interval (``max_auc_drop`` the mixing scale)."""
    from recloop.evidence.sequential import paired_auc_difference

    labels, champion_scores, challenger_scores, users = journal.paired_scores(champion, challenger, since)
    return paired_auc_difference(labels, champion_scores, challenger_scores, users, tau=config.max_auc_drop,
                                 alpha=config.alpha)


def paired_evidence(journal, mode: Mode, champion: str, challenger: str, since: float, config: CanaryConfig):
    """The challenger − champion relative CTR difference since the canary began, with its always-valid
    interval: from interleaved requests (credit per team), or A/B per user with CUPED (each user's clicks
    per impression in the week before the canary as the covariate)."""
    from recloop.evidence.sequential import interleaving_difference

    if mode == "interleave":
        users, champion_clicks, challenger_clicks = journal.interleaving_credits(challenger, since)
        return interleaving_difference(champion_clicks, challenger_clicks, users, tau=config.min_effect,
                                       alpha=config.alpha)
    return _ab_evidence(journal, [journal.user_clicks(version, since) for version in (champion, challenger)],
                        since, config)


def retriever_evidence(journal, champion: str, challenger: str, since: float, config: CanaryConfig):
    """The retriever's A/B comparison since its canary began: the users' CTR on what each retriever found
    (the ranker ranked both), CUPED with each user's CTR in the week before as the covariate."""
    arms = [journal.retriever_user_clicks(version, since) for version in (champion, challenger)]
    return _ab_evidence(journal, arms, since, config)


def _ab_evidence(journal, arms: list, since: float, config: CanaryConfig):
    """A/B difference of two arms' per-user (users, clicks, impressions), CUPED on the week before ``since``."""
    from recloop.evidence.sequential import ab_difference

    pre_users, pre_clicks, pre_impressions = journal.user_clicks(None, since - PRE_PERIOD_SECONDS, since)
    before = dict(zip(pre_users.tolist(), (pre_clicks / np.maximum(pre_impressions, 1)).tolist(), strict=True))
    covariates = [np.array([before.get(u, 0.0) for u in np.unique(users)]) for users, _, _ in arms]
    (users_a, clicks_a, shown_a), (users_b, clicks_b, shown_b) = arms
    return ab_difference(clicks_a, shown_a, users_a, clicks_b, shown_b, users_b, tau=config.min_effect,
                         alpha=config.alpha, pre_a=covariates[0] if before else None,
                         pre_b=covariates[1] if before else None)


def _shadowed(challenger: VariantStats, champion: VariantStats) -> VariantStats:
    """In shadow mode only errors, NaNs, latency and online AUC (on the champion's feedback) say anything."""
    return VariantStats(requests=challenger.requests, errors=challenger.errors,
                        nan_responses=challenger.nan_responses, p99_ms=challenger.p99_ms,
                        impressions=champion.impressions, clicks=champion.clicks, online_auc=challenger.online_auc)


def step(settings: Settings, config: CanaryConfig | None = None, now: float | None = None,
         model_name: str = MODEL_NAME) -> CanaryStep:
    """Judge the challenger and act: start, hold, step the share up, promote, or roll back. Logged to MLflow."""
    config = config or CanaryConfig()
    now = time.time() if now is None else now
    current = status(settings, config, now, model_name)
    if not current.active:
        return CanaryStep(current, None)
    if not current.started:
        return start(settings, config, mode=current.mode, now=now, model_name=model_name)
    assert current.decision is not None and current.challenger is not None
    run_id = _canary_run(settings, current)
    _apply(settings, current.challenger, current.decision, who="canary-controller", now=now, model_name=model_name,
           run_id=run_id, mode=current.mode)
    _log_applied(run_id, current, current.decision)
    return CanaryStep(current, current.decision)


@dataclass(frozen=True)
class ManualResult:
    """An operator's action: on the challenger, or (no challenger, rollback) on the champion."""

    action: Literal["promote", "rollback"]
    target: Literal["challenger", "champion"]
    version: str | None
    aliases: dict[str, str | None]

    def to_dict(self) -> dict:
        return {"action": self.action, "target": self.target, "version": self.version, "aliases": self.aliases}


def manual(settings: Settings, action: Literal["promote", "rollback"], reason: str, who: str = "operator",
           model_name: str = MODEL_NAME, expected: str | None = None) -> ManualResult:
    """An operator's promote or roll back of the challenger (or, with no challenger, of the champion).
    ``expected``: the challenger the operator named; another one (a gate made it challenger meanwhile) is
    refused rather than acted on."""
    challenger = registry.version_by_alias(settings, "challenger", check_model(model_name))
    if expected is not None and challenger != expected:
        raise NoCanary(f"v{expected} is no longer the challenger of {model_name} (now: "
                       f"{'v' + challenger if challenger else 'none'}): nothing done")
    if challenger is None:
        if action == "rollback" and registry.version_by_alias(settings, "previous", model_name):
            champion = registry.version_by_alias(settings, "champion", model_name)
            return ManualResult("rollback", "champion", champion, registry.rollback(
                settings, who=who, why=reason, model_name=model_name))
        raise NoCanary(f"nothing to {action} of {model_name}: no challenger" + (
            " and no previous champion" if action == "rollback" else ""))
    current = status(settings, model_name=model_name)
    figures = current.decision.figures if current.decision else {}
    decision = CanaryDecision(action, 1.0 if action == "promote" else 0.0, (f"manual {action} by {who}: {reason}",),
                              figures)
    run_id = _canary_run(settings, current)
    _apply(settings, challenger, decision, who=who, now=time.time(), model_name=model_name, run_id=run_id,
           mode=current.mode)
    _log_applied(run_id, current, decision)
    return ManualResult(action, "challenger", challenger, registry.aliases(settings, model_name))


def _apply(settings: Settings, challenger: str, decision: CanaryDecision, who: str, now: float,
           model_name: str = MODEL_NAME, run_id: str | None = None, mode: Mode = "canary") -> None:
    """Record the decision in the challenger's ``canary`` tag (one write), then move the aliases."""
    changes: dict = {"last_action": decision.action, "last_reasons": tuple(decision.reasons)}
    if run_id is not None:
        changes["run_id"] = run_id
    if decision.action == "step":
        changes.update(share=decision.share, step_started_at=now)
    elif decision.action in ("promote", "rollback"):
        changes.update(state="promoted" if decision.action == "promote" else "rolled_back",
                       share=decision.share, reasons=tuple(decision.reasons))
    _update(settings, challenger, model_name, **changes)
    if decision.action == "promote":
        # The KPIs it earned in the canary are its baseline: the drift monitor judges decay against them.
        baseline = kpi_baseline_at_promotion(decision.figures, mode)
        if baseline:
            registry.tag(settings, challenger, kpi_baseline_tag(baseline), model_name)
        registry.promote(settings, challenger, who=who, why="; ".join(decision.reasons), model_name=model_name)
    elif decision.action == "rollback" and registry.version_by_alias(settings, "challenger", model_name) == challenger:
        # only the version judged: a retrain's gate may have made another the challenger meanwhile
        registry.remove_alias(settings, "challenger", model_name)


def kpi_baseline_at_promotion(figures: dict, mode: Mode) -> dict[str, float]:
    """The online CTR, AUC and impressions a promoted challenger is held to afterwards (KPI decay).

    In an A/B canary its own traffic's. Interleaved, no request showed its list alone: the CTR of the
    interleaved lists mixes both teams (half of each list is the champion's), so the level is the
    champion's own CTR (holdout and users outside the experiment) moved by the interleaving's relative
    effect *at its lower bound*, on the champion's impressions. The lower bound, not the estimate: promotion
    needs only the bound above ``-min_effect``, and at a few hundred requests the estimate is wide (+107 %
    [-31 %, +245 %] was seen in the demo), so a baseline at the estimate called a model that held its level a
    54 % decay and retrained for nothing. No AUC: the challenger's AUC over interleaved lists (half of them the
    other team's picks, which it rates lower) is not its AUC over the lists it ranks alone, where every item is
    one it rated high; held to it, a new champion in a world with no drift was 0.04-0.06 "below the baseline"
    the next day in 3 of 10 seeds, each a full retrain for nothing (benchmarks/RESULTS.md, issue 36). Nor in
    shadow mode, where it scored only the champion's lists.
    """
    baseline = {k: figures.get(f"challenger_{k}") for k in ("ctr", "auc", "impressions")}
    effect, champion_ctr = figures.get("ctr_effect_low"), figures.get("champion_ctr")
    if mode == "interleave":
        usable = all(isinstance(v, int | float) and v == v for v in (effect, champion_ctr))
        baseline["ctr"] = champion_ctr * (1.0 + effect) if usable else None
        baseline["impressions"] = figures.get("champion_impressions") if usable else None
    if mode in ("interleave", "shadow"):  # shadowed, it scored only the champion's lists
        baseline["auc"] = None
    return {k: float(v) for k, v in baseline.items() if isinstance(v, int | float) and v == v}


def _canary_run(settings: Settings, current: CanaryStatus) -> str:
    """The challenger's canary run in MLflow's ``recloop-canary`` experiment (created on its first decision)."""
    from mlflow import MlflowClient

    version, model_name = current.challenger, current.model
    assert version is not None
    tag = CanaryTag.from_tags(registry.version_info(settings, version, model_name).tags)
    if tag is not None and tag.run_id is not None:
        return tag.run_id
    registry.configure(settings)
    prefix = "canary" if model_name == MODEL_NAME else "canary-retriever"
    run = MlflowClient().create_run(registry.experiment(settings, EXPERIMENT), run_name=f"{prefix}-v{version}", tags={
        "recloop.kind": "canary", "recloop.model": model_name, "recloop.version": version,
        "recloop.champion": current.champion or ""})
    return run.info.run_id


def _log_applied(run_id: str, current: CanaryStatus, decision: CanaryDecision) -> None:
    """``_log`` after the decision was applied (its tag written, the aliases moved): a failure to log it is a
    warning, not an error. Raised, the flow's retry found the canary over (promoted or rolled back) and
    reported "none": the outcome's count and its record were lost, though the decision stood."""
    import logging

    try:
        _log(run_id, current, decision)
    except Exception as err:  # noqa: BLE001 - MLflow down for a moment: the registry holds the decision
        logging.getLogger(__name__).warning("v%s: %s applied; logging it to MLflow's canary run failed: %s",
                                            current.challenger, decision.action, err)


def _log(run_id: str, current: CanaryStatus, decision: CanaryDecision) -> None:
    """Append the decision to the challenger's canary run in MLflow (its tag records it: ``_apply``)."""
    import mlflow
    from mlflow import MlflowClient

    client = MlflowClient()
    index = len(client.get_metric_history(run_id, "share"))
    metrics = {"share": decision.share, "action_code": {"hold": 0, "step": 1, "promote": 2, "rollback": -1}.get(
        decision.action, 0)}
    metrics.update({("judged_share" if k == "share" else k): float(v) for k, v in decision.figures.items()
                    if isinstance(v, int | float) and v == v})  # "share" stays the share after the decision
    with mlflow.start_run(run_id=run_id):
        mlflow.log_metrics(metrics, step=index)
        mlflow.log_dict({"decision": _json_ready(decision.to_dict()), "stats": current.to_dict()["stats"],
                         "at": time.time()}, f"canary/decision-{index:03d}.json")
        mlflow.set_tags({"canary.last_action": decision.action, "canary.last_reasons": "; ".join(decision.reasons),
                         "mlflow.note.content": _decisions_note(client, run_id, current, decision, index)})
    if decision.action in ("promote", "rollback"):
        client.set_terminated(run_id, "FINISHED")


def _decisions_note(client, run_id: str, current: CanaryStatus, decision: CanaryDecision, index: int) -> str:
    """The run's description (MLflow shows it on the run's page): every decision so far as a table row, with
    the evidence that decided it and the guardrails it held (``canary.explain``), this one appended."""
    from recloop.canary import explain

    note = client.get_run(run_id).data.tags.get("mlflow.note.content") or ""
    if explain.COLUMNS[-1] not in note:  # the first decision: the heading and the table's header
        note = (f"# Canary of {current.model} v{current.challenger} against champion v{current.champion}\n\n"
                f"Mode: {current.mode}. Each row is one decision of the controller.\n\n" + explain.markdown_header())
    note += explain.markdown_row(explain.decision_row(index, decision.action, decision.share, decision.figures,
                                                      decision.reasons))
    return explain.fit_note(note)  # the oldest rows give way (MLflow cut a long canary's mid-row)
