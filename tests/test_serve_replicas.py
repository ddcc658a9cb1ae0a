"""Two ``recloop serve`` processes sharing one journal in a real PostgreSQL: the canary controller judges the
union of their traffic, and feedback sent to the replica that did not serve the request lands once."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import pyarrow.dataset as ds
import pytest
from polling import eventually
from safetensors.torch import load_file, save_file

from recloop import checkpoint, pipeline, registry
from recloop.canary import CanaryConfig, controller
from recloop.journal import JournalBusy, SqliteJournal
from recloop.journal.postgres import PostgresJournal
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig
from recloop.train import TrainSummary

pytestmark = pytest.mark.services

CHECKOUT = Path(__file__).resolve().parents[1]
TOKEN = "replica-admin-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
# A/B, straight to 100 %. Each canary splits users with its own salt and their activity is heavy-tailed: the
# challenger's half of 60 requests was once 18 (min_requests was 20), so 10 are enough to judge here.
CANARY = CanaryConfig(steps=(0.5, 1.0), bake_seconds=0, min_requests=10, min_feedback=100,
                      max_p99_ratio=10.0, max_auc_drop=0.5, mode="canary", holdout=0.0)


@pytest.fixture
def database():
    """A database of its own, dropped afterwards: its DSN."""
    import psycopg2

    name = f"recloop_journal_{uuid.uuid4().hex[:12]}"
    admin = psycopg2.connect(ADMIN_DSN)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    try:
        yield f"postgresql://postgres@127.0.0.1:5432/{name}"
    finally:
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _twin_of_champion(home: Settings) -> str:
    """The champion's checkpoint registered again as a new version (a challenger that scores the same)."""
    source = checkpoint.resolve(home, "1")
    target = home.home / "checkpoints" / f"twin-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    assert weights  # a real checkpoint; saved again with metadata: another file, or it is the champion's version
    save_file(weights, target / "model.safetensors", metadata={"twin": target.parent.name})
    base = TrainSummary(**checkpoint.read(source)["summary"])
    base.checkpoint, base.run_id = str(target), f"{base.run_id}-{target.parent.name}"
    return pipeline.register_training(home, base).version


