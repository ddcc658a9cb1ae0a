"""The one readiness helper: returns what the check found, names what never came, stops when it is gone."""

from __future__ import annotations

import itertools
import subprocess
import sys

import pytest

from recloop.readiness import NotReady, wait_until


def test_returns_the_first_true_answer_and_retries_only_the_errors_named():
    answers = itertools.chain([None, 0, ConnectionError("refused"), {"ready": True}], itertools.repeat(None))

    def check():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(check, what="a server", timeout=30, interval=0.01, errors=(ConnectionError,)) == {"ready": True}
    with pytest.raises(ZeroDivisionError):  # an error not named is a bug, not "not yet"
        wait_until(lambda: 1 / 0, what="a bug", timeout=30, interval=0.01)


def test_names_what_never_came_and_stops_when_the_process_is_gone():
    with pytest.raises(NotReady, match="the deployment: not ready within 0.1 s"):
        wait_until(lambda: False, what="the deployment", timeout=0.1, interval=0.01)
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    with pytest.raises(NotReady, match="mlflow: it exited"):  # long before the timeout
        wait_until(lambda: False, what="mlflow", timeout=600, interval=0.01,
                   gone=lambda: None if process.poll() is None else "it exited")
