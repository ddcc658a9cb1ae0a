"""The Feast bridge: build the store from settings, apply the repo, materialize, read features.

recloop never imports ``feature_repo/``; Feast parses it (as ``feast apply`` does) and recloop looks
objects up by name (``ranking_v1``). The configuration is built from ``Settings`` so that switching
the online store to Redis is one setting (``RECLOOP_FEAST_ONLINE_STORE=redis``).

Each ``RECLOOP_HOME`` owns its Feast state: the registry file and the SQLite online store are resolved
under the home when Feast is configured, and ``apply_repo`` first forgets tables a copied registry
recorded in another home (see ``forget_other_homes_tables``), so no home's apply can tear down another's.

Example::

    store = feature_store(settings)
    apply_repo(settings)                       # only when the repo or RECLOOP_HOME changed
    materialize(settings, end=datetime.now(timezone.utc))
    online_features(settings, {"user_id": [1, 2], "item_id": [7, 9]})
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import logging
import os
import sys
import warnings
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import pandas as pd

from recloop import endpoints
from recloop.features.feast_import import import_feast
from recloop.settings import Settings

if TYPE_CHECKING:
    from recloop.schema import DatasetSpec

FEATURE_SERVICE = "ranking_v1"


def _repo_path(settings: Settings) -> Path:
    repo = settings.feast_repo
    if not repo.is_absolute() and not repo.exists():
        # Installed elsewhere than the checkout: fall back to the repo next to the package sources.
        candidate = Path(__file__).resolve().parents[3] / "feature_repo"
        repo = candidate if candidate.exists() else repo
    if not (repo / "feature_store.yaml").exists():
        raise FileNotFoundError(f"no Feast repository at {repo} (set RECLOOP_FEAST_REPO)")
    return repo.resolve()


def redis_connection_string(url: str, limits: endpoints.Limits | None = None) -> str:
    """``redis://host:port/db`` → Feast's ``host:port,db=N`` (with our connect and read timeouts)."""
    parsed = urlparse(url)
    db = parsed.path.strip("/") or "0"
    extra = f",password={parsed.password}" if parsed.password else ""
    return (f"{parsed.hostname or '127.0.0.1'}:{parsed.port or 6379},db={db}{extra}"
            f"{endpoints.feast_redis_options(limits or endpoints.Limits())}")


def _online_db(settings: Settings) -> Path:
    """The SQLite online store of this home (when the online store is SQLite)."""
    return settings.home.resolve() / "feast" / "online.db"


def _registry_file(settings: Settings) -> Path | None:
    """The registry file of this home, or None for a SQL registry."""
    if settings.feast_registry.startswith(("postgresql", "mysql", "sqlite")):
        return None
    return Path(settings.feast_registry) if settings.feast_registry else settings.home.resolve() / "feast" / "registry.db"


def repo_config(settings: Settings):
    """Feast's RepoConfig for these settings (the same as feature_store.yaml for the defaults)."""
    import_feast()
    from feast.repo_config import RepoConfig

    from recloop.features import offline_store

    home = settings.home.resolve()
    if settings.feast_online_store == "redis":
        online = {"type": "redis",
                  "connection_string": redis_connection_string(settings.redis_url, endpoints.limits_for(settings))}
    else:
        online = {"type": "sqlite", "path": str(_online_db(settings))}
    registry_file = _registry_file(settings)
    if registry_file is None:
        registry = {"registry_type": "sql", "cache_ttl_seconds": 60,
                    "path": endpoints.with_connect_timeout(settings.feast_registry, endpoints.limits_for(settings))}
    else:
        registry = str(registry_file)
    (home / "feast").mkdir(parents=True, exist_ok=True)
    return RepoConfig(project="recloop", provider="local", registry=registry, online_store=online,
                      offline_store={"type": offline_store.TYPE}, entity_key_serialization_version=3,
                      repo_path=str(_repo_path(settings)))


def _environment(settings: Settings) -> None:
    """What the repo definitions and YAML read: an absolute RECLOOP_HOME (and the Redis address)."""
    os.environ["RECLOOP_HOME"] = str(settings.home.resolve())
    os.environ["RECLOOP_FEAST_REDIS"] = redis_connection_string(settings.redis_url, endpoints.limits_for(settings))


def require_services(settings: Settings) -> None:
    """The services this home's Feast configuration reaches (a SQL registry, a Redis online store)
    answer, or ``endpoints.ServiceUnavailable`` within seconds naming the one that does not."""
    limits = endpoints.limits_for(settings)
    if _registry_file(settings) is None:
        endpoints.probe("the Feast registry database", settings.feast_registry, limits)
    if settings.feast_online_store == "redis":
        endpoints.require_redis(settings.redis_url, limits)


