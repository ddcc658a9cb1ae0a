"""The dataset spec: which columns an event has, what each one means, and what values are valid.

A spec is a YAML file, validated when it is loaded, so a user can bring their own data by writing one.
Two ship with recloop: ``synthetic`` (the simulator's events) and ``criteo`` (Criteo display-ads logs).

Every column has a *role*:

============  =====================================================================
role          meaning
============  =====================================================================
event_id      unique id of the event (exactly one column)
timestamp     when it happened, UTC (exactly one column)
label         the training target, 0/1 (exactly one column)
user_key      entity key of the user (at most one)
item_key      entity key of the item (at most one)
categorical   a categorical feature (one id per event)
multi_hot     a list of categorical ids (for example a history of items)
numeric       a numeric feature
oracle        known ground truth (the simulator's click probability); never a feature
============  =====================================================================

Example::

    spec = load_spec("synthetic")          # a shipped spec, or a path to your own YAML file
    spec.event_id, spec.timestamp          # ('event_id', 'ts')
    [c.name for c in spec.by_role("categorical")]
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from recloop.config_files import yaml_problem

Role = Literal[
    "event_id", "timestamp", "label", "user_key", "item_key", "categorical", "multi_hot", "numeric", "oracle"
]
DType = Literal["string", "int8", "int32", "int64", "float32", "float64", "bool", "timestamp", "list<int64>"]

FLOAT_DTYPES = ("float32", "float64")
TimestampFormat = Literal["iso", "epoch_s", "epoch_ms", "epoch_us"]
EPOCH_UNITS = {"epoch_s": 1_000_000, "epoch_ms": 1_000, "epoch_us": 1}  # microseconds per unit
_SINGLE_ROLES = ("event_id", "timestamp", "label")
_AT_MOST_ONE_ROLES = ("user_key", "item_key")
# Never missing: an event without its id, time or label cannot be trained on, and the feature job ranks
# the user and item keys to join each event to its entity's state (a null key has no rank).
_NOT_NULLABLE_ROLES = _SINGLE_ROLES + _AT_MOST_ONE_ROLES
_ROLE_DTYPES: dict[str, tuple[str, ...]] = {
    "event_id": ("string",),
    "timestamp": ("timestamp",),
    "label": ("int8", "int32", "int64", "bool"),
    "user_key": ("int64", "int32", "string"),
    "item_key": ("int64", "int32", "string"),
    "multi_hot": ("list<int64>",),
    "numeric": ("int8", "int32", "int64", "float32", "float64"),
    "oracle": ("float32", "float64"),
}


class SpecError(ValueError):
    """A spec file is missing, is not valid YAML, or does not describe a usable dataset."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


@lru_cache(maxsize=256)
def compile_pattern(pattern: str) -> re.Pattern:
    """A spec's ``pattern`` as Python compiles it for serving and for what RE2 cannot run at ingestion:
    ASCII classes (``re.ASCII``), as RE2's, so that both judge a value alike (Python's ``\\d`` also takes
    other scripts' digits, which ingestion quarantines)."""
    return re.compile(pattern, re.ASCII)


