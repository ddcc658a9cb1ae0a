"""Sections 5 and 6 of the fault table (``faults.py``): bad models and bad requests against a real serving API.

A small world (3 days) is ingested and featurized into Feast's SQLite online store, a champion is
trained, registered and gated; then each fault is made for real (files truncated in the registry's
artifact store or in the serving cache, NaN weights, a deleted feature state, dropped online tables)
and simulated users send traffic. A request "failed" when it got a 5xx other than a named 503.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import sqlite3
import uuid
from collections import Counter
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import httpx

from recloop import checkpoint, pipeline, registry
from recloop.canary import CanaryConfig, controller
from recloop.features import store
from recloop.features.config import FeatureConfig
from recloop.features.definition import FeatureLayout
from recloop.features.job import build_features
from recloop.gate import GateThresholds, run_gate
from recloop.ingest import ingest
from recloop.model import ModelConfig
from recloop.schema import load_spec
from recloop.serve.app import ServerThread, create_app
from recloop.serve.traffic import SimulatedUsers, drive
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig, simulate
from recloop.train import TrainConfig, TrainSummary, train

WORLD = WorldConfig(seed=4, days=4, events_per_day=4000)
FEATURES_END = datetime(2026, 1, 4, tzinfo=UTC)
TOKEN = "faults-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
REQUESTS = 150


def build_home(root: Path) -> Settings:
    spec = load_spec("synthetic")
    simulate(WORLD, root / "landing")
    settings = Settings(home=root / "home", frame_backend="pandas", admin_token=TOKEN, serve_poll_seconds=0.2,
                        feedback_flush_seconds=3600)
    ingest(root / "landing", spec, settings, now=datetime(2026, 2, 1, tzinfo=UTC))
    build_features(settings, spec, FeatureConfig.for_spec(spec), end=FEATURES_END)
    store.apply_repo(settings)
    store.materialize(settings, FEATURES_END, timedelta(days=7))
    summary = train(settings, TrainConfig(days=3, epochs=2, batch_size=512, validation_hours=12, device="cpu",
                                          model=ModelConfig(embedding_dim=8, bottom_mlp=(16,), top_mlp=(32,))))
    version = pipeline.register_training(settings, summary).version
    if run_gate(settings, version, GateThresholds(calibration_range=(0.5, 2.0)), smoke_check=False).alias is None:
        registry.promote(settings, version, who="faults", why="the fault table needs a champion")
    return settings


def register_variant(home: Settings, change: Callable[[dict], None] | None = None) -> str:
    """A new version: the champion's checkpoint, its weights changed by ``change``."""
    from safetensors.torch import load_file, save_file

    source = checkpoint.resolve(home, "1")
    target = home.home / "checkpoints" / f"variant-{uuid.uuid4().hex[:8]}" / source.name
    shutil.copytree(source, target)
    weights = load_file(target / "model.safetensors")
    if change is not None:
        change(weights)
    # metadata: another file even with the same weights (the same file would be the champion's version again)
    save_file(weights, target / "model.safetensors", metadata={"variant": target.parent.name})
    base = TrainSummary(**checkpoint.read(source)["summary"])
    base.checkpoint, base.run_id = str(target), f"{base.run_id}-{target.parent.name}"
    return pipeline.register_training(home, base).version


def nan_weights(weights: dict) -> None:
    weights["over_arch.layers.0.bias"][:] = float("nan")


def registry_file(home: Settings, version: str) -> Path:
    import mlflow
    from mlflow import MlflowClient

    registry.configure(home)
    source = MlflowClient().get_model_version(registry.MODEL_NAME, version).source
    location = mlflow.get_logged_model(source.removeprefix("models:/")).artifact_location
    [found] = Path(location.removeprefix("file://")).rglob("model.safetensors")
    return found


def truncate(path: Path) -> bytes:
    original = path.read_bytes()
    path.write_bytes(original[: len(original) // 2])
    return original


def reset(home: Settings) -> None:
    if registry.version_by_alias(home, "challenger"):
        registry.remove_alias(home, "challenger")
    registry.set_alias(home, "champion", "1", who="faults", why="reset")
    shutil.rmtree(checkpoint.cache_dir(home), ignore_errors=True)


def canary(home: Settings, version: str) -> None:
    registry.set_alias(home, "challenger", version, who="faults", why="fault under test")
    controller.start(home, CanaryConfig(steps=(0.5, 1.0)))


def traffic(url: str, users: SimulatedUsers, requests: int = REQUESTS) -> tuple[int, Counter, Counter]:
    """Requests sent, answers by status, answers by serving version."""
    summary = asyncio.run(drive(url, users, requests, concurrency=4, feedback=False))
    statuses = Counter({"200": sum(summary.versions.values())})
    statuses.update({k: v for k, v in summary.errors.items() if not k.startswith("feedback")})
    return requests, statuses, Counter(summary.versions)


def row(fault: str, outcome: str, sent: int, statuses: Counter, versions: Counter, health: dict, ok: bool,
        check: Callable[[bool, str], str]) -> dict:
    failed = sum(n for code, n in statuses.items() if code.startswith("5") and code != "503")
    return {"fault": fault, "requests sent": sent, "answered": ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items())),
            "failed (5xx)": failed, "served by": ", ".join(f"v{k}: {v}" for k, v in sorted(versions.items())) or "-",
            "/healthz": f"{'ready' if health.get('ready') else 'not ready'}"
                        + (f" ({health['reasons'][0][:90]})" if health.get("reasons") else ""),
            "outcome": outcome, "check": check(ok and failed == 0, fault)}


