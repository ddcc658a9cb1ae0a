"""The retriever's gate run: score a registered ``recloop-retriever`` version and its champion on the
candidate's held-out hours, decide (``recloop.gate.retrieval``), record the verdict on the version, and
move its alias. The ranker's counterpart is ``recloop.gate.runner``.

Example::

    logged = log_retriever(settings, summary)                       # recloop.retrieval.publish
    outcome = run_retrieval_gate(settings, logged.version, oracle=WorldOracle(world))
    outcome["alias"]       # 'champion' (first model), 'challenger' (passed) or None (failed)
"""

from __future__ import annotations

from recloop import registry
from recloop.gate.retrieval import RetrievalThresholds, decide, report_markdown
from recloop.registry import RETRIEVER_NAME
from recloop.retrieval.evaluate import WorldOracle
from recloop.retrieval.publish import retriever_folder
from recloop.settings import Settings


def run_retrieval_gate(settings: Settings, version: str, thresholds: RetrievalThresholds | None = None,
                       oracle: WorldOracle | None = None) -> dict:
    """Score candidate and champion on the candidate's held-out hours, decide, tag, and set the alias.

    A pass makes the first retriever ``champion`` and any later one ``challenger`` (its canary starts
    from there); a failure leaves the version registered, its ``gate`` tag saying ``failed`` with the reasons.
    """
    from recloop.features.definition import FeatureLayout
    from recloop.retrieval.retriever import Retriever, score_window

    thresholds = thresholds or RetrievalThresholds()
    info = registry.version_info(settings, version, RETRIEVER_NAME)
    champion_version = registry.version_by_alias(settings, "champion", RETRIEVER_NAME)
    if champion_version == version:
        raise RuntimeError(f"retriever version {version} is already the champion")
    if info.validation_window is None:
        raise RuntimeError(f"retriever version {version} has no held-out window in its run's tags")
    window = info.validation_window
    training = FeatureLayout.for_settings(settings).training
    files = sorted(p for p in training.glob("*.parquet") if window[0] <= p.stem <= window[1])
    if not files:
        raise RuntimeError(f"the held-out hours {window} are no longer in {training}")
    ks = tuple(sorted({100, thresholds.k}))
    candidate = score_window(Retriever.load(retriever_folder(settings, version)), files, ks, oracle)
    champion = None
    if champion_version is not None:
        champion = score_window(Retriever.load(retriever_folder(settings, champion_version)), files, ks, oracle)
    mode = info.mode or "full"
    decision = decide(candidate, champion, thresholds, mode)
    report = report_markdown(decision, candidate, champion, version, champion_version, mode)
    from mlflow import MlflowClient

    MlflowClient().log_text(info.run_id, report, f"gate_report_v{version}.md")
    registry.describe(settings, version, report, RETRIEVER_NAME,
                      whole=f"artifact gate_report_v{version}.md of the retriever's run")
    recall = f"recall@{thresholds.k}"
    registry.tag(settings, version, registry.gate_tag(
        decision.passed, champion=champion_version, window=list(window), reasons=list(decision.reasons),
        **{recall: candidate.overall.get(recall), f"champion_{recall}": champion.overall.get(recall) if champion else None}),
        RETRIEVER_NAME)
    alias = None
    if decision.passed and champion_version is None:
        registry.promote(settings, version, who="gate", why="first retriever: passed the floors",
                         model_name=RETRIEVER_NAME)
        alias = "champion"
    elif decision.passed:
        from recloop.canary import controller

        controller.set_challenger(settings, version, who="gate", why="passed the gate", model_name=RETRIEVER_NAME)
        alias = "challenger"
    return {"passed": decision.passed, "reasons": list(decision.reasons), "version": version, "alias": alias,
            "champion": champion_version, "mode": mode, "first_model": decision.first_model,
            "candidate": candidate.to_dict(), "champion_scores": champion.to_dict() if champion else None,
            "figures": decision.figures, "report": report}
