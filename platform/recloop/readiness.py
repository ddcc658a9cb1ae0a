"""Waiting until something is ready: the one helper every wait in recloop goes through.

``recloop up`` waits for each service to answer, the demo waits for serving to pick up moved aliases,
``ServerThread`` waits for uvicorn to start: each is "call a check until it says yes, give up at a deadline
or when what is awaited is gone". ``wait_until`` is that, on tenacity (fixed pauses, a stop after the
timeout, errors named as passing retried): a wait that fails says what it waited for and why it stopped.

Example::

    health = wait_until(lambda: httpx.get(url).status_code == 200, what="the API at " + url, timeout=30,
                         errors=(httpx.HTTPError,), gone=lambda: None if process.poll() is None else "it exited")
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tenacity import (
    RetryError,
    Retrying,
    retry_if_exception_type,
    retry_if_result,
    stop_after_delay,
    wait_fixed,
)

T = TypeVar("T")


class NotReady(RuntimeError):
    """What was awaited did not become ready: the timeout passed, or it is gone."""


class _Gone(Exception):
    pass


def wait_until(check: Callable[[], T], *, what: str, timeout: float, interval: float = 0.05,
               errors: tuple[type[BaseException], ...] = (),
               gone: Callable[[], str | None] | None = None) -> T:
    """Call ``check`` every ``interval`` seconds until it returns something true, and return that.

    Args:
        what: what is awaited, for the error (``NotReady: <what>: not ready within 30 s``).
        errors: exceptions of ``check`` that mean "not yet" (a refused connection); others propagate.
        gone: asked before each try; a reason (``"it exited"``) stops the wait at once.
    Raises:
        NotReady: at ``timeout`` seconds, or when ``gone`` gives a reason.
    """
    def attempt() -> T:
        if gone is not None and (reason := gone()):
            raise _Gone(reason)
        return check()

    retrying = Retrying(stop=stop_after_delay(max(timeout, 0.0)), wait=wait_fixed(interval),
                        retry=retry_if_result(lambda ready: not ready) | retry_if_exception_type(errors))
    try:
        return retrying(attempt)
    except _Gone as err:
        raise NotReady(f"{what}: {err}") from None
    except RetryError as err:  # the last try said no, or raised one of ``errors``
        raise NotReady(f"{what}: not ready within {timeout:g} s") from err.last_attempt.exception()