@pytest.fixture
def replicas(champion_home: Settings, copy_home, database: str, tmp_path: Path):
    """Two serving processes over one installation, journal in PostgreSQL, a challenger at 50 %."""
    home = copy_home(champion_home, tmp_path / "home", feast=True, journal="postgres", postgres_dsn=database)
    challenger = _twin_of_champion(home)
    registry.set_alias(home, "challenger", challenger, who="test", why="two replicas")
    controller.start(home, CANARY)
    env = {**os.environ, "RECLOOP_HOME": str(home.home), "RECLOOP_JOURNAL": "postgres",
           "RECLOOP_POSTGRES_DSN": database, "RECLOOP_FRAME_BACKEND": "pandas", "RECLOOP_ADMIN_TOKEN": TOKEN,
           "RECLOOP_FEAST_REPO": str(CHECKOUT / "feature_repo"), "RECLOOP_SERVE_POLL_SECONDS": "0.5",
           "RECLOOP_FEEDBACK_FLUSH_SECONDS": "3600", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONPATH": os.pathsep.join([str(CHECKOUT / "platform"), str(CHECKOUT / "kernels"), str(CHECKOUT)])}
    ports = [_free_port(), _free_port()]
    logs = [open(tmp_path / f"replica-{i}.log", "w") for i in range(2)]  # noqa: SIM115 - closed below
    processes = [subprocess.Popen([sys.executable, "-m", "recloop.cli", "serve", "--port", str(port)], env=env,
                                  cwd=tmp_path, stdout=log, stderr=subprocess.STDOUT)
                 for port, log in zip(ports, logs, strict=True)]
    try:
        urls = [f"http://127.0.0.1:{port}" for port in ports]
        def ready(url: str, process) -> bool:
            assert process.poll() is None, (tmp_path / "replica-0.log").read_text()[-3000:]
            try:
                health = httpx.get(f"{url}/healthz", timeout=2).json()
            except httpx.HTTPError:
                return False
            return health["versions"]["challenger"] == challenger and health["share"] == 0.5

        for url, process in zip(urls, processes, strict=True):
            eventually(lambda url=url, process=process: ready(url, process), 120, f"replica {url} never became ready",
                       interval=0.2)
        yield home, urls, challenger
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        for log in logs:
            log.close()


def test_replicas_share_one_journal(replicas):
    from recloop.serve.traffic import SimulatedUsers

    home, urls, challenger = replicas
    users = SimulatedUsers(World(WorldConfig(seed=4, days=4, events_per_day=6000)), day=3.2, seed=23)
    clients = [httpx.Client(base_url=url, timeout=30) for url in urls]
    sent, served, impressions = {}, {"1": 0, challenger: 0}, 0
    try:
        for i in range(60):  # round-robin: request i to replica i % 2, its feedback to the other one
            body, who = users.request()
            answer = clients[i % 2].post("/rank", json=body).json()
            served[answer["model_version"]] += 1
            shown, clicked, _ = users.react(answer, who)
            feedback = {"request_id": answer["request_id"], "impressions": shown, "clicks": clicked}
            accepted = clients[(i + 1) % 2].post("/feedback", json=feedback).json()
            again = clients[i % 2].post("/feedback", json=feedback).json()
            assert accepted["accepted"] == len(shown) and accepted["served_version"] == answer["model_version"]
            assert again["accepted"] == 0 and again["duplicates"] == len(shown)  # once, whichever replica
            sent.update({f"{answer['request_id']}-{item}": int(item in clicked) for item in shown})
            impressions += len(shown)
        assert served["1"] and served[challenger]

        # The controller sees both replicas' traffic: every request and every impression, not half.
        status = controller.status(home, CANARY)
        stats = status.stats
        assert stats["champion"].requests + stats["challenger"].requests == 60
        assert stats["champion"].requests == served["1"] and stats["challenger"].requests == served[challenger]
        assert stats["champion"].impressions + stats["challenger"].impressions == impressions
        step = controller.step(home, CANARY)
        assert step.decision.action == "step" and step.decision.share == 1.0, step.decision.reasons

        landed = [c.post("/admin/flush", headers=AUTH).json()["landed"] for c in clients]
        assert sum(landed) == len(sent)
        assert [c.post("/admin/flush", headers=AUTH).json()["landed"] for c in clients] == [0, 0]
    finally:
        for client in clients:
            client.close()
    events = ds.dataset(home.landing_dir / "serving", format="parquet").to_table().to_pandas()
    assert len(events) == len(sent) and set(events["event_id"]) == set(sent)
    assert dict(zip(events["event_id"], events["label"].astype(int), strict=True)) == sent


@pytest.mark.parametrize("store", ["sqlite", "postgres"])
def test_both_stores_answer_the_same(store: str, tmp_path: Path, request):
    """The same requests and feedback give the same answers, stats and landed events in either store."""
    from recloop.schema import load_spec

    spec = load_spec("synthetic")
    if store == "postgres":
        journal = PostgresJournal(request.getfixturevalue("database"), spec)
    else:
        journal = SqliteJournal(tmp_path / "journal.db", spec)
    try:
        payload = ('{"item_ids": [5, 6, 7], "context": {"device": "mobile", "country": "US", "category": [1, 2, 3], '
                   '"price": [1.0, 2.0, 3.0], "history": [4]}, "per_candidate": {"category": true, "price": true}, '
                   '"scores": {"1": [0.9, 0.1, 0.5], "2": [0.2, 0.8, 0.5]}, "ranked": [5, 7, 6]}')
        for n, user in enumerate((10, 11)):
            request_id = f"{n:032x}"
            journal.record((request_id, 100.0 + n, 1_767_225_600_000_000, user, "champion", "1", 3.0, payload),
                           [(request_id, "1", "served", "ok", 2.0 + n, 100.0 + n),
                            (request_id, "2", "shadow", "ok", 4.0, 100.0 + n),
                            (request_id, f"retriever:{n + 1}", "served", "ok", 1.0, 100.0 + n)])
        assert journal.add_feedback(f"{0:032x}", [5, 6], [5]) == {"accepted": 2, "duplicates": 0, "clicks": 1,
                                                                  "served_version": "1"}
        assert journal.add_feedback(f"{0:032x}", [5, 6, 7], [7])["accepted"] == 1  # 5 and 6 were in already
        assert journal.add_feedback(f"{1:032x}", [6], [6])["accepted"] == 1
        with pytest.raises(Exception, match="unknown request"):
            journal.request_wait_seconds = 0.1
            journal.add_feedback(f"{9:032x}", [5], [])
        # the monitor's concept-drift baseline starts where a version first served alone with feedback
        assert journal.first_served_us("1") == 1_767_225_600_000_000 and journal.first_served_us("2") is None
        # each retriever's A/B arm: user 10's request found by retriever 1, user 11's by retriever 2
        users, clicks, shown = journal.retriever_user_clicks("1")
        assert (users.tolist(), clicks.tolist(), shown.tolist()) == ([10], [2.0], [3.0])
        assert journal.retriever_user_clicks("2")[0].tolist() == [11] and journal.retriever_user_clicks(
            "2", since=200.0)[0].tolist() == []
        champion, shadow = journal.stats("1"), journal.stats("2", since=100.5)
        assert (champion.requests, champion.impressions, champion.clicks) == (2, 4, 3)
        assert (shadow.requests, shadow.impressions) == (1, 0)
        assert champion.online_auc is not None and champion.p99_ms == pytest.approx(2.99)
        path, rows = journal.land_feedback(tmp_path / "landing")
        assert rows == 4 and journal.land_feedback(tmp_path / "landing") == (None, 0)
        landed = ds.dataset(path).to_table().to_pandas()
        assert sorted(landed["event_id"]) == sorted([f"{0:032x}-5", f"{0:032x}-6", f"{0:032x}-7", f"{1:032x}-6"])
        assert landed.set_index("event_id")["position"].to_dict()[f"{0:032x}-7"] == 2
    finally:
        journal.close()


def test_the_journal_keeps_requests_its_store_refused_and_lands_past_a_bad_row(tmp_path: Path, monkeypatch):
    """A store that fails for a moment (a database restarting) loses no request row and does not stop the
    writer; a feedback row whose item the answer did not list (a journal from before feedback was checked
    against the answer) lands with no position, for ingestion to quarantine, instead of blocking every
    landing after it."""
    import sqlite3
    import time

    from recloop.schema import load_spec

    journal = SqliteJournal(tmp_path / "journal.db", load_spec("synthetic"))
    try:
        write, failures = journal._write_requests, []

        def flaky(requests, evaluations):
            if len(failures) < 2:
                failures.append(len(requests))
                raise sqlite3.OperationalError("database is locked")
            write(requests, evaluations)

        monkeypatch.setattr(journal, "_write_requests", flaky)
        payload = '{"item_ids": [5, 6, 7], "context": {}, "per_candidate": {}, "scores": {"1": [0.9, 0.1, 0.5]}, ' \
                  '"ranked": [5]}'
        for n in range(3):
            journal.record((f"{n:032x}", time.time(), 1_767_225_600_000_000, 10 + n, "champion", "1", 3.0, payload),
                           [(f"{n:032x}", "1", "served", "ok", 2.0, time.time())])
        eventually(lambda: all(journal._request(f"{n:032x}") for n in range(3)), 10, "the refused rows never landed")
        assert len(failures) == 2 and journal._writer.is_alive()

        assert journal.add_feedback(f"{0:032x}", [5], [5])["accepted"] == 1
        with pytest.raises(Exception, match=r"\[6\] were not shown"):
            journal.add_feedback(f"{1:032x}", [5, 6], [])
        # the row an older journal let in: item 6 was a candidate, never listed
        journal._insert_new_feedback([(f"{1:032x}-6", f"{1:032x}", 6, 0, time.time(), "1", "{}", None)])
        path, rows = journal.land_feedback(tmp_path / "landing")
        landed = ds.dataset(path).to_table().to_pandas().set_index("event_id")["position"]
        assert rows == 2 and landed[f"{0:032x}-5"] == 1 and landed.isna()[f"{1:032x}-6"]

        # feedback naming a request that never was waits (for another replica to write it) only while few do
        looked = []
        monkeypatch.setattr(journal, "_request", lambda request_id: looked.append(request_id))
        journal.request_wait_seconds = 0.2
        with pytest.raises(Exception, match="unknown request"):
            journal.add_feedback(f"{7:032x}", [5], [])
        assert len(looked) > 1  # it waited, asking again
        held = [journal._waiting.acquire(blocking=False) for _ in range(2)]  # two calls already waiting
        looked.clear()
        with pytest.raises(JournalBusy, match="every wait for one is taken: retry"):  # a 503: may exist
            journal.add_feedback(f"{8:032x}", [5], [])
        assert held == [True, True] and len(looked) == 1  # answered at once: no serving thread held
    finally:
        journal.close()


def test_a_write_the_store_refused_leaves_the_sqlite_journal_writable(tmp_path: Path):
    """A write that fails inside its transaction (another process holding the database's write lock past the
    busy timeout) is rolled back: the next write goes through (the connection stayed inside the failed
    transaction, and every later write failed until a restart)."""
    import sqlite3
    import time

    journal = SqliteJournal(tmp_path / "journal.db")
    try:
        journal._db.execute("PRAGMA busy_timeout = 50")  # a short wait for the lock held below
        row = (f"{3:032x}", time.time(), 1_767_225_600_000_000, 10, "champion", "1", 3.0, "{}")
        evaluation = (f"{3:032x}", "1", "served", "ok", 2.0, time.time())
        other = sqlite3.connect(tmp_path / "journal.db", isolation_level=None)
        other.execute("BEGIN IMMEDIATE")
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            journal._write_requests([row], [evaluation])
        # feedback on a request still queued while the store refuses it: a retry may land it (503, not 404)
        journal._stop.set()  # (the writer thread out of the way: this thread flushes)
        journal._writer.join(timeout=5)
        queued = (f"{4:032x}", *row[1:7], '{"item_ids": [5], "scores": {"1": [0.5]}, "ranked": [5]}')
        journal.record(queued, [])
        with pytest.raises(JournalBusy, match="refused the queued requests"):
            journal.add_feedback(f"{4:032x}", [5], [5])
        other.execute("ROLLBACK")
        other.close()
        journal._write_requests([row], [evaluation])
        assert journal._request(f"{3:032x}") is not None
        assert journal.add_feedback(f"{4:032x}", [5], [5])["accepted"] == 1
    finally:
        journal.close()


def test_the_off_policy_log_reads_explored_requests_only(tmp_path: Path):
    """A request whose context has the value "exploration" is not an explored one (the text filter matched
    it, then reading its propensities raised, failing every gate whose window held it)."""
    import json
    import time

    from recloop.schema import load_spec

    journal = SqliteJournal(tmp_path / "journal.db", load_spec("synthetic"))
    try:
        explored = {"item_ids": [5, 6], "context": {}, "per_candidate": {}, "scores": {"1": [0.9, 0.1]}, "ranked": [5, 6],
                    "exploration": {"propensities": [0.7, 1.0]}}
        plain = {"item_ids": [5, 6], "context": {"device": "exploration"}, "per_candidate": {}, "scores": {"1": [0.9, 0.1]},
                 "ranked": [5, 6]}
        for n, payload in enumerate((explored, plain)):
            journal.record((f"{n:032x}", time.time(), 1_767_225_600_000_000, 10 + n, "champion", "1", 3.0,
                            json.dumps(payload)), [(f"{n:032x}", "1", "served", "ok", 2.0, time.time())])
        journal.flush()
        for n in range(2):
            assert journal.add_feedback(f"{n:032x}", [5, 6], [5])["accepted"] == 2
        logged = journal.exploration_requests()
        assert [(r["user_id"], r["top"], r["propensity"], r["label"]) for r in logged] == [(10, 5, 0.7, 1)]
    finally:
        journal.close()


@pytest.mark.services
def test_the_postgres_journal_waits_for_a_free_connection_and_keeps_them_open(request):
    """More concurrent calls than pooled connections wait their turn (psycopg2 raised "connection pool
    exhausted": a 500), and the pool keeps its connections open between calls (one was kept)."""
    from concurrent.futures import ThreadPoolExecutor

    journal = PostgresJournal(request.getfixturevalue("database"), pool_size=2)
    try:
        with ThreadPoolExecutor(6) as pool:
            answers = list(pool.map(lambda _: journal._query("SELECT pg_sleep(0.2), 1", []), range(6)))
        assert [a[0][1] for a in answers] == [1] * 6
        assert len(journal._pool._pool) == 2  # both connections idle in the pool, not closed
    finally:
        journal.close()


def test_a_retrieval_that_failed_counts_its_feedback_in_the_champions_arm_only(tmp_path: Path):
    """A retriever challenger that failed, answered by the champion's retrieval: both are journaled as
    served, and the request's feedback belongs to the champion's arm alone (it counted in both)."""
    import time

    from recloop.schema import load_spec

    journal = SqliteJournal(tmp_path / "journal.db", load_spec("synthetic"))
    try:
        payload = '{"item_ids": [5, 6], "context": {}, "per_candidate": {}, "scores": {"1": [0.9, 0.1]}, "ranked": [5, 6]}'
        journal.record((f"{0:032x}", time.time(), 1_767_225_600_000_000, 10, "champion", "1", 3.0, payload),
                       [(f"{0:032x}", "1", "served", "ok", 2.0, time.time()),
                        (f"{0:032x}", "retriever:2", "served", "error", 1.0, time.time()),
                        (f"{0:032x}", "retriever:1", "served", "ok", 1.0, time.time())])
        journal.flush()
        assert journal.add_feedback(f"{0:032x}", [5, 6], [5])["accepted"] == 2
        challenger, champion = journal.retriever_stats("2"), journal.retriever_stats("1")
        assert (challenger.requests, challenger.errors, challenger.impressions) == (1, 1, 0)
        assert (champion.impressions, champion.clicks) == (2, 1)
        assert len(journal.retriever_user_clicks("2")[0]) == 0
        assert journal.retriever_user_clicks("1")[1].tolist() == [1]
    finally:
        journal.close()


@pytest.mark.services
def test_a_request_written_by_one_replica_wakes_feedback_waiting_on_another(request):
    """Feedback for a request another replica has not written yet waits on LISTEN/NOTIFY: the write wakes it.
    The fallback poll is set longer than the wait, so only the notification can end it with the request
    found: one look before, one after (a 20 ms poll looked dozens of times)."""
    import threading

    from recloop.schema import load_spec

    class Counting(PostgresJournal):
        looks = 0

        def _request(self, request_id: str):
            found = super()._request(request_id)
            self.looks += 1  # counted once answered: the test writes the request after the first look found none
            return found

    dsn, spec = request.getfixturevalue("database"), load_spec("synthetic")
    serving = PostgresJournal(dsn, spec)
    waiting = Counting(dsn, spec, request_wait_seconds=60.0, fallback_poll_seconds=120.0)
    try:
        eventually(waiting._listening.is_set, 30, "the replica never listened")
        request_id, answers = f"{7:032x}", []
        thread = threading.Thread(target=lambda: answers.append(waiting.add_feedback(request_id, [5, 6], [6])))
        thread.start()
        eventually(lambda: waiting.looks >= 1, 30, "the feedback never looked for its request")
        payload = ('{"item_ids": [5, 6], "context": {"device": "mobile", "country": "US", "category": [1, 2], '
                   '"price": [1.0, 2.0], "history": []}, "per_candidate": {"category": true, "price": true}, '
                   '"scores": {"1": [0.9, 0.1]}, "ranked": [5, 6]}')
        serving.record((request_id, 100.0, 1_767_225_600_000_000, 10, "champion", "1", 3.0, payload), [])
        serving.flush()
        thread.join(timeout=60)
        assert answers == [{"accepted": 2, "duplicates": 0, "clicks": 1, "served_version": "1"}]
        assert waiting.looks == 2
    finally:
        serving.close()
        waiting.close()


def test_the_journal_names_its_database_without_the_password():
    """What /healthz's degraded line and the logs show of RECLOOP_POSTGRES_DSN, URL or libpq string alike."""
    from recloop.journal import _shown

    assert _shown("postgresql://recloop:s3cret@db:5432/recloop") == "postgresql://recloop:***@db:5432/recloop"
    assert "s3cret" not in _shown("host=db password=s3cret dbname=recloop")
    assert "s3 cret" not in _shown("host=db password='s3 cret' dbname=recloop")


def test_request_rows_kept_by_a_stopped_process_are_written_by_the_next(tmp_path: Path):
    """A journal that could not write its request rows before stopping keeps them in a file; the next process
    queues them again and removes the file once they are in the store (each row once)."""
    from recloop.schema import load_spec

    spec = load_spec("synthetic")
    payload = '{"item_ids": [5], "context": {}, "per_candidate": {}, "scores": {"1": [0.5]}, "ranked": [5]}'
    first = SqliteJournal(tmp_path / "first.db", spec)
    first.close()
    first.record(("a" * 32, 1.0, 1, 7, "champion", "1", 2.0, payload), [("a" * 32, "1", "served", "ok", 1.0, 1.0)])
    kept = first.keep_unwritten(tmp_path / "kept")  # what Service.stop does when the store refused the last flush
    assert kept is not None and first.keep_unwritten(tmp_path / "kept") is None
    second = SqliteJournal(tmp_path / "second.db", spec)
    try:
        assert second.queue_kept(tmp_path / "kept") == 1 and second.unwritten_requests == 1
        second.flush()
        assert not kept.exists() and second.stats("1").requests == 1
        second.flush()  # nothing queued: nothing written twice
        assert second.stats("1").requests == 1
    finally:
        second.close()
