"""The loop: ingest → features → train → gate → canary start, for the ranker and then the retriever (each
its own registered model, gate and canary: ``retriever_flow``). Hourly incremental; full on drift, by hand,
or periodically: a scheduled run starts over from scratch once the champion's chain of incremental runs
spans ``full_every_hours`` hours of data (a chain trails a full retrain over the same hours).

One retrain (or any training or gate) at a time: the run holds the ``recloop-model`` slot from ingest to
the canary's start (``flow_support.model_slot``); its ``train`` and ``gate`` subflows run inside it. An
incremental retrain with no hour the champion has not seen ends ``Skipped``: nothing trained, no version
registered. A scheduled incremental retrain while a canary runs ends ``Skipped`` too, for that model alone
(the ranker's and the retriever's canaries each hold back their own retrain): a new challenger would replace
the one being judged and reset its sequential evidence, so no canary would ever finish. It waits no longer
than the canary, which always ends (non-inferiority shown, significantly worse, or ``max_users`` reached), and
than ``canary_wait_hours``: past that its candidate replaces the challenger (trained from the champion, over
every hour the champion has not seen; if the challenger was the drift monitor's retrain, the monitor's hold
passes to it, ``monitor.runner.carry_request``); drift, manual and requested full retrains supersede a running
canary (a drift retrain must not wait behind a pre-drift challenger). Before it waits or supersedes, a scheduled run judges a challenger the gate handed to the
canary on insufficient evidence again, on its held-out hours and every hour landed since
(``gate.runner.grown_evidence``): shown non-inferior, its canary promotes it on its guardrails; shown worse, it
is rolled back. The run's final state names the outcome (``Skipped``, ``Refused``, ``Challenger``,
``Champion``), its message says why, and its tags carry the version and the gate's verdict.
"""

import time
from typing import Literal

from prefect import flow, task
from prefect.states import Cancelled

from flows.canary_flow import canary_flow, outwaited, running_canary_task, waits_for
from flows.features_flow import features_flow
from flows.gate_flow import already_judged, gate_flow, judged_task
from flows.ingest_flow import ingest_flow
from flows.retriever_flow import retriever_flow
from flows.train_flow import train_flow
from recloop import datasets, pipeline
from recloop.flow_support import (
    SlotBusy,
    log,
    model_slot,
    outcome_state,
    record_failed_run,
    record_outcome,
    retrain_run_name,
    settings_from,
    tag_run,
)
from recloop.monitor import runner
from recloop.train import TrainConfig


@task
def pending_task(validation_hours: int, settings: dict | None) -> dict:
    """The hours an incremental run from the champion would train on."""
    return pipeline.pending_hours(settings_from(settings), TrainConfig(validation_hours=validation_hours)).to_dict()


@task
def periodic_full_task(validation_hours: int, every_hours: float | None, settings: dict | None,
                       record: bool = False) -> str | None:
    """Why this scheduled run should start over from scratch (``pipeline.periodic_full_due``), or None;
    ``record``: the periodic retrain has trained, remember it (``pipeline.record_periodic_full``)."""
    if not every_hours:
        return None
    resolved = settings_from(settings)
    pending = pipeline.pending_hours(resolved, TrainConfig(validation_hours=validation_hours))
    if record:
        pipeline.record_periodic_full(resolved, pending)
        return None
    return pipeline.periodic_full_due(resolved, pending, every_hours)


@flow(name="retrain", flow_run_name=retrain_run_name, log_prints=True, on_failure=[record_failed_run],
      on_crashed=[record_failed_run])
