"""The models being served, and the swap that never fails a request.

``ModelPool.live`` is one immutable ``Deployment`` (champion, challenger, canary share and mode). A
request reads it once and uses that object to the end, so a request in flight finishes on the models
it started with. The watcher thread polls MLflow (aliases, and the canary tags on the challenger),
downloads and loads any new version *before* it swaps, then replaces ``live`` in one assignment:
requests never wait on a load. Each version loads on its own, so a bad challenger never keeps the
champion from serving (see ``ModelPool``); a version that fails to load is recorded, reported, and
tried again later.

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
from typing import TYPE_CHECKING, Literal

from recloop.endpoints import ServiceUnavailable
from recloop.scoring import LoadedModel, load_version
from recloop.settings import Settings

if TYPE_CHECKING:
    pass

log = logging.getLogger("recloop.serve")

CanaryMode = Literal["interleave", "canary", "shadow"]


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
    salt: str | None = None  # the experiment's salt (the ``canary`` tag's); None: the pool's own


def registry_wanted(settings: Settings, model_name: str | None = None) -> Wanted:
    """Aliases and the challenger's ``canary`` tag (share, mode, salt) of a registered model (default: the
    ranker), from MLflow. A challenger without one (its canary not started) gets no traffic."""
    from recloop import registry
    from recloop.canary.tag import CanaryTag

    model_name = model_name or registry.MODEL_NAME
    # Once per poll (``registry.version_by_alias`` configures again on each call, a few ms of CPU each:
    # every watcher's poll holds the GIL that long, and a request arriving meanwhile waits).
    client = registry.mlflow_client(settings)
    # (a registry that cannot answer raises: the pool keeps its current models)
    champion, challenger = (registry.alias_version(client, alias, model_name) for alias in ("champion", "challenger"))
    share, mode, salt = 0.0, "canary", None
    if challenger is not None:
        tag = CanaryTag.from_tags(client.get_model_version(model_name, challenger).tags)
        if tag is not None:
            share, mode, salt = tag.serving_share, tag.mode, tag.salt  # salt: each experiment's own split of users
    return Wanted(champion, challenger, share, mode, salt)


@dataclass(frozen=True)
class LoadFailure:
    """A version that could not be loaded: why, when, and when the watcher tries it again."""

    version: str
    reason: str
    at: float
    retry_at: float


class ModelPool:
    """Live deployment + background watcher. ``loader`` and ``source`` are injectable for tests of the swap.

    Each version loads on its own: a champion that loads serves even when the challenger does not (the
    challenger is left out, and ``on_load_failure`` hears of it, once per version and failure); a new
    champion that does not load leaves the current one serving. A failed version is tried again after
    ``retry_seconds``, or at once by ``sync(force=True)`` (``/admin/reload``).
    """

    def __init__(self, settings: Settings, loader: Callable[[Settings, str], LoadedModel] = load_version,
                 source: Callable[[Settings], Wanted] = registry_wanted, cache_size: int = 4,
                 retry_seconds: float = 60.0, salt: str = "recloop-canary", name: str = "model"):
        self.settings = settings
        self.salt, self.name = salt, name
        self.live = Deployment(salt=salt)
        self.swaps = 0
        self.last_error: str | None = None
        self.failures: dict[str, LoadFailure] = {}
        self.wanted: Wanted | None = None
        self._loader, self._source = loader, source
        self._cache: OrderedDict[str, LoadedModel] = OrderedDict()
        self._cache_size = cache_size
        self._retry_seconds = retry_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self.on_swap: Callable[[Deployment, Deployment], None] | None = None
        self.on_load_failure: Callable[[LoadFailure], None] | None = None

    def _model(self, version: str | None, force: bool) -> LoadedModel | None:
        """The loaded version, or None when it does not load (recorded in ``failures``)."""
        if version is None:
            return None
        if version not in self._cache:
            failed = self.failures.get(version)
            if failed is not None and not force and time.time() < failed.retry_at:
                return None
            try:
                self._cache[version] = self._loader(self.settings, version)
            except ServiceUnavailable:
                raise  # the registry is down: not this version's fault
            except Exception as err:  # noqa: BLE001 - one bad version must not take serving down
                now = time.time()
                failure = LoadFailure(version, f"{type(err).__name__}: {err}"[:2000], now, now + self._retry_seconds)
                log.error("model v%s does not load: %s", version, failure.reason)
                first = failed is None or failed.reason != failure.reason
                self.failures[version] = failure
                if first and self.on_load_failure:
                    self.on_load_failure(failure)
                return None
            self.failures.pop(version, None)
        self._cache.move_to_end(version)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        return self._cache[version]

    def sync(self, force: bool = False) -> bool:
        """Bring ``live`` in line with the registry as far as the versions load; returns whether it swapped.

        Loads happen before the swap. ``force`` retries versions that failed to load.
        """
        with self._sync_lock:
            wanted = self._source(self.settings)
            self.wanted = wanted
            current = self.live
            champion = self._model(wanted.champion, force)
            if champion is None and wanted.champion is not None:
                champion = current.champion  # a new champion that does not load: the current one keeps serving
            challenger = self._model(wanted.challenger, force)
            if challenger is not None and champion is not None and challenger.version == champion.version:
                challenger = None
            share = wanted.share if challenger else 0.0
            salt = wanted.salt or self.salt  # the experiment's own salt (set at its start), else the pool's
            new = Deployment(champion, challenger, share, wanted.mode, salt)
            if new.versions == current.versions:
                if (share, wanted.mode, salt) != (current.share, current.mode, current.salt):
                    self.live = replace(current, share=share, mode=wanted.mode, salt=salt)
                return False
            self.live = new  # the swap: one reference assignment
            self.swaps += 1
            if self.on_swap:
                self.on_swap(current, new)
            log.info("serving %s champion v%s, challenger v%s at %.0f%%", self.name, *new.versions.values(),
                     new.share * 100)
            return True

    def set_share(self, share: float, mode: CanaryMode | None = None) -> Deployment:
        """Change the canary share (and mode) of the live deployment at once."""
        with self._sync_lock:
            self.live = replace(self.live, share=share, mode=mode or self.live.mode)
            return self.live

    def try_sync(self) -> bool:
        """``sync``, keeping the current models when the registry cannot be read (``last_error`` says why)."""
        try:
            swapped = self.sync()
        except Exception as err:  # noqa: BLE001 - keep serving the current models
            self.last_error = str(err) if isinstance(err, ServiceUnavailable) else f"{type(err).__name__}: {err}"
            log.warning("model watcher: %s", self.last_error)
            return False
        self.last_error = None
        return swapped

    def start(self) -> None:
        def watch() -> None:
            while not self._stop.is_set():
                self.try_sync()
                self._stop.wait(self.settings.serve_poll_seconds)

        self._thread = threading.Thread(target=watch, name=f"recloop-{self.name}-watcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=10)


