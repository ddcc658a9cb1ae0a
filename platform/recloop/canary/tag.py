"""The canary's state on the challenger's model version: one JSON tag, ``canary``, read and written here.

The controller writes it (one ``set_model_version_tag`` per change: start, a new share, a decision) and
serving reads it (share, mode, salt), so the two agree through MLflow without talking to each other. In
the MLflow UI a version shows one ``canary`` tag whose ``state`` says where its canary stands.

Versions tagged before this tag existed carry separate ``canary.*`` tags; ``CanaryTag.from_tags`` reads
those as a fallback, so an experiment in flight across an upgrade keeps its share and split of users.

Example::

    tag = CanaryTag.from_tags(version.tags)            # None: no canary was started on this version
    if tag is not None and tag.state == "running":
        share, mode, salt = tag.share, tag.mode, tag.salt
    registry.tag(settings, version, replace(tag, share=0.25).to_tag())
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Literal

from recloop.version_tags import CANARY_TAG, KPI_BASELINE_TAG, LOAD_FAILED_TAG, readable, record

log = logging.getLogger(__name__)

State = Literal["running", "promoted", "rolled_back", "superseded"]
Mode = Literal["interleave", "canary", "shadow"]
_LEGACY = "canary."  # the prefix of the separate tags that versions carried before


@dataclass(frozen=True)
class CanaryTag:
    """A version's canary: where it stands and what serving needs to route to it.

    Args:
        state: ``running`` until a decision ends it (``promoted`` or ``rolled_back``), or a newer candidate
            takes the challenger alias before it decides (``superseded``: a drift or manual retrain).
        share: the share of users the challenger serves (0 once rolled back).
        mode: ``interleave`` (one merged ranking), ``canary`` (A/B per user) or ``shadow`` (scores only).
        salt: this experiment's hash salt: its own split of users.
        started_at: when the canary started (epoch seconds); the evidence accumulates from here.
        step_started_at: when the current share was set; the step's traffic is counted from here.
        share_set_by: who set the share by hand, if someone did (``None``: the controller).
        run_id: the canary's run in MLflow's ``recloop-canary`` experiment.
        last_action: the last decision (hold, step, promote, rollback).
        last_reasons: its reasons.
        reasons: the reasons of the decision that ended it (promoted or rolled back).
    """

    state: State = "running"
    share: float = 0.0
    mode: Mode = "canary"
    salt: str | None = None
    started_at: float | None = None
    step_started_at: float | None = None
    share_set_by: str | None = None
    run_id: str | None = None
    last_action: str | None = None
    last_reasons: tuple[str, ...] = ()
    reasons: tuple[str, ...] = ()

    @property
    def serving_share(self) -> float:
        """The share serving gives the challenger: its share while the canary runs, else none."""
        return self.share if self.state == "running" else 0.0

    def to_tag(self) -> dict[str, str]:
        """The tags to set on the version (``registry.tag``): ``canary`` in a line ("running: 50% of users,
        interleave; last: hold"), ``canary.json`` the state itself."""
        value = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}
        return readable(CANARY_TAG, self.summary(), value)

    def summary(self) -> str:
        """The canary's state in a line a person reads."""
        if self.state == "running":
            line = f"running: {self.share:.0%} of users, {self.mode}"
            if self.last_action:
                line += f"; last check: {self.last_action}" + (f" ({self.last_reasons[0]})" if self.last_reasons else "")
            return line
        state = {"rolled_back": "rolled back", "promoted": "promoted", "superseded": "superseded"}[self.state]
        return state + (f": {self.reasons[0]}" if self.reasons else "")

    @classmethod
    def from_tags(cls, tags: Mapping[str, str]) -> CanaryTag | None:
        """The version's canary from its tags; ``None`` when it has none (or only an unreadable one, logged)."""
        raw = record(tags, CANARY_TAG)
        if raw is None:
            return _from_legacy(tags)
        try:
            value = json.loads(raw)
            known = {f.name for f in fields(cls)}
            return _checked({k: v for k, v in value.items() if k in known})
        except (ValueError, TypeError, AttributeError) as err:
            log.warning("unreadable %r tag %r (%s): treated as no canary", CANARY_TAG, raw[:200], err)
            return None


