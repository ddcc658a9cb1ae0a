"""A version means a different model: a candidate whose weights a registered version has already is not
registered again (its run points at that version) and never gated; the trainer says which flags it overrode;
a retrain whose candidate was judged already (a queued retrain behind the one that gated it) skips the gate."""

from __future__ import annotations

import json
from pathlib import Path

from mlflow import MlflowClient

from recloop import checkpoint, pipeline, registry, tracking
from recloop.settings import Settings
from recloop.train import TrainConfig

SMALL = {"embedding_dim": 8, "bottom_mlp": (16,), "top_mlp": (32,)}


def _versions() -> list[str]:
    return sorted(str(v.version) for v in MlflowClient().search_model_versions(f"name='{registry.MODEL_NAME}'"))


def test_the_same_weights_are_no_new_version_and_the_overrides_are_said(champion_home: Settings, tmp_path: Path,
                                                                      copy_home):
    """``--days 2 --epochs 1`` and ``--days 3 --epochs 2`` train the same rows the same number of passes (the
    window grows back to ``train_rows``, ``fit_to_data`` raises one epoch to two): one model, one version."""
    from recloop.model import ModelConfig

    home = copy_home(champion_home, tmp_path / "home")
    common = {"validation_hours": 12, "device": "cpu", "deterministic": True, "checkpoint_every": 1000,
              "model": ModelConfig(**SMALL)}
    first = pipeline.train_and_register(home, TrainConfig(days=2, epochs=1, **common))
    overrides = first.summary.overrides
    assert any(o.startswith("epochs 1 → 2:") for o in overrides), overrides
    assert any(o.startswith("days 2 → ") and "train_rows" in o for o in overrides), overrides
    tags = registry.version_info(home, first.version).tags
    assert json.loads(tags[f"{tracking.OVERRIDES_TAG}.json"]) == overrides
    assert tags[tracking.OVERRIDES_TAG].startswith(overrides[0][:100])  # the line a person reads
    assert tags[checkpoint.WEIGHTS_TAG] == checkpoint.weights_digest(first.summary.checkpoint)
    assert first.logged.duplicate_of is None and _versions() == ["1", first.version]

    again = pipeline.train_and_register(home, TrainConfig(days=3, epochs=2, **common))
    assert again.summary.run_id != first.summary.run_id  # another run, trained anew...
    assert checkpoint.weights_digest(again.summary.checkpoint) == tags[checkpoint.WEIGHTS_TAG]  # ...to the same weights
    assert again.logged.duplicate_of == first.version and again.version == first.version
    assert _versions() == ["1", first.version]  # no new version
    run = MlflowClient().get_run(again.logged.run_id)
    assert run.data.tags[tracking.DUPLICATE_TAG] == first.version
    assert not any(o.startswith("epochs") for o in again.summary.overrides)  # two asked, two made
    assert again.to_dict()["mlflow"]["duplicate_of"] == first.version


def test_a_candidate_judged_already_or_a_duplicate_is_not_gated():
    from flows.retrain_flow import already_judged

    refused = {"verdict": "failed", "champion": "1", "reasons": ["auc below"]}
    assert already_judged(
        "3", None, refused) == "v3 was judged already (refused by the gate against champion v1): not gated again"
    assert "passed" in already_judged("3", "3", {"verdict": "passed", "champion": None})
    assert "same weights as registered v2" in already_judged("2", "2", None)
    assert already_judged("4", None, None) is None


def test_a_queued_retrain_does_not_gate_again_the_version_the_first_refused(prefect_server, champion_home,
                                                                          copy_home, tmp_path: Path):
    """Two retrains queued on one home: the first trains v2 and the gate refuses it; the second finds the same
    run finished and v2 registered, and ends Skipped saying v2 was judged already, its verdict untouched."""
    from flows.retrain_flow import retrain_flow
    from recloop.flow_support import settings_parameter

    home = copy_home(champion_home, tmp_path / "home", feast=True)
    home.landing_dir.mkdir(parents=True, exist_ok=True)
    strict = tmp_path / "gate.yaml"  # no candidate passes
    strict.write_text("min_auc: 0.999\n")
    runs = [retrain_flow(mode="incremental", reason="drift", gate_thresholds=str(strict), retriever=False,
                         settings=settings_parameter(home), return_state=True) for _ in range(2)]
    assert runs[0].name == "Refused", runs[0]
    version = runs[0].result()["train"]["mlflow"]["version"]
    verdict = registry.version_info(home, version).tags[registry.GATE_TAG]
    assert runs[1].is_completed() and runs[1].name == "Skipped", runs[1]
    assert f"v{version} was judged already (refused by the gate against champion v1)" in runs[1].message
    second = runs[1].result()
    assert "gate" not in second and second["train"]["mlflow"]["version"] == version
    assert registry.version_info(home, version).tags[registry.GATE_TAG] == verdict  # not judged again
    assert _versions() == ["1", version]
