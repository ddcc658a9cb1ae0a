"""Serving and gating under bad models and missing parts: a broken challenger never takes the champion
down, a damaged download is fetched again, health says ready only when a request can be scored, a dead
MLflow is named within seconds, and a truncated candidate is refused by the gate, tagged failed."""

from __future__ import annotations

import contextlib
import shutil
import socket
import sqlite3
import uuid
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from mlflow import MlflowClient

from recloop import checkpoint, pipeline, registry
from recloop.canary import CanaryConfig, controller
from recloop.canary.tag import load_failure
from recloop.features.definition import FeatureLayout
from recloop.gate import GateThresholds, run_gate
from recloop.serve.app import create_app
from recloop.settings import Settings
from recloop.train import TrainSummary

TOKEN = "s3cret-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
RANK = {"user_id": 3, "item_ids": [1, 2, 3], "context": {"category": 1}}  # category: the spec allows no null


@pytest.fixture(scope="module")
def home(champion_home: Settings, tmp_path_factory, copy_home) -> Settings:
    """A copy of the shared champion's installation, with its own Feast registry and online tables."""
    return copy_home(champion_home, tmp_path_factory.mktemp("serve-faults") / "home", feast=True,
                     admin_token=TOKEN, serve_poll_seconds=0.2, feedback_flush_seconds=3600)


@pytest.fixture
def fresh(home: Settings):
    """Champion v1 alone, and an empty model cache, before and after each test."""
    def reset() -> None:
        if registry.version_by_alias(home, "challenger"):
            registry.remove_alias(home, "challenger")
        shutil.rmtree(checkpoint.cache_dir(home), ignore_errors=True)

    reset()
    yield home
    reset()


def register_copy_of_champion(home: Settings) -> str:
    """A new version whose checkpoint is the champion's (same weights): a model that works. Its weights file is
    written again with metadata: the very same file would be the champion's version (``registry.log_training``)."""
    from safetensors.torch import load_file, save_file

    source = checkpoint.resolve(home, "1")
    target = home.home / "checkpoints" / f"copy-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target)
    save_file(load_file(target / "model.safetensors"), target / "model.safetensors", metadata={"copy": target.parent.name})
    base = TrainSummary(**checkpoint.read(source)["summary"])
    base.checkpoint, base.run_id = str(target), f"{base.run_id}-{target.parent.name}"
    return pipeline.register_training(home, base).version


def registry_file(home: Settings, version: str, name: str = "model.safetensors") -> Path:
    """The version's own file in the registry's artifact store (what every download copies)."""
    import mlflow

    registry.configure(home)
    source = MlflowClient().get_model_version(registry.MODEL_NAME, version).source  # models:/m-<id>
    location = mlflow.get_logged_model(source.removeprefix("models:/")).artifact_location
    [found] = Path(location.removeprefix("file://")).rglob(name)
    return found


def truncate(path: Path) -> bytes:
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    return original


def start_canary(home: Settings, version: str) -> None:
    registry.set_alias(home, "challenger", version, who="test", why="fault test")
    controller.start(home, CanaryConfig(steps=(0.5, 1.0)))


# --- one bad model file ------------------------------------------------------------------------------------


def test_a_challenger_damaged_in_the_registry_leaves_the_champion_serving_everyone(fresh: Settings):
    home = fresh
    version = register_copy_of_champion(home)
    start_canary(home, version)
    stored = registry_file(home, version)
    original = truncate(stored)
    try:
        with TestClient(create_app(home)) as http:
            health = http.get("/healthz").json()
            assert health["ready"] is True and health["versions"] == {"champion": "1", "challenger": None}
            assert "damaged" in health["load_failures"][version]
            answers = [http.post("/rank", json={**RANK, "user_id": user}) for user in range(40)]
            assert {a.status_code for a in answers} == {200}  # half of them were routed to the challenger
            assert {a.json()["model_version"] for a in answers} == {"1"}

            # The serving process marked it; the canary controller rolls it back.
            assert "model.safetensors" in load_failure(registry.version_info(home, version).tags)
            status = controller.status(home)
            assert status.decision.action == "rollback" and "does not load in serving" in status.decision.reasons[0]

            # The registry's copy is repaired: a reload fetches it again and the challenger serves.
            stored.write_bytes(original)
            reloaded = http.post("/admin/reload", headers=AUTH)
            assert reloaded.status_code == 200, reloaded.text
            assert reloaded.json()["versions"] == {"champion": "1", "challenger": version}
    finally:
        stored.write_bytes(original)