def retrain_flow(mode: Literal["incremental", "full"] = "incremental", reason: str = "scheduled",
                 spec: str | None = None, days: int = 7, epochs: int | None = None, batch_size: int | None = None,
                 validation_hours: int = 6, canary_config: str | None = None,
                 gate_thresholds: str | None = None, slot_timeout_seconds: float = 3600,
                 retriever: bool = True, retriever_thresholds: str | None = None, retriever_epochs: int = 3,
                 monitor_request: bool = False, requested_at: float | None = None,
                 canary_wait_hours: float = 24.0, replay_fraction: float = 1.0,
                 full_every_hours: float | None = None, full_epochs: int = 2, seed: int = 0,
                 full_embedding_l2_choices: list[float] | None = None, settings: dict | None = None) -> dict:
    """``monitor_request``: this run answers the drift monitor's request (the ``full-retrain`` deployment's
    event trigger sets it; the demo's inline retrain too): its gate verdict is recorded for the monitor's
    trigger, so the cool-down starts only when the retrain passes and a refused one is asked for again
    (``monitor.runner.record_retrain_outcome``). ``requested_at``: the monitor's clock at the request
    (simulated time in the demo); the outcome is recorded at it, else now. ``canary_wait_hours``: a scheduled
    incremental retrain waits for a running canary at most this long after it started, then supersedes it.
    ``replay_fraction``: an incremental run also replays a random sample of older hours, this share of its new
    ones (``TrainConfig.replay_fraction``): along a chain of daily incremental runs, as many older hours as new
    ones kept held-out AUC +0.018 [0.005, 0.030] above new hours alone (``benchmarks/incremental.py --chain``).
    ``full_every_hours``: a scheduled incremental retrain becomes a full one (``days``, ``full_epochs``; reason
    ``periodic``) once the champion's chain of incremental runs spans this many hours of data
    (``pipeline.periodic_full_due``); None: never. ``epochs``: passes of the training; None: one for an
    incremental run, ``full_epochs`` for a full one (by hand, on drift or periodic alike, here or on a server).
    ``seed``: the ranker's training seed (``TrainConfig.seed``). ``full_embedding_l2_choices``: a full retrain
    (by hand, on drift or periodic) tries these embedding penalties besides the default and keeps one that does
    better on the newest rows (``TrainConfig.embedding_l2_choices``; on MovieLens 1M 1.0 took the ranker from
    behind the CTR baseline to level with it; a training each). None: none tried, as on the synthetic world."""
    epochs = run_epochs(mode, epochs, full_epochs)
    retriever_step = None
    if retriever:
        def retriever_step(resolved_spec: str, run_mode: str) -> dict:
            return retriever_flow(mode=run_mode, spec=resolved_spec, days=days, epochs=retriever_epochs,
                                  validation_hours=validation_hours, thresholds_path=retriever_thresholds,
                                  canary_config=canary_config,
                                  wait_for_canary_hours=canary_wait_hours if _waits(mode, reason) else None,
                                  settings=settings)
    try:
        with model_slot(slot_timeout_seconds, settings_from(settings).home):
            return _retrain(mode, reason, spec, days, epochs, batch_size, validation_hours, canary_config,
                            gate_thresholds, settings, retriever_step, canary_wait_hours, replay_fraction,
                            (time.time() if requested_at is None else requested_at) if monitor_request else None,
                            (full_every_hours, full_epochs), seed, full_embedding_l2_choices)
    except SlotBusy as busy:
        log("%s", busy)
        record_outcome(settings_from(settings), "retrain", "cancelled")
        return Cancelled(message=str(busy))


def run_epochs(mode: str, epochs: int | None, full_epochs: int) -> int:
    """The passes a retrain's training makes: ``epochs`` when given, else 1 (incremental) or ``full_epochs``."""
    return epochs if epochs is not None else (full_epochs if mode == "full" else 1)


