"""A script of ``benchmarks/`` imported as a module (the folder is not a package: its scripts import each other
by name, so it is on the path while one is imported)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def benchmark_script(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` as a module."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
