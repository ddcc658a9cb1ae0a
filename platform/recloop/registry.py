"""MLflow IO: registered versions and the aliases that carry state; where runs and artifacts go.

The registry records and resolves versions; it never starts or follows a training (``recloop.tracking``
keeps the MLflow run of a training and logs its model, then calls ``register`` here).

Every alias and version function takes ``model_name``: the ranker (``recloop-ranker``, the default) and
the retriever (``recloop-retriever``) are separate registered models, each with its own versions and
aliases.

Aliases: ``champion`` (serving), ``challenger`` (passed the gate, in canary), ``previous`` (the last
champion, for rollback). A version that fails the gate keeps its number, its ``gate`` tag saying
``failed`` with the reasons. Tags: one per concern, JSON where it has parts (``gate``: the verdict first,
then the champion, window, reasons and thresholds; ``alias.<name>``: who moved it, why and when;
``rolled_back``; ``canary``: see ``recloop.canary.tag``). Tracking runs on SQLite under ``RECLOOP_HOME`` unless ``RECLOOP_MLFLOW_TRACKING_URI`` names
a server or database; artifacts go under ``RECLOOP_HOME/mlartifacts`` unless
``RECLOOP_MLFLOW_ARTIFACT_URI`` names an object store.

Example::

    version = register(settings, model_uri, run_id)   # recloop.tracking.log_training calls this
    set_alias(settings, "challenger", logged.version, who="gate", why="passed")
    version_by_alias(settings, "champion")
"""

from __future__ import annotations

import getpass
import json
import logging
import os
import re
import time
from contextlib import contextmanager
from dataclasses import dataclass

from recloop import endpoints
from recloop.locks import exclusive_lock
from recloop.settings import Settings
from recloop.version_tags import CANARY_TAG, LOAD_FAILED_TAG, ROLLED_BACK_TAG, both, readable, record

EXPERIMENT = "recloop"
MODEL_NAME = "recloop-ranker"
RETRIEVER_NAME = "recloop-retriever"  # its versions: recloop.retrieval.publish; same aliases, its own
ALIASES = ("champion", "challenger", "previous")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoggedModel:
    run_id: str
    model_uri: str
    version: str
    duplicate_of: str | None = None  # the run's weights were registered already, as this version: none new


_METRIC_NAME = re.compile(r"[^A-Za-z0-9_\-. /]")


def metric_name(name: str) -> str:
    """``name`` as MLflow accepts a metric name: ``=`` and ``:`` (slice names such as ``device=mobile``)
    become ``.``, anything else outside letters, digits, ``_ - . / `` and space becomes ``_``."""
    return _METRIC_NAME.sub("_", name.replace("=", ".").replace(":", "."))


def configure(settings: Settings) -> str:
    """Point MLflow at this installation; returns the id of the training experiment.

    Raises:
        endpoints.ServiceUnavailable: a tracking server that does not answer, within seconds.
    """
    import logging

    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # its INFO lines (schema migrations...) are noise
    import mlflow

    logging.getLogger("mlflow").setLevel(os.environ["MLFLOW_LOGGING_LEVEL"].upper())  # imported earlier, maybe
    logging.getLogger("alembic").setLevel(logging.WARNING)
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    # Logging a model copies its artifacts with a tqdm bar on stderr: noise in every command's output.
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    object_store(settings)
    endpoints.require_mlflow(settings)
    uri = tracking_uri(settings)
    settings.home.mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    return experiment(settings, EXPERIMENT)


def object_store(settings: Settings) -> None:
    """The S3-compatible object store of ``RECLOOP_OBJECT_STORE_*`` (MinIO, say) for MLflow's artifacts, as
    boto3 reads it: its endpoint and keys. Variables already set by the user win."""
    for variable, value in (("MLFLOW_S3_ENDPOINT_URL", settings.object_store_url),
                            ("AWS_ACCESS_KEY_ID", settings.object_store_access_key),
                            ("AWS_SECRET_ACCESS_KEY", settings.object_store_secret_key.get_secret_value())):
        if value:
            os.environ.setdefault(variable, value)