class ColumnSpec(_Frozen):
    """One column of the event table.

    Args:
        name: column name as it appears in the files.
        role: what the column means (see the module docstring).
        dtype: the type values are converted to on ingestion.
        nullable: whether a missing value is allowed (the event id, timestamp, label and the user and
            item keys never are).
        min, max: inclusive bounds for numbers; ISO dates or datetimes for the timestamp. A ``numeric``
            column is a model input and needs both: no value the model sees is unbounded.
        allowed: the only values permitted (for example ``[0, 1]`` for a label).
        pattern: a regular expression every string value must match in full. ``\\d``, ``\\w``, ``\\s`` and
            ``\\b`` are ASCII (RE2's meaning, which ingestion runs it with; serving matches the same way).
        separator: how a ``list<int64>`` value is written in text formats (CSV), e.g. ``"3|17|42"``.
        allow_non_finite: for float columns, let NaN and ±infinity land; by default such a value is
            quarantined (``non_finite:<column>``): one infinite price turns a whole training run into NaN.
        format: for a timestamp column, how the files write it: ``iso`` (ISO 8601 text, or the file
            format's own timestamp type; the default), ``epoch_s``, ``epoch_ms`` or ``epoch_us`` (numbers
            since 1970-01-01 UTC, as integers or text).
        vocabulary: for a ``multi_hot`` column, the categorical or key column whose vocabulary its ids share
            (a history of items → the item key); by default the list has a vocabulary of its own (genres
            are not items).
        integral_floats: for an integer column, accept a float written with a zero fraction (``2015.0``,
            common in CSVs exported by pandas) as that integer; ``2015.5`` is still quarantined. Default:
            the spec's ``integral_floats``.
        scale: for a ``numeric`` column, how the model sees it before standardization: ``log`` (log1p; a
            column whose ``min`` is below zero gets the signed sign(x)·log1p(|x|)), ``linear`` (as written), or
            ``auto`` (the default): ``log`` when ``min`` is at least zero, else ``linear``. Counts with heavy tails
            (Criteo's I1–I13: mostly under 10, a few in the tens of thousands, -1 as a sentinel) want ``log``:
            standardized as written, one large count sits 60 standard deviations out and the rest near zero.
    """

    name: str
    role: Role
    dtype: DType
    nullable: bool = False
    min: float | str | None = None
    max: float | str | None = None
    allowed: list[int | float | str | bool] | None = None
    pattern: str | None = None
    separator: str = "|"
    allow_non_finite: bool = False
    format: TimestampFormat | None = None
    integral_floats: bool | None = None
    vocabulary: str | None = None
    scale: Literal["auto", "log", "linear"] = "auto"
    description: str = ""

    @property
    def non_negative(self) -> bool:
        """Whether the spec bounds the column's values below at zero or above."""
        return self.min is not None and not isinstance(self.min, str) and float(self.min) >= 0

    @property
    def log_scale(self) -> bool:
        """Whether a numeric column is log-transformed as a model input (``scale``)."""
        return self.scale == "log" or (self.scale == "auto" and self.non_negative)

    @field_validator("pattern")
    @classmethod
    def _pattern_compiles(cls, value: str | None) -> str | None:
        if value is not None:
            try:
                compile_pattern(value)
            except re.error as err:
                raise ValueError(f"pattern {value!r} is not a valid regular expression: {err}") from err
        return value

    @model_validator(mode="after")
    def _consistent(self) -> ColumnSpec:
        allowed_dtypes = _ROLE_DTYPES.get(self.role)
        if allowed_dtypes and self.dtype not in allowed_dtypes:
            raise ValueError(f"column {self.name!r}: role {self.role} needs dtype in {allowed_dtypes}, not {self.dtype}")
        if self.role in _NOT_NULLABLE_ROLES and self.nullable:
            why = " (features join each event to its entity by this key)" if self.role in _AT_MOST_ONE_ROLES else ""
            raise ValueError(f"column {self.name!r}: the {self.role} column cannot be nullable{why}")
        if self.dtype == "timestamp":
            bounds = [None if b is None else _parse_utc(b, f"column {self.name!r} bound") for b in (self.min, self.max)]
        elif isinstance(self.min, str) or isinstance(self.max, str):
            raise ValueError(f"column {self.name!r}: min/max must be numbers for dtype {self.dtype}")
        else:
            bounds = [self.min, self.max]
        if None not in bounds and bounds[0] > bounds[1]:  # every row would be quarantined as out of range
            raise ValueError(f"column {self.name!r}: min {self.min} is above max {self.max}")
        if self.pattern is not None and self.dtype != "string":
            raise ValueError(f"column {self.name!r}: pattern only applies to string columns")
        if self.vocabulary is not None and self.role != "multi_hot":
            raise ValueError(f"column {self.name!r}: vocabulary only applies to multi_hot columns")
        if self.format is not None and self.dtype != "timestamp":
            raise ValueError(f"column {self.name!r}: format only applies to timestamp columns")
        if self.integral_floats is not None and self.dtype not in ("int8", "int32", "int64", "list<int64>"):
            raise ValueError(f"column {self.name!r}: integral_floats only applies to integer columns")
        if self.allow_non_finite and self.dtype not in FLOAT_DTYPES:
            raise ValueError(f"column {self.name!r}: allow_non_finite only applies to float columns")
        if self.scale != "auto" and self.role != "numeric":
            raise ValueError(f"column {self.name!r}: scale only applies to numeric columns")
        if self.role == "numeric" and (self.min is None or self.max is None):
            raise ValueError(f"column {self.name!r}: a numeric column is a model input and needs both min and max")
        return self

    def timestamp_bounds(self) -> tuple[datetime | None, datetime | None]:
        """(min, max) of a timestamp column as aware UTC datetimes."""
        return (
            _parse_utc(self.min, "min") if self.min is not None else None,
            _parse_utc(self.max, "max") if self.max is not None else None,
        )


class CriteoOptions(_Frozen):
    """How event ids and timestamps are derived for Criteo files, which carry neither.

    A file's day index is read from its name with ``day_pattern`` (``day_3`` → 3; 0 if it does not match);
    its rows are spread evenly over that day, starting at ``start``. The event id is a hash of the row's
    content (its fields joined by tabs), so the same row gives the same id whatever file, name or line it
    arrives in: a file sent again lands nothing twice.
    """

    start: datetime
    day_pattern: str = r"day_(\d+)"

    @field_validator("start")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value if value.tzinfo else value.replace(tzinfo=UTC)


