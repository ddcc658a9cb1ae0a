"""The external services recloop calls, each with a timeout, a bounded retry and one clear error.

A dead service must cost seconds and one line naming it, never minutes of silence and a traceback:
with their defaults, MLflow's client retried a dead tracking server for 515 s and the serving API
blocked at start-up. Everything that reaches another process goes through here:

============  ==================================================================  =======================
service       timeouts                                                            when unreachable
============  ==================================================================  =======================
MLflow        ``MLFLOW_HTTP_REQUEST_TIMEOUT`` / ``_MAX_RETRIES`` / ``_BACKOFF_*``   ``require_mlflow``:
              (set unless the environment already does)                           ``GET /health``, retried
Redis         ``socket_connect_timeout``, ``socket_timeout`` and redis-py's own     ``redis_client`` +
              bounded ``Retry`` (our clients and Feast's connection string)        ``require_redis``
PostgreSQL    libpq's ``connect_timeout`` in the URL (``with_connect_timeout``)     ``require_postgres``
Prefect       ``PREFECT_API_REQUEST_TIMEOUT``, ``PREFECT_CLIENT_MAX_RETRIES``       ``require_prefect``:
                                                                                   ``GET /api/health``
============  ==================================================================  =======================

Each ``require_*`` raises ``ServiceUnavailable``, whose message is the one line a user sees, e.g.
``MLflow at http://mlflow:5000 is unreachable: connection refused (3 tries in 1.6 s)``. Local stores
(SQLite files, a file registry) need no probe. The limits come from ``Settings``
(``RECLOOP_CONNECT_TIMEOUT_SECONDS``, ``RECLOOP_REQUEST_TIMEOUT_SECONDS``, ``RECLOOP_SERVICE_RETRIES``).

Example::

    require_mlflow(settings)                       # ServiceUnavailable within seconds if it is down
    client = redis_client(settings.redis_url, limits_for(settings))
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from urllib.parse import parse_qsl, urlencode, urlparse, urlunparse

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from recloop.settings import Settings

DEFAULT_PORTS = {"http": 80, "https": 443, "redis": 6379, "rediss": 6379, "postgresql": 5432, "postgres": 5432,
                 "mysql": 3306}


@dataclass(frozen=True)
class Limits:
    """How long to wait for a service, and how often to try.

    Args:
        connect_seconds: to open a connection.
        request_seconds: for one request once connected.
        attempts: tries in all (1 = no retry); waits between them start at ``backoff_seconds`` and double.
    """

    connect_seconds: float = 3.0
    request_seconds: float = 15.0
    attempts: int = 3
    backoff_seconds: float = 0.25


def limits_for(settings: Settings) -> Limits:
    return Limits(connect_seconds=settings.connect_timeout_seconds, request_seconds=settings.request_timeout_seconds,
                  attempts=1 + settings.service_retries)


class ServiceUnavailable(Exception):
    """A service could not be reached; ``str()`` is one line naming it, its address and what happened.

    Not an ``OSError`` or ``RuntimeError``: handlers of a command's own errors must not swallow it.
    """

    def __init__(self, service: str, uri: str, reason: str, attempts: int = 1, seconds: float = 0.0):
        self.service, self.uri, self.reason = service, redact(uri), reason
        tries = f"{attempts} {'try' if attempts == 1 else 'tries'} in {seconds:.1f} s"
        super().__init__(f"{service} at {self.uri} is unreachable: {reason} ({tries})")


def redact(uri: str) -> str:
    """The URI without its password (safe to print)."""
    parsed = urlparse(uri)
    if parsed.password is None:
        return uri
    netloc = parsed.netloc.replace(f":{parsed.password}@", ":***@")
    return urlunparse(parsed._replace(netloc=netloc))


def address(uri: str) -> tuple[str, int] | None:
    """``(host, port)`` of a network URI; None for local stores (a path, ``file:``, ``sqlite:``)."""
    parsed = urlparse(uri)
    scheme = parsed.scheme.split("+")[0].lower()  # postgresql+psycopg2 → postgresql
    if scheme not in DEFAULT_PORTS or not parsed.hostname:
        return None
    try:
        port = parsed.port
    except ValueError:  # a port that is not a number: let the connection attempt say so
        port = None
    return parsed.hostname, port or DEFAULT_PORTS[scheme]


def _reason(err: BaseException) -> str:
    if isinstance(err, ConnectionRefusedError):
        return "connection refused"
    if isinstance(err, TimeoutError | socket.timeout):
        return "no answer (timed out)"
    if isinstance(err, socket.gaierror):
        return f"unknown host ({err.strerror})"
    return getattr(err, "strerror", None) or str(err) or type(err).__name__


def retrying(limits: Limits, errors: tuple[type[BaseException], ...] = (OSError,)) -> Retrying:
    """A tenacity loop: ``limits.attempts`` tries on ``errors``, exponential waits, the last error re-raised."""
    return Retrying(stop=stop_after_attempt(limits.attempts), reraise=True,
                    wait=wait_exponential(multiplier=limits.backoff_seconds, max=4 * limits.backoff_seconds),
                    retry=retry_if_exception_type(errors))


def probe(service: str, uri: str, limits: Limits = Limits()) -> None:
    """Open (and close) a TCP connection to the service, with retries; ``ServiceUnavailable`` if it never opens."""
    target = address(uri)
    if target is None:
        return
    started, attempts = time.monotonic(), 0
    try:
        for attempt in retrying(limits):
            with attempt:
                attempts += 1
                socket.create_connection(target, timeout=limits.connect_seconds).close()
    except OSError as err:
        raise ServiceUnavailable(service, uri, _reason(err), attempts, time.monotonic() - started) from err


# --- MLflow -----------------------------------------------------------------------------------------------


def mlflow_environment(limits: Limits) -> None:
    """MLflow's HTTP client limits (its defaults: 120 s per request, 7 retries with growing waits)."""
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(max(1, round(limits.request_seconds))))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(max(0, limits.attempts - 1)))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_JITTER", "0.5")