def experiment(settings: Settings, name: str) -> str:
    """The id of experiment ``name``, created with its artifacts where ``artifact_location`` says. Every
    experiment is made here: one created without a location on a local store would write to ``./mlruns``
    of whatever directory the process runs in."""
    import mlflow

    found = mlflow.get_experiment_by_name(name)
    if found is not None:
        return found.experiment_id
    location = artifact_location(settings, name, mlflow.get_tracking_uri())
    try:
        return mlflow.create_experiment(name, artifact_location=location)
    except Exception:  # noqa: BLE001 - created meanwhile by another process
        return mlflow.get_experiment_by_name(name).experiment_id


def artifact_location(settings: Settings, name: str, tracking_uri: str) -> str | None:
    """Where experiment ``name`` keeps its artifacts: ``RECLOOP_MLFLOW_ARTIFACT_URI`` (``mlflow-artifacts:/...``
    through a server that proxies its object store, or the store itself); else, with a tracking server, the
    server's own default (None: a server started with ``--serve-artifacts`` proxies them); else (SQLite under
    the home) ``RECLOOP_HOME/mlartifacts``."""
    base = settings.mlflow_artifact_uri
    if not base and tracking_uri.startswith(("http://", "https://")):
        return None
    base = base or (settings.home.resolve() / "mlartifacts").as_uri()
    return base if name == EXPERIMENT else f"{base.rstrip('/')}/{name}"


def tracking_uri(settings: Settings) -> str:
    """This installation's tracking (and registry) URI, as ``configure`` sets it process-wide."""
    return endpoints.with_connect_timeout(settings.resolved_mlflow_tracking_uri(), endpoints.limits_for(settings))


def mlflow_client(settings: Settings):
    """A client of this installation's tracking store and registry, named explicitly: MLflow's process-wide
    URIs (``configure``) are another installation's while a second one runs in the same process (tests: two
    servers; a server thread of one read the other's aliases, then failed to load that version from its own)."""
    from mlflow import MlflowClient

    configure(settings)
    uri = tracking_uri(settings)
    return MlflowClient(tracking_uri=uri, registry_uri=uri)


PERMANENT = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "PERMISSION_DENIED", "UNAUTHENTICATED",
                       "INVALID_STATE", "BAD_REQUEST", "FEATURE_DISABLED"})


def _transient(err: BaseException) -> bool:
    """Whether a failed registration may succeed when tried again: a version number taken by another
    registration at the same moment, a locked store, a server that did not answer; not a refusal."""
    from mlflow.exceptions import MlflowException

    return isinstance(err, MlflowException) and err.error_code not in PERMANENT


def register(settings: Settings, model_uri: str, run_id: str | None = None, attempts: int = 8,
             model_name: str = MODEL_NAME, tags: dict[str, str] | None = None) -> str:
    """A new version of the registered model (with ``tags`` from its creation); safe when several runs
    register at once.

    MLflow numbers versions ``MAX(version)+1``, so two registrations can collide: registrations are
    serialized with a file lock on this machine and retried with exponential backoff (tenacity, ``attempts``
    in all, each wait logged) against a shared server; a refusal (``PERMANENT``) is raised at once.
    """
    from mlflow.exceptions import MlflowException
    from tenacity import Retrying, before_sleep_log, retry_if_exception, stop_after_attempt, wait_exponential

    client = mlflow_client(settings)
    retrying = Retrying(stop=stop_after_attempt(attempts), wait=wait_exponential(multiplier=0.1, max=5.0),
                        retry=retry_if_exception(_transient), reraise=True,
                        before_sleep=before_sleep_log(log, logging.WARNING))
    with exclusive_lock(settings.home.resolve() / "mlflow-register.lock"):
        for attempt in retrying:
            with attempt:
                try:
                    client.create_registered_model(model_name)
                except MlflowException as err:
                    if "RESOURCE_ALREADY_EXISTS" not in str(err.error_code):
                        raise
                version = client.create_model_version(model_name, model_uri, run_id=run_id, tags=tags)
    return str(version.version)


