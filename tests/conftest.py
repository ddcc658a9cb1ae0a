"""Shared fixtures and the ``gpu`` / ``services`` markers.

- ``gpu``: skipped when CUDA is not available.
- ``services``: needs Redis at 127.0.0.1:6379 and PostgreSQL at 127.0.0.1:5432. Skipped when they are
  not reachable, except under ``CI=true``, where a missing service is a failure: CI must run these tests.
"""

from __future__ import annotations

import os
import socket

# Without a GPU, the Triton kernels run in Triton's interpreter (tests ask for them with
# backend="triton"). The variable must be set before recloop_kernels is first imported.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from recloop.settings import Settings
from recloop.simulate import World, WorldConfig

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


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
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


def pytest_runtest_setup(item: pytest.Item) -> None:
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

    def make(root: Path, world: WorldConfig, features: bool = True, features_end: datetime | None = None) -> Settings:
        spec = load_spec("synthetic")
        simulate(world, root / "landing")
        settings = Settings(home=root / "home", frame_backend="pandas")
        ingest(root / "landing", spec, settings, now=INGEST_CLOCK)
        if features:
            build_features(settings, spec, FeatureConfig.for_spec(spec), end=features_end)
        return settings

    return make
