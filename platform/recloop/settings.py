"""Where recloop keeps its data and which services it talks to, read from the environment.

Every value can be overridden by an environment variable named ``RECLOOP_<FIELD>`` (for example
``RECLOOP_HOME=/data/recloop`` or ``RECLOOP_MLFLOW_TRACKING_URI=http://mlflow:5000``) or by a ``.env``
file in the working directory. The defaults run the whole loop on one machine with embedded services:
everything lives under ``RECLOOP_HOME`` (``./.recloop``).

Example::

    settings = Settings()                      # environment + defaults
    settings.landing_dir                       # PosixPath('.recloop/landing')
    Settings(home="/tmp/rl").lake_events_dir   # PosixPath('/tmp/rl/lake/events')
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, SecretStr, ValidationError, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


class SettingsError(ValueError):
    """A setting (an environment variable ``RECLOOP_<FIELD>``, ``.env``, or a value given in code) that is not
    what its field takes, said in one line naming the variable (pydantic's report took four lines and named a
    field the user never typed)."""


class Settings(BaseSettings):
    """Endpoints, secrets and data locations of one recloop installation.

    Args:
        home: root folder for the landing zone, lake, quarantine and the embedded stores.
        mlflow_tracking_uri: MLflow tracking server or store; empty means SQLite under ``home``.
        mlflow_artifact_uri: where MLflow puts artifacts (``mlflow-artifacts:/recloop`` through a server that
            proxies its object store, or ``s3://...``); empty means the tracking server's default, or files
            under ``home`` without a server.
        prefect_api_url: a Prefect server; empty means Prefect's temporary local server.
        feast_repo: the Feast repository folder (``feature_repo/`` of the checkout by default).
        feast_online_store: ``sqlite`` (a file under ``home``) or ``redis`` (at ``redis_url``).
        feast_registry: Feast registry: empty means a file under ``home``; a ``postgresql://`` URL
            makes it a SQL registry (safe for several processes, as a team's setup needs).
        redis_url: Redis for the Feast online store when it is switched to Redis.
        postgres_dsn: PostgreSQL for MLflow / Prefect / Feast registry when a team runs them there.
        object_store_url, object_store_access_key, object_store_secret_key: an S3-compatible object store.
        frame_backend: ``auto`` (cuDF when a GPU and cuDF are there, pandas otherwise), ``cudf`` or
            ``pandas``.
        admin_token: bearer token for the serving API's admin endpoints (admin endpoints refuse every
            request while it is empty).
        serve_poll_seconds: how often the serving API checks MLflow for moved aliases and canary share.
        serve_torch_threads: intra-op threads per scoring call (requests already run in parallel).
        serve_threads: requests scored at once per serving process (the rest wait their turn).
        feedback_flush_seconds: how often served feedback is written to the landing zone as a file.
        serve_max_body_bytes: the largest request body the serving API reads (larger: 413).
        serve_item_cache_items: items whose online state (Redis, SQLite) a serving process keeps in memory until the
            next materialization writes the store (0: every request reads its items from the store).
        connect_timeout_seconds, request_timeout_seconds, service_retries: how long a call to MLflow,
            Redis, PostgreSQL or Prefect waits to connect and for an answer, and how often it is
            retried, before it fails with one line naming the service (see ``recloop.endpoints``).
        features_engine: ``local`` (the feature job in this process) or ``dask`` (partitions by hash of entity
            key on a Dask cluster: ``dask_scheduler``, or a local cluster of ``dask_workers`` processes).
        dask_scheduler: a Dask scheduler address (``tcp://scheduler:8786``); empty starts a local cluster.
        dask_workers: worker processes of that local cluster.
        dask_partitions: hash partitions of the entity keys, and at most as many period partitions (0: two per
            worker).
        explore_share: the share of (champion-served) requests ranked by a Plackett-Luce draw over the
            model's logits instead of by score, each position's propensity logged in the journal, so a
            candidate's online CTR can be estimated off-policy (IPS / SNIPS / DR) before its canary. 0: off.
        explore_temperature: the draw's temperature (lower: closer to the model's own order).
        journal: where serving replicas keep their journal: ``sqlite`` (a file under ``home``, one host) or
            ``postgres`` (at ``postgres_dsn``, shared by every replica).
        spec: the dataset spec every command and flow uses when none is given (a shipped name or a YAML
            path); empty means the spec this home last worked with, else ``synthetic`` (``recloop.datasets``).
        recommend_candidates: items ``/recommend`` retrieves before filtering and ranking.
        recommend_seen_hours: ``/recommend`` leaves out items the user was shown or clicked within this
            many hours (event time; 0 turns the rule off).
        recommend_retrieval_weight: ``/recommend`` orders by the ranker's probability times the retriever's
            estimate of how likely the user is to pick the item (``Retriever.log_propensity``) to this power
            (0: the ranker's alone). None: 1 when the spec's rows are items users ``chosen`` (ratings,
            purchases), 0 when they are items ``shown`` (``DatasetSpec.events``). The ranker answers "will they
            like it if they meet it"; on a log of choices, what a user goes on to like also depends on which
            items they pick at all, which only the retriever learnt (the test ratings log's recall@10 of
            ``/recommend``: 0.12 and 0.07 by the ranker alone, 0.67 and 0.64 at 1; tests/test_replay.py).
        recommend_seen_history_items, recommend_seen_history_days, recommend_seen_history_all: ``/recommend``
            also leaves out the items the user interacted with in the lake (``recloop.features.seen``, the
            file the feature job writes): each user's newest ``items`` (0 turns the rule off) within the last
            ``days``; label-1 interactions only, or every one with ``all`` (a log in which every row means the
            user has the item, such as ratings). ``all`` None: by the spec, every row of a log of items users
            ``chosen`` (``DatasetSpec.events``), label-1 rows of a log of items ``shown``.
        recommend_category_cap: most items of one category in a ``/recommend`` answer (0: no cap).
        recommend_boosts: category → multiplier of the ranker's score when ``/recommend`` orders
            (``RECLOOP_RECOMMEND_BOOSTS='{"5": 1.2}'``).
        up_prefect_port, up_mlflow_port, up_evidently_port, up_serving_port: the ports ``recloop up`` starts
            the services on (``--prefect-port`` ... override them), so two homes can run side by side; with
            another Prefect port, point ``RECLOOP_PREFECT_API_URL`` at it for the flows.
    """

    model_config = SettingsConfigDict(env_prefix="RECLOOP_", env_file=".env", extra="ignore", frozen=True)

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as err:
            said = "; ".join(_said(e) for e in err.errors())
            raise SettingsError(f"bad setting: {said}") from None

    @field_validator("home", mode="before")
    @classmethod
    def _a_folder(cls, value: Any) -> Any:
        """An empty ``RECLOOP_HOME`` was the working directory (a lake appeared wherever a command ran); a
        file there failed later with NotADirectoryError."""
        if isinstance(value, str | Path) and not str(value).strip():
            raise ValueError("is empty: name a folder (or unset it for ./.recloop)")
        if isinstance(value, str | Path) and Path(value).exists() and not Path(value).is_dir():
            raise ValueError("is a file, not a folder")
        return value

    home: Path = Path(".recloop")
    mlflow_tracking_uri: str = ""
    mlflow_artifact_uri: str = ""
    prefect_api_url: str = ""
    feast_repo: Path = Path("feature_repo")
    feast_online_store: Literal["sqlite", "redis"] = "sqlite"
    feast_registry: str = ""
    redis_url: str = "redis://127.0.0.1:6379/0"
    postgres_dsn: str = "postgresql://postgres@127.0.0.1:5432/recloop"
    object_store_url: str = ""
    object_store_access_key: str = ""
    object_store_secret_key: SecretStr = SecretStr("")
    frame_backend: Literal["auto", "cudf", "pandas"] = "auto"
    admin_token: SecretStr = SecretStr("")
    serve_poll_seconds: float = 2.0
    serve_torch_threads: int = 1
    serve_threads: int = 4
    feedback_flush_seconds: float = 5.0
    serve_max_body_bytes: int = 1 << 20
    serve_item_cache_items: int = Field(default=1_000_000, ge=0)
    connect_timeout_seconds: float = 3.0
    request_timeout_seconds: float = 15.0
    service_retries: int = 2
    features_engine: Literal["local", "dask"] = "local"
    dask_scheduler: str = ""
    dask_workers: int = 2
    dask_partitions: int = 0
    journal: Literal["sqlite", "postgres"] = "sqlite"
    explore_share: float = 0.0
    explore_temperature: float = 1.0
    spec: str = ""
    recommend_candidates: int = Field(default=500, ge=1, le=5000)
    recommend_seen_hours: float = Field(default=24.0, ge=0.0)
    recommend_retrieval_weight: float | None = Field(default=None, ge=0.0, le=10.0)
    recommend_seen_history_items: int = Field(default=500, ge=0)
    recommend_seen_history_days: float = Field(default=365.0, gt=0.0)
    recommend_seen_history_all: bool | None = None
    recommend_category_cap: int = Field(default=3, ge=0)
    recommend_boosts: dict[int, Annotated[float, Field(ge=0.0, allow_inf_nan=False)]] = Field(default_factory=dict)
    up_prefect_port: int = Field(default=4200, ge=1, le=65535)
    up_mlflow_port: int = Field(default=5000, ge=1, le=65535)
    up_evidently_port: int = Field(default=8001, ge=1, le=65535)
    up_serving_port: int = Field(default=8000, ge=1, le=65535)

    @property
    def landing_dir(self) -> Path:
        """Where new event files arrive (simulator output, serving feedback)."""
        return self.home / "landing"

    @property
    def lake_dir(self) -> Path:
        return self.home / "lake"

    @property
    def lake_events_dir(self) -> Path:
        """Landed events as parquet, partitioned ``date=YYYY-MM-DD/``."""
        return self.lake_dir / "events"

    @property
    def quarantine_dir(self) -> Path:
        """Rows that failed validation, with their original values and the reason."""
        return self.home / "quarantine"

    @property
    def ledger_path(self) -> Path:
        """The ingestion ledger (SQLite). Its name starts with ``_`` so dataset readers skip it."""
        return self.lake_dir / "_ledger.sqlite"

    @property
    def serving_dir(self) -> Path:
        """The serving API's journal (requests, feedback) and its cache of downloaded models."""
        return self.home / "serving"

    @property
    def unavailable_items_path(self) -> Path:
        """The catalog's unavailable items (a JSON list of item ids): ``/recommend`` never returns them."""
        return self.home / "catalog" / "unavailable.json"

    def resolved_mlflow_tracking_uri(self) -> str:
        """The tracking URI to use: the configured one, or SQLite under ``home``."""
        if self.mlflow_tracking_uri:
            return self.mlflow_tracking_uri
        return f"sqlite:///{(self.home / 'mlflow.db').resolve()}"


def _said(error: dict) -> str:
    """One failed setting: its variable, its value (short; not shown for a token, password, DSN or secret),
    and why."""
    name = "RECLOOP_" + "_".join(map(str, error["loc"])).upper()
    text = repr(error.get("input"))
    if any(word in name for word in ("TOKEN", "PASSWORD", "DSN", "SECRET")):
        text = "(not shown)"
    elif len(text) > 60:
        text = text[:57] + "..."
    return f"{name}={text}: {error['msg'].removeprefix('Value error, ')}"
