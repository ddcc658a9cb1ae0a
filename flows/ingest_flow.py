"""Ingest what is new in the landing zone into the lake (scheduled with each retrain, or by hand)."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import log, markdown_table, publish, run_name, settings_from


@task(retries=2, retry_delay_seconds=10, persist_result=True, result_serializer="json")
def ingest_task(spec: str | None, settings: dict | None) -> dict:
    summary = pipeline.ingest_new(settings_from(settings), spec).to_dict()
    summary.pop("files_detail")
    return summary


@flow(name="ingest", flow_run_name=lambda: run_name("ingest"), log_prints=True)
def ingest_flow(spec: str | None = None, settings: dict | None = None) -> dict:
    summary = ingest_task(spec, settings)
    log("%s files ingested, %s skipped (seen before); %s rows landed, %s quarantined", summary["files_ingested"],
        summary["files_skipped"], summary["rows_landed"], summary["rows_quarantined"])
    publish("ingest", markdown_table([{k: summary[k] for k in (
        "files", "files_ingested", "files_skipped", "rows_in", "rows_landed", "rows_quarantined", "seconds")}]),
        "files and rows ingested")
    return summary
