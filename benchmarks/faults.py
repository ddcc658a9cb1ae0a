"""The fault table: bad files, kills at commit points, concurrent runs, bad models, bad requests and dead
services, each with a clear, bounded outcome, and nothing lost.

    python benchmarks/faults.py [--big-rows 2000000] [--skip-models] [--json out.json]

Every row is checked as it is measured: a row lost or landed twice, a 5xx answer where a clear 4xx/503
was due, or a dead service not named makes the script exit 1 after printing the tables. Times are wall
times of real processes (a CLI process includes ~3-5 s of Python imports); "tries in" is the time the
failing call itself took, as the error message reports it.

Sections (each prints one table):

1. bad files: one landing folder holding every kind of bad file, ingested once: per file its outcome;
   then rows in / landed / quarantined, checked against the lake and the quarantine, and a rerun.
2. kills: an ingest process SIGKILLed at nine points of the commit; the next run must leave every event
   exactly once, the quarantine exact, no temporaries, the ledger done.
3. concurrent runs: three ingest processes on the same folder at once.
4. memory: peak RSS ingesting one big parquet file, per row (``--big-rows``).
5. bad models and 6. bad requests: a trained champion behind the serving API (``fault_models.py``).
7. dead services: the CLI and the serving API against a dead port and a server that never answers.
8. issue 41 (``fault_probes.py``): serving started with the registry down, serving started with its PostgreSQL
   journal down (the real one, a database refusing connections), an identical candidate, a queued retrain behind
   a refused one, a training SIGKILLed mid-epoch (``--only-probes``: this section alone, on a champion trained
   for it).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from contextlib import contextmanager
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
from common import machine

from recloop.ingest import ingest
from recloop.ingest.ledger import Ledger
from recloop.schema import load_spec
from recloop.settings import Settings
from recloop.simulate import World, WorldConfig, simulate

NOW = datetime(2026, 2, 1, tzinfo=UTC)
SPEC = load_spec("synthetic")
PROBLEMS: list[str] = []  # contract breaches found while measuring: the exit status


def check(ok: bool, what: str) -> str:
    if not ok:
        PROBLEMS.append(what)
    return "ok" if ok else f"BROKEN: {what}"


def print_table(title: str, rows: list[dict]) -> None:
    print(f"\n## {title}\n")
    columns = list(rows[0])
    print("| " + " | ".join(columns) + " |")
    print("|" + " --- |" * len(columns))
    for row in rows:
        print("| " + " | ".join(str(row[c]).replace("|", "\\|") for c in columns) + " |")
    sys.stdout.flush()


def events(hour: int = 18, seed: int = 11) -> pa.Table:
    world = World(WorldConfig(seed=seed, days=1, events_per_day=4000))
    for h in range(hour):
        world.hour_events(0, h)
    return world.hour_events(0, hour)


def lake(settings: Settings) -> pa.Table:
    if not settings.lake_events_dir.exists():
        return pa.table({"event_id": pa.array([], pa.string())})
    return ds.dataset(settings.lake_events_dir, format="parquet", partitioning="hive").to_table()


def quarantine_rows(settings: Settings) -> int:
    files = list(settings.quarantine_dir.rglob("*.parquet")) if settings.quarantine_dir.exists() else []
    return sum(pq.read_metadata(f).num_rows for f in files)


def csv_text(table: pa.Table) -> str:
    frame = table.to_pandas()
    frame["history"] = frame["history"].map(lambda h: "|".join(str(int(v)) for v in h))
    frame["ts"] = frame["ts"].map(lambda t: t.isoformat())
    return frame.to_csv(index=False)


def shifted(table: pa.Table, days: int) -> pa.Table:
    later = pc.add(table["ts"], pa.scalar(timedelta(days=days), pa.duration("us")))
    return table.set_column(table.column_names.index("ts"), "ts", later)


# --- 1. bad files ------------------------------------------------------------------------------------------


def bad_files(work: Path) -> None:
    good = events()
    other = events(hour=19)
    landing = work / "landing"
    (landing / "day1").mkdir(parents=True)
    pq.write_table(good, landing / "day1" / "good.parquet")
    prices = other["price"].to_pylist()
    prices[:3] = [float("inf"), float("nan"), -float("inf")]
    pq.write_table(other.set_column(other.column_names.index("price"), "price", pa.array(prices, pa.float64())),
                   landing / "day1" / "inf-prices.parquet")
    pq.write_table(shifted(good.slice(0, 25), days=2), landing / "replayed-other-date.parquet")
    lines = csv_text(events(hour=20)).splitlines()
    lines[5] = ",".join(lines[5].split(",")[:4])
    (landing / "short-lines.csv").write_text("\n".join(lines) + "\n")
    data = (landing / "day1" / "good.parquet").read_bytes()
    (landing / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (landing / "not-parquet.parquet").write_bytes(b"hello, I am text")
    (landing / "empty.parquet").write_bytes(b"")
    (landing / "latin1.csv").write_bytes(csv_text(other).replace("US", "Ü").encode("latin-1"))
    (landing / "passwd.csv").symlink_to("/etc/passwd")
    outside = work / "outside"
    outside.mkdir()
    pq.write_table(good.slice(0, 5), outside / "elsewhere.parquet")
    (landing / "linked-folder").symlink_to(outside, target_is_directory=True)
    os.mkfifo(landing / "pipe.csv")
    pq.write_table(good.slice(0, 5), landing / "..%2f..%2fescape.parquet")
    pq.write_table(good.slice(0, 5), landing / "vanishes.parquet")
    (landing / "_world.json").write_text("{}")

    settings = Settings(home=work / "home")

    def remove_one(result) -> None:
        if result.path.endswith("good.parquet"):
            (landing / "vanishes.parquet").unlink()  # gone between discovery and reading

    started = time.perf_counter()
    summary = ingest(landing, SPEC, settings, now=NOW, on_file=remove_one, batch_rows=64)
    seconds = time.perf_counter() - started
    rows = [{"file": Path(r.path).name, "outcome": r.status, "rows in": r.rows_in, "landed": r.rows_landed,
             "quarantined": r.rows_quarantined,
             "reason": r.error or ", ".join(f"{k}={v}" for k, v in r.reasons.items()) or "-"}
            for r in summary.results]
    landed, quarantined = lake(settings).num_rows, quarantine_rows(settings)
    rerun = ingest(landing, SPEC, settings, now=NOW)
    rows.append({"file": "TOTAL", "outcome": f"{summary.files_ingested} ingested, {summary.files_rejected} rejected, "
                 f"{summary.files_ignored} ignored", "rows in": summary.rows_in, "landed": summary.rows_landed,
                 "quarantined": summary.rows_quarantined,
                 "reason": check(summary.rows_in == summary.rows_landed + summary.rows_quarantined
                                 and landed == summary.rows_landed and quarantined == summary.rows_quarantined
                                 and rerun.rows_in == 0 and len(summary.results) == 14
                                 and pc.count_distinct(lake(settings)["event_id"]).as_py() == landed,
                                 "bad files: accounting") + f" (lake {landed}, quarantine {quarantined}, rerun reads "
                 f"{rerun.rows_in} rows; {seconds:.2f} s)"})
    print_table("1. bad files in one landing folder (one run, batches of 64 rows)", rows)


# --- 2. kills at commit points ---------------------------------------------------------------------------------

KILL_CHILD = textwrap.dedent("""
    import os, signal, sys
    from datetime import datetime, timezone
    from pathlib import Path
    import recloop.ingest.lake as lake
    import recloop.ingest.run as run
    from recloop.ingest import ingest
    from recloop.ingest.ledger import Ledger
    from recloop.schema import load_spec
    from recloop.settings import Settings

    source, home, point = sys.argv[1], sys.argv[2], sys.argv[3]

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    def hook(owner, name, nth=1, after=False, half=False):
        real, calls = getattr(owner, name), [0]
        def wrapper(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth and half:  # write half of this batch, then die
                real(args[0], args[1].slice(0, args[1].num_rows // 2))
                die()
            if calls[0] == nth and not after:
                die()
            out = real(*args, **kwargs)
            if calls[0] == nth:
                die()
            return out
        setattr(owner, name, wrapper)

    {"reading": lambda: hook(run, "_checked"),
     "staging": lambda: hook(lake.StagedParquet, "write", nth=2, half=True),
     "ids-added": lambda: hook(Ledger, "claim_ids", nth=2, after=True),
     "before-commit-point": lambda: hook(Ledger, "begin_commit"),
     "after-commit-point": lambda: hook(Ledger, "begin_commit", after=True),
     "between-renames": lambda: hook(lake.os, "replace", nth=2),
     "before-finish": lambda: hook(Ledger, "finish_commit"),
     "after-first-file": lambda: hook(Ledger, "finish_commit", after=True),
     "recovering": lambda: hook(lake.os, "replace", nth=1),
     "none": lambda: None}[point]()
    ingest(Path(source), load_spec("synthetic"), Settings(home=Path(home)),
           now=datetime(2026, 2, 1, tzinfo=timezone.utc), batch_rows=100)
""")
KILL_POINTS = ("reading", "staging", "ids-added", "before-commit-point", "after-commit-point", "between-renames",
               "before-finish", "after-first-file", "recovering")


def kill_landing(folder: Path) -> None:
    """Three files: one spanning two dates with a bad row, one CSV with a short line, one of replays."""
    folder.mkdir(parents=True)
    base = events()
    stamps = pa.concat_arrays([base["ts"].slice(0, 100).combine_chunks(),
                               shifted(base.slice(100), 1)["ts"].combine_chunks()])
    spanning = base.set_column(1, "ts", stamps)
    labels = spanning["label"].to_pylist()
    labels[0] = 5
    pq.write_table(spanning.set_column(spanning.column_names.index("label"), "label", pa.array(labels, pa.int8())),
                   folder / "a-span.parquet")
    lines = csv_text(events(hour=20)).splitlines()
    lines[7] = ",".join(lines[7].split(",")[:3])
    (folder / "b-hour.csv").write_text("\n".join(lines) + "\n")
    pq.write_table(shifted(base.slice(0, 30), days=3), folder / "c-replays.parquet")


def run_child(source: Path, home: Path, point: str) -> int:
    return subprocess.run([sys.executable, "-c", KILL_CHILD, str(source), str(home), point], capture_output=True,
                          timeout=300).returncode


def kills(work: Path) -> None:
    landing = work / "landing"
    kill_landing(landing)
    reference = Settings(home=work / "reference")
    clean = ingest(landing, SPEC, reference, now=NOW, batch_rows=100)
    expected_ids = sorted(lake(reference)["event_id"].to_pylist())
    expected_quarantine = quarantine_rows(reference)
    rows = []
    for point in KILL_POINTS:
        settings = Settings(home=work / f"home-{point}")
        codes = [run_child(landing, settings.home, "between-renames")] if point == "recovering" else []
        codes.append(run_child(landing, settings.home, point))
        after_kill = lake(settings).num_rows
        summary = ingest(landing, SPEC, settings, now=NOW, batch_rows=100)
        ids = lake(settings)["event_id"].to_pylist()
        with Ledger.open(settings.ledger_path) as ledger:
            states = sorted({e.status for e in ledger.entries()})
        temporaries = list(settings.home.rglob(".*.tmp"))
        again = ingest(landing, SPEC, settings, now=NOW)
        lost, twice = len(set(expected_ids) - set(ids)), len(ids) - len(set(ids))
        rows.append({
            "killed at": point, "exit": ",".join(str(c) for c in codes), "visible after kill": after_kill,
            "next run": f"{summary.files_ingested} ingested, {summary.files_skipped} skipped, "
                        f"{len(summary.recovered)} recovered",
            "lake rows": f"{len(ids)} / {len(expected_ids)}", "lost": lost, "twice": twice,
            "quarantine": f"{quarantine_rows(settings)} / {expected_quarantine}",
            "check": check(all(c == -signal.SIGKILL for c in codes) and sorted(ids) == expected_ids
                           and quarantine_rows(settings) == expected_quarantine and not temporaries
                           and states == ["done"] and again.rows_in == 0, f"kill at {point}"),
        })
    print_table(f"2. ingest killed (SIGKILL) at commit points, then run again ({clean.rows_in} rows in, 3 files, "
                "batches of 100)", rows)


# --- 3. concurrent runs, 4. memory ------------------------------------------------------------------------------


def concurrent(work: Path) -> None:
    simulate(WorldConfig(seed=9, days=1, events_per_day=6000), work / "landing")
    settings = Settings(home=work / "home")
    started = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", KILL_CHILD, str(work / "landing"), str(settings.home), "none"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(3)]
    codes = [child.wait(timeout=300) for child in children]
    seconds = time.perf_counter() - started
    ids = lake(settings)["event_id"].to_pylist()
    with Ledger.open(settings.ledger_path) as ledger:
        done = len(ledger.entries(status="done"))
    print_table("3. three ingest processes on one folder at once", [{
        "runs": 3, "exit codes": codes, "events": 6000, "lake rows": len(ids), "distinct": len(set(ids)),
        "files done": f"{done} / 24", "seconds": f"{seconds:.1f}",
        "check": check(codes == [0, 0, 0] and len(ids) == len(set(ids)) == 6000 and done == 24, "concurrent runs"),
    }])


MEMORY_CHILD = textwrap.dedent("""
    import sys, time, json
    from datetime import datetime, timezone
    from pathlib import Path
    from recloop.ingest import ingest
    from recloop.schema import load_spec
    from recloop.settings import Settings

    def high_water_kb():  # this process's own peak (ru_maxrss would include the parent's, from before exec)
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1])

    spec = load_spec("synthetic")
    before = high_water_kb()
    started = time.perf_counter()
    summary = ingest(Path(sys.argv[1]), spec, Settings(home=Path(sys.argv[2])),
                     now=datetime(2026, 2, 1, tzinfo=timezone.utc))
    print(json.dumps({"rows": summary.rows_landed, "seconds": time.perf_counter() - started,
                      "before_kb": before, "peak_kb": high_water_kb()}))
""")


def memory(work: Path, rows: int) -> None:
    simulate(WorldConfig(seed=0, days=1, events_per_day=rows), work / "hourly")
    big = work / "big.parquet"
    pq.write_table(ds.dataset(work / "hourly", format="parquet").to_table(), big)
    shutil.rmtree(work / "hourly")
    done = subprocess.run([sys.executable, "-c", MEMORY_CHILD, str(big), str(work / "home")], capture_output=True,
                          text=True, timeout=900)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    grown = (result["peak_kb"] - result["before_kb"]) * 1024
    print_table("4. memory: one big parquet file ingested (before: ~775 bytes per row, 1.55 GB for 2M rows)", [{
        "rows": f"{result['rows']:,}", "file MB": f"{big.stat().st_size / 1e6:.0f}",
        "peak RSS MB": f"{result['peak_kb'] / 1024:.0f}", "after imports MB": f"{result['before_kb'] / 1024:.0f}",
        "grown MB": f"{grown / 1e6:.0f}", "bytes per row": f"{grown / result['rows']:.0f}",
        "seconds": f"{result['seconds']:.1f}",
        "check": check(result["rows"] == rows and grown < 600e6, "memory bound"),
    }])


# --- 7. dead services -------------------------------------------------------------------------------------------


@contextmanager
def dead_and_silent() -> tuple[int, int]:
    """A port nothing listens on, and one that accepts connections and never answers."""
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        dead = closed.getsockname()[1]
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        yield dead, silent.getsockname()[1]


def cli(args: list[str], env: dict[str, str], cwd: Path) -> tuple[float, int, str]:
    """Run ``recloop ARGS`` in a fresh process: wall seconds, exit code, its first error line."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "recloop.cli", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, cwd=cwd, timeout=900)
    seconds = time.perf_counter() - started
    errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    return seconds, done.returncode, errors[0] if errors else (done.stderr.strip().splitlines() or ["(nothing)"])[-1]


def dead_services(work: Path, models_home: Path | None) -> None:
    home = work / "home"
    if models_home is not None:
        shutil.copytree(models_home, home, ignore=shutil.ignore_patterns("serving", "cache"))
    else:
        simulate(WorldConfig(seed=2, days=2, events_per_day=2000), work / "landing")
        ingest(work / "landing", SPEC, Settings(home=home), now=NOW)
    base = {"RECLOOP_HOME": str(home), "MLFLOW_DISABLE_TELEMETRY": "true"}

    def own_home(n: int) -> dict[str, str]:
        """A fresh copy per case: a features run that fails halfway must not leave the next one nothing to do."""
        copy = work / f"home-{n}"
        shutil.copytree(home, copy)
        return {**base, "RECLOOP_HOME": str(copy)}
    rows = []
    with dead_and_silent() as (dead, silent):
        cases = [
            ("MLflow", "dead port", ["promote", "1", "--json"], {"RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}"}),
            ("MLflow", "never answers", ["promote", "1", "--json"],
             {"RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{silent}"}),
            ("MLflow", "dead port", ["gate", "--json"], {"RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}"}),
            ("MLflow", "dead port", ["canary", "status", "--json"],
             {"RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}"}),
            ("Redis", "dead port", ["features", "--json"],
             {"RECLOOP_FEAST_ONLINE_STORE": "redis", "RECLOOP_REDIS_URL": f"redis://127.0.0.1:{dead}/0"}),
            ("Redis", "never answers", ["features", "--json"],
             {"RECLOOP_FEAST_ONLINE_STORE": "redis", "RECLOOP_REDIS_URL": f"redis://127.0.0.1:{silent}/0"}),
            ("PostgreSQL", "dead port", ["features", "--json"],
             {"RECLOOP_FEAST_REGISTRY": f"postgresql://postgres@127.0.0.1:{dead}/feast"}),
            ("Prefect", "dead port", ["retrain", "--json"], {"RECLOOP_PREFECT_API_URL": f"http://127.0.0.1:{dead}/api"}),
            ("Prefect", "never answers", ["retrain", "--json"],
             {"RECLOOP_PREFECT_API_URL": f"http://127.0.0.1:{silent}/api"}),
        ]
        for n, (service, how, args, env) in enumerate(cases):
            seconds, code, line = cli(args, {**own_home(n), **env}, work)
            rows.append({"service": service, "fault": how, "command": "recloop " + " ".join(args), "exit": code,
                         "seconds (process)": f"{seconds:.1f}", "message": line,
                         "check": check(code == 3 and (f"{service} at" in line or "Feast registry" in line),
                                        f"{service} {how}: {line}")})
        rows.append(serve_with_dead_mlflow(work, home, base, dead))
    print_table("7. dead services: time to one clear line (before: promote silent 515 s then a traceback; serve "
                "blocked at start-up)", rows)


def serve_with_dead_mlflow(work: Path, home: Path, base: dict, dead: int) -> dict:
    """``recloop serve`` against a dead MLflow: how long until /healthz answers, and what it says."""
    import httpx

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    started = time.perf_counter()
    server = subprocess.Popen([sys.executable, "-m", "recloop.cli", "serve", "--port", str(port)], cwd=work,
                              env={**os.environ, **base, "RECLOOP_MLFLOW_TRACKING_URI": f"http://127.0.0.1:{dead}"},
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    answer = None
    try:
        while time.perf_counter() - started < 120 and server.poll() is None:
            try:
                answer = httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=5)
                break
            except httpx.HTTPError:
                time.sleep(0.2)
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=60)
    seconds = time.perf_counter() - started
    reason = answer.json()["reasons"][0] if answer is not None else "(no answer)"
    return {"service": "MLflow", "fault": "dead port", "command": "recloop serve: first /healthz",
            "exit": answer.status_code if answer is not None else "-", "seconds (process)": f"{seconds:.1f}",
            "message": reason, "check": check(answer is not None and answer.status_code == 503 and "MLflow at" in reason,
                                              "serve with a dead MLflow")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-rows", type=int, default=2_000_000)
    parser.add_argument("--skip-models", action="store_true", help="no training: sections 5 and 6 left out")
    parser.add_argument("--json", dest="json_path")
    parser.add_argument("--only-probes", action="store_true", help="section 8 alone (issue 41's probes)")
    args = parser.parse_args()
    print("# recloop fault table\nmachine: " + ", ".join(f"{k}={v}" for k, v in machine().items()))
    work = Path(tempfile.mkdtemp(prefix="recloop-faults-"))
    started = time.perf_counter()
    try:
        if args.only_probes:
            from fault_models import build_home
            from fault_probes import issue41_probes

            issue41_probes(build_home(work / "champion"), work / "probes", check, print_table)
        else:
            bad_files(work / "files")
            kills(work / "kills")
            concurrent(work / "concurrent")
            memory(work / "memory", args.big_rows)
            models_home = None
            if not args.skip_models:
                from fault_models import model_and_request_faults

                models_home = model_and_request_faults(work / "models", check, print_table)
            dead_services(work / "services", models_home)
            if models_home is not None:
                from fault_probes import issue41_probes

                issue41_probes(Settings(home=models_home, frame_backend="pandas"), work / "probes", check, print_table)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"\n{len(PROBLEMS)} contract breaches; {time.perf_counter() - started:.0f} s in all")
    for problem in PROBLEMS:
        print(f"- {problem}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps({"problems": PROBLEMS}, indent=2) + "\n")
    sys.exit(1 if PROBLEMS else 0)


if __name__ == "__main__":
    main()
