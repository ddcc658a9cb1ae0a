"""How long `recloop --help` takes, against the floor of starting Python with the CLI's own libraries
(typer, rich, pydantic-settings) and against importing what the command used to import before any command
ran (pandas via ingest and pandera, numpy via simulate, the dataset specs).

    python benchmarks/cli_startup.py [--repeats 5] [--json out.json]

Target (issue #20): under 1 s.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

from common import ROOT, best_of, machine, report

CASES = {
    "floor: python + typer, rich, settings": "import typer, rich.console, rich.table; import recloop.settings",
    "recloop --help": None,
    "what --help imported before (ingest, simulate, schema, endpoints)": (
        "import typer, rich.console; import recloop.settings, recloop.ingest, recloop.simulate, recloop.schema, "
        "recloop.endpoints"
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", dest="json_path")
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(ROOT / p) for p in ("", "platform", "kernels"))}
    rows = []
    for name, code in CASES.items():
        command = (
            [sys.executable, "-m", "recloop.cli", "--help"] if code is None else [sys.executable, "-c", code]
        )
        seconds = best_of(
            args.repeats,
            lambda command=command: subprocess.run(command, env=env, check=True, capture_output=True),
        )
        rows.append({"case": name, "median s": f"{seconds:.2f}"})
    report("recloop --help start-up", rows, machine(), args.json_path)


if __name__ == "__main__":
    main()