class HistorySpec(_Frozen):
    """A list column the feature job derives from the lake instead of reading it from the files: each event's
    user's newest ``items`` distinct items *before* the event (oldest first, as a history list is written),
    by the rule ``/recommend``'s seen filter applies (``recloop.features.seen``: label-1 rows, or every row of
    a log of items users ``chosen``; within ``RECLOOP_RECOMMEND_SEEN_HISTORY_DAYS``).

    It feeds the ranker and the retriever's user tower as a ``multi_hot`` list sharing the item key's
    vocabulary, so a user is described by what they picked, not only by an id of their own: what a log
    without a history column (ratings, purchases) needs for a user with few events. Serving derives the same
    list from the history file the feature job publishes (``features/seen.parquet``), as of that run; a
    request never gives it.

    Args:
        name: the derived column's name (not a column of the files).
        items: how many of the user's newest items it holds.
    """

    name: str = "recent_items"
    items: int = 20

    @field_validator("items")
    @classmethod
    def _items(cls, value: int) -> int:
        if not 1 <= value <= 500:
            raise ValueError("items must be between 1 and 500")
        return value


class DatasetSpec(_Frozen):
    """A dataset: its columns, how its files are laid out, and how strict ingestion is.

    Args:
        name: short name (used in paths and logs).
        format: ``table`` for parquet or CSV files with named columns; ``criteo_tsv`` for Criteo logs,
            whose fields are the spec's columns minus the derived event id and timestamp: headerless TSV
            (``*.tsv``, ``*.txt``, ``day_N``, optionally ``.gz``) in the spec's order, or a CSV with a header
            or a parquet file naming them.
        columns: the columns, see ``ColumnSpec``.
        on_extra_columns: ``quarantine`` rows of a file that has columns the spec does not know
            (the contract changed upstream: a person should look), or ``ignore`` those columns.
        max_future_seconds: events stamped further than this past the ingest clock are quarantined.
        integral_floats: every integer column accepts ``2015.0`` as ``2015`` (a column's own
            ``integral_floats`` wins); fractional values are quarantined either way.
        criteo: how Criteo files get their derived event id and timestamp (``format: criteo_tsv``).
        events: what a row is. ``shown``: an item put in front of the user (an impression), the label their
            response; ``chosen``: an item the user picked themselves (a rating, a purchase, a play), the label
            whether they liked it. ``/recommend`` orders a ``chosen`` log's items by how likely the user is to
            pick them as well as to like them (``Settings.recommend_retrieval_weight``).
        history: a user-history list derived from the lake (``HistorySpec``), for a log without one;
            ``history: {name: recent_items, items: 20}``.
    """

    name: str
    description: str = ""
    format: Literal["table", "criteo_tsv"] = "table"
    columns: tuple[ColumnSpec, ...]
    on_extra_columns: Literal["quarantine", "ignore"] = "quarantine"
    max_future_seconds: int = 24 * 3600
    integral_floats: bool = False
    criteo: CriteoOptions | None = None
    events: Literal["shown", "chosen"] = "shown"
    history: HistorySpec | None = None

    @model_validator(mode="after")
    def _roles(self) -> DatasetSpec:
        names = [c.name for c in self.columns]
        duplicated = sorted({n for n in names if names.count(n) > 1})
        if duplicated:
            raise ValueError(f"columns listed twice: {duplicated}")
        for role in _SINGLE_ROLES:
            count = sum(c.role == role for c in self.columns)
            if count != 1:
                raise ValueError(f"a spec needs exactly one {role} column, found {count}")
        for role in _AT_MOST_ONE_ROLES:
            if sum(c.role == role for c in self.columns) > 1:
                raise ValueError(f"a spec has at most one {role} column")
        for column in self.by_role("multi_hot"):
            if column.vocabulary is not None and column.vocabulary not in [
                    c.name for c in self.columns if c.role in ("user_key", "item_key", "categorical")]:
                raise ValueError(f"multi_hot {column.name!r} shares the vocabulary of {column.vocabulary!r}, which is "
                                 "not a key or categorical column")
        if self.history is not None:
            if not (self.user_key and self.item_key):
                raise ValueError("history: a derived user history needs a user_key and an item_key column")
            if self.history.name in names:
                raise ValueError(f"history: {self.history.name!r} is a column of the files; a derived history "
                                 "needs a name of its own")
        if self.format == "criteo_tsv" and self.criteo is None:
            raise ValueError("format criteo_tsv needs a 'criteo:' section with the start time")
        return self

    # --- lookups ---------------------------------------------------------------------------------------

    def column(self, name: str) -> ColumnSpec:
        for c in self.columns:
            if c.name == name:
                return c
        raise KeyError(f"spec {self.name!r} has no column {name!r}")

    def accepts_integral_floats(self, column: ColumnSpec) -> bool:
        return self.integral_floats if column.integral_floats is None else column.integral_floats

    def by_role(self, role: Role) -> list[ColumnSpec]:
        return [c for c in self.columns if c.role == role]

    @property
    def history_column(self) -> ColumnSpec | None:
        """The derived history (``history``) as the feature job makes it: a ``multi_hot`` list of item ids."""
        if self.history is None:
            return None
        return ColumnSpec(name=self.history.name, role="multi_hot", dtype="list<int64>", nullable=True,
                          vocabulary=self.item_key, description="derived from the lake: the user's newest items")

    def model_lists(self) -> list[ColumnSpec]:
        """The ``multi_hot`` columns the models read: the files' own, then the derived history."""
        derived = self.history_column
        return [*self.by_role("multi_hot"), *([derived] if derived is not None else [])]

    def _single(self, role: Role) -> str | None:
        found = self.by_role(role)
        return found[0].name if found else None

    @property
    def version(self) -> str:
        """A short digest of everything the spec says: what ingestion makes of a file depends on it (the
        ledger keys files on content + this version, so a fixed spec reads a file again)."""
        import hashlib
        import json

        # a spec without a derived history keeps the digest it had before ``history`` existed
        dumped = self.model_dump(mode="json", exclude={"history"} if self.history is None else None)
        canonical = json.dumps(dumped, sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    @property
    def names(self) -> list[str]:
        return [c.name for c in self.columns]

    @property
    def event_id(self) -> str:
        return self._single("event_id")  # type: ignore[return-value]  # validated: exactly one

    @property
    def timestamp(self) -> str:
        return self._single("timestamp")  # type: ignore[return-value]

    @property
    def label(self) -> str:
        return self._single("label")  # type: ignore[return-value]

    @property
    def user_key(self) -> str | None:
        return self._single("user_key")

    @property
    def item_key(self) -> str | None:
        return self._single("item_key")

    @property
    def file_fields(self) -> list[str]:
        """Columns present in the source files (all but the derived ones for Criteo)."""
        if self.format == "criteo_tsv":
            return [c.name for c in self.columns if c.role not in ("event_id", "timestamp")]
        return self.names


def _parse_utc(value: float | str, what: str) -> datetime:
    if not isinstance(value, str):
        raise ValueError(f"{what}: expected an ISO date or datetime, got {value!r}")
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError as err:
        raise ValueError(f"{what}: {value!r} is not an ISO date or datetime") from err
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=UTC)


