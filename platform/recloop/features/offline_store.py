"""Feast's DuckDB offline store, with its connection released before the interpreter exits.

Feast's ``duckdb`` offline store reads through ibis, which keeps one global DuckDB connection for the life
of the process. Still open at exit, DuckDB's bindings (nanobind) report it on stderr as dozens of lines
(``nanobind: leaked 28 instances!``, `` - leaked instance ... DuckDBPyType``, ``leaked 84 functions!``...)
after every ``feast materialize-incremental``, ``feast get-historical-features`` or recloop command that
read the offline store. ``feature_repo/feature_store.yaml`` and ``recloop.features.store`` name this class
as the offline store, so the ``feast`` CLI loads it too: it is Feast's store unchanged, plus ``release``
(after each use in recloop, and at exit in any process that loaded it) and the filter of ibis's notice
about DuckDB's renamed ``fetch_arrow_table``.
"""

from __future__ import annotations

import atexit
import warnings

from pydantic import StrictStr

from recloop.features.feast_import import import_feast

import_feast()  # before Feast's modules below: without typeguard's instrumentation (feast_import)

from feast.infra.offline_stores.duckdb import DuckDBOfflineStore as _FeastDuckDBOfflineStore  # noqa: E402
from feast.infra.offline_stores.duckdb import DuckDBOfflineStoreConfig as _FeastDuckDBOfflineStoreConfig  # noqa: E402

TYPE = "recloop.features.offline_store.DuckDBOfflineStore"  # what a Feast configuration's offline_store.type says

# ibis 12 calls DuckDB's deprecated fetch_arrow_table on every read: a notice for ibis's authors, not our users.
warnings.filterwarnings("ignore", message=r"fetch_arrow_table\(\) is deprecated", category=DeprecationWarning)


class DuckDBOfflineStoreConfig(_FeastDuckDBOfflineStoreConfig):
    type: StrictStr = TYPE


class DuckDBOfflineStore(_FeastDuckDBOfflineStore):
    """Feast's DuckDB offline store (point-in-time joins over the feature parquet files), unchanged."""


def release() -> None:
    """Disconnect the global DuckDB connection that the offline store leaves in ibis (a later read opens a
    new one)."""
    import ibis

    backend = ibis.options.default_backend
    if backend is not None:
        backend.disconnect()
        ibis.options.default_backend = None


atexit.register(release)