def feature_store(settings: Settings):
    import_feast()
    from feast import FeatureStore

    _environment(settings)
    if _registry_file(settings) is None:
        endpoints.probe("the Feast registry database", settings.feast_registry, endpoints.limits_for(settings))
    return FeatureStore(config=repo_config(settings), repo_path=str(_repo_path(settings)))


FEAST_VALUE_TYPES = {"int64": "INT64", "int32": "INT32", "string": "STRING"}


def entities_file(settings: Settings) -> Path:
    """The entities the repo's definitions generate (``feature_repo/feature_definitions.py`` reads it)."""
    return settings.home.resolve() / "feast" / "entities.json"


def write_entities(settings: Settings, spec: DatasetSpec | None = None) -> dict:
    """Write the spec's entities for the repo: per kind (``user``, ``item``) the join key and its value type.

    Without a spec, the home's (``recloop.datasets``). Returns what was written.
    """
    from recloop import datasets
    from recloop.features.definition import ENTITY_PREFIXES

    spec = spec or datasets.resolve(settings, None, remember=False)
    entities = {}
    for role, prefix in ENTITY_PREFIXES.items():
        key = getattr(spec, role)
        if key:
            entities[prefix] = {"join_key": key, "value_type": FEAST_VALUE_TYPES[spec.column(key).dtype]}
    target = entities_file(settings)
    target.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(entities, indent=2, sort_keys=True) + "\n"
    if not target.is_file() or target.read_text() != text:
        staged = target.with_name(".entities.json.tmp")
        staged.write_text(text)
        os.replace(staged, target)
    return entities


def join_keys(settings: Settings) -> dict[str, str]:
    """``{"user": <join key>, "item": <join key>}`` as last applied (the home's spec before any apply)."""
    path = entities_file(settings)
    entities = json.loads(path.read_text()) if path.is_file() else write_entities(settings)
    return {prefix: entry["join_key"] for prefix, entry in entities.items()}


def _fingerprint(settings: Settings) -> str:
    repo = _repo_path(settings)
    digest = hashlib.sha256(str(settings.home.resolve()).encode())
    digest.update(entities_file(settings).read_bytes() if entities_file(settings).is_file() else b"")
    digest.update(settings.feast_online_store.encode())
    for path in sorted(repo.glob("*.py")) + sorted(repo.glob("*.yaml")):
        digest.update(path.name.encode() + path.read_bytes())
    return digest.hexdigest()


def apply_repo(settings: Settings, spec: DatasetSpec | None = None, force: bool = False) -> bool:
    """``feast apply`` for the repo, when it, the spec's entities or the settings changed since the last apply.

    The entities, join keys and views follow the spec (``write_entities``; without one, the home's).
    Returns whether it applied.
    """
    import_feast()
    from feast.repo_operations import apply_total

    write_entities(settings, spec)
    marker = settings.home.resolve() / "feast" / "applied.sha256"
    fingerprint = _fingerprint(settings)
    if not force and marker.exists() and marker.read_text() == fingerprint:
        return False
    require_services(settings)
    _environment(settings)
    forget_other_homes_tables(settings)
    repo = _repo_path(settings)
    for path in repo.glob("*.py"):  # definitions read RECLOOP_HOME at import: import them afresh
        sys.modules.pop(path.stem, None)
    cwd = os.getcwd()
    sys.path.insert(0, str(repo))  # Feast imports the definitions by module name, as its CLI does
    # The sources are glob paths (one parquet file per hour), which Feast's existence check cannot
    # resolve; it says so at WARNING level although DuckDB reads them fine.
    source_logger = logging.getLogger("feast.infra.offline_stores.file_source")
    level = source_logger.level
    source_logger.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stdout(io.StringIO()):  # apply_total prints a plan meant for the CLI
            apply_total(repo_config(settings), repo, skip_source_validation=False)
    finally:
        source_logger.setLevel(level)
        os.chdir(cwd)  # apply_total changes directory into the repo
        sys.path.remove(str(repo))
    marker.write_text(fingerprint)
    return True


def forget_other_homes_tables(settings: Settings) -> list[str]:
    """Drop from this home's registry file the SQLite online tables that live in another home.

    Feast's registry records each SQLite online table with its absolute path, and ``apply`` tears down
    a recorded table whose path differs from the configured one. A registry copied with its home (a
    backup restored elsewhere, a copy to experiment in) names the original's tables: applying it would
    delete the original's online store while its server still reads it. The entries are removed from
    the record only (the tables themselves are never touched); ``apply`` then creates this home's own.
    Everything else in the registry (definitions, materialization intervals) is kept.

    Returns:
        The paths of the tables forgotten.
    """
    import_feast()
    from feast.protos.feast.core.Registry_pb2 import Registry as RegistryProto

    registry_file = _registry_file(settings)
    if registry_file is None or not registry_file.exists():
        return []
    proto = RegistryProto.FromString(registry_file.read_bytes())
    own = str(_online_db(settings))
    kept, foreign = [], []
    for infra_object in proto.infra.infra_objects:
        is_other_home = infra_object.HasField("sqlite_table") and infra_object.sqlite_table.path != own
        (foreign if is_other_home else kept).append(infra_object)
    if not foreign:
        return []
    del proto.infra.infra_objects[:]
    proto.infra.infra_objects.extend(kept)
    staged = registry_file.with_name(f".{registry_file.name}.tmp")
    with open(staged, "wb") as handle:
        handle.write(proto.SerializeToString())
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(staged, registry_file)
    return sorted({f"{o.sqlite_table.path}:{o.sqlite_table.name}" for o in foreign})


