"""Waiting in tests for something another thread or process does (a server loading a model, a replica
starting): poll a condition until it holds or a deadline passes. A readiness wait, not a speed claim."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def eventually(probe: Callable[[], T], timeout: float, what: str, interval: float = 0.05) -> T:
    """``probe()`` until it returns something truthy (returned); AssertionError naming ``what`` after
    ``timeout`` seconds. ``what`` may be a callable for a message built from the last state."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(what() if callable(what) else what)
        time.sleep(interval)


def wait_for(http, condition: Callable[[dict], bool], timeout: float = 20.0) -> dict:
    """The server's ``/healthz`` once ``condition`` holds on it."""
    last: dict = {}

    def probe() -> dict | None:
        last["health"] = http.get("/healthz").json()
        return last["health"] if condition(last["health"]) else None

    return eventually(probe, timeout, lambda: f"the server never reached the expected state: {last.get('health')}")
