"""The models being served, and the swap that never fails a request.

``ModelPool.live`` is one immutable ``Deployment`` (champion, challenger, canary share and mode). A
request reads it once and uses that object to the end, so a request in flight finishes on the models
it started with. The watcher thread polls MLflow (aliases, and the canary tags on the challenger),
downloads and loads any new version *before* it swaps, then replaces ``live`` in one assignment:
requests never wait on a load, and a version that fails to load is logged and not swapped in.

Versions are fetched from the MLflow registry (``checkpoint.resolve``: the checkpoint is a logged
artifact, safetensors + JSON), so a serving replica needs no shared filesystem with the trainer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

import pyarrow as pa
import torch

from recloop.data.loader import rows_to_batch
from recloop.model import RankingModel
from recloop.settings import Settings

log = logging.getLogger("recloop.serve")

CanaryMode = Literal["canary", "shadow"]


@dataclass(frozen=True)
class LoadedModel:
    version: str
    model: RankingModel
    dense: tuple[str, ...]
    tables: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return self.dense + self.tables


@dataclass(frozen=True)
class Deployment:
    """What serves right now: read once per request."""

    champion: LoadedModel | None = None
    challenger: LoadedModel | None = None
    share: float = 0.0
    mode: CanaryMode = "canary"
    salt: str = "recloop-canary"
    loaded_at: float = field(default_factory=time.time)

    @property
    def versions(self) -> dict[str, str | None]:
        return {"champion": self.champion.version if self.champion else None,
                "challenger": self.challenger.version if self.challenger else None}


@dataclass(frozen=True)
class Wanted:
    """What MLflow says should serve."""

    champion: str | None
    challenger: str | None
    share: float
    mode: CanaryMode


def registry_wanted(settings: Settings) -> Wanted:
    """Aliases and the challenger's canary tags, from the MLflow registry."""
    from mlflow import MlflowClient

    from recloop import registry
    from recloop.canary.controller import MODE_TAG, SHARE_TAG

    registry.configure(settings)
    client = MlflowClient()
    champion = registry.version_by_alias(settings, "champion")
    challenger = registry.version_by_alias(settings, "challenger")
    share, mode = 0.0, "canary"
    if challenger is not None:
        tags = client.get_model_version(registry.MODEL_NAME, challenger).tags
        share = float(tags.get(SHARE_TAG, 0.0))
        mode = "shadow" if tags.get(MODE_TAG) == "shadow" else "canary"
    return Wanted(champion, challenger, share, mode)


def load_version(settings: Settings, version: str) -> LoadedModel:
    """A registered version, downloaded once (``checkpoint.resolve``) and loaded on the CPU."""
    from recloop import checkpoint

    model, state = checkpoint.load_model(checkpoint.resolve(settings, version), device="cpu")
    inputs = checkpoint.trained_inputs(state)
    return LoadedModel(version, model, inputs.dense, inputs.table_names)


class ModelPool:
    """Live deployment + background watcher. ``loader`` and ``source`` are injectable for tests of the swap."""

    def __init__(self, settings: Settings, loader: Callable[[Settings, str], LoadedModel] = load_version,
                 source: Callable[[Settings], Wanted] = registry_wanted, cache_size: int = 4):
        self.settings = settings
        self.live = Deployment()
        self.swaps = 0
        self.last_error: str | None = None
        self._loader, self._source = loader, source
        self._cache: OrderedDict[str, LoadedModel] = OrderedDict()
        self._cache_size = cache_size
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self.on_swap: Callable[[Deployment, Deployment], None] | None = None

    def _model(self, version: str | None) -> LoadedModel | None:
        if version is None:
            return None
        if version not in self._cache:
            self._cache[version] = self._loader(self.settings, version)
        self._cache.move_to_end(version)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return self._cache[version]

    def sync(self) -> bool:
        """Bring ``live`` in line with the registry; returns whether it swapped. Loads happen before the swap."""
        with self._sync_lock:
            wanted = self._source(self.settings)
            current = self.live
            if (wanted.champion, wanted.challenger) == (current.versions["champion"], current.versions["challenger"]):
                if (wanted.share, wanted.mode) != (current.share, current.mode):
                    self.live = replace(current, share=wanted.share, mode=wanted.mode)
                return False
            champion = self._model(wanted.champion)
            challenger = self._model(wanted.challenger)
            new = Deployment(champion, challenger, wanted.share if challenger else 0.0, wanted.mode)
            self.live = new  # the swap: one reference assignment
            self.swaps += 1
            if self.on_swap:
                self.on_swap(current, new)
            log.info("serving champion v%s, challenger v%s at %.0f%%", *new.versions.values(), new.share * 100)
            return True

    def set_share(self, share: float, mode: CanaryMode | None = None) -> Deployment:
        """Change the canary share (and mode) of the live deployment at once."""
        with self._sync_lock:
            self.live = replace(self.live, share=share, mode=mode or self.live.mode)
            return self.live

    def start(self) -> None:
        def watch() -> None:
            while not self._stop.is_set():
                try:
                    self.sync()
                    self.last_error = None
                except Exception as err:  # noqa: BLE001 - keep serving the current models
                    self.last_error = f"{type(err).__name__}: {err}"
                    log.warning("model watcher: %s", self.last_error)
                self._stop.wait(self.settings.serve_poll_seconds)

        self._thread = threading.Thread(target=watch, name="recloop-model-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


@torch.no_grad()
def score(loaded: LoadedModel, rows: pa.Table) -> torch.Tensor:
    """Click probabilities for feature rows (the request's ``d_*``, ``c_*``, ``m_*`` columns)."""
    batch = rows_to_batch(rows, loaded.dense, loaded.tables)
    return torch.sigmoid(loaded.model(batch.dense, batch.values, batch.offsets).float())
