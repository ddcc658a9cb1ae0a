"""Build features for everything new and load the Feast online store."""

from prefect import flow, task

from recloop import pipeline
from recloop.flow_support import markdown_table, publish
from recloop.settings import Settings


@task(retries=2, retry_delay_seconds=10, persist_result=True)
def features_task(spec: str) -> dict:
    return pipeline.build_features(Settings(), spec)


@flow(name="features", log_prints=True)
def features_flow(spec: str = "synthetic") -> dict:
    summary = features_task(spec)
    publish("features", markdown_table([{k: summary[k] for k in (
        "start", "end", "rows", "state_version", "hours_written", "seconds")}]), "feature window built")
    return summary
