"""Prefect's temporary local server under a locked database: a flow run waits for the lock instead of failing.

`recloop demo` died on day 3, 1 run of 2 on a quiet machine: creating a subflow timed out (httpx.ReadTimeout)
while the server's SQLite database was locked by its own services. ``configure_prefect`` now gives requests to
the temporary server longer than the server's own lock wait. Here the lock is held on purpose, longer than
recloop's request timeout for real services (set to 1 s with no retry, so the old behaviour fails at once).
Under load the server may also answer 503 at once (a transaction's snapshot went stale while its own
services wrote): those are retried with Prefect's own count and backoff for the temporary server.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent("""
    import json, sqlite3, sys, threading, time
    from pathlib import Path

    from recloop.flow_support import configure_prefect
    from recloop.settings import Settings

    home = Path(sys.argv[1])
    configure_prefect(Settings(home=home, request_timeout_seconds=1.0, service_retries=0))
    from prefect import flow

    @flow(name="noop")
    def noop() -> int:
        return 1

    noop()  # starts the temporary server and creates its database
    held = threading.Event()

    def hold_the_write_lock(seconds: float) -> None:
        db = sqlite3.connect(home / "prefect" / "prefect.db", timeout=30, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")  # the write lock: the server's writers wait for it
        held.set()
        time.sleep(seconds)
        db.execute("ROLLBACK")
        db.close()

    holder = threading.Thread(target=hold_the_write_lock, args=(4.0,))
    holder.start()
    held.wait()
    began = time.perf_counter()
    try:
        outcome = {"result": noop(), "waited": time.perf_counter() - began}
    except BaseException as err:
        outcome = {"error": f"{type(err).__name__}: {err}"[:500], "waited": time.perf_counter() - began}
    holder.join()
    print(json.dumps(outcome))
""")


@pytest.mark.slow  # ~35 s here: Prefect's import and its temporary server's start dominate
def test_a_flow_run_waits_for_the_temporary_servers_locked_database(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "RECLOOP_"))}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "platform"), str(ROOT / "kernels"), env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True,
                            env=env, timeout=240, cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert "error" not in outcome, outcome["error"]
    assert outcome["result"] == 1
    assert outcome["waited"] >= 2.0  # the run really was held up by the lock (longer than the 1 s limit)
