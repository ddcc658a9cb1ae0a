"""The serving API's documentation pages work offline: Swagger UI and ReDoc load their files from the app."""

from __future__ import annotations

import re

import pytest


@pytest.mark.parametrize("page", ["/docs", "/redoc"])
def test_the_docs_pages_load_every_file_from_the_app_itself(settings, page):
    """FastAPI's own /docs loads Swagger UI from a CDN (cdn.jsdelivr.net): a blank page on a host without
    internet access. Every script and stylesheet the page names is a path of this app, and it answers."""
    from fastapi.testclient import TestClient

    from recloop.serve.app import create_app

    client = TestClient(create_app(settings))  # no lifespan: the pages need no model
    html = client.get(page).text
    assets = re.findall(r"""(?:src|href)=["']?([^"' >]+)""", html) + re.findall(r"url: ?['\"]([^'\"]+)", html)
    assert assets, html
    assert not [a for a in assets if "://" in a or a.startswith("//")], assets  # nothing from elsewhere
    scripts = [a for a in assets if a.endswith(".js")]
    assert scripts and all(client.get(a).status_code == 200 for a in assets if a.endswith((".js", ".css"))), assets
    assert client.get("/openapi.json").json()["paths"]["/rank"]
