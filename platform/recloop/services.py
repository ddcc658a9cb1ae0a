"""``recloop up`` / ``recloop down``: the UIs and the serving API as local background processes.

Each runs in its own session (so ``down`` stops it with its children), logs to
``$RECLOOP_HOME/run/<name>.log``, and is recorded in ``$RECLOOP_HOME/run/<name>.pid``. They read the same
state the demo and the flows write: Prefect's database under ``$RECLOOP_HOME/prefect``, MLflow's
SQLite store, the Evidently workspace, the registry's models.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path

from recloop.readiness import NotReady, wait_until
from recloop.settings import Settings


@dataclass(frozen=True)
class Service:
    name: str
    port: int
    health: str  # path answered with 200 once it is up

    def url(self, host: str) -> str:
        return f"http://{host}:{self.port}"


SERVICES = (Service("prefect", 4200, "/api/health"), Service("mlflow", 5000, "/health"),
            Service("evidently", 8001, "/"), Service("serving", 8000, "/metrics"))


def services_for(settings: Settings, ports: dict[str, int | None] | None = None) -> tuple[Service, ...]:
    """The services on this home's ports (``RECLOOP_UP_*_PORT``), ``ports`` (name → port, None: the
    setting's) overriding them: two homes on one machine each get their own."""
    chosen = {"prefect": settings.up_prefect_port, "mlflow": settings.up_mlflow_port,
              "evidently": settings.up_evidently_port, "serving": settings.up_serving_port}
    chosen.update({name: port for name, port in (ports or {}).items() if port is not None})
    return tuple(replace(service, port=chosen[service.name]) for service in SERVICES)


def _read_pid_file(path: Path) -> tuple[int, int | None]:
    """A pid file's pid and the port its service was started on (None in a file from before ports were kept)."""
    fields = path.read_text().split()
    return int(fields[0]), (int(fields[1]) if len(fields) > 1 else None)


MLFLOW_UI_WORKERS = 1


def _command(service: Service, settings: Settings, host: str) -> list[str]:
    bin_dir = Path(sys.executable).parent
    if service.name == "prefect":
        return [str(bin_dir / "prefect"), "server", "start", "--host", host, "--port", str(service.port)]
    if service.name == "mlflow":
        # One worker process: MLflow's default four each import MLflow (with its job runner off, see
        # ``_service_env``: 9 CPU-seconds to answer on a 2-core host; the four workers and the job runner took 33);
        # one reviewer's browser on one machine is served by one worker's threads. A team's MLflow is its own
        # server (``mlflow_tracking_uri``).
        return [str(bin_dir / "mlflow"), "ui", "--backend-store-uri", settings.resolved_mlflow_tracking_uri(),
                "--host", host, "--port", str(service.port), "--workers", str(MLFLOW_UI_WORKERS)]
    if service.name == "evidently":
        from recloop.monitor.dashboards import workspace_path

        return [str(bin_dir / "evidently"), "ui", "--workspace", str(workspace_path(settings)), "--host", host,
                "--port", str(service.port)]
    return [str(bin_dir / "recloop"), "serve", "--host", host, "--port", str(service.port)]