def require_mlflow(settings: Settings) -> str:
    """The tracking URI, once MLflow's limits are set and a tracking server answers (a database URI:
    accepts a connection)."""
    limits = limits_for(settings)
    mlflow_environment(limits)
    uri = settings.resolved_mlflow_tracking_uri()
    if urlparse(uri).scheme in ("http", "https"):
        require_http("MLflow", uri, "/health", limits)
    else:
        probe("MLflow", uri, limits)
    return uri


def require_http(service: str, base_url: str, path: str, limits: Limits = Limits()) -> None:
    """An HTTP service answers ``GET base_url + path`` within the connect timeout, whatever the status: a
    server that accepts connections and never answers is as unreachable as one that refuses them."""
    import httpx

    probe(service, base_url, limits)
    started, attempts = time.monotonic(), 0
    url = base_url.rstrip("/") + path
    try:
        for attempt in retrying(limits, (httpx.TimeoutException, httpx.NetworkError)):
            with attempt:
                attempts += 1
                httpx.get(url, timeout=limits.connect_seconds)
    except (httpx.TimeoutException, httpx.NetworkError) as err:
        reason = "no answer (timed out)" if isinstance(err, httpx.TimeoutException) else str(err)
        raise ServiceUnavailable(service, base_url, reason, attempts, time.monotonic() - started) from err


# --- Redis ------------------------------------------------------------------------------------------------


def redis_client(url: str, limits: Limits = Limits()):
    """A redis-py client that gives up after ``limits`` instead of waiting on the OS's TCP timeouts."""
    import redis
    from redis.backoff import ExponentialBackoff
    from redis.retry import Retry

    return redis.Redis.from_url(
        url, socket_connect_timeout=limits.connect_seconds, socket_timeout=limits.request_seconds,
        retry=Retry(ExponentialBackoff(cap=4 * limits.backoff_seconds, base=limits.backoff_seconds),
                    max(0, limits.attempts - 1)),
        retry_on_error=[redis.exceptions.ConnectionError, redis.exceptions.TimeoutError],
    )


def feast_redis_options(limits: Limits) -> str:
    """The same limits in Feast's Redis connection-string syntax (``,key=value`` pairs)."""
    return f",socket_connect_timeout={limits.connect_seconds},socket_timeout={limits.request_seconds}"


def require_redis(url: str, limits: Limits = Limits()) -> None:
    """Redis answers ``PING`` (a health check waits the connect timeout for its answer, not a request's)."""
    import redis

    started = time.monotonic()
    quick = Limits(limits.connect_seconds, limits.connect_seconds, limits.attempts, limits.backoff_seconds)
    try:
        redis_client(url, quick).ping()
    except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as err:
        cause = err.__cause__ or err.__context__
        reason = _reason(cause) if isinstance(cause, OSError) else str(err).split(".")[0]
        raise ServiceUnavailable("Redis", url, reason, limits.attempts, time.monotonic() - started) from err


# --- PostgreSQL -------------------------------------------------------------------------------------------


def with_connect_timeout(url: str, limits: Limits = Limits()) -> str:
    """A PostgreSQL URL with libpq's ``connect_timeout`` (seconds) unless it sets one; others unchanged."""
    parsed = urlparse(url)
    if parsed.scheme.split("+")[0] not in ("postgresql", "postgres"):
        return url
    query = dict(parse_qsl(parsed.query))
    query.setdefault("connect_timeout", str(max(1, round(limits.connect_seconds))))
    return urlunparse(parsed._replace(query=urlencode(query)))


def require_postgres(url: str, limits: Limits = Limits()) -> None:
    probe("PostgreSQL", url, limits)


# --- Prefect ----------------------------------------------------------------------------------------------


def prefect_environment(limits: Limits) -> None:
    """Prefect's client limits (its defaults: 60 s per request, 5 retries)."""
    os.environ.setdefault("PREFECT_API_REQUEST_TIMEOUT", str(limits.request_seconds))
    os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", str(max(0, limits.attempts - 1)))


def require_prefect(api_url: str, limits: Limits = Limits()) -> None:
    """A Prefect server answers its health check (``<api_url>/health``)."""
    require_http("Prefect", api_url, "/health", limits)
