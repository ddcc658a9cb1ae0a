"""Ingest what is new in the landing zone into the lake (scheduled with each retrain, or by hand)."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import markdown_table, publish
from recloop.settings import Settings


@task(retries=2, retry_delay_seconds=10, persist_result=True)
def ingest_task(spec: str) -> dict:
    return pipeline.ingest_new(Settings(), spec)


@flow(name="ingest", log_prints=True)
def ingest_flow(spec: str = "synthetic") -> dict:
    summary = ingest_task(spec)
    publish("ingest", markdown_table([{k: summary[k] for k in (
        "files", "files_ingested", "files_skipped", "rows_in", "rows_landed", "rows_quarantined", "seconds")}]),
        "files and rows ingested")
    return summary
