"""Ingestion: landing files (parquet, CSV, Criteo TSV) → the event lake, bad rows → quarantine.

``readers`` split a file into rows, ``validate`` checks rows against the dataset spec, ``ledger``
remembers which files are in, ``lake`` commits outputs atomically, and ``run`` ties them together.
"""

from recloop.ingest.run import FileResult, IngestSummary, discover, ingest

__all__ = ["FileResult", "IngestSummary", "discover", "ingest"]
