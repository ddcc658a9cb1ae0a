"""Shared fixtures and the ``gpu`` / ``services`` markers.

- ``gpu``: skipped when CUDA is not available.
- ``services``: needs Redis at 127.0.0.1:6379 and PostgreSQL at 127.0.0.1:5432. Skipped when they are
  not reachable, except under ``CI=true``, where a missing service is a failure: CI must run these tests.
- ``browser``: needs Debian's headless Chromium at /usr/bin/chromium; skipped without it, except under
  ``CI=true`` (``.ci/run`` installs it).
"""

from __future__ import annotations

import os
import socket

# The suite runs thousands of small tensor ops next to servers and subprocesses on a 2-core machine:
# one intra-op thread per process avoids OpenMP threads spinning against each other (a training step of
# the tests' tiny model took 10x longer with two threads on a busy machine). Children inherit the variable.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# Without a GPU, the Triton kernels run in Triton's interpreter (tests ask for them with
# backend="triton"). The variable must be set before recloop_kernels is first imported.
try:
    import torch as _torch

    _torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from recloop.simulate import World, WorldConfig

try:
    from recloop.settings import Settings
except (
    ImportError
):  # a GPU machine with torch, triton, numpy, pandas and pyarrow only (benchmarks/gpu_suite.py):
    Settings = None  # the kernel, loader and trainer-core tests run there; fixtures needing settings do not

def pytest_xdist_auto_num_workers(config) -> int:
    """``-n auto``: a worker per core, at most four (each worker trains the session's champion and starts
    its own Prefect server; beyond four the shared services and the disk are the bottleneck)."""
    return max(1, min(4, os.cpu_count() or 1))


SERVICES = {"redis": ("127.0.0.1", 6379), "postgres": ("127.0.0.1", 5432)}


def _reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


# The files that take longest, longest first (``--durations=0``, 2-core CPU, 2026-11-25: 177, 130, 92, 90, 62,
# 59, 53, 52 and 48 s of a 1,076 s suite). ``--dist loadfile`` hands files to the workers in this order (xdist's
# own, by number of tests per file, is switched off in ``pytest_configure``): each worker starts with two files
# (the 1st and 3rd, the 2nd and 4th), then takes the next as it frees up, so the short files fill in at the end
# instead of one worker starting a long file near it.
LONGEST_FIRST = ("test_serve.py", "test_demo.py", "test_flows.py", "test_monitor.py", "test_replay.py",
                 "test_deployments.py", "test_train_distributed.py", "test_gate.py", "test_gpu_suite.py")


def pytest_configure(config: pytest.Config) -> None:
    if hasattr(config.option, "loadscopereorder"):  # xdist: files in LONGEST_FIRST's order, not by test count
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: k for k, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    in_ci = os.environ.get("CI", "").lower() == "true"
    down = [name for name, address in SERVICES.items() if not _reachable(*address)]
    has_gpu = None
    for item in items:
        if "gpu" in item.keywords:
            has_gpu = _cuda_available() if has_gpu is None else has_gpu
            if not has_gpu:
                item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if "services" in item.keywords and down and not in_ci:
            item.add_marker(pytest.mark.skip(reason=f"services not reachable: {down}"))
        if "browser" in item.keywords and not in_ci and not Path(CHROMIUM).is_file():
            item.add_marker(pytest.mark.skip(reason=f"no {CHROMIUM} (Debian's chromium package; .ci/run installs it)"))


CHROMIUM = "/usr/bin/chromium"


def pytest_runtest_setup(item: pytest.Item) -> None:
    if "browser" in item.keywords and os.environ.get("CI", "").lower() == "true" and not Path(CHROMIUM).is_file():
        pytest.fail(f"CI=true: browser tests must run, but {CHROMIUM} is missing (.ci/run installs chromium)")
    if "services" in item.keywords and os.environ.get("CI", "").lower() == "true":
        down = [name for name, address in SERVICES.items() if not _reachable(*address)]
        if down:
            pytest.fail(f"CI=true: services tests must run, but {down} are not reachable")


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    """Settings whose RECLOOP_HOME is a fresh temporary folder."""
    return Settings(home=tmp_path / "home")


@pytest.fixture
def now() -> datetime:
    """A fixed ingest clock, a little after the simulated worlds' default start."""
    return datetime(2026, 2, 1, tzinfo=UTC)


@pytest.fixture(scope="session", autouse=True)
def _feast_imported_quietly() -> None:
    """Feast's modules call ``warnings.simplefilter("once", DeprecationWarning)`` (and add 11 more filters) when
    first imported. Imported inside a test, that filter goes in front of pyproject's ``filterwarnings`` for the
    rest of the test, and other libraries' import-time notices (Evidently's numpy.core, Litestar's Dependency)
    show in the report. Imported here, once per session, with its filters undone, it changes nothing."""
    import warnings

    try:
        with warnings.catch_warnings():
            from recloop.features.feast_import import import_feast

            import_feast()  # as recloop imports it (without typeguard's instrumentation)
    except Exception:  # noqa: BLE001 - the GPU machine has no Feast; a broken one fails its own tests
        pass