def materialize(settings: Settings, end: datetime, ttl: timedelta, since: datetime | None = None) -> list[str]:
    """Load entity state rows up to ``end`` into the online store, incrementally per view.

    Each view continues from where its last materialization ended; the first one starts at
    ``end - ttl`` (older rows are expired by the views' TTL anyway). ``since``: the earliest time whose
    rows the feature job wrote again for late events (periods that were already loaded: their corrected rows
    are loaded again from there, when the rebuild reached the last load's end). Returns the views loaded.
    """
    from recloop.features import offline_store

    require_services(settings)
    store = feature_store(settings)
    loaded = []
    for projection in store.get_feature_service(FEATURE_SERVICE).feature_view_projections:
        view = store.get_feature_view(projection.name)
        start = view.most_recent_end_time or (end - ttl)
        if start.tzinfo is None:
            start = start.replace(tzinfo=UTC)
        if since is not None and end >= start:  # (a rebuild that stopped short of the last load: left to the
            start = min(start, max(since, end - ttl))  # run that completes it, never older rows over newer ones)
        if start >= end:
            continue
        if settings.feast_online_store == "redis":
            _materialize_redis(settings, store, view, start, end)
        else:
            try:
                with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)  # ibis 12 on DuckDB 2.0
                    store.materialize(start_date=start, end_date=end, feature_views=[view.name])
            finally:
                offline_store.release()
        loaded.append(view.name)
    return loaded


def _materialize_redis(settings: Settings, store, view, start: datetime, end: datetime) -> int:
    """Our pipelined writer (see online_writer.py), then record the interval in Feast's registry."""
    import pyarrow as pa
    import pyarrow.dataset as ds

    from recloop.features.online_writer import write_to_redis

    [join_key] = [column.name for column in view.entity_columns]
    folder = Path(view.batch_source.path).parent
    features = [f.name for f in view.features]
    timestamp = ds.field("event_timestamp")
    table = ds.dataset(folder, format="parquet").to_table(
        columns=[join_key, "event_timestamp", *features],
        filter=(timestamp >= pa.scalar(start, pa.timestamp("us", tz="UTC")))
        & (timestamp < pa.scalar(end, pa.timestamp("us", tz="UTC"))),
    )
    client = endpoints.redis_client(settings.redis_url, endpoints.limits_for(settings))
    written = write_to_redis(client, project=store.project, view=view.name, join_key=join_key, table=table,
                             features=features)
    store.registry.apply_materialization(view, store.project, start, end)
    return written


def historical_features(settings: Settings, entity_rows: pd.DataFrame) -> pd.DataFrame:
    """Point-in-time features of ``ranking_v1`` for ``entity_rows`` (``user_id``, ``item_id``,
    ``event_timestamp``), one output row per input row, in input order.

    Feast's file offline store silently drops entity rows whose key exists in the source but has no
    feature row valid at that time; those come back here with nulls, so row counts always hold.
    """
    from recloop.features import offline_store

    store = feature_store(settings)
    rows = entity_rows.reset_index(drop=True).copy()
    rows["_row"] = range(len(rows))
    service = store.get_feature_service(FEATURE_SERVICE)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # ibis 12 on DuckDB 2.0
            result = store.get_historical_features(entity_df=rows, features=service).to_df()
    finally:
        offline_store.release()
    merged = rows[["_row"]].merge(result.drop(columns=[c for c in rows.columns if c != "_row"], errors="ignore"),
                                  on="_row", how="left")
    if len(merged) != len(rows):
        raise RuntimeError(f"point-in-time join returned {len(merged)} rows for {len(rows)} entity rows")
    return merged.drop(columns="_row")


def online_features(settings: Settings, entities: dict[str, list]) -> pd.DataFrame:
    """The online store's current ``ranking_v1`` features for ``{"user_id": [...], "item_id": [...]}``."""
    store = feature_store(settings)
    service = store.get_feature_service(FEATURE_SERVICE)
    return store.get_online_features(features=service, entity_rows=_rows(entities)).to_df()


def _rows(entities: dict[str, list]) -> list[dict]:
    lengths = {len(v) for v in entities.values()}
    if len(lengths) != 1:
        raise ValueError("every entity key list must have the same length")
    return [dict(zip(entities, values, strict=True)) for values in zip(*entities.values(), strict=True)]
