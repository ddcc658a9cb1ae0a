"""Configuration files: YAML or JSON of a frozen dataclass's fields, type-checked, unknown keys refused.

The gate's thresholds, the canary's guardrails and the monitor's settings are all read this way, so a
typo in a key or a value of the wrong type is one clear error naming the file, not a silent default.

Example::

    thresholds = load_dataclass("gate.yaml", GateThresholds)   # {min_auc: 0.6} → GateThresholds(min_auc=0.6, ...)
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A configuration file that cannot be read as the configuration it is meant to be."""


def load_dataclass(path: str | Path, cls: type[T]) -> T:
    """The dataclass ``cls`` from a YAML/JSON mapping of its fields; fields left out keep their defaults."""
    import yaml
    from pydantic import TypeAdapter, ValidationError

    try:
        raw = yaml.safe_load(Path(path).read_text(encoding="utf-8")) or {}
    except yaml.YAMLError as err:
        raise ConfigError(f"{path} is not valid YAML: {yaml_problem(err)}") from err
    except UnicodeDecodeError as err:
        raise ConfigError(f"{path} is not UTF-8 text (byte {err.start})") from err
    except OSError as err:
        raise ConfigError(f"{path}: {err.strerror or err}") from err
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: expected a mapping of {cls.__name__} fields, got {type(raw).__name__}")
    known = {field.name for field in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ConfigError(f"{path}: unknown {cls.__name__} settings {unknown}; known: {sorted(known)}")
    not_numbers = sorted(name for name, value in raw.items() if _has_nan(value))
    if not_numbers:  # NaN compares false with everything: a NaN threshold switched its check off
        raise ConfigError(f"{path}: {not_numbers}: NaN is not a setting (write the number, or null where "
                          "the setting may be off)")
    try:
        return TypeAdapter(cls).validate_python(raw)
    except ValidationError as err:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        raise ConfigError(f"{path}: {problems}") from err
    except ValueError as err:  # the dataclass's own checks of its values together (``__post_init__``)
        raise ConfigError(f"{path}: {err}") from err


def _has_nan(value) -> bool:
    """YAML's ``.nan``, or text pydantic would read as NaN (``NaN``, ``nan``), in a value or a list of them."""
    if isinstance(value, list | tuple):
        return any(_has_nan(v) for v in value)
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            return False
    return isinstance(value, float) and math.isnan(value)


def yaml_problem(err: Exception) -> str:
    """A YAML parser's error in one line: what it found and where (its report spans five lines with a caret)."""
    mark = getattr(err, "problem_mark", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
    problem = getattr(err, "problem", None) or " ".join(str(err).split())
    return f"{problem}{where}"
