"""Ranker versions for canary tests: the champion's checkpoint registered again, its weights changed."""

from __future__ import annotations

import json
import shutil
import uuid

from safetensors.torch import load_file, save_file

from recloop import checkpoint, pipeline
from recloop.settings import Settings
from recloop.train import TrainSummary


def variant(home: Settings, change, top_mlp: tuple[int, ...] | None = None) -> str:
    """Register a copy of the champion's checkpoint with its weights changed; returns the new version."""
    source = checkpoint.resolve(home, "1")
    target = home.home / "checkpoints" / f"variant-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    change(weights)
    # a version of its own even when ``change`` leaves the weights as they are (``unchanged``): the same file
    # would be the champion's version again (registry.log_training), the metadata makes it another file
    save_file(weights, target / "model.safetensors", metadata={"variant": target.parent.name})
    if top_mlp is not None:
        state = json.loads((target / "state.json").read_text())
        state["model"]["top_mlp"] = list(top_mlp)
        (target / "state.json").write_text(json.dumps(state))
    base = TrainSummary(**checkpoint.read(source)["summary"])
    base.checkpoint, base.run_id = str(target), f"{base.run_id}-{target.parent.name}"
    return pipeline.register_training(home, base).version


def unchanged(weights) -> None:
    pass


def inverted(weights) -> None:
    """Scores reversed: the ranking shows users their least likely clicks first (the logit's every part: the
    over arch's last layer and, in a model with one, the wide part, which is added to it)."""
    weights["over_arch.layers.2.weight"].neg_()
    weights["over_arch.layers.2.bias"].neg_()
    for name in ("wide_arch.linear.weight", "wide_arch.linear.bias"):
        if name in weights:
            weights[name].neg_()