@pytest.fixture(scope="session")
def small_events() -> pa.Table:
    """About 200 valid synthetic events (one busy simulated hour), typed as the synthetic spec says."""
    world = World(WorldConfig(seed=11, days=1, events_per_day=4000))
    for hour in range(18):
        world.hour_events(0, hour)  # build up some click histories
    return world.hour_events(0, 18)


INGEST_CLOCK = datetime(2026, 2, 1, tzinfo=UTC)


@pytest.fixture(scope="session")
def lake_factory():
    """Build a lake: ``make(root, world, features=True, features_end=None) -> Settings``.

    The world is simulated under ``root/landing`` and ingested into ``root/home``; features are built
    (up to ``features_end``, or for everything) unless ``features=False``.
    """
    from recloop.features.config import FeatureConfig
    from recloop.features.job import build_features
    from recloop.ingest import ingest
    from recloop.schema import load_spec
    from recloop.simulate import simulate

    def make(
        root: Path, world: WorldConfig, features: bool = True, features_end: datetime | None = None
    ) -> Settings:
        spec = load_spec("synthetic")
        simulate(world, root / "landing")
        settings = Settings(home=root / "home", frame_backend="pandas")
        ingest(root / "landing", spec, settings, now=INGEST_CLOCK)
        if features:
            build_features(settings, spec, FeatureConfig.for_spec(spec), end=features_end)
        return settings

    return make


# --- one trained champion for every test that needs a registry ---------------------------------------------------

CHAMPION_WORLD = WorldConfig(seed=4, days=4, events_per_day=6000)
CHAMPION_FEATURES_END = datetime(2026, 1, 4, tzinfo=UTC)  # days 1-3 featurized; day 4 is ingested, not built


@pytest.fixture(scope="session")
def champion_home(tmp_path_factory, lake_factory) -> Settings:
    """Four days of a world ingested, features for the first three (published to Feast's online store),
    and version 1 trained on them, registered and gated champion (after loading in a fresh process).

    Shared by every test that needs a champion: copy it with ``copy_home`` before changing anything.
    """
    from datetime import timedelta

    from recloop import pipeline, registry
    from recloop.features import store
    from recloop.gate import GateThresholds, run_gate
    from recloop.train import TrainConfig, train

    settings = lake_factory(
        tmp_path_factory.mktemp("champion"), CHAMPION_WORLD, features_end=CHAMPION_FEATURES_END
    )
    store.apply_repo(settings)
    store.materialize(settings, CHAMPION_FEATURES_END, timedelta(days=7))
    summary = train(
        settings,
        TrainConfig(
            days=3,
            epochs=2,
            batch_size=512,
            validation_hours=12,
            device="cpu",
            checkpoint_every=1000,
            model=_small_model(),
        ),
    )
    logged = pipeline.register_training(settings, summary)
    # A 50-step model on 13k rows is the registry's first version here, not a judgement of the model: the
    # baseline rule (on by default) is tested on its own in test_gate.
    outcome = run_gate(
        settings, logged.version, GateThresholds(calibration_range=(0.5, 2.0), **BASELINES_REPORTED), smoke_check=True
    )
    assert outcome.passed and outcome.alias == "champion" and outcome.first_model, outcome.reasons
    assert registry.aliases(settings)["champion"] == "1"
    return settings


# The gate's baseline rule off: fixtures whose few-step models stand in for "a registered version".
BASELINES_REPORTED = {"baseline_auc_margin": None, "baseline_logloss_margin": None}

SMALL_MODEL_DIMS = {"embedding_dim": 8, "bottom_mlp": (16,), "top_mlp": (32,)}


def _small_model():
    from recloop.model import ModelConfig

    return ModelConfig(**SMALL_MODEL_DIMS)


def _copy_home(source: Settings, target: Path, feast: bool = False, **overrides) -> Settings:
    import shutil

    shutil.copytree(source.home, target, ignore=shutil.ignore_patterns("serving", "registry.db"))
    settings = Settings(**{"home": target, "frame_backend": "pandas", **overrides})
    if feast:
        from recloop.features import store

        store.apply_repo(settings)
    return settings


@pytest.fixture(scope="session")
def copy_home():
    """``copy_home(source, target, feast=False, **settings) -> Settings``: a copy of an installation to change
    freely. Feast's registry stays behind (the copied one names the original's online tables as its
    infrastructure: applying it would drop them); ``feast=True`` applies a fresh one for the copy."""
    return _copy_home


# --- one Prefect server for every test that needs one ---------------------------------------------------------


@pytest.fixture(scope="session")
def prefect_server():
    """A real Prefect server (``prefect_test_harness``) for the session: starting one costs seconds.

    Run loggers send to the UI only, as the CLI and the demo set them (tests read the runs' logs back)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.logging.configuration import setup_logging
    from prefect.testing.utilities import prefect_test_harness

    from recloop.flow_support import batch_embedded_server_writers, in_process_runs, run_logs_to_the_ui_only

    run_logs_to_the_ui_only()
    batch_embedded_server_writers()  # as the demo's temporary server
    setup_logging(incremental=False)
    with prefect_test_harness(server_startup_timeout=180), in_process_runs():  # no heartbeats, as the demo
        yield
