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

The registry is needed only to *change* versions: each deployment that served is remembered beside the
verified cache (``last_known.json``), and a replica started while the registry cannot be reached serves
those versions from its cache (verified against the manifests they were downloaded with), says it is
degraded, and catches up at the first poll the registry answers. A restart during an MLflow outage used
to turn into a full outage (``/healthz`` and ``/rank`` 503 with the champion's files on disk).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from recloop.endpoints import ServiceUnavailable
from recloop.scoring import LoadedModel, load_version
from recloop.settings import Settings

if TYPE_CHECKING:
    pass

log = logging.getLogger("recloop.serve")

CanaryMode = Literal["interleave", "canary", "shadow"]


def _describe(err: Exception) -> str:
    return str(err) if isinstance(err, ServiceUnavailable) else f"{type(err).__name__}: {err}"


class RegistryUnreachable(Exception):
    """The registry cannot be read and the last known deployment cannot be served from the cache either."""


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

    return wanted_from(registry.mlflow_client(settings), model_name or registry.MODEL_NAME)


def wanted_from(client, model_name: str) -> Wanted:
    """``registry_wanted`` through ``client`` (an ``MlflowClient``); a registry that cannot answer raises."""
    from recloop import registry
    from recloop.canary.tag import CanaryTag

    champion, challenger = (registry.alias_version(client, alias, model_name) for alias in ("champion", "challenger"))
    share, mode, salt = 0.0, "canary", None
    if challenger is not None:
        tag = CanaryTag.from_tags(client.get_model_version(model_name, challenger).tags)
        if tag is not None:
            share, mode, salt = tag.serving_share, tag.mode, tag.salt  # salt: each experiment's own split of users
    return Wanted(champion, challenger, share, mode, salt)


class RegistryReader:
    """A watcher's source: ``registry_wanted`` with one MLflow client kept from poll to poll.

    ``registry.mlflow_client`` configures MLflow (its limits, the experiment's lookup) on every call; at a
    poll every fraction of a second that was most of a serving process's idle CPU (``benchmarks/demo_stages.py``)
    and held the GIL while requests waited. The client is made again after a poll that failed, so a registry
    that comes back is probed and configured afresh.

    Args:
        model_name: the registered model to read (default: the ranker).
    """

    def __init__(self, model_name: str | None = None):
        self.model_name = model_name
        self._client = None
        self._uri: str | None = None

    def __call__(self, settings: Settings) -> Wanted:
        from recloop import registry

        uri = registry.tracking_uri(settings)
        if self._client is None or self._uri != uri:
            self._client, self._uri = registry.mlflow_client(settings), uri
        try:
            return wanted_from(self._client, self.model_name or registry.MODEL_NAME)
        except Exception:
            self._client = None
            raise


LAST_KNOWN_FILE = "last_known.json"


def last_known_path(settings: Settings, model_name: str) -> Path:
    """Where a model's last deployment that served is remembered: beside its verified downloads."""
    from recloop import checkpoint

    return checkpoint.cache_dir(settings) / model_name / LAST_KNOWN_FILE


def remember(path: Path, live: Deployment) -> None:
    """Write the versions ``live`` serves (with its share, mode and salt), atomically."""
    record = {**live.versions, "share": live.share, "mode": live.mode, "salt": live.salt, "at": time.time()}
    path.parent.mkdir(parents=True, exist_ok=True)
    staging = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}")
    staging.write_text(json.dumps(record))
    os.replace(staging, path)


