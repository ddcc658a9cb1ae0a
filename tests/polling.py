"""Waiting in tests for something another thread or process does (a server loading a model, a replica
starting): poll a condition until it holds or a deadline passes, through the platform's one readiness
helper (``recloop.readiness.wait_until``). A readiness wait, not a speed claim."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from recloop.readiness import NotReady, wait_until

T = TypeVar("T")


def eventually(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """``probe()`` until it returns something truthy (returned); AssertionError naming ``what`` after
    ``timeout`` seconds. ``what`` may be a callable for a message built from the last state."""
    try:
        return wait_until(probe, what="a test's condition", timeout=timeout, interval=interval)
    except NotReady:
        raise AssertionError(what() if callable(what) else what) from None


def wait_for(http, condition: Callable[[dict], bool], timeout: float = 20.0) -> dict:
    """The server's ``/healthz`` once ``condition`` holds on it."""
    last: dict = {}

    def probe() -> dict | None:
        last["health"] = http.get("/healthz").json()
        return last["health"] if condition(last["health"]) else None

    return eventually(probe, timeout, lambda: f"the server never reached the expected state: {last.get('health')}")