def _retrain(mode: str, reason: str, spec: str | None, days: int, epochs: int, batch_size: int | None,
             validation_hours: int, canary_config: str | None, gate_thresholds: str | None, settings: dict | None,
             retriever_step=None, canary_wait_hours: float = 24.0, replay_fraction: float = 0.0,
             monitor_clock: float | None = None, periodic: tuple[float | None, int] = (None, 2), seed: int = 0,
             l2_choices: list[float] | None = None):
    spec = datasets.source(settings_from(settings), spec)  # resolved once, for every stage below
    result: dict = {"mode": mode, "reason": reason, "spec": spec}
    log("%s retrain (%s)", mode, reason)
    result["ingest"] = ingest_flow(spec, settings=settings)
    result["features"] = features_flow(spec, settings=settings)
    if mode == "incremental":
        pending = result["pending"] = pending_task(validation_hours, settings)
        if pending["champion"] is not None and not pending["hours"]:
            tag_run("mode:incremental", "retrain:skipped")
            result["skipped"] = (f"no new hours: champion v{pending['champion']} has trained on every hour up to "
                                 f"{pending['trained_until']} (held-out hours excluded); nothing trained, no version "
                                 "registered")
            return _finish(settings, "Skipped", result["skipped"], result)  # the retriever has nothing new either
        if _waits(mode, reason) and (grown := grown_evidence_task(gate_thresholds, settings)) is not None:
            # the challenger on insufficient evidence, judged again with the hours landed since its gate
            result["grown_evidence"] = grown
            log("v%s on the hours landed since its gate: %s, %s", grown["version"], grown["verdict"], grown["interval"])
            if grown["verdict"] == "passed":  # its canary now promotes it on its guardrails
                result["canary"] = canary_flow(config_path=canary_config, start=False, settings=settings)
        if _waits(mode, reason) and (canary := running_canary_task(settings)) is not None:
            if not outwaited(canary, canary_wait_hours):
                tag_run("mode:incremental", "retrain:skipped")
                result["waiting_for"] = canary
                result["skipped"] = waits_for(canary, "retrain") + "; nothing trained, no ranker version registered"
                return _finish(settings, "Skipped", result["skipped"], result, retriever_step)  # the retriever's rule
            # Waited long enough: this run's candidate will replace the challenger. It still starts from the
            # champion, over every hour the champion has not seen (the challenger's too): on the loop's chain
            # that beat continuing from the challenger, a drift's full retrain (benchmarks/RESULTS.md, "Issue 36:
            # the monitor reported a drift retrain's own change again").
            result["superseding"] = canary["version"]
        if pending["hours"]:
            log("%s new hours to train on: %s..%s", pending["hours"], pending["first"], pending["last"])
        if _waits(mode, reason) and (why := periodic_full_task(validation_hours, periodic[0], settings)) is not None:
            log("%s", why)
            tag_run("retrain:periodic")  # the run's name keeps the mode it was scheduled with; its tags say full
            mode, reason, epochs = "full", "periodic", periodic[1]
            result.update(mode=mode, reason=reason, periodic=why)
    from recloop.gate.runner import smoke_process_ahead

    with smoke_process_ahead():  # the gate's fresh serving-check process imports while the candidate trains
        result["train"] = train_flow(mode=mode, days=days, epochs=epochs, replay_fraction=replay_fraction,
                                     batch_size=batch_size, validation_hours=validation_hours, seed=seed,
                                     embedding_l2_choices=l2_choices if mode == "full" else None,
                                     settings=settings)
        if reason == "periodic":  # it trained: the next periodic retrain is a period away, whatever the gate says
            periodic_full_task(validation_hours, periodic[0], settings, record=True)
        version = result["train"]["mlflow"]["version"]
        record = judged_task(version, settings)
        if (skip := already_judged(version, result["train"]["mlflow"].get("duplicate_of"), record)) is not None:
            log("%s", skip)
            tag_run(f"model-version:{version}", f"mode:{mode}", "gate:skipped")
            result["skipped"] = skip
            if monitor_clock is not None and record is not None:  # the monitor learns the verdict that stands
                runner.record_retrain_outcome(settings_from(settings), deployed=record["verdict"] == "passed",
                                              now=monitor_clock, gate_reasons=record.get("reasons", []),
                                              version=str(version))
        else:
            result["gate"] = gate = gate_flow(version, gate_thresholds, settings=settings)
    if skip is not None:  # the unused serving-check process is stopped before the retriever trains
        return _finish(settings, "Skipped", skip, result, retriever_step)
    if monitor_clock is not None:  # the monitor's trigger learns the verdict: cool-down only after a pass
        runner.record_retrain_outcome(settings_from(settings), deployed=gate["alias"] is not None, now=monitor_clock,
                                      gate_reasons=gate.get("reasons", []), version=str(version))
    if gate["alias"] == "challenger":
        if (replaced := result.get("superseding")) and runner.carry_request(settings_from(settings), replaced,
                                                                             str(version)):
            log("v%s replaces v%s, the drift monitor's last retrain, and trained on the hours it answered: its "
                "canary holds the monitor's next request", version, replaced)
        result["canary"] = canary_flow(config_path=canary_config, start=True, settings=settings)
    insufficient = gate.get("verdict") == "insufficient evidence"  # to the canary, which decides
    verdict = "passed" if gate["passed"] else "insufficient" if insufficient else "failed"
    tag_run(f"model-version:{version}", f"mode:{mode}", f"gate:{verdict}")
    reasons = "; ".join(gate["reasons"])
    if insufficient:
        then = "; canary started" if "canary" in result else ""
        return _finish(settings, "Challenger", f"v{version}: insufficient evidence offline → challenger (the canary "
                       f"decides){then}: {'; '.join(gate.get('insufficient', []))}", result, retriever_step)
    if not gate["passed"]:
        return _finish(settings, "Refused", f"v{version} failed the gate, stays unserved: {reasons}", result,
                       retriever_step)
    then = "; canary started" if "canary" in result else ""
    return _finish(settings, gate["alias"].capitalize(), f"v{version} passed the gate → {gate['alias']}{then}", result,
                   retriever_step)


@task
def grown_evidence_task(thresholds_path: str | None, settings: dict | None) -> dict | None:
    """``gate.runner.grown_evidence``: the undecided challenger judged on the hours landed since its gate."""
    from recloop.gate import load_thresholds
    from recloop.gate.runner import grown_evidence

    try:
        found = grown_evidence(settings_from(settings), load_thresholds(thresholds_path) if thresholds_path else None)
    except Exception as err:  # noqa: BLE001 - a second look that fails leaves the canary as it was; the retrain goes on
        log("the undecided challenger could not be judged again: %s: %s", type(err).__name__, err)
        return None
    return found.to_dict() if found is not None else None


def _waits(mode: str, reason: str) -> bool:
    """A scheduled incremental run (one that becomes a periodic full retrain included: it is checked first)
    waits for a running canary; drift, manual and requested full retrains supersede it (a drift retrain must
    not wait behind a challenger trained before the drift)."""
    return mode == "incremental" and reason == "scheduled"


def _finish(settings: dict | None, name: str, message: str, result: dict, retriever_step=None):
    """The run's outcome is the ranker's; the retriever's steps (run here, in the same slot) add to its message."""
    if retriever_step is not None:
        result["retriever"] = retriever = retriever_step(result["spec"], result["mode"])
        gate = retriever.get("gate")
        skipped = retriever.get("skipped") or retriever["train"].get("skipped")
        message += ("; retriever: " + skipped if gate is None else
                    f"; retriever v{gate['version']} " + (f"passed its gate → {gate['alias']}" if gate["passed"]
                                                           else "failed its gate"))
    record_outcome(settings_from(settings), "retrain", name.lower())
    return outcome_state(name, message, result)
