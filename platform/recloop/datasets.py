"""Which dataset spec a command, flow or deployment works with: resolved once, the same rule everywhere.

The spec is, in order: the one given (``--spec``, a flow's ``spec`` parameter; a shipped name such as
``criteo`` or a path to a YAML file of any name), ``RECLOOP_SPEC``, the spec this home last worked with
(a copy kept at ``$RECLOOP_HOME/spec.yaml``), else ``synthetic``. A spec given by path is read once and
copied into the home, so later commands (``recloop retrain``, the scheduled deployments, the drift-triggered
full retrain) use it without being told again, whatever the working directory.

Example::

    spec = resolve(settings, "my_events.yaml")     # loads, validates and remembers it for this home
    spec = resolve(settings, None)                 # later: the same spec
    source(settings, None)                         # a string a flow parameter can carry
"""

from __future__ import annotations

import os
from pathlib import Path

import yaml

from recloop.schema import DatasetSpec, is_spec_path, load_spec
from recloop.settings import Settings

DEFAULT_SPEC = "synthetic"


def home_copy(settings: Settings) -> Path:
    """Where a home keeps the spec it works with."""
    return settings.home.resolve() / "spec.yaml"


def normalized(value: str | Path) -> str:
    """A shipped name as it is; a path made absolute (a flow may run in another directory)."""
    path = Path(value)
    if is_spec_path(value):
        return str(path.expanduser().resolve())
    return str(value)


def source(settings: Settings, spec: str | Path | None = None) -> str:
    """The spec to use as a string (a shipped name or an absolute path): see the module docstring."""
    if spec:
        return normalized(spec)
    if settings.spec:
        return normalized(settings.spec)
    copy = home_copy(settings)
    return str(copy) if copy.is_file() else DEFAULT_SPEC


def resolve(
    settings: Settings, spec: DatasetSpec | str | Path | None = None, remember: bool = True
) -> DatasetSpec:
    """The validated spec (``SpecError`` naming the file and its problems); an explicit or configured one
    is remembered in the home when ``remember``."""
    if isinstance(spec, DatasetSpec):
        return spec
    where = source(settings, spec)
    loaded = load_spec(where)
    if remember and (spec or settings.spec) and where != str(home_copy(settings)):
        keep(settings, loaded)
    return loaded


def keep(settings: Settings, spec: DatasetSpec) -> None:
    """Write ``spec`` as this home's spec (atomically; unchanged content is not rewritten)."""
    text = (
        "# the dataset spec this home works with (written by recloop; pass --spec to change it)\n"
        + yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True), sort_keys=False)
    )
    target = home_copy(settings)
    if target.is_file() and target.read_text(encoding="utf-8") == text:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    staged = target.with_name(".spec.yaml.tmp")
    staged.write_text(text, encoding="utf-8")
    os.replace(staged, target)
