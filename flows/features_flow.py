"""Build features for everything new and load the Feast online store."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import log, markdown_table, publish, run_name, settings_from


@task(retries=2, retry_delay_seconds=10, persist_result=True, result_serializer="json")
def features_task(spec: str | None, settings: dict | None) -> dict:
    return pipeline.build_features(settings_from(settings), spec).to_dict()


@flow(name="features", flow_run_name=lambda: run_name("features"), log_prints=True)
def features_flow(spec: str | None = None, settings: dict | None = None) -> dict:
    summary = features_task(spec, settings)
    log("features for %s..%s: %s rows, %s hours written", summary["start"], summary["end"], summary["rows"],
        summary["hours_written"])
    publish("features", markdown_table([{k: summary[k] for k in (
        "start", "end", "rows", "state_version", "hours_written", "seconds")}]), "feature window built")
    return summary