def remembered(path: Path) -> Wanted | None:
    """The last deployment that served, as a ``Wanted``; None when there is none (or it cannot be read)."""
    try:
        record = json.loads(path.read_text())
        return Wanted(record["champion"], record["challenger"], float(record["share"]), record["mode"],
                      record.get("salt"))
    except (OSError, ValueError, KeyError, TypeError):
        return None


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

    A pool with nothing serving whose registry cannot be read starts from the last deployment that served
    (``last_known.json`` of ``model_name``, the versions from the verified cache only); ``degraded`` says so
    until a poll reads the registry again. ``degraded`` also holds while a serving pool's polls fail.
    """

    def __init__(self, settings: Settings, loader: Callable[[Settings, str], LoadedModel] = load_version,
                 source: Callable[[Settings], Wanted] | None = None, cache_size: int = 4,
                 retry_seconds: float = 60.0, salt: str = "recloop-canary", name: str = "model",
                 model_name: str | None = None):
        from recloop.registry import MODEL_NAME

        self.settings = settings
        self.salt, self.name = salt, name
        self.model_name = model_name or MODEL_NAME
        self.from_last_known = False  # serving what was remembered, the registry not read since start-up
        self.registry_read_at: float | None = None
        self._offline_error: str | None = None
        self._remembered_key: tuple | None = None
        self.live = Deployment(salt=salt)
        self.swaps = 0
        self.last_error: str | None = None
        self.failures: dict[str, LoadFailure] = {}
        self.wanted: Wanted | None = None
        self._loader, self._source = loader, source or RegistryReader(self.model_name)
        self._cache: OrderedDict[str, LoadedModel] = OrderedDict()
        self._cache_size = cache_size
        self._retry_seconds = retry_seconds
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._sync_lock = threading.Lock()
        self.on_swap: Callable[[Deployment, Deployment], None] | None = None
        self.on_load_failure: Callable[[LoadFailure], None] | None = None

    @property
    def degraded(self) -> str | None:
        """Why the versions served may not be the registry's (None: they are): the registry could not be
        read at the last poll while something serves."""
        if self.live.champion is None or self.last_error is None:
            return None
        if self.from_last_known:
            return f"serving the last known versions from the local cache: {self.last_error}"
        return f"the registry cannot be read (serving the versions of the last poll that could): {self.last_error}"

    def _model(self, version: str | None, force: bool, offline: bool = False) -> LoadedModel | None:
        """The loaded version, or None when it does not load (recorded in ``failures``). ``offline``: the
        registry is down, so a version not in the verified cache is left out rather than raising."""
        if version is None:
            return None
        if version not in self._cache:
            failed = self.failures.get(version)
            if failed is not None and not force and time.time() < failed.retry_at:
                return None
            try:
                self._cache[version] = self._loader(self.settings, version)
            except ServiceUnavailable:
                if offline:
                    return None
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
            offline = False
            try:
                wanted = self._source(self.settings)
            except Exception as err:
                wanted = self._last_known()
                if wanted is None:
                    raise
                offline, self._offline_error = True, _describe(err)
            if self.wanted is not None:  # a version appointed again is tried, and a failure reported, afresh
                for version in {wanted.champion, wanted.challenger} - {self.wanted.champion, self.wanted.challenger}:
                    self.failures.pop(version, None)
            self.wanted = wanted
            current = self.live
            champion = self._model(wanted.champion, force, offline)
            if champion is None and wanted.champion is not None:
                champion = current.champion  # a new champion that does not load: the current one keeps serving
            if offline and champion is None:
                raise RegistryUnreachable(f"{self._offline_error}; the last known champion v{wanted.champion} "
                                          "does not load from the verified cache")
            challenger = self._model(wanted.challenger, force, offline)
            if challenger is not None and champion is not None and challenger.version == champion.version:
                challenger = None
            share = wanted.share if challenger else 0.0
            salt = wanted.salt or self.salt  # the experiment's own salt (set at its start), else the pool's
            new = Deployment(champion, challenger, share, wanted.mode, salt)
            self.from_last_known = offline
            if not offline:
                self.registry_read_at = time.time()
            if new.versions == current.versions:
                if (share, wanted.mode, salt) != (current.share, current.mode, current.salt):
                    self.live = replace(current, share=share, mode=wanted.mode, salt=salt)
                self._remember()
                return False
            self.live = new  # the swap: one reference assignment
            self._remember()
            self.swaps += 1
            if self.on_swap:
                self.on_swap(current, new)
            log.info("serving %s champion v%s, challenger v%s at %.0f%%", self.name, *new.versions.values(),
                     new.share * 100)
            return True

    def _last_known(self) -> Wanted | None:
        """What served last (``last_known.json``), only while nothing serves yet: a pool already serving keeps
        its models when the registry cannot be read."""
        if self.live.champion is not None:
            return None
        return remembered(last_known_path(self.settings, self.model_name))

    def _remember(self) -> None:
        """Record what serves now, read from the registry (not a deployment restored from the record), when it
        changed; a record that cannot be written costs the next start-up without a registry, not a request."""
        live = self.live
        if self.from_last_known or live.champion is None:
            return
        key = (live.versions["champion"], live.versions["challenger"], live.share, live.mode, live.salt)
        if key == self._remembered_key:
            return
        try:
            remember(last_known_path(self.settings, self.model_name), live)
            self._remembered_key = key
        except OSError as err:
            log.warning("could not remember the %s deployment: %s", self.name, err)

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
            self.last_error = _describe(err)
            log.warning("model watcher: %s", self.last_error)
            return False
        if self.from_last_known:  # started from the record: the registry's error stays the reason
            self.last_error = self._offline_error
            log.warning("%s watcher: %s", self.name, self.degraded)
        else:
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