def _alias_unset(err: Exception) -> bool:
    """Whether an alias lookup's MlflowException says the alias (or the model) does not exist, rather than
    that the registry could not answer: a locked SQLite store, a lost connection or a server's 5xx come
    as TEMPORARILY_UNAVAILABLE (or another code) and must not read as "no champion"."""
    code = getattr(err, "error_code", "")
    return code == "RESOURCE_DOES_NOT_EXIST" or (code == "INVALID_PARAMETER_VALUE" and "not found" in str(err))


def alias_version(client, alias: str, model_name: str = MODEL_NAME) -> str | None:
    """The version ``alias`` points to through ``client`` (an ``MlflowClient``), None when the alias or the
    model does not exist; an error when the registry cannot answer (``_alias_unset``)."""
    from mlflow.exceptions import MlflowException

    try:
        return str(client.get_model_version_by_alias(model_name, alias).version)
    except MlflowException as err:
        if _alias_unset(err):
            return None
        raise


def version_by_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> str | None:
    """``alias_version`` with this installation's client."""
    return alias_version(mlflow_client(settings), alias, model_name)


def aliases(settings: Settings, model_name: str = MODEL_NAME) -> dict[str, str | None]:
    return {alias: version_by_alias(settings, alias, model_name) for alias in ALIASES}




def stale_tags(alias: str) -> tuple[str, ...]:
    """The tags of a version's earlier state that no longer hold once ``alias`` moves to it: a challenger (or
    champion) again is not ``rolled_back``, and its ``serving.load_failed`` was about an earlier attempt (the
    canary controller would roll the new canary back on it at its first check); a new challenger's ``canary``
    tag is its old experiment's (rolled back, superseded), its new one is written when the canary starts."""
    return {"challenger": (ROLLED_BACK_TAG, LOAD_FAILED_TAG, CANARY_TAG),
            "champion": (ROLLED_BACK_TAG, LOAD_FAILED_TAG)}.get(alias, ())


def set_alias(settings: Settings, alias: str, version: str, *, who: str | None = None, why: str = "",
              model_name: str = MODEL_NAME) -> None:
    """Point ``alias`` at ``version``, recording who and why on the version; when the alias moves to it, the
    version's tags of an earlier state are removed (``stale_tags``)."""
    client = mlflow_client(settings)
    before = alias_version(client, alias, model_name)
    client.set_registered_model_alias(model_name, alias, version)
    if before != str(version):
        present = client.get_model_version(model_name, version).tags or {}
        for key in (name for stale in stale_tags(alias) for name in both(stale)):
            if key in present:
                client.delete_model_version_tag(model_name, version, key)
    tag(settings, version, moved_by(f"alias.{alias}", who, why), model_name)  # one per alias: who moved it, why, when


