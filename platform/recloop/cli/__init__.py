"""The ``recloop`` command (``recloop.cli:app``).

Human-readable output and progress bars go to stderr; with ``--json`` the command prints exactly one JSON
object on stdout, for scripts and flows, errors included. A failure is one line: errors in what the user
asked for exit with code 2, an unreachable service with 3, anything else with 1; ``recloop --debug``
shows the traceback (see ``cli_boundary``). ``recloop gate`` exits 4 when it refuses the candidate.
"""

# isort: off
from recloop.cli import data, models, loop  # noqa: F401 - each registers its commands, in --help's order
# isort: on
from recloop.cli.base import CanaryAction, Device, Drift, Mode, app, main
from recloop.cli.loop import DEMO_WIDTH, demo_table, deployment_result

__all__ = ["DEMO_WIDTH", "CanaryAction", "Device", "Drift", "Mode", "app", "demo_table", "deployment_result", "main"]