def builtin_specs() -> list[str]:
    """Names of the specs that ship with recloop."""
    folder = resources.files("recloop") / "specs"
    return sorted(p.name.removesuffix(".yaml") for p in folder.iterdir() if p.name.endswith(".yaml"))


def is_spec_path(name_or_path: str | Path) -> bool:
    """Whether ``--spec`` names a file rather than a shipped spec: a YAML suffix, a path with a folder in it, or
    an existing file; a shipped name stays a name even where the working directory holds a folder of that name
    (``criteo/``, the data beside the command)."""
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        return True
    shipped = (resources.files("recloop") / "specs" / f"{text}.yaml").is_file() if text and "/" not in text else False
    return not shipped and (path.exists() or "/" in text)


def load_spec(name_or_path: str | Path) -> DatasetSpec:
    """Load and validate a spec: a shipped one by name (``synthetic``, ``criteo``) or a YAML file.

    Raises:
        SpecError: naming the file and every problem found in it.
    """
    path = Path(name_or_path)
    if is_spec_path(name_or_path):
        if path.is_dir():
            raise SpecError(f"spec {path} is a folder, not a YAML file")
        if not path.is_file():
            raise SpecError(f"spec file {path} does not exist")
        try:
            text, source = path.read_text(encoding="utf-8"), str(path)
        except UnicodeDecodeError as err:
            raise SpecError(f"spec file {path} is not UTF-8 text (byte {err.start})") from None
    else:
        resource = resources.files("recloop") / "specs" / f"{name_or_path}.yaml"
        if not resource.is_file():
            raise SpecError(
                f"unknown spec {str(name_or_path)!r}: give a path to a YAML file or one of {builtin_specs()}"
            )
        text, source = resource.read_text(encoding="utf-8"), f"builtin spec {name_or_path}"
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise SpecError(f"{source} is not valid YAML: {yaml_problem(err)}") from err
    if not isinstance(raw, dict):
        raise SpecError(f"{source}: expected a mapping at the top level")
    try:
        return DatasetSpec.model_validate(raw)
    except ValidationError as err:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '(top)'}: {e['msg']}" for e in err.errors()
        )
        raise SpecError(f"{source} is not a valid dataset spec: {problems}") from err