def _service_env(service: Service, host: str) -> dict[str, str]:
    """A service's own environment: where it listens (the Prefect UI asks its API at ``PREFECT_UI_API_URL``,
    which otherwise stays http://127.0.0.1:4200/api whatever port it was given: the UI on another port said
    "Can't connect to Server API"), and what it need not start (Prefect's writers batched, MLflow's job runner)."""
    if service.name == "prefect":  # its writers batched as the temporary server's (flow_support)
        from recloop.flow_support import embedded_server_writers

        return {"PREFECT_UI_API_URL": f"{service.url(host)}/api", "PREFECT_SERVER_API_PORT": str(service.port),
                **embedded_server_writers()}
    if service.name == "mlflow":  # MLflow's job runner (seven consumer processes for its GenAI jobs): unused here
        return {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": os.environ.get("MLFLOW_SERVER_ENABLE_JOB_EXECUTION", "false")}
    return {}


def _run_dir(settings: Settings) -> Path:
    folder = settings.home.resolve() / "run"
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs. An exited child its parent has not reaped yet (a zombie: ``down`` called by the
    process that ran ``up``, as the demo's test does) still takes signals, but runs no more: ``down`` waited
    out its five seconds for each such service."""
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # no /proc here, or it has just gone
        return True
    return stat.rsplit(")", 1)[-1].split()[:1] != ["Z"]  # the state follows the name in parentheses


def _runs(pid: int, service: Service) -> bool:
    """Whether ``pid`` is alive and is ``service`` (its program on its port, as ``up`` starts it): a pid file
    outlives its process, and the pid can be another program's since (``up`` reported the service running,
    ``down`` would have signalled that program's process group). Where there is no /proc to read, alive is
    taken as enough."""
    if not _alive(pid):
        return False
    try:
        args = [a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a]
    except OSError:
        return True
    program = service.name if service.name in ("prefect", "mlflow", "evidently") else "recloop"
    # a console script runs as `python <bin>/<name> ...`: its name among the first two arguments
    return any(Path(a).name == program for a in args[:2]) and str(service.port) in args


def _port_free(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError:
            return False
    return True


def up(settings: Settings, host: str = "127.0.0.1", timeout: float = 120.0,
       services: tuple[Service, ...] | None = None) -> dict[str, dict]:
    """Start what is not running yet and wait until each answers; returns name → url, pid, status.

    A service counts as up only when the process started here answers: a port another process holds is a
    failure named as such (an answer from someone else's server there would be a lie), and so is a process
    that exited while something answered on its port.
    """
    import httpx

    from recloop.flow_support import configure_prefect

    configure_prefect(settings)
    services = services if services is not None else services_for(settings)
    env = {**os.environ, "RECLOOP_HOME": str(settings.home.resolve()), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)  # the server itself must not point at another one
    started, processes = {}, {}

    def alive(name: str) -> bool:  # a child started here that exited is a zombie until reaped: poll it
        if name in processes:
            return processes[name].poll() is None
        return _alive(started[name]["pid"])

    for service in services:
        pid_file = _run_dir(settings) / f"{service.name}.pid"
        if pid_file.exists():
            pid, port = _read_pid_file(pid_file)
            running = replace(service, port=port or service.port)
            if _runs(pid, running):
                started[service.name] = {"url": running.url(host), "pid": pid, "status": "running"}
                continue
        if not _port_free(host, service.port):
            started[service.name] = {"url": service.url(host), "pid": None, "status": (
                f"failed: port {service.port} on {host} is held by another process (not one `recloop up` "
                "started): stop it, or free the port")}
            continue
        log = open(_run_dir(settings) / f"{service.name}.log", "ab")  # noqa: SIM115 - handed to the child
        process = subprocess.Popen(_command(service, settings, host), env={**env, **_service_env(service, host)},
                                   stdout=log, stderr=log, start_new_session=True)
        pid_file.write_text(f"{process.pid} {service.port}")  # the port too: `down` finds it by both
        processes[service.name] = process
        started[service.name] = {"url": service.url(host), "pid": process.pid, "status": "starting"}
    deadline = time.time() + timeout
    for service in services:
        entry = started[service.name]
        if entry["status"].startswith("failed"):
            continue
        try:  # up once the process started here answers (not someone else on its port)
            wait_until(lambda s=service, e=entry: httpx.get(e["url"] + s.health, timeout=2).status_code == 200
                       and alive(s.name), what=service.name, timeout=deadline - time.time(), interval=0.5,
                       errors=(httpx.HTTPError,), gone=lambda s=service: None if alive(s.name) else "it exited")
            entry["status"] = "up"
        except NotReady:
            entry["status"] = f"failed: see {_run_dir(settings) / (service.name + '.log')}"
    return started


def deployment_count(api_url: str) -> int | None:
    """How many deployments the Prefect server at ``api_url`` (``…/api``) holds; None if it does not say."""
    import httpx

    try:
        answer = httpx.post(f"{api_url.rstrip('/')}/deployments/count", json={}, timeout=5)
        return int(answer.json()) if answer.status_code == 200 else None
    except (httpx.HTTPError, ValueError):
        return None


def deployments_hint(count: int | None, api_url: str, checkout: Path | None) -> str | None:
    """What to run so the Prefect UI's Deployments page is not empty: ``up`` starts the server the
    deployments are served from, but deploying them (a work pool, ``prefect deploy --all`` in the checkout
    holding ``prefect.yaml``, a worker to run them) is a choice of where runs go, so it is printed, not done.
    None when the server already has deployments (or could not be asked)."""
    if count is None or count > 0:
        return None
    where = f"cd {checkout} && " if checkout is not None else ""
    return ("Prefect has no deployments yet (its Deployments page is empty): the demo runs its flows in "
            "process. To deploy the hourly retrain, the drift monitor and the canary checks to this server:\n"
            f"  export PREFECT_API_URL={api_url}\n"
            "  prefect work-pool create recloop-gpu --type process\n"
            f"  {where}prefect deploy --all\n"
            "  prefect worker start --pool recloop-gpu")


def checkout() -> Path | None:
    """The folder holding ``prefect.yaml`` and ``flows/`` (an editable install's checkout), if there is one."""
    import flows

    root = Path(flows.__file__).resolve().parent.parent
    return root if (root / "prefect.yaml").is_file() else None


def down(settings: Settings, services: tuple[Service, ...] = SERVICES) -> dict[str, str]:
    """Stop every service ``up`` started (the whole process group), then forget it (``services``: as given
    to ``up``, on its ports)."""
    stopped = {}
    for service in services_for(settings):
        pid_file = _run_dir(settings) / f"{service.name}.pid"
        if not pid_file.exists():
            continue
        pid, port = _read_pid_file(pid_file)  # the port it was started on, whatever the settings say now
        if _runs(pid, replace(service, port=port or service.port)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGTERM)
            try:
                wait_until(lambda p=pid: not _alive(p), what=f"{service.name} stopping", timeout=5, interval=0.1)
            except NotReady:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pid, signal.SIGKILL)
            stopped[service.name] = "stopped"
        else:
            stopped[service.name] = "was not running"
        pid_file.unlink()
    return stopped