def _checked(value: dict) -> CanaryTag:
    """A CanaryTag from decoded JSON, with its types checked (a bad value is a ValueError, not a surprise later)."""
    state = value.get("state", "running")
    if state not in ("running", "promoted", "rolled_back", "superseded"):
        raise ValueError(f"unknown state {state!r}")
    mode = value.get("mode") if value.get("mode") in ("interleave", "shadow") else "canary"
    optional_float = {k: None if value.get(k) is None else float(value[k]) for k in ("started_at", "step_started_at")}
    optional_str = {k: None if value.get(k) is None else str(value[k]) for k in
                    ("salt", "share_set_by", "run_id", "last_action")}
    reasons = {k: tuple(str(r) for r in value.get(k) or ()) for k in ("last_reasons", "reasons")}
    return CanaryTag(state=state, share=float(value.get("share", 0.0)), mode=mode, **optional_float,
                     **optional_str, **reasons)


def _from_legacy(tags: Mapping[str, str]) -> CanaryTag | None:
    """A version tagged with the separate ``canary.*`` tags (before the one JSON tag); ``None`` if it has none."""
    old = {k.removeprefix(_LEGACY): v for k, v in tags.items() if k.startswith(_LEGACY)}
    if "step_started_at" not in old and "share" not in old:
        return None

    def reasons(key: str) -> list[str]:
        text = old.get(key)
        if not text:
            return []
        try:
            return list(json.loads(text))
        except ValueError:
            return text.split("; ")

    try:
        return _checked({"state": {"promoted": "promoted", "rolled_back": "rolled_back"}.get(
                             old.get("outcome", ""), "running"),
                         "share": old.get("share", 0.0), "mode": old.get("mode"), "salt": old.get("salt"),
                         "started_at": old.get("started_at", old.get("step_started_at")),
                         "step_started_at": old.get("step_started_at"), "share_set_by": old.get("share_set_by"),
                         "run_id": old.get("run_id"), "last_action": old.get("last_action"),
                         "last_reasons": reasons("last_reasons"), "reasons": reasons("reasons")})
    except (ValueError, TypeError) as err:
        log.warning("unreadable canary.* tags (%s): treated as no canary", err)
        return None


# Two more concerns the canary shares with others, one tag each:


def load_failure(tags: Mapping[str, str]) -> str | None:
    """Why serving could not load the version (``None``: it loaded); a plain-text tag from before is the reason."""
    raw = record(tags, LOAD_FAILED_TAG)
    if raw is None:
        return None
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    return str(value.get("reason") or raw) if isinstance(value, dict) else raw


def kpi_baseline(tags: Mapping[str, str]) -> dict[str, float]:
    """The online KPIs a champion earned in its canary (the drift monitor's baseline); older versions carry
    them as ``kpi.baseline_<name>`` tags."""
    raw = record(tags, KPI_BASELINE_TAG)
    try:
        value = json.loads(raw) if raw is not None else {
            k: tags[f"{KPI_BASELINE_TAG}_{k}"] for k in ("ctr", "auc", "impressions") if f"{KPI_BASELINE_TAG}_{k}" in tags}
        return {k: float(v) for k, v in value.items() if v is not None}
    except (ValueError, TypeError, AttributeError) as err:
        log.warning("unreadable %r tag (%s): no baseline", KPI_BASELINE_TAG, err)
        return {}


def load_failure_tag(reason: str, at: float) -> dict[str, str]:
    """Serving's mark on a version that does not load: a line to read and its record (``reason``, ``at``)."""
    return readable(LOAD_FAILED_TAG, f"does not load in serving: {reason}", {"reason": reason[:4000], "at": at})


def kpi_baseline_tag(baseline: dict) -> dict[str, str]:
    """The KPIs a champion earned in its canary: a line to read and its record (``ctr``, ``auc``, ``impressions``)."""
    shown = [f"{name} {baseline[key]:.4f}" for key, name in (("ctr", "CTR"), ("auc", "online AUC"))
             if isinstance(baseline.get(key), int | float)]
    if baseline.get("impressions") is not None:
        shown.append(f"over {int(baseline['impressions']):,} impressions")
    return readable(KPI_BASELINE_TAG, "earned in its canary: " + (", ".join(shown) or "no figures"), baseline)
