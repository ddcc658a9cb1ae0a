"""External services fail fast and by name: real dead ports, a real server that never answers, and the
real Redis / PostgreSQL when they are up. Bounds are generous pytest timeouts, never timed assertions
(the fault script in benchmarks/ measures how fast)."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator

import pytest

from recloop import endpoints
from recloop.endpoints import Limits, ServiceUnavailable
from recloop.settings import Settings

QUICK = Limits(connect_seconds=0.5, request_seconds=1.0, attempts=2, backoff_seconds=0.05)
CLIENT_VARIABLES = ("MLFLOW_HTTP_REQUEST_TIMEOUT", "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
                    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER",
                    "PREFECT_API_REQUEST_TIMEOUT", "PREFECT_CLIENT_MAX_RETRIES")


def dead_port() -> int:
    """A port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections (the kernel's backlog) but never answers a byte."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


@pytest.fixture
def client_environment() -> Iterator[None]:
    """The client variables recloop sets (only where unset) are put back as they were."""
    saved = {k: os.environ.pop(k) for k in CLIENT_VARIABLES if k in os.environ}
    yield
    for key in CLIENT_VARIABLES:
        os.environ.pop(key, None)
    os.environ.update(saved)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("scheme,service", [("http", "MLflow"), ("redis", "Redis"), ("postgresql", "PostgreSQL"),
                                            ("http", "Prefect")])
def test_a_dead_port_is_one_line_naming_the_service_and_address(scheme, service):
    uri = f"{scheme}://user:hunter2@127.0.0.1:{dead_port()}/x"
    with pytest.raises(ServiceUnavailable) as caught:
        if service == "Redis":
            endpoints.require_redis(uri, QUICK)
        elif service == "PostgreSQL":
            endpoints.require_postgres(uri, QUICK)
        elif service == "Prefect":
            endpoints.require_prefect(uri, QUICK)
        else:
            endpoints.probe(service, uri, QUICK)
    message = str(caught.value)
    assert message.startswith(f"{service} at {scheme}://user:***@127.0.0.1:") and "\n" not in message
    assert "connection refused" in message and "hunter2" not in message


@pytest.mark.timeout(30)
def test_a_redis_that_never_answers_times_out(silent_server):
    with pytest.raises(ServiceUnavailable, match="Redis at redis://127.0.0.1"):
        endpoints.require_redis(f"redis://127.0.0.1:{silent_server}/0", QUICK)


@pytest.mark.timeout(30)
def test_a_prefect_server_that_never_answers_times_out(silent_server):
    with pytest.raises(ServiceUnavailable, match="Prefect at http://127.0.0.1"):
        endpoints.require_prefect(f"http://127.0.0.1:{silent_server}/api", QUICK)


@pytest.mark.services
def test_the_real_services_pass_their_checks():
    endpoints.require_redis("redis://127.0.0.1:6379/0", QUICK)
    endpoints.require_postgres("postgresql://postgres@127.0.0.1:5432/postgres", QUICK)


@pytest.mark.services
def test_postgres_urls_get_a_connect_timeout_that_libpq_obeys():
    import psycopg2

    url = endpoints.with_connect_timeout("postgresql://postgres@127.0.0.1:5432/postgres", QUICK)
    assert "connect_timeout=1" in url
    with psycopg2.connect(url) as connection, connection.cursor() as cursor:
        cursor.execute("SELECT 1")
        assert cursor.fetchone() == (1,)
    assert endpoints.with_connect_timeout("postgresql://h/db?connect_timeout=9", QUICK).endswith("connect_timeout=9")
    assert endpoints.with_connect_timeout("sqlite:///x.db", QUICK) == "sqlite:///x.db"


def test_local_stores_need_no_probe(tmp_path):
    for uri in (f"sqlite:///{tmp_path}/mlflow.db", str(tmp_path), f"file://{tmp_path}"):
        assert endpoints.address(uri) is None
        endpoints.probe("MLflow", uri, QUICK)  # nothing to reach: no error


def test_client_limits_come_from_settings_unless_the_environment_sets_them(client_environment, monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "99")  # an operator's own choice wins
    settings = Settings(request_timeout_seconds=7, service_retries=1)
    endpoints.mlflow_environment(endpoints.limits_for(settings))
    endpoints.prefect_environment(endpoints.limits_for(settings))
    assert os.environ["MLFLOW_HTTP_REQUEST_TIMEOUT"] == "99"
    assert os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] == "1"
    assert (os.environ["PREFECT_API_REQUEST_TIMEOUT"], os.environ["PREFECT_CLIENT_MAX_RETRIES"]) == ("7.0", "1")


def test_feasts_redis_connection_string_carries_the_timeouts():
    from recloop.features.store import redis_connection_string

    text = redis_connection_string("redis://:pw@10.0.0.5:6380/2", QUICK)
    assert text == "10.0.0.5:6380,db=2,password=pw,socket_connect_timeout=0.5,socket_timeout=1.0"


@pytest.mark.timeout(30)
def test_feasts_services_are_checked_before_feast_is_used(tmp_path):
    from recloop.features import store

    redis_down = Settings(home=tmp_path, feast_online_store="redis", redis_url=f"redis://127.0.0.1:{dead_port()}/0",
                          service_retries=1, connect_timeout_seconds=0.5)
    with pytest.raises(ServiceUnavailable, match="Redis at redis://127.0.0.1"):
        store.require_services(redis_down)
    registry_down = Settings(home=tmp_path, feast_registry=f"postgresql://postgres@127.0.0.1:{dead_port()}/feast",
                             service_retries=1, connect_timeout_seconds=0.5)
    with pytest.raises(ServiceUnavailable, match="the Feast registry database at postgresql://"):
        store.require_services(registry_down)
    store.require_services(Settings(home=tmp_path))  # SQLite online store, file registry: nothing to reach


@pytest.mark.timeout(30)
def test_an_mlflow_that_accepts_but_never_answers_is_unreachable(silent_server, client_environment):
    settings = Settings(mlflow_tracking_uri=f"http://127.0.0.1:{silent_server}", connect_timeout_seconds=0.5,
                        service_retries=1)
    with pytest.raises(ServiceUnavailable, match="no answer"):
        endpoints.require_mlflow(settings)
