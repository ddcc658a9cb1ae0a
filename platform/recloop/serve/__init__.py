"""The serving API: FastAPI app, request features, model hot-swap, journal, metrics, canary controller."""
