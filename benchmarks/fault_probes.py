"""Section 8 of the fault table (``faults.py``, issue 41): the faults left open after the hardening.

- registry down at serving start: ``recloop serve`` once with MLflow up (its cache and last known deployment
  filled), then started again with MLflow at a closed port: time to the first ``/healthz``, what it says,
  and ``/rank`` answers from the cached champion;
- identical candidate: two trainings that differ only in flags that change nothing (``--days 2 --epochs 1``
  and ``--days 3 --epochs 2``: the window grows back to ``train_rows``, ``fit_to_data`` raises one epoch
  to two): versions registered, what the second run says;
- queued retrain: two retrains of one home in a row, the gate refusing the first's candidate: what the
  second does with the version the first refused;
- mid-epoch kill: a training made long on purpose (batches of 64), SIGKILLed once a checkpoint inside its
  epoch exists; the rerun resumes and its weights are compared with an uninterrupted run's;
- journal down at serving start: ``recloop serve`` with its PostgreSQL journal (the real one at 127.0.0.1:5432)
  in a database that refuses connections (``ALLOW_CONNECTIONS false``): time to the first ``/healthz``, 200
  ``/rank``s, feedback's answer; then the database lets connections in: time until the journal caught up, the
  feedback accepted, and the request rows in the database against those served.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

from recloop.settings import Settings

SMALL = "ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,))"


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _serve(home: Path, env: dict, seconds: float = 240) -> tuple[float, object, subprocess.Popen, int]:
    """``recloop serve`` on a free port until its /healthz answers: (seconds, answer, process, port)."""
    import httpx

    port = _port()
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "recloop.cli", "serve", "--port", str(port)], cwd=home.parent,
                              env={**os.environ, "RECLOOP_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true", **env},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    answer = None
    while time.perf_counter() - started < seconds and server.poll() is None:
        try:
            answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    return time.perf_counter() - started, answer, server, port


def _stop(server: subprocess.Popen) -> None:
    os.killpg(server.pid, signal.SIGTERM)
    server.wait(timeout=60)


def registry_down_at_start(home: Settings, check: Callable[[bool, str], str]) -> dict:
    import httpx

    base = {"RECLOOP_FRAME_BACKEND": "pandas",
            "RECLOOP_FEAST_REPO": str(Path(__file__).resolve().parents[1] / "feature_repo")}
    _, first, server, _ = _serve(home.home, base)
    _stop(server)
    dead = _port()
    seconds, answer, server, port = _serve(home.home, {**base, "RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}"})
    statuses: Counter = Counter()
    try:
        for user in range(200):
            body = {"user_id": user, "item_ids": [1, 2, 3], "context": {"category": 1}}  # (no null category)
            statuses[str(httpx.post(f"http://127.0.0.1:{port}/rank", json=body, timeout=10).status_code)] += 1
        scraped = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    finally:
        _stop(server)
    body = answer.json() if answer is not None else {}
    degraded = 'recloop_serving_degraded{model="ranker"} 1.0' in scraped
    ok = answer is not None and answer.status_code == 200 and body.get("ready") and statuses["200"] == 200 and degraded
    return {"probe": "registry down at serving start", "before": "/healthz 503, every /rank 503 (full outage)",
            "outcome": f"/healthz {answer.status_code if answer is not None else '-'} after {seconds:.1f} s, "
                       f"ready={body.get('ready')}, serving {body.get('versions')}; /rank: "
                       + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
                       + f"; recloop_serving_degraded=1: {degraded}; "
                       + (body.get("degraded") or ["(not degraded)"])[0][:120],
            "check": check(bool(ok), "serving with the registry down at start-up")}


ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"


def journal_down_at_start(home: Settings, check: Callable[[bool, str], str]) -> dict:
    import uuid

    import httpx
    import psycopg2

    name = f"recloop_faults_{uuid.uuid4().hex[:10]}"
    admin = psycopg2.connect(ADMIN_DSN)
    admin.autocommit = True
    admin.cursor().execute(f"CREATE DATABASE {name}")
    admin.cursor().execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS false")
    dsn = f"postgresql://postgres@127.0.0.1:5432/{name}"
    env = {"RECLOOP_FRAME_BACKEND": "pandas", "RECLOOP_JOURNAL": "postgres", "RECLOOP_POSTGRES_DSN": dsn,
           "RECLOOP_FEEDBACK_FLUSH_SECONDS": "3600",
           "RECLOOP_FEAST_REPO": str(Path(__file__).resolve().parents[1] / "feature_repo")}
    server = None
    try:
        seconds, answer, server, port = _serve(home.home, env)
        url = f"http://127.0.0.1:{port}"
        statuses: Counter = Counter()
        served = []
        for user in range(200):
            ranked = httpx.post(f"{url}/rank", json={"user_id": user, "item_ids": [1, 2, 3], "context": {"category": 1}},
                                timeout=10)
            statuses[str(ranked.status_code)] += 1
            if ranked.status_code == 200:
                served.append(ranked.json())
        shown = [item["item_id"] for item in served[0]["items"]] if served else []
        feedback = {"request_id": served[0]["request_id"] if served else "", "impressions": shown, "clicks": shown[:1]}
        refused = httpx.post(f"{url}/feedback", json=feedback, timeout=10)
        admin.cursor().execute(f"ALTER DATABASE {name} ALLOW_CONNECTIONS true")
        reopened = time.perf_counter()
        while time.perf_counter() - reopened < 120 and httpx.get(f"{url}/healthz", timeout=10).json()["degraded"]:
            time.sleep(0.2)
        caught_up = time.perf_counter() - reopened
        accepted = httpx.post(f"{url}/feedback", json=feedback, timeout=10)
        with psycopg2.connect(dsn) as db, db.cursor() as cursor:
            cursor.execute("SELECT COUNT(*) FROM recloop_journal.requests")
            (written,) = cursor.fetchone()
        db.close()
    finally:
        if server is not None:
            _stop(server)
        admin.cursor().execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")
        admin.close()
    body = answer.json() if answer is not None else {}
    journal = [d for d in body.get("degraded", []) if d.startswith("journal")]
    ok = (answer is not None and answer.status_code == 200 and body.get("ready") and statuses["200"] == 200
          and journal and refused.status_code == 503 and accepted.status_code == 200 and written == len(served))
    return {"probe": "journal (PostgreSQL) down at serving start",
            "before": "`recloop serve` exited 3 (one line): no serving at all until the database answered",
            "outcome": f"/healthz {answer.status_code if answer is not None else '-'} after {seconds:.1f} s, "
                       f"ready={body.get('ready')}, degraded: {(journal or ['-'])[0][:90]}...; /rank: "
                       + ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items()))
                       + f"; /feedback {refused.status_code} (Retry-After {refused.headers.get('retry-after')}); "
                       f"database back: caught up in {caught_up:.1f} s, /feedback {accepted.status_code}, "
                       f"{written} of {len(served)} request rows written",
            "check": check(bool(ok), "serving with the journal down at start-up")}


def identical_candidate(home: Settings, check: Callable[[bool, str], str]) -> dict:
    from mlflow import MlflowClient

    from recloop import pipeline, registry
    from recloop.model import ModelConfig
    from recloop.train import TrainConfig

    common = {"validation_hours": 12, "device": "cpu", "deterministic": True, "checkpoint_every": 1000,
              "model": eval(SMALL, {"ModelConfig": ModelConfig})}  # noqa: S307 - our own constant
    registry.configure(home)

    def versions() -> int:
        return len(MlflowClient().search_model_versions(f"name='{registry.MODEL_NAME}'"))

    before = versions()
    first = pipeline.train_and_register(home, TrainConfig(days=2, epochs=1, **common))
    second = pipeline.train_and_register(home, TrainConfig(days=3, epochs=2, **common))
    added = versions() - before
    ok = added == 1 and second.logged.duplicate_of == first.version and first.summary.overrides
    return {"probe": "identical candidate (--days 2 --epochs 1, then --days 3 --epochs 2)",
            "before": "two new versions, byte-identical weights; the gate passed the second against the first",
            "outcome": f"{added} new version (v{first.version}); the second run: duplicate of "
                       f"v{second.logged.duplicate_of}, not registered, not gated; overrides said: "
                       + "; ".join(o.split(":")[0] for o in first.summary.overrides),
            "check": check(bool(ok), "identical candidate")}


def queued_retrain(home: Settings, check: Callable[[bool, str], str], work: Path) -> dict:
    from recloop.flow_support import configure_prefect

    configure_prefect(home)  # before Prefect is imported: its files under this home, its temporary server
    from flows.retrain_flow import retrain_flow
    from recloop import registry
    from recloop.flow_support import settings_parameter

    strict = work / "strict-gate.yaml"
    strict.write_text("min_auc: 0.999\n")
    home.landing_dir.mkdir(parents=True, exist_ok=True)
    states = [retrain_flow(mode="incremental", reason="drift", gate_thresholds=str(strict), retriever=False,
                           settings=settings_parameter(home), return_state=True) for _ in range(2)]
    version = states[0].result()["train"]["mlflow"]["version"] if states[0].name == "Refused" else None
    verdict = registry.gate_record(registry.version_info(home, version).tags) if version else None
    ok = states[0].name == "Refused" and states[1].name == "Skipped" and "judged already" in states[1].message
    return {"probe": "queued retrain (two in a row, the first's candidate refused)",
            "before": "the second re-ran the gate on the version the first refused",
            "outcome": f"first: {states[0].name} (v{version}); second: {states[1].name}: {states[1].message[:110]}; "
                       f"v{version}'s gate tag unchanged: {registry.gate_record(registry.version_info(home, version).tags) == verdict}",
            "check": check(ok, "queued retrain")}


def mid_epoch_kill(home: Settings, check: Callable[[bool, str], str], work: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    from recloop.checkpoint import read as read_checkpoint
    from recloop.model import ModelConfig
    from recloop.train import TrainConfig, train

    text = (f"TrainConfig(mode='full', days=3, epochs=1, batch_size=64, validation_hours=12, checkpoint_every=25, "
            f"device='cpu', deterministic=True, model={SMALL})")
    config = eval(text, {"TrainConfig": TrainConfig, "ModelConfig": ModelConfig})  # noqa: S307 - our own
    killed_home = work / "killed"
    shutil.copytree(home.home, killed_home, ignore=shutil.ignore_patterns("checkpoints", "serving", "cache"))
    other = Settings(home=killed_home, frame_backend="pandas")
    code = ("from recloop.model import ModelConfig\nfrom recloop.settings import Settings\n"
            "from recloop.train import TrainConfig, train\n"
            f"train(Settings(home={str(killed_home)!r}, frame_backend='pandas'), {text})\n")
    started = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    killed = None
    while killed is None and child.poll() is None and time.perf_counter() - started < 600:
        for pointer in (killed_home / "checkpoints").glob("*/latest.json"):
            try:
                state = read_checkpoint(pointer.parent)
            except Exception:  # noqa: BLE001 - being written
                continue
            if not state["completed"] and state["position"]["batch"] >= 50:
                child.send_signal(signal.SIGKILL)
                killed = state["position"]
        time.sleep(0.05)
    child.kill()
    child.wait(30)
    if killed is None:
        return {"probe": "mid-epoch kill", "before": "not measured (both tries finished first)",
                "outcome": "the run finished before a checkpoint inside its epoch", "check": check(False, "mid-epoch kill")}
    resumed = train(other, config)
    clean_home = work / "clean"
    shutil.copytree(home.home, clean_home, ignore=shutil.ignore_patterns("checkpoints", "serving", "cache"))
    uninterrupted = train(Settings(home=clean_home, frame_backend="pandas"), config)
    a = load_file(Path(uninterrupted.checkpoint) / "model.safetensors")
    b = load_file(Path(resumed.checkpoint) / "model.safetensors")
    same = all(torch.equal(a[k], b[k]) for k in a)
    return {"probe": "mid-epoch kill (SIGKILL, batches of 64)",
            "before": "not measured (both tries finished first)",
            "outcome": f"killed at step {killed['step']} (epoch {killed['epoch']}, batch {killed['batch']} of "
                       f"~{uninterrupted.steps}); the rerun resumed from step {resumed.resumed_from_step} to "
                       f"{resumed.steps} steps; weights equal to an uninterrupted run's: {same}",
            "check": check(same and resumed.resumed_from_step > 0, "mid-epoch kill")}


def issue41_probes(home: Settings, work: Path, check: Callable[[bool, str], str], print_table: Callable) -> None:
    """Run every probe on copies of ``home`` (a trained champion's installation); print one table."""
    rows = []
    for n, probe in enumerate((registry_down_at_start, journal_down_at_start, identical_candidate, queued_retrain,
                               mid_epoch_kill)):
        copy = work / f"home-{n}"
        (work / f"probe-{n}").mkdir(parents=True, exist_ok=True)
        shutil.copytree(home.home, copy, ignore=shutil.ignore_patterns("serving", "registry.db"))
        settings = Settings(home=copy, frame_backend="pandas", serve_poll_seconds=0.5)
        if probe in (registry_down_at_start, journal_down_at_start):
            from recloop.features import store

            store.apply_repo(settings)
        started = time.perf_counter()
        try:
            row = probe(settings, check) if probe in (registry_down_at_start, journal_down_at_start,
                                                      identical_candidate) else \
                probe(settings, check, work / f"probe-{n}")
        except Exception as err:  # noqa: BLE001 - a probe that breaks is a row saying so
            row = {"probe": probe.__name__, "before": "", "outcome": f"{type(err).__name__}: {err}"[:300],
                   "check": check(False, f"{probe.__name__} raised")}
        row["seconds"] = f"{time.perf_counter() - started:.0f}"
        rows.append(row)
        print(f"  {row['probe']}: {row['check']}", flush=True)
    print_table("8. issue 41: serving without its registry or its journal, one version per model, queued retrains, "
                "a kill mid-epoch", rows)