def test_a_damaged_cached_copy_is_fetched_again(fresh: Settings):
    home = fresh
    version = register_copy_of_champion(home)
    cached = checkpoint.resolve(home, version) / "model.safetensors"
    truncate(cached)  # the bytes on this machine, not the registry's
    start_canary(home, version)
    with TestClient(create_app(home)) as http:
        health = http.get("/healthz").json()
        assert health["versions"] == {"champion": "1", "challenger": version} and health["ready"], health
    assert checkpoint.verify(cached.parent, checkpoint._read_manifest(cached.parent.parent.parent)) is None


def test_checksums_catch_what_sizes_do_not(fresh: Settings, tmp_path: Path):
    step = checkpoint.resolve(fresh, "1")
    copy = tmp_path / step.name
    shutil.copytree(step, copy)
    recorded = checkpoint.manifest(copy)
    data = bytearray((copy / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF  # same size, one bit pattern changed
    (copy / "model.safetensors").write_bytes(bytes(data))
    assert "SHA-256" in checkpoint.verify(copy, recorded)
    truncate(copy / "dense_optimizer.safetensors")
    assert "header says" in checkpoint.verify(copy, None)  # a version without a manifest: its own header


# --- readiness --------------------------------------------------------------------------------------------


def test_health_is_not_ready_without_feature_state(fresh: Settings, tmp_path: Path, copy_home):
    home = copy_home(fresh, tmp_path / "home", feast=True)
    shutil.rmtree(FeatureLayout.for_settings(home).state)
    with TestClient(create_app(home)) as http:
        health = http.get("/healthz")
        assert health.status_code == 503 and "no feature state" in health.json()["reasons"][0]
        answer = http.post("/rank", json=RANK)
        assert answer.status_code == 503 and "feature state" in answer.json()["detail"]


def test_health_is_not_ready_when_the_online_store_is_gone(fresh: Settings, tmp_path: Path, copy_home):
    home = copy_home(fresh, tmp_path / "home", feast=True)
    with TestClient(create_app(home)) as http:
        assert http.get("/healthz").json()["ready"] is True
        with sqlite3.connect(home.home / "feast" / "online.db") as db:  # what a stray apply used to do
            for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                db.execute(f'DROP TABLE "{table}"')
        checkpoint_free = http.get("/healthz")
        while checkpoint_free.json()["ready"]:  # the probe's result is kept for a second
            checkpoint_free = http.get("/healthz")
        assert checkpoint_free.status_code == 503 and "features cannot be built" in checkpoint_free.json()["reasons"][0]
        assert http.post("/rank", json=RANK).status_code == 503


@pytest.mark.timeout(120)
def test_serving_starts_with_a_dead_mlflow_and_says_so(fresh: Settings, tmp_path: Path, copy_home):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{probe.getsockname()[1]}"
    home = copy_home(fresh, tmp_path / "home", feast=True, mlflow_tracking_uri=dead, admin_token=TOKEN)
    with TestClient(create_app(home)) as http:
        health = http.get("/healthz")
        assert health.status_code == 503
        assert f"MLflow at {dead} is unreachable" in health.json()["reasons"][0]
        assert http.post("/rank", json=RANK).status_code == 503
        assert http.post("/admin/reload", headers=AUTH).status_code == 503


def closed_port_uri() -> str:
    """A registry URI that refuses connections: a local port nothing listens on."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


@pytest.mark.timeout(240)
def test_serving_started_while_mlflow_is_down_serves_its_last_known_versions(fresh: Settings, tmp_path: Path,
                                                                            copy_home):
    """A replica restarted during an MLflow outage serves the champion and challenger it served last, from its
    verified cache, ready but degraded (and a metric says so), instead of 503 on every request."""
    version = register_copy_of_champion(fresh)
    start_canary(fresh, version)
    with TestClient(create_app(fresh)) as http:  # served once with the registry up: cache and record filled
        assert http.get("/healthz").json()["versions"] == {"champion": "1", "challenger": version}
    dead = closed_port_uri()
    home = copy_home(fresh, tmp_path / "home", feast=True, mlflow_tracking_uri=dead, admin_token=TOKEN)
    with TestClient(create_app(home)) as http:
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["ready"], health.json()
        assert health.json()["versions"] == {"champion": "1", "challenger": version}
        assert health.json()["share"] == 0.5
        [degraded] = health.json()["degraded"]
        assert degraded.startswith("ranker: serving the last known versions") and f"MLflow at {dead}" in degraded
        ranked = http.post("/rank", json=RANK)
        assert ranked.status_code == 200 and ranked.json()["model_version"] in ("1", version)
        scraped = http.get("/metrics").text
        assert 'recloop_serving_degraded{model="ranker"} 1.0' in scraped
        assert 'recloop_serving_degraded{model="retriever"} 0.0' in scraped  # none registered: none to serve
        assert http.post("/admin/reload", headers=AUTH).status_code == 503  # versions cannot change meanwhile


@pytest.mark.timeout(240)
def test_a_pool_started_from_its_cache_catches_up_when_the_registry_returns(fresh: Settings, tmp_path: Path,
                                                                           copy_home):
    from recloop.scoring import load_version
    from recloop.serve.models import ModelPool, registry_wanted

    assert ModelPool(fresh).try_sync()  # served v1 with the registry up: remembered
    down = copy_home(fresh, tmp_path / "down", mlflow_tracking_uri=closed_port_uri())
    registry_of = {"now": down}  # the replica's registry: down at start-up, back later (the same store)
    pool = ModelPool(down, source=lambda settings: registry_wanted(registry_of["now"]),
                     loader=lambda settings, v: load_version(registry_of["now"], v))
    assert pool.try_sync()
    assert pool.live.versions == {"champion": "1", "challenger": None}
    assert pool.degraded and "unreachable" in pool.degraded and pool.registry_read_at is None
    assert not pool.try_sync() and pool.degraded  # still down: still the cache's versions, still degraded
    moved = register_copy_of_champion(fresh)
    registry.set_alias(fresh, "champion", moved, who="test", why="promoted during the outage")
    try:
        registry_of["now"] = fresh
        assert pool.try_sync()
        assert pool.live.versions == {"champion": moved, "challenger": None}
        assert pool.degraded is None and pool.last_error is None and pool.registry_read_at is not None
    finally:
        registry.set_alias(fresh, "champion", "1", who="test", why="reset")


ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


@pytest.fixture
def locked_database():
    """A database of the real PostgreSQL that refuses connections (``ALLOW_CONNECTIONS false``, as a database being
    restored or restarted does): ``(dsn, reopen)``; ``reopen()`` lets connections in. Dropped afterwards."""
    import psycopg2

    name = f"recloop_down_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(ADMIN_DSN)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    admin.cursor().execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    try:
        yield (f"postgresql://postgres@127.0.0.1:5432/{name}",
               lambda: admin.cursor().execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true"))
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


@pytest.mark.services
@pytest.mark.timeout(240)
def test_serving_started_while_its_postgres_journal_is_down_serves_and_catches_up(fresh: Settings, tmp_path: Path,
                                                                                  copy_home, locked_database):
    """A replica (re)started while its journal's PostgreSQL refuses connections serves, ready but degraded: requests
    kept in memory (and, by a process stopped meanwhile, on disk for the next one), feedback refused with a 503 the
    client retries; once the database answers, every request served meanwhile is written and feedback is accepted."""
    import psycopg2
    from polling import eventually

    dsn, reopen = locked_database
    home = copy_home(fresh, tmp_path / "home", feast=True, journal="postgres", postgres_dsn=dsn, admin_token=TOKEN)
    kept_dir = home.serving_dir / "journal-kept"
    with TestClient(create_app(home)) as http:  # a replica stopped during the outage: its rows go to disk
        first = [http.post("/rank", json={**RANK, "user_id": user}) for user in range(5)]
        assert {a.status_code for a in first} == {200}
    [kept] = kept_dir.glob("requests-*.json")
    with TestClient(create_app(home)) as http:  # the next one, still during the outage
        health = http.get("/healthz")
        assert health.status_code == 200 and health.json()["ready"], health.json()
        [degraded] = health.json()["degraded"]
        assert degraded.startswith("journal: PostgreSQL at") and "not currently accepting connections" in degraded
        served = [http.post("/rank", json={**RANK, "user_id": user}) for user in range(20)]
        assert {a.status_code for a in served} == {200}
        request_id = served[0].json()["request_id"]
        shown = [item["item_id"] for item in served[0].json()["items"]]
        refused = http.post("/feedback", json={"request_id": request_id, "impressions": shown, "clicks": shown[:1]})
        assert refused.status_code == 503 and int(refused.headers["Retry-After"]) >= 1
        assert "feedback not recorded" in refused.json()["detail"] and "send it again" in refused.json()["detail"]
        scraped = http.get("/metrics").text
        assert "recloop_journal_degraded 1.0" in scraped and "recloop_feedback_refused_total 1.0" in scraped
        assert "recloop_journal_unwritten_requests 25.0" in scraped  # the 5 kept on disk, queued again, and 20

        reopen()  # the database answers again
        eventually(lambda: not http.get("/healthz").json()["degraded"], 60, "the journal never caught up")
        accepted = http.post("/feedback", json={"request_id": request_id, "impressions": shown, "clicks": shown[:1]})
        assert accepted.status_code == 200 and accepted.json()["accepted"] == len(shown), accepted.text
        scraped = http.get("/metrics").text
        assert "recloop_journal_degraded 0.0" in scraped and "recloop_journal_unwritten_requests 0.0" in scraped
    with psycopg2.connect(dsn) as db, db.cursor() as cursor:
        cursor.execute("SELECT request_id FROM recloop_journal.requests")
        written = {request_id for (request_id,) in cursor.fetchall()}
    db.close()
    assert written == {a.json()["request_id"] for a in first + served}  # nothing served during the outage lost
    assert not kept.exists()  # written, so no later process writes it again


@pytest.mark.services
@pytest.mark.timeout(120)
def test_an_outages_request_rows_past_the_bound_wait_on_disk_and_are_written_when_it_ends(tmp_path: Path,
                                                                                          locked_database):
    """While the journal's PostgreSQL refuses connections, request rows past ``spill_rows`` leave memory for a
    file (a crash then loses nothing, an outage of hours does not grow the process); once it answers, the
    spilled rows are queued again, written, and their files removed."""
    import json

    import psycopg2
    from polling import eventually

    from recloop.journal import open_journal

    dsn, reopen = locked_database
    settings = Settings(home=tmp_path / "home", journal="postgres", postgres_dsn=dsn, service_retries=1,
                        connect_timeout_seconds=0.5)
    journal = open_journal(settings, connect_later=True)
    kept = tmp_path / "journal-kept"
    journal.spill_folder, journal.spill_rows = kept, 10
    try:
        ids = [uuid.uuid4().hex for _ in range(25)]
        for n, request_id in enumerate(ids):
            journal.record((request_id, 1.0e9 + n, 1_000_000 * n, n, "champion", "1", 1.0, json.dumps({})), [])
        eventually(lambda: list(kept.glob("requests-*.json")), 60, "nothing was spilled to disk")
        assert journal.unwritten_requests < 10  # the rest wait on disk, not in memory
        spilled = [row[0] for path in kept.glob("requests-*.json") for row, _ in json.loads(path.read_text())]
        assert set(spilled) <= set(ids) and spilled
        reopen()
        eventually(lambda: journal.degraded is None and not list(kept.glob("requests-*.json")), 60,
                   "the spilled rows were never written")
    finally:
        journal.close()
    with psycopg2.connect(dsn) as db, db.cursor() as cursor:
        cursor.execute("SELECT request_id FROM recloop_journal.requests")
        written = {request_id for (request_id,) in cursor.fetchall()}
    db.close()
    assert written == set(ids)  # every row served during the outage, once


class Forwarder:
    """A TCP port that leads to a real service while ``open`` and refuses connections otherwise: the service
    going down and coming back at one address, with the service itself untouched (the shared Redis)."""

    def __init__(self, target: tuple[str, int]):
        self.target, self.port, self._listener, self._conns = target, _free_port(), None, []

    def open(self) -> None:
        import threading

        self._listener = socket.create_server(("127.0.0.1", self.port))
        listener = self._listener

        def pump(source, sink) -> None:
            try:
                while data := source.recv(65536):
                    sink.sendall(data)
            except OSError:
                pass
            finally:
                for end in (source, sink):
                    end.close()

        def accept() -> None:
            while True:
                try:
                    client, _ = listener.accept()
                except OSError:
                    return
                server = socket.create_connection(self.target)
                self._conns += [client, server]
                for a, b in ((client, server), (server, client)):
                    threading.Thread(target=pump, args=(a, b), daemon=True).start()

        threading.Thread(target=accept, daemon=True).start()

    def close(self) -> None:
        if self._listener is not None:  # shut down first: a close alone leaves a blocked accept() listening
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
        for conn in self._conns:
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_RDWR)
            conn.close()
        self._conns = []


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.mark.services
@pytest.mark.timeout(180)
def test_serving_started_while_redis_is_down_says_why_and_serves_once_it_answers(fresh: Settings, tmp_path: Path,
                                                                                 copy_home):
    """The online store is needed to score a request, not only to change versions: a replica started while Redis
    is down starts (no crash, no exit), answers 503 with the reason on /healthz and /rank, and serves once Redis
    answers, with no restart (the audit of serving's start-up dependencies, issue 41)."""
    import redis
    from polling import eventually
    from redis.backoff import NoBackoff
    from redis.retry import Retry

    redis.Redis(host="127.0.0.1", port=6379, db=12).flushdb()
    door = Forwarder(("127.0.0.1", 6379))
    door.open()  # up while Feast's repository is applied for this home (apply checks Redis first)
    home = copy_home(fresh, tmp_path / "home", feast=True, feast_online_store="redis",
                     redis_url=f"redis://127.0.0.1:{door.port}/12")
    door.close()
    with pytest.raises(redis.ConnectionError):  # down, as the replica will find it (asked once: the client's
        # default three retries with backoff spent seconds learning what the first refused connection says)
        redis.Redis(host="127.0.0.1", port=door.port, db=12, socket_connect_timeout=2,
                    retry=Retry(NoBackoff(), 0)).ping()
    try:
        with TestClient(create_app(home)) as http:
            health = http.get("/healthz")
            assert health.status_code == 503, health.json()
            assert "features cannot be built" in health.json()["reasons"][0], health.json()
            answer = http.post("/rank", json=RANK)
            assert answer.status_code == 503 and "features unavailable" in answer.json()["detail"], answer.json()
            door.open()  # Redis answers again at the same address
            eventually(lambda: http.get("/healthz").json()["ready"], 60, "serving never saw Redis come back")
            answer = http.post("/rank", json=RANK)
            assert answer.status_code == 200 and answer.json()["model_version"] == "1", answer.text
    finally:
        door.close()
        redis.Redis(host="127.0.0.1", port=6379, db=12).flushdb()


def test_no_cached_copy_of_the_last_known_champion_is_no_champion(fresh: Settings, tmp_path: Path, copy_home):
    from recloop.serve.models import ModelPool

    assert ModelPool(fresh).try_sync()
    down = copy_home(fresh, tmp_path / "down", mlflow_tracking_uri=closed_port_uri())
    shutil.rmtree(checkpoint.cache_dir(down) / registry.MODEL_NAME / "v1")  # the record stays, the files do not
    pool = ModelPool(down)
    assert not pool.try_sync() and pool.live.champion is None
    assert "does not load from the verified cache" in pool.last_error and "MLflow at" in pool.last_error


# --- a version's state tags --------------------------------------------------------------------------------


def test_a_version_made_challenger_again_loses_its_stale_state_tags(fresh: Settings):
    """A version rolled back (or that once failed to load) and made challenger again starts clean: a stale
    ``serving.load_failed`` made the controller roll the new canary back at its first check."""
    from recloop.canary.tag import CANARY_TAG, LOAD_FAILED_TAG

    home = fresh
    version = register_copy_of_champion(home)
    start_canary(home, version)
    registry.tag(home, version, {LOAD_FAILED_TAG: '{"reason": "then", "at": 0}', registry.ROLLED_BACK_TAG: "{}"})
    registry.set_alias(home, "challenger", version, who="test", why="the same alias again: nothing changes")
    assert {LOAD_FAILED_TAG, registry.ROLLED_BACK_TAG, CANARY_TAG} <= set(registry.version_info(home, version).tags)
    registry.remove_alias(home, "challenger")
    controller.set_challenger(home, version, who="test", why="tried again")
    tags = registry.version_info(home, version).tags
    assert not {LOAD_FAILED_TAG, registry.ROLLED_BACK_TAG, CANARY_TAG} & set(tags), tags
    assert "alias.challenger" in tags
    assert controller.running(home) is None  # no canary until it is started anew
    registry.tag(home, "1", {registry.ROLLED_BACK_TAG: "{}"})
    registry.set_alias(home, "champion", "1", who="test", why="already champion: its tags stay")
    assert registry.ROLLED_BACK_TAG in registry.version_info(home, "1").tags
    registry.tag(home, version, {registry.ROLLED_BACK_TAG: "{}"})
    registry.promote(home, version, who="test", why="promoted after all")
    assert registry.ROLLED_BACK_TAG not in registry.version_info(home, version).tags
    registry.set_alias(home, "champion", "1", who="test", why="reset")


def test_a_version_that_does_not_load_is_reported_again_when_appointed_again(fresh: Settings):
    from recloop.serve.models import ModelPool

    home = fresh
    version = register_copy_of_champion(home)
    stored = registry_file(home, version)
    original = truncate(stored)
    reported = []
    pool = ModelPool(home)
    pool.on_load_failure = reported.append
    try:
        registry.set_alias(home, "challenger", version, who="test", why="bad")
        pool.try_sync()
        registry.remove_alias(home, "challenger")
        pool.try_sync()
        registry.set_alias(home, "challenger", version, who="test", why="bad again")  # its tag was cleared...
        pool.try_sync()
    finally:
        stored.write_bytes(original)
    assert [f.version for f in reported] == [version, version]  # ...so serving says it again


# --- the gate -----------------------------------------------------------------------------------------------


def test_the_gate_refuses_a_truncated_candidate_and_tags_it_failed(fresh: Settings):
    home = fresh
    version = register_copy_of_champion(home)
    stored = registry_file(home, version)
    original = truncate(stored)
    try:
        outcome = run_gate(home, version, GateThresholds(calibration_range=(0.5, 2.0)), smoke_check=False)
    finally:
        stored.write_bytes(original)
    assert not outcome.passed and outcome.alias is None
    assert "cannot be loaded" in outcome.reasons[0] and "model.safetensors" in outcome.reasons[0]
    tags = registry.version_info(home, version).tags
    gate = registry.gate_record(tags)
    assert gate["verdict"] == "failed" and "model.safetensors" in gate["reasons"][0]
    assert registry.version_by_alias(home, "champion") == "1"


@pytest.mark.timeout(120)
def test_a_registry_that_cannot_answer_leaves_the_champion_serving(fresh: Settings, tmp_path: Path, copy_home):
    """An alias lookup that fails (a locked store, a server's 5xx: MLflow raises TEMPORARILY_UNAVAILABLE or
    INTERNAL_ERROR) is not "no champion": the poll keeps the current models and says why (it installed no
    champion at all, and every replica answered 503 until a poll went through)."""
    import threading
    from http.server import BaseHTTPRequestHandler, HTTPServer

    from recloop.serve.models import ModelPool, registry_wanted

    class Busy(BaseHTTPRequestHandler):  # a tracking server that is up and fails the alias lookups
        def do_GET(self):
            answers = {"/health": (200, b"OK"), "/api/2.0/mlflow/experiments/get-by-name": (200, (
                b'{"experiment": {"experiment_id": "1", "name": "recloop", "lifecycle_stage": "active"}}'))}
            status, body = answers.get(self.path.split("?")[0], (
                503, b'{"error_code": "TEMPORARILY_UNAVAILABLE", "message": "busy"}'))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = HTTPServer(("127.0.0.1", 0), Busy)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    busy = copy_home(fresh, tmp_path / "busy", mlflow_tracking_uri=f"http://127.0.0.1:{server.server_port}")
    registry_of = {"now": fresh}
    pool = ModelPool(fresh, source=lambda settings: registry_wanted(registry_of["now"]))
    try:
        assert pool.try_sync() and pool.live.champion is not None
        serving = pool.live.champion.version
        registry_of["now"] = busy
        assert not pool.try_sync()
        assert pool.live.champion is not None and pool.live.champion.version == serving
        assert pool.last_error and "registered-models/alias" in pool.last_error, pool.last_error
        assert registry.version_by_alias(fresh, "no-such-alias") is None  # an unset alias is still None
    finally:
        server.shutdown()
