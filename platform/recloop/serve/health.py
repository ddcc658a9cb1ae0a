"""Readiness: whether the serving API can score a request right now, and if not, why.

``/healthz`` used to say ready as soon as a champion was loaded, while every ``/rank`` answered 500
because the feature state was missing or the online store's tables were gone. Readiness is now what a
request needs, checked the way a request does it: the champion is loaded, the feature state is there,
and a probe request (an unknown user and item, so nothing real is touched) reads the online store,
builds its rows and is scored by the champion to finite numbers. The probe's outcome is kept for
``probe_seconds`` so a health check polled often costs one probe per interval, not one per call.

Example::

    readiness = Readiness(pool, features)
    verdict = readiness.check()
    verdict.ready, verdict.reasons        # False, ('no feature state: run `recloop features` first',)
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import numpy as np

from recloop.features.online import PROBE_ENTITY, RequestFeatures
from recloop.scoring import score
from recloop.serve.models import ModelPool


@dataclass(frozen=True)
class Verdict:
    ready: bool
    reasons: tuple[str, ...]
    checked_at: float


class Readiness:
    """Checks the scoring path of one serving process (see module doc)."""

    def __init__(self, pool: ModelPool, features: RequestFeatures, probe_seconds: float = 1.0):
        self.pool, self.features, self.probe_seconds = pool, features, probe_seconds
        self._last: tuple[tuple, Verdict] | None = None
        self._lock = threading.Lock()

    def check(self) -> Verdict:
        live = self.pool.live
        reasons = []
        if live.champion is None:
            reasons.append(self._no_champion())
        if self.features.state_version is None:
            reasons.append("no feature state: run `recloop features` first")
        if reasons:
            return Verdict(False, tuple(reasons), time.time())
        key = (live.champion.version, self.features.state_version)
        with self._lock:
            if self._last is not None and self._last[0] == key and \
                    time.time() - self._last[1].checked_at < self.probe_seconds:
                return self._last[1]
            verdict = self._probe(live.champion)
            self._last = (key, verdict)
            return verdict

    def _no_champion(self) -> str:
        wanted = self.pool.wanted
        if self.pool.last_error:
            return f"no champion model is deployed: {self.pool.last_error}"
        if wanted is None or wanted.champion is None:
            return "no champion model is deployed: the registry has no 'champion' alias (train and gate a model first)"
        failure = self.pool.failures.get(wanted.champion)
        why = failure.reason if failure else "not loaded yet"
        return f"no champion model is deployed: v{wanted.champion} does not load ({why})"

    def _probe(self, champion) -> Verdict:
        now = time.time()
        try:
            rows, _ = self.features.rows(PROBE_ENTITY, [PROBE_ENTITY], {}, int(now * 1_000_000), whole_row=False)
        except Exception as err:  # noqa: BLE001 - whatever breaks the path is the reason
            return Verdict(False, (f"features cannot be built: {type(err).__name__}: {err}",), now)
        try:
            values = score(champion, rows).numpy()
        except Exception as err:  # noqa: BLE001
            return Verdict(False, (f"champion v{champion.version} cannot score: {type(err).__name__}: {err}",), now)
        if not np.isfinite(values).all():
            return Verdict(False, (f"champion v{champion.version} scores NaN",), now)
        return Verdict(True, (), now)
