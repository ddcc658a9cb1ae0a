"""``recloop retrain`` where no Prefect server is configured (issue 41): the retrain flow runs in the command's own
process on Prefect's temporary server (a port of its choosing, its database under ``$RECLOOP_HOME/prefect``),
trains the champion's next day incrementally, gates the candidate and says what happened as JSON, exit 0; the
run is recorded where ``recloop up`` would show it."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from recloop import checkpoint, registry
from recloop.settings import Settings

CHECKOUT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_retrain_runs_in_its_own_process_without_a_prefect_server(champion_home: Settings, copy_home,
                                                                    tmp_path: Path):
    home = copy_home(champion_home, tmp_path / "home")  # day 4 ingested, not yet featurized: one new day to learn
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PREFECT_", "RECLOOP_"))}  # no server, no harness's API URL, nothing of the session
    env.update(RECLOOP_HOME=str(home.home), RECLOOP_FRAME_BACKEND="pandas", MLFLOW_DISABLE_TELEMETRY="true",
               PYTHONPATH=os.pathsep.join([str(CHECKOUT / "platform"), str(CHECKOUT / "kernels"), str(CHECKOUT)]))
    done = subprocess.run([sys.executable, "-m", "recloop.cli", "retrain", "--json"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=560)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    assert "Traceback" not in done.stderr, done.stderr[-4000:]
    out = json.loads(done.stdout)
    assert out["mode"] == "incremental" and out["version"] == "2", out
    assert out["gate"]["passed"] is True or out["gate"]["reasons"], out["gate"]  # a refusal says why
    assert out["gate"]["alias"] == ("challenger" if out["gate"]["passed"] else None)
    assert "version" in out["retriever"] or "skipped" in out["retriever"], out["retriever"]
    info = registry.version_info(home, "2")
    assert info.mode == "incremental" and checkpoint.WEIGHTS_TAG in info.tags
    assert registry.gate_record(info.tags)["verdict"] in ("passed", "failed")

    # The temporary server's database under the home: the retrain and its subflows, ended and named.
    with sqlite3.connect(home.home / "prefect" / "prefect.db") as db:
        runs = dict(db.execute("SELECT f.name, r.state_name FROM flow_run r JOIN flow f ON f.id = r.flow_id "
                               "WHERE r.parent_task_run_id IS NULL").fetchall())
        names = [name for (name,) in db.execute("SELECT name FROM flow_run")]
    assert runs["retrain"] in ("Challenger", "Refused", "Champion"), runs
    assert {"ingest", "features", "train", "gate"} <= {name for (name,) in sqlite3.connect(
        home.home / "prefect" / "prefect.db").execute("SELECT f.name FROM flow_run r JOIN flow f ON f.id = r.flow_id")}
    assert len(names) == len(set(names)), names  # every run named, none twice
    # the server's task-run recorder writes in batches (flow_support.EMBEDDED_SERVER_WRITERS): the last batch is
    # flushed as the command's temporary server stops, so every task run is there and ended
    with sqlite3.connect(home.home / "prefect" / "prefect.db") as db:
        tasks = dict(db.execute("SELECT state_type, COUNT(*) FROM task_run GROUP BY state_type").fetchall())
    assert set(tasks) == {"COMPLETED"} and tasks["COMPLETED"] >= 4, tasks
