"""Feast imported once per process without typeguard's instrumentation of its classes.

Feast decorates its definition classes (``Entity``, ``FeatureView``, ``OnDemandFeatureView``, ``DataSource``…)
with typeguard's ``@typechecked``, which re-parses and recompiles each decorated function's source when the
module is imported: about 4.4 of Feast's 7.5 seconds of import on a 2-core host (measured: 7.5 s plain, 3.2 s
this way), paid by every process that touches the feature store (each ``recloop`` command that builds or
publishes features, each serving process reading the online store, each test worker). Those checks guard
callers who build Feast objects by hand with the wrong types; recloop builds them from a validated spec
(``recloop.features.definition``). typeguard itself is unchanged for everything else: the decorator is swapped
only while ``feast`` is first imported. Call ``import_feast()`` before any ``from feast… import`` (a bare one would
import Feast the slow way: ``tests/test_feast.py`` looks for them).
"""

from __future__ import annotations

import sys
from types import ModuleType


def import_feast() -> ModuleType:
    """The ``feast`` package, imported on first use with typeguard's ``typechecked`` as a no-op decorator."""
    if "feast" in sys.modules:
        return sys.modules["feast"]
    try:
        import typeguard
    except ImportError:  # a Feast that no longer uses typeguard: nothing to swap
        import feast

        return feast
    checked = typeguard.typechecked
    typeguard.typechecked = _unchecked
    try:
        import feast
    finally:
        typeguard.typechecked = checked
    return feast


def _unchecked(target=None, **_options):
    """``typechecked`` that leaves its target as it is (bare, or called with options first)."""
    return target if target is not None else (lambda decorated: decorated)
