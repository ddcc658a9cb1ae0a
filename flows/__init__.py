"""recloop's Prefect flows: thin wiring over ``recloop.pipeline`` (no logic lives here).

An importable package (``from flows.retrain_flow import retrain_flow``), installed with recloop; the
deployments in ``prefect.yaml`` name the same files as entrypoints. Every flow takes ``settings``: the
``RECLOOP_*`` settings to use as a JSON object of overrides (the rest come from the environment).
"""