def moved_by(name: str, who: str | None, why: str) -> dict[str, str]:
    """Tag ``name`` saying who moved the version, why and when: a line to read, and its record (``by``, ``why``, ``at``)."""
    moved = {"by": who or getpass.getuser(), "why": why, "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    when = moved["at"].replace("T", " ").removesuffix("Z") + " UTC"
    return readable(name, f"by {moved['by']} at {when}" + (f": {why}" if why else ""), moved)


def remove_alias(settings: Settings, alias: str, model_name: str = MODEL_NAME) -> None:
    mlflow_client(settings).delete_registered_model_alias(model_name, alias)


def tag(settings: Settings, version: str, tags: dict[str, str], model_name: str = MODEL_NAME) -> None:
    client = mlflow_client(settings)
    for key, value in tags.items():
        client.set_model_version_tag(model_name, version, key, str(value))


GATE_TAG = "gate"


def gate_tag(passed: bool, **detail) -> dict[str, str]:
    """The gate's verdict: ``gate`` says it in a line ("failed vs champion v1: AUC ...", the first reason), ``gate.json``
    holds the record, the verdict first, then ``detail`` (champion, window, reasons, figures, thresholds)."""
    verdict = "passed" if passed else "failed"
    reasons = [str(r) for r in detail.get("reasons") or detail.get("insufficient_evidence") or ()]
    # the record's verdict stays passed/failed (what programs read); the line says when the canary decides instead
    shown = "insufficient evidence (the canary decides)" if detail.get("insufficient_evidence") else verdict
    summary = shown + (f" vs champion v{detail['champion']}" if detail.get("champion") else "")
    summary += (f": {reasons[0]}" if reasons else "") + (f" (+{len(reasons) - 1} more)" if len(reasons) > 1 else "")
    return readable(GATE_TAG, summary, {"verdict": verdict, **detail})


def gate_record(tags: dict[str, str]) -> dict | None:
    """A version's gate verdict and detail (``{"verdict": "passed" | "failed", ...}``), ``None`` if never gated.
    Versions gated before the one tag carry a plain verdict (and ``gate.detail`` JSON): read as the same."""
    raw = record(tags, GATE_TAG)
    if raw is None:
        return None
    if raw in ("passed", "failed"):
        try:
            detail = json.loads(tags.get(f"{GATE_TAG}.detail") or "{}")
        except ValueError:
            detail = {}
        return {"verdict": raw, **(detail if isinstance(detail, dict) else {})}
    try:
        found = json.loads(raw)
    except ValueError:
        return None
    return found if isinstance(found, dict) and found.get("verdict") in ("passed", "failed") else None


DESCRIPTION_CHARACTERS = 5000  # MLflow's SQL stores keep a version's description in a VARCHAR(5000)


def describe(settings: Settings, version: str, description: str, model_name: str = MODEL_NAME, *,
             whole: str = "") -> None:
    """Set the version's description (markdown, rendered on its MLflow page), cut to what the store keeps
    (``fit_description``; ``whole`` says where the whole text is), its tables' cells spaced (``spaced_cells``)."""
    mlflow_client(settings).update_model_version(model_name, version,
                                                 description=spaced_cells(fit_description(description, whole)))


CELL_GAP = "&nbsp;" * 3


def spaced_cells(markdown: str) -> str:
    """Markdown tables with a gap after each cell's text, for MLflow's page: it renders a description's tables
    (Showdown, GitHub flavour) with no cell padding and strips every style attribute, so adjacent columns ran
    together ("candidatechampion"). The separator rows and everything outside tables are left as they are.

    Example::

        spaced_cells("| a | b |\n| --- | --- |")  # '| a&nbsp;&nbsp;&nbsp; | b&nbsp;&nbsp;&nbsp; |\n| --- | --- |'
    """
    out = []
    for line in markdown.split("\n"):
        if line.startswith("|") and not re.fullmatch(r"\|(\s*:?-{3,}:?\s*\|)+\s*", line):
            cells = re.split(r"(?<!\\)\|", line)[1:-1]
            line = "|" + "|".join(f" {c.strip()}{CELL_GAP} " if c.strip() else c for c in cells) + "|"
        out.append(line)
    return "\n".join(out)


def fit_description(markdown: str, whole: str = "", limit: int = DESCRIPTION_CHARACTERS) -> str:
    """``markdown`` as a version's description: whole when it fits MLflow's ``limit``, else its first blocks
    (paragraphs, lists, tables: never a table cut in its middle, which rendered as stray text) and a last line
    saying what was left out and where the whole is. A PostgreSQL or MySQL tracking store refused longer ones
    (the gate failed on ``value too long``); SQLite kept them.

    Example::

        fit_description(report, whole="artifact gate_report_v3.md of the training run")
    """
    if len(markdown) <= limit:
        return markdown
    blocks, kept = markdown.split("\n\n"), []
    for block in blocks:
        note = (f"\n\n*{len(blocks) - len(kept)} more sections not shown here (MLflow keeps {limit} characters)"
                + (f": the whole report is the {whole}" if whole else "") + ".*")
        if len("\n\n".join([*kept, block])) + len(note) + 200 > limit:
            return "\n\n".join(kept) + note
        kept.append(block)
    return "\n\n".join(kept)[:limit]


@dataclass(frozen=True)
class VersionInfo:
    """A registered version as the loop reads it: its tags and aliases, and its training run's lineage.

    ``train_window`` and ``validation_window`` are the first and last training-file hours
    (``YYYY-MM-DDTHH``) of the run. The checkpoint itself is found by ``checkpoint.resolve``.
    """

    version: str
    run_id: str | None
    tags: dict[str, str]
    aliases: tuple[str, ...]
    mode: str | None
    source: str
    train_window: tuple[str, str] | None
    validation_window: tuple[str, str] | None


def version_info(settings: Settings, version: str, model_name: str = MODEL_NAME) -> VersionInfo:
    client = mlflow_client(settings)
    found = client.get_model_version(model_name, version)
    run_tags = client.get_run(found.run_id).data.tags if found.run_id else {}

    def window(name: str) -> tuple[str, str] | None:
        value = run_tags.get(name)
        return tuple(value.split("..", 1)) if value else None  # type: ignore[return-value]

    return VersionInfo(str(found.version), found.run_id, dict(found.tags), tuple(found.aliases),
                       run_tags.get("recloop.mode"), found.source, window("recloop.train_window"),
                       window("recloop.validation_window"))


class UnknownVersion(LookupError):
    """No such registered version (the message names the versions there are)."""


def require_version(settings: Settings, version: str | int, model_name: str = MODEL_NAME) -> str:
    """``version`` as the registry writes it (``"01"`` is ``"1"``); raises ``UnknownVersion`` unless it is
    a number in ASCII digits that ``model_name`` has registered (``"²"`` and ``"١"`` are digits to Python's
    ``int`` and ``isdigit``, not versions)."""
    client = mlflow_client(settings)
    numbers = sorted(int(v.version) for v in client.search_model_versions(f"name='{model_name}'"))
    if re.fullmatch(r"[0-9]+", str(version)) and int(version) in numbers:
        return str(int(version))
    known = f"versions {numbers[0]}..{numbers[-1]}" if numbers else "no version registered yet"
    raise UnknownVersion(f"{model_name} has no version {str(version)!r} ({known})")


@contextmanager
def _moving_aliases(settings: Settings):
    """One alias move at a time on this machine: two promotes at once each read the old champion, and one's
    version was lost while both said they had won."""
    with exclusive_lock(settings.home.resolve() / "mlflow-aliases.lock"):
        yield


def promote(settings: Settings, version: str, *, who: str | None = None, why: str = "",
            model_name: str = MODEL_NAME) -> dict[str, str | None]:
    """``champion`` := version, ``previous`` := the old champion, ``challenger`` removed if it was this.

    Raises:
        UnknownVersion: ``version`` is not registered.
    """
    version = require_version(settings, version, model_name)  # "01" compared as "1": champion == previous
    with _moving_aliases(settings):
        old = version_by_alias(settings, "champion", model_name)
        if old is not None and old != version:
            set_alias(settings, "previous", old, who=who, why=f"replaced by v{version}", model_name=model_name)
        set_alias(settings, "champion", version, who=who, why=why, model_name=model_name)
        if version_by_alias(settings, "challenger", model_name) == version:
            remove_alias(settings, "challenger", model_name)
        return aliases(settings, model_name)


def rollback(settings: Settings, *, who: str | None = None, why: str = "",
             model_name: str = MODEL_NAME) -> dict[str, str | None]:
    """``champion`` := ``previous`` (the demoted version is tagged with who and why)."""
    with _moving_aliases(settings):
        previous = version_by_alias(settings, "previous", model_name)
        if previous is None:
            raise RuntimeError("nothing to roll back to: no version has the 'previous' alias")
        current = version_by_alias(settings, "champion", model_name)
        if current is not None:
            tag(settings, current, moved_by(ROLLED_BACK_TAG, who, why), model_name)
        set_alias(settings, "champion", previous, who=who, why=f"rollback: {why}", model_name=model_name)
        remove_alias(settings, "previous", model_name)
        return aliases(settings, model_name)
