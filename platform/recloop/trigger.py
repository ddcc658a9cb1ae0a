"""When a monitoring decision starts a full retrain: debounced, with a cool-down, never on broken data.

- ``drift`` and ``kpi_decay`` request a full retrain;
- ``data_quality`` alerts and does not retrain (training on a broken column teaches the model the breakage);
- after a retrain was requested, further requests wait out a cool-down, so a drift that persists for
  hours (as it does until the new model is out) cannot start a storm of retrains;
- the requests are recorded in ``$RECLOOP_HOME/loop/triggers.json`` (under a file lock), the memory the
  cool-down needs across processes and flow runs. One retrain at a time is the deployment's concurrency
  limit (``prefect.yaml``); this module decides whether to ask at all.

Example::

    verdict = should_retrain("drift", last_requested_at=None, now=time.time(), config=TriggerConfig())
    if verdict.retrain:
        record(settings, verdict, now)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

from recloop.ingest.ledger import exclusive_lock
from recloop.settings import Settings


@dataclass(frozen=True)
class TriggerConfig:
    """Args:
    cooldown_seconds: after a requested retrain, no other is requested for this long.
    retrain_on: monitoring decisions that request a full retrain.
    """

    cooldown_seconds: float = 6 * 3600
    retrain_on: tuple[str, ...] = ("drift", "kpi_decay")


@dataclass(frozen=True)
class TriggerVerdict:
    retrain: bool
    alert: bool
    reason: str
    decision: str

    def to_dict(self) -> dict:
        return asdict(self)


def should_retrain(decision: str, last_requested_at: float | None, now: float, config: TriggerConfig,
                   reasons: tuple[str, ...] | list[str] = ()) -> TriggerVerdict:
    """The pure rule (see the module docstring)."""
    detail = "; ".join(reasons)
    if decision == "data_quality":
        return TriggerVerdict(False, True, f"data quality: alert, no retrain on broken data ({detail})", decision)
    if decision not in config.retrain_on:
        return TriggerVerdict(False, False, f"{decision}: nothing to do", decision)
    if last_requested_at is not None and now - last_requested_at < config.cooldown_seconds:
        left = config.cooldown_seconds - (now - last_requested_at)
        return TriggerVerdict(False, False, f"{decision}, but a retrain was requested {now - last_requested_at:.0f} s "
                                            f"ago: cool-down, {left:.0f} s left", decision)
    return TriggerVerdict(True, decision == "kpi_decay", f"{decision}: full retrain ({detail})", decision)


def _path(settings: Settings) -> Path:
    return settings.home.resolve() / "loop" / "triggers.json"


def history(settings: Settings) -> list[dict]:
    path = _path(settings)
    return json.loads(path.read_text()) if path.exists() else []


def last_requested_at(settings: Settings) -> float | None:
    requested = [t["at"] for t in history(settings)]
    return max(requested) if requested else None


def decide_and_record(settings: Settings, decision: str, reasons: list[str], now: float,
                      config: TriggerConfig | None = None) -> TriggerVerdict:
    """Apply the rule against the recorded history and record a requested retrain, atomically."""
    config = config or TriggerConfig()
    path = _path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    with exclusive_lock(path.with_suffix(".lock")):
        past = history(settings)
        last = max((t["at"] for t in past), default=None)
        verdict = should_retrain(decision, last, now, config, reasons)
        if verdict.retrain:
            past.append({"at": now, "decision": decision, "reasons": list(reasons)})
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(past, indent=2) + "\n")
            os.replace(tmp, path)
    return verdict