def model_and_request_faults(root: Path, check: Callable[[bool, str], str], print_table: Callable) -> Path:
    """Run sections 5 and 6; returns the home (for the dead-services section to reuse)."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    for name in ("mlflow", "recloop.serve", "recloop.checkpoint"):  # the faults are made on purpose: the
        logging.getLogger(name).setLevel(logging.CRITICAL)        # tables say what happened
    home = build_home(root)
    world = World(WORLD).replay(3)
    users = SimulatedUsers(world, 3.5, candidates=50, seed=1, send_ts=False)
    rows = []

    # A challenger whose registry copy is truncated: the champion serves everyone; the canary rolls it back.
    reset(home)
    broken = register_variant(home)
    canary(home, broken)
    stored = registry_file(home, broken)
    original = truncate(stored)
    with ServerThread(create_app(home)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        health = http.get("/healthz").json()
        sent, statuses, versions = traffic(server.url, users)
        decision = controller.status(home).decision
        stored.write_bytes(original)
        reload = http.post("/admin/reload", headers=AUTH).json()
    rows.append(row("challenger truncated in the registry (canary 50 %)",
                    f"challenger left out; canary: {decision.action}; repaired + /admin/reload → serving "
                    f"{reload['versions']}", sent, statuses, versions, health,
                    health["ready"] and decision.action == "rollback" and reload["versions"]["challenger"] == broken,
                    check))

    # The serving cache's copy truncated: verified, fetched again, served.
    reset(home)
    cached = register_variant(home)
    truncate(checkpoint.resolve(home, cached) / "model.safetensors")
    canary(home, cached)
    with ServerThread(create_app(home)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        health = http.get("/healthz").json()
        sent, statuses, versions = traffic(server.url, users)
    rows.append(row("challenger truncated in the serving cache", f"fetched again; versions {health['versions']}",
                    sent, statuses, versions, health, health["versions"]["challenger"] == cached and
                    versions[cached] > 0, check))

    # A challenger that scores NaN: every request it gets is answered by the champion; rolled back.
    reset(home)
    nan = register_variant(home, nan_weights)
    canary(home, nan)
    with ServerThread(create_app(home)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        health = http.get("/healthz").json()
        sent, statuses, versions = traffic(server.url, users)
        decision = controller.status(home).decision
    rows.append(row("challenger scores NaN (canary 50 %)", f"champion answered instead; canary: {decision.action}",
                    sent, statuses, versions, health, decision.action == "rollback" and set(versions) == {"1"}, check))

    # A new champion that does not load (promoted by hand while damaged): the previous one keeps serving.
    reset(home)
    bad_champion = register_variant(home)
    stored = registry_file(home, bad_champion)
    original = truncate(stored)
    with ServerThread(create_app(home)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
        registry.promote(home, bad_champion, who="faults", why="a damaged promotion")
        for _ in range(100):
            health = http.get("/healthz").json()
            if bad_champion in health["load_failures"]:
                break
            asyncio.run(asyncio.sleep(0.1))
        sent, statuses, versions = traffic(server.url, users)
    stored.write_bytes(original)
    rows.append(row("new champion truncated in the registry", "previous champion kept serving", sent, statuses,
                    versions, health, set(versions) == {"1"}, check))

    # The gate on a truncated candidate: refused and tagged.
    reset(home)
    candidate = register_variant(home)
    stored = registry_file(home, candidate)
    original = truncate(stored)
    outcome = run_gate(home, candidate, GateThresholds(calibration_range=(0.3, 3.0)), smoke_check=False)
    stored.write_bytes(original)
    tag = (registry.gate_record(registry.version_info(home, candidate).tags) or {}).get("verdict")
    rows.append(row("gate: candidate truncated in the registry", f"gate={tag}: {outcome.reasons[0][:90]}", 0,
                    Counter(), Counter(), {"ready": True, "reasons": []}, tag == "failed" and not outcome.passed, check))

    # Missing feature state, then dropped online tables: not ready, and every request a named 503.
    reset(home)
    for fault in ("feature state deleted", "online store tables dropped"):
        copy = Settings(home=root / f"copy-{len(rows)}", frame_backend="pandas", admin_token=TOKEN)
        shutil.copytree(home.home, copy.home, ignore=shutil.ignore_patterns("serving", "cache"))
        store.apply_repo(copy)
        if fault == "feature state deleted":
            shutil.rmtree(FeatureLayout.for_settings(copy).state)
        with ServerThread(create_app(copy)) as server, httpx.Client(base_url=server.url, timeout=30) as http:
            if fault == "online store tables dropped":
                with sqlite3.connect(copy.home / "feast" / "online.db") as db:
                    for (table,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'").fetchall():
                        db.execute(f'DROP TABLE "{table}"')
                asyncio.run(asyncio.sleep(1.1))  # the readiness probe's result is kept for a second
            health = http.get("/healthz").json()
            sent, statuses, versions = traffic(server.url, users, 30)
        rows.append(row(fault, "not ready, requests refused with the reason", sent, statuses, versions, health,
                        not health["ready"] and statuses.get("503") == sent, check))
    print_table("5. bad models and missing parts behind the serving API", rows)

    reset(home)
    with ServerThread(create_app(home)) as server:
        print_table("6. bad requests (interleaved with valid traffic)", bad_requests(server.url, users, home, check))
    return home.home


def bad_requests(url: str, users: SimulatedUsers, home: Settings, check: Callable[[bool, str], str]) -> list[dict]:
    body, _ = users.request()
    one = {"user_id": 3, "item_ids": [1, 2]}
    cases = [
        ("body over the limit (declared)", json.dumps({**one, "context": {"device": "x" * home.serve_max_body_bytes}}),
         413),
        ("body over the limit (chunked)", "chunked", 413),
        ("50 MB body", json.dumps({**one, "context": {"device": "x" * 50_000_000}}), 413),
        ("price: Infinity", '{"user_id": 3, "item_ids": [1], "context": {"price": Infinity}}', 422),
        ("price: 1e999", '{"user_id": 3, "item_ids": [1], "context": {"price": 1e999}}', 422),
        ("price: NaN in a list", '{"user_id": 3, "item_ids": [1, 2], "context": {"price": [1.0, NaN]}}', 422),
        ("position: 2^53", json.dumps({**one, "context": {"position": 2**53}}), 422),
        ("position: 2^64", json.dumps({**one, "context": {"position": 2**64}}), 422),
        ("position: 5000 (spec max 1000)", json.dumps({**one, "context": {"position": 5000}}), 422),
        ("price: -1 (spec min 0)", json.dumps({**one, "context": {"price": -1}}), 422),
        ("unknown context column", json.dumps({**one, "context": {"colour": "red"}}), 422),
        ("1001 candidates", json.dumps({"user_id": 3, "item_ids": list(range(1001))}), 422),
        ("user_id -1", json.dumps({"user_id": -1, "item_ids": [1]}), 422),
        ("user_id 2^64", json.dumps({"user_id": 2**64, "item_ids": [1]}), 422),
        ("not JSON", "{user_id: 3", 422),
        ("history of 10^6 items", json.dumps({**one, "context": {"history": list(range(10**6))}}), 413),
        ("string of 5000 chars", json.dumps({**one, "context": {"device": "x" * 5000}}), 422),
    ]
    rows, failed_valid, sent_valid = [], 0, 0
    with httpx.Client(base_url=url, timeout=60) as http:
        for name, payload, expected in cases:
            if payload == "chunked":
                text = json.dumps({**one, "context": {"device": "x" * (2 * home.serve_max_body_bytes)}}).encode()
                content = (text[i:i + 65536] for i in range(0, len(text), 65536))
            else:
                content = payload.encode()
            answer = http.post("/rank", content=content, headers={"Content-Type": "application/json"})
            valid = http.post("/rank", json=body)  # a good request right after each bad one
            sent_valid += 1
            failed_valid += valid.status_code != 200
            detail = answer.json().get("detail")
            detail = detail if isinstance(detail, str) else (detail[0]["msg"] if detail else "")
            rows.append({"request": name, "status": answer.status_code, "expected": expected,
                         "detail": str(detail)[:80], "check": check(answer.status_code == expected, f"request {name}")})
    requests, statuses, _ = traffic(url, users, 100)
    served = statuses.get("200", 0)
    rows.append({"request": f"valid traffic: {requests} + {sent_valid} between the bad ones",
                 "status": f"{served + sent_valid - failed_valid} × 200", "expected": "all 200",
                 "detail": f"{requests - served + failed_valid} failed",
                 "check": check(served == requests and failed_valid == 0, "valid requests among bad ones")})
    return rows
