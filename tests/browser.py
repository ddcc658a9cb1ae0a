"""Pages opened in a real browser: Debian's headless Chromium (``.ci/run`` installs it), no driver.

``render(url, screenshot)`` runs ``chromium --dump-dom`` after the page's scripts ran (a virtual-time budget:
the page's timers and requests complete before the DOM is read) and saves a screenshot; tests assert on the
rendered DOM. Each run gets a fresh profile folder and no network beyond what the page asks for.
"""

from __future__ import annotations

import html
import os
import re
import subprocess
import tempfile
from pathlib import Path

CHROMIUM = Path("/usr/bin/chromium")
FLAGS = ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--hide-scrollbars", "--mute-audio")


def _chromium(url: str, *args: str, budget_ms: int, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="recloop-chromium-") as profile:
        # A clean environment: the browser inherits nothing of the test process's (Prefect's, torch's, a
        # session bus it cannot reach), which hung it under pytest while the same command ran in 9 s outside.
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": profile, "LANG": "C.UTF-8"}
        return subprocess.run([str(CHROMIUM), *FLAGS, f"--user-data-dir={profile}", "--window-size=1400,1800",
                               f"--virtual-time-budget={budget_ms}", *args, url], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=timeout, check=False, env=env)


def render(url: str, screenshot: Path, budget_ms: int = 15_000, timeout: float = 90.0) -> str:
    """The page's DOM after its scripts ran (``--dump-dom``), and a PNG of it at ``screenshot``."""
    done = _chromium(url, f"--screenshot={screenshot}", "--dump-dom", budget_ms=budget_ms, timeout=timeout)
    assert done.returncode == 0 and "<html" in done.stdout, (url, done.returncode, done.stderr[-2000:])
    assert screenshot.is_file(), (url, done.stderr[-2000:])
    return done.stdout


def text(dom: str) -> str:
    """The visible text of a DOM dump: tags, scripts and styles out, entities decoded, spaces collapsed."""
    body = re.sub(r"<(script|style|noscript)\b.*?</\1>", " ", dom, flags=re.S | re.I)
    body = re.sub(r"<[^>]+>", " ", body)
    return re.sub(r"\s+", " ", html.unescape(body)).strip()
