"""Check every row of a source table against the dataset spec, and give each bad row its reasons.

Two steps:

1. **Coerce** each column to the spec's type. Text (CSV, TSV) is parsed; typed values (parquet) are cast.
   A value that cannot be converted becomes null in the typed table and its row gets
   ``invalid_type:<column>``. The fast path is one Arrow cast per column; only when it fails are the
   values examined one by one to find which rows are bad.
2. **Check** the typed values: NaN and ±infinity in float columns (unless the spec allows them), then a
   pandera schema generated from the spec: nulls, ranges, allowed values, patterns, timestamps in the
   future.

Reason codes (a row may have several, joined by ``"; "``)::

    missing_column:<c>     unexpected_column:<c>   invalid_type:<c>   null:<c>
    non_finite:<c>         out_of_range:<c>        not_allowed:<c>    pattern_mismatch:<c>
    future_timestamp:<c>   wrong_field_count:<got>/<expected>   duplicate_event_id
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from datetime import datetime, timedelta

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc

from recloop.formats import ARROW_TYPES
from recloop.schema import EPOCH_UNITS, FLOAT_DTYPES, ColumnSpec, DatasetSpec, compile_pattern

os.environ.setdefault("DISABLE_PANDERA_IMPORT_WARNING", "True")
import pandera.pandas as pandera  # noqa: E402  (after the variable that silences its import warning)

_INT_BOUNDS = {"int8": (-(2**7), 2**7 - 1), "int32": (-(2**31), 2**31 - 1), "int64": (-(2**63), 2**63 - 1)}


def arrow_schema(spec: DatasetSpec) -> pa.Schema:
    """The Arrow schema of landed events: the spec's columns with their types, in the spec's order."""
    return pa.schema([pa.field(c.name, ARROW_TYPES[c.dtype], nullable=c.nullable) for c in spec.columns])


@dataclass
class RowProblems:
    """Reasons collected per row; ``reasons()`` joins them into one string per bad row."""

    num_rows: int

    def __post_init__(self) -> None:
        self._found: list[tuple[np.ndarray, str]] = []  # (row positions, code)
        self.hints: list[str] = []  # what the spec could say to accept rows quarantined here (one per column)

    def add(self, rows: np.ndarray, code: str) -> None:
        rows = np.asarray(rows)
        if rows.dtype == bool:
            rows = np.flatnonzero(rows)
        if len(rows):
            self._found.append((rows.astype(np.int64), code))

    def add_all(self, code: str) -> None:
        self.add(np.arange(self.num_rows), code)

    def rows_with(self, code: str) -> np.ndarray:
        hits = [rows for rows, c in self._found if c == code]
        return np.concatenate(hits) if hits else np.empty(0, dtype=np.int64)

    def bad_mask(self) -> np.ndarray:
        mask = np.zeros(self.num_rows, dtype=bool)
        for rows, _ in self._found:
            mask[rows] = True
        return mask

    def reasons(self) -> np.ndarray:
        """(num_rows,) object array: the joined reasons of each row, None for a good row."""
        out = np.full(self.num_rows, None, dtype=object)
        for rows, code in self._found:
            current = out[rows]
            out[rows] = [code if c is None else f"{c}; {code}" for c in current]
        return out


def check_rows(table: pa.Table, spec: DatasetSpec, now: datetime) -> tuple[pa.Table | None, RowProblems]:
    """Coerce and check ``table`` (original values, columns by name) against ``spec``.

    Returns:
        The typed table (spec schema, one row per input row; unconvertible values null), or None when
        the file's columns do not match the spec, and the problems found per row.
    """
    problems = RowProblems(table.num_rows)
    present = set(table.column_names)
    missing = [name for name in spec.names if name not in present]
    extra = [name for name in table.column_names if name not in set(spec.names)]
    for name in missing:
        problems.add_all(f"missing_column:{name}")
    if extra and spec.on_extra_columns == "quarantine":
        for name in extra:
            problems.add_all(f"unexpected_column:{name}")
    if missing or (extra and spec.on_extra_columns == "quarantine"):
        return None, problems

    columns = {}
    for col in spec.columns:
        typed, bad = coerce_column(col, table[col.name], spec.accepts_integral_floats(col))
        problems.add(bad, f"invalid_type:{col.name}")
        if bad.any():
            hint = type_hint(col, table[col.name], bad)
            if hint:
                problems.hints.append(hint)
        if col.dtype in FLOAT_DTYPES and not col.allow_non_finite:
            typed, non_finite = _drop_non_finite(typed)
            problems.add(non_finite, f"non_finite:{col.name}")
        columns[col.name] = typed
    typed_table = pa.Table.from_arrays(list(columns.values()), schema=arrow_schema(spec).remove_metadata())
    _check_values(typed_table, spec, now, problems)
    return typed_table, problems


# --- coercion ------------------------------------------------------------------------------------------


def coerce_column(col: ColumnSpec, values: pa.ChunkedArray | pa.Array, integral_floats: bool = False
                  ) -> tuple[pa.Array, np.ndarray]:
    """Convert one column to ``col.dtype``. Returns the typed array and a mask of unconvertible rows.

    ``integral_floats``: an integer column accepts text such as ``2015.0`` (a typed float column with whole
    values is always accepted: the conversion loses nothing).

    Timestamps land in the spec's unit, microseconds: a finer one (pandas writes nanoseconds) is truncated
    to the microsecond, toward the past (``...:00.123456789`` → ``...:00.123456``), in files and text alike.
    """
    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if pa.types.is_dictionary(arr.type):
        arr = arr.dictionary_decode()
    target = ARROW_TYPES[col.dtype]
    none_bad = np.zeros(len(arr), dtype=bool)
    if col.dtype == "timestamp" and col.format in EPOCH_UNITS and not pa.types.is_timestamp(arr.type):
        return _from_epoch(arr, EPOCH_UNITS[col.format], target)
    if arr.type == target:
        return arr, none_bad
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), target), none_bad
    is_text = pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type)
    if col.dtype == "string":
        if is_text or pa.types.is_integer(arr.type) or pa.types.is_boolean(arr.type):
            return arr.cast(pa.string()), none_bad
        return _all_bad(arr, target)
    if is_text:
        return _parse_text(col, arr.cast(pa.string()), target, integral_floats)
    if col.dtype == "timestamp":
        if pa.types.is_timestamp(arr.type):  # naive timestamps are taken as UTC
            return _to_micros(arr, target)
        return _all_bad(arr, target)
    if col.dtype == "list<int64>":
        if (pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type)) and pa.types.is_integer(
            arr.type.value_type
        ):
            return _int_lists(arr, target)
        return _all_bad(arr, target)
    if pa.types.is_integer(arr.type) and col.dtype in _INT_BOUNDS:
        return _from_integers(arr, col.dtype, target)
    if col.dtype == "bool" and (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
        # only 0 and 1 are booleans (Arrow's cast reads any non-zero number as true; text "2" is refused)
        return _from_floats(col, arr.cast(pa.float64(), safe=False).to_numpy(zero_copy_only=False), target,
                            present=np.asarray(arr.is_valid()))
    if pa.types.is_integer(arr.type) and col.dtype in FLOAT_DTYPES:
        # The nearest float, as for text: beyond 2**53 (2**24 for float32) not every integer has one of its
        # own, and a float column asks for no more; no int64 is outside float32's range.
        return arr.cast(target, safe=False), none_bad
    if pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type) or pa.types.is_boolean(arr.type):
        try:
            return arr.cast(target), none_bad
        except pa.ArrowInvalid:  # fractional values or out of range for the target: find which rows
            as_float = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)  # floats here: exact in float64
            return _from_floats(col, as_float, target)
    return _all_bad(arr, target)


def _from_integers(arr: pa.Array, dtype: str, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Integers of any width to an integer type; a value outside the type's range is invalid, that row
    alone. Compared as integers: a float64 round trip would refuse (or round) anything beyond 2**53."""
    try:
        return arr.cast(target), np.zeros(len(arr), dtype=bool)
    except pa.ArrowInvalid:
        pass
    low, high = _INT_BOUNDS[dtype]
    present = np.asarray(arr.is_valid())
    unsigned = pa.types.is_unsigned_integer(arr.type)
    values = arr.cast(pa.uint64() if unsigned else pa.int64()).fill_null(0).to_numpy()  # (N,) exact
    ok = present & (values <= high)
    if not unsigned:
        ok &= values >= low
    typed = pa.array(np.where(ok, values, 0).astype(np.int64), mask=~ok).cast(target)
    return typed, present & ~ok


def _int_lists(arr: pa.ListArray, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Lists of integers to ``list<int64>``; a list holding an element beyond int64 (from a uint64 list) is
    invalid, that row alone."""
    try:
        return arr.cast(target), np.zeros(len(arr), dtype=bool)
    except pa.ArrowInvalid:
        pass
    elements = pc.list_flatten(arr).cast(pa.uint64()).fill_null(0).to_numpy()  # only uint64 lists fail the cast
    parents = pc.list_parent_indices(arr).to_numpy()
    bad = np.zeros(len(arr), dtype=bool)
    bad[parents[elements > _INT_BOUNDS["int64"][1]]] = True
    return pc.if_else(pa.array(bad), pa.scalar(None, arr.type), arr).cast(target), bad


def _drop_non_finite(values: pa.Array) -> tuple[pa.Array, np.ndarray]:
    """NaN and ±infinity to null; returns the array and a mask of the rows that held one."""
    non_finite = pc.and_(values.is_valid(), pc.invert(pc.is_finite(values))).fill_null(False)
    mask = np.asarray(non_finite)
    if not mask.any():
        return values, mask
    return pc.if_else(non_finite, pa.scalar(None, values.type), values), mask


def _all_bad(arr: pa.Array, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    return pa.nulls(len(arr), target), np.asarray(arr.is_valid())


def _from_floats(
    col: ColumnSpec, values: np.ndarray, target: pa.DataType, present: np.ndarray | None = None,
    nan_written: np.ndarray | None = None,
) -> tuple[pa.Array, np.ndarray]:
    """Floats to the target type, marking fractional, out-of-range or unparsed (NaN) values bad.

    ``present`` says which rows had a value at all (default: the non-NaN ones); a present value that is
    NaN here failed to parse, unless ``nan_written`` says the text itself was ``nan`` (a float column
    keeps it, for the non-finite check to judge).
    """
    parsed = ~np.isnan(values)
    if nan_written is not None and col.dtype in FLOAT_DTYPES:
        parsed |= nan_written
    present = parsed if present is None else present
    if col.dtype in _INT_BOUNDS:
        low, high = _INT_BOUNDS[col.dtype]
        with np.errstate(invalid="ignore"):  # high + 1 is a power of two, exact as a float; high is not
            ok = parsed & (np.floor(values) == values) & (values >= low) & (values < float(high + 1))
    elif col.dtype == "bool":
        ok = parsed & np.isin(values, (0.0, 1.0))
    else:
        ok = parsed
    with np.errstate(over="ignore"):  # a float64 beyond float32's range is infinite there: judged later
        typed = pa.array(np.where(ok, values, 0), mask=~ok).cast(target)
    return typed, present & ~ok


def _from_epoch(arr: pa.Array, unit_us: int, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Numbers since the epoch (integers, floats or their text) in ``unit_us`` microseconds → timestamps."""
    present = np.asarray(arr.is_valid())
    if pa.types.is_integer(arr.type):  # unchecked: a uint64 beyond int64 is a number too large, that row alone
        values = pc.cast(arr, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    elif pa.types.is_floating(arr.type):
        values = arr.cast(pa.float64()).to_numpy(zero_copy_only=False)
    elif pa.types.is_string(arr.type) or pa.types.is_large_string(arr.type):
        text = pc.utf8_trim_whitespace(arr.cast(pa.string())).to_numpy(zero_copy_only=False)
        values = pd.to_numeric(pd.Series(text, dtype=object), errors="coerce").to_numpy(np.float64, na_value=np.nan)
    else:
        return _all_bad(arr, target)
    micros = values * unit_us
    with np.errstate(invalid="ignore"):
        ok = present & np.isfinite(micros) & (np.abs(micros) < 2**62)
    typed = pa.array(np.where(ok, np.round(np.where(ok, micros, 0)), 0).astype(np.int64), mask=~ok)
    return typed.cast(pa.timestamp("us", tz="UTC")).cast(target), present & ~ok


def _to_micros(arr: pa.Array, target: pa.DataType) -> tuple[pa.Array, np.ndarray]:
    """Typed timestamps (any unit; UTC underneath, whatever the zone) → microseconds, marking the rows that
    cannot be held.

    Nanoseconds are floored to the microsecond (the spec's unit: the extra digits are below what the lake
    keeps, and flooring never moves an event later). Seconds and milliseconds are scaled up exactly; one
    beyond what int64 microseconds hold (about 292,000 years from 1970) is invalid, that row alone.
    """
    unit = arr.type.unit
    if unit == "us":
        return arr.cast(target), np.zeros(len(arr), dtype=bool)
    present = np.asarray(arr.is_valid())
    counts = arr.cast(pa.int64()).fill_null(0).to_numpy()  # (N,) int64, in the file's unit since the epoch
    if unit == "ns":
        micros, ok = counts // 1_000, present
    else:
        scale = {"s": 1_000_000, "ms": 1_000}[unit]
        limit = np.iinfo(np.int64).max // scale
        ok = present & (counts >= -limit) & (counts <= limit)
        micros = np.where(ok, counts, 0) * scale
    return pa.array(micros, pa.int64(), mask=~ok).cast(target), present & ~ok


def type_hint(col: ColumnSpec, values: pa.ChunkedArray | pa.Array, bad: np.ndarray) -> str | None:
    """What the spec could say to accept the values of ``col`` that failed conversion, if it can tell."""
    arr = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    if pa.types.is_nested(arr.type):  # the hints are about numbers and timestamps written as scalars
        return None
    sample = arr.filter(pa.array(bad)).slice(0, 100)
    text = pc.utf8_trim_whitespace(sample.cast(pa.string())).drop_null().to_pylist()
    if not text:
        return None
    if col.dtype == "timestamp" and col.format in (None, "iso"):
        numbers = pd.to_numeric(pd.Series(text, dtype=object), errors="coerce").dropna()
        if len(numbers) == len(text):
            magnitude = float(np.median(np.abs(numbers)))
            unit = ("epoch_s" if magnitude < 1e11 else "epoch_ms" if magnitude < 1e14 else "epoch_us")
            return (f"column {col.name!r} holds numbers such as {text[0]}: if they are {unit.replace('_', ' ')}, "
                    f"add `format: {unit}` to the column in the spec")
    whole = [t for t in text if re.fullmatch(r"[+-]?\d+\.0*", t)]
    if col.dtype in _INT_BOUNDS and whole:
        return (f"column {col.name!r} holds whole numbers written as floats such as {whole[0]}: add "
                "`integral_floats: true` to the column (or the spec) to accept them")
    return None


def _parse_text(col: ColumnSpec, text: pa.Array, target: pa.DataType, integral_floats: bool = False
                ) -> tuple[pa.Array, np.ndarray]:
    stripped = pc.utf8_trim_whitespace(text)
    if integral_floats and col.dtype in _INT_BOUNDS:  # "2015.0" → "2015"; "2015.5" stays and is refused
        stripped = pc.replace_substring_regex(stripped, r"^([+-]?\d+)\.0*$", r"\1")
    present = np.asarray(stripped.is_valid())
    if col.dtype == "list<int64>":
        return _parse_int_lists(col, stripped, present)
    if col.dtype == "bool":
        lowered = pc.utf8_lower(stripped)
        truthy = pc.is_in(lowered, pa.array(["true", "1", "t", "yes"]))
        falsy = pc.is_in(lowered, pa.array(["false", "0", "f", "no"]))
        ok = np.asarray(pc.or_(truthy, falsy).fill_null(False))
        typed = pc.if_else(pa.array(ok), truthy, pa.scalar(None, pa.bool_()))
        return typed, present & ~ok
    try:
        return stripped.cast(target), np.zeros(len(text), dtype=bool)
    except pa.ArrowInvalid:
        pass
    if col.dtype == "timestamp":
        series = pd.Series(stripped.to_numpy(zero_copy_only=False), dtype=object)
        parsed = pd.to_datetime(series, utc=True, errors="coerce", format="ISO8601")
        typed, _ = _to_micros(pa.array(parsed, pa.timestamp("ns", tz="UTC")), target)
        return typed, present & np.asarray(parsed.isna())
    if col.dtype in _INT_BOUNDS:
        # Exact integers: 18 digits always fit in int64; longer ones are out of range for every int type.
        well_formed = np.asarray(pc.match_substring_regex(stripped, r"^[+-]?\d{1,18}$").fill_null(False))
        as_int64 = pc.if_else(pa.array(well_formed), stripped, pa.scalar(None, pa.string())).cast(pa.int64())
        values = as_int64.to_numpy(zero_copy_only=False)
        low, high = _INT_BOUNDS[col.dtype]
        with np.errstate(invalid="ignore"):
            ok = well_formed & (values >= low) & (values <= high)
        typed = pc.if_else(pa.array(ok), as_int64, pa.scalar(None, pa.int64())).cast(target)
        return typed, present & ~ok
    numbers = pd.to_numeric(pd.Series(stripped.to_numpy(zero_copy_only=False), dtype=object), errors="coerce")
    values = numbers.to_numpy(dtype=np.float64, na_value=np.nan)
    nan_written = np.asarray(pc.match_substring_regex(stripped, r"^[+-]?nan$", ignore_case=True).fill_null(False))
    return _from_floats(col, values, target, present, nan_written)


def _parse_int_lists(col: ColumnSpec, text: pa.Array, present: np.ndarray) -> tuple[pa.Array, np.ndarray]:
    """``"3|17|42"`` (the column's separator) to ``[3, 17, 42]``; anything else is invalid.

    Text cannot tell an empty list from a missing one, so an empty field is an empty list (a user with
    no history yet), never null.
    """
    text = text.fill_null("")
    sep = "\\" + col.separator if col.separator in r".^$*+?()[]{}|\\" else col.separator
    item = r"\s*[+-]?\d{1,18}\s*"
    well_formed = np.asarray(pc.match_substring_regex(text, f"^({item}({sep}{item})*)?$").fill_null(False))
    kept = pc.if_else(pa.array(well_formed), text, pa.scalar(None, pa.string()))
    parts = pc.split_pattern(kept, col.separator)
    flat = pc.utf8_trim_whitespace(parts.flatten())
    flat = pc.if_else(pc.equal(flat, ""), pa.scalar(None, pa.string()), flat)  # "" -> []
    values = flat.drop_null().cast(pa.int64())
    keep_counts = pc.list_value_length(parts).fill_null(0).to_numpy() - _nulls_per_list(parts, flat)
    offsets = np.concatenate([[0], np.cumsum(keep_counts)]).astype(np.int32)
    typed = pa.ListArray.from_arrays(pa.array(offsets), values, mask=pa.array(~np.asarray(kept.is_valid())))
    return typed, present & ~well_formed


def _nulls_per_list(parts: pa.ListArray, flat: pa.Array) -> np.ndarray:
    """How many elements of each list became null (empty strings dropped from ``"1||2"`` or ``""``)."""
    parents = pc.list_parent_indices(parts).to_numpy()
    is_null = ~np.asarray(flat.is_valid())
    return np.bincount(parents[is_null], minlength=len(parts))


# --- value checks ----------------------------------------------------------------------------------------


# What a Python datetime holds (years 1-9999), in microseconds since 1970: pandera reports a failing value as a
# Python object, and one beyond these crashed its report (OverflowError), rejecting the file's good rows too.
_DATETIME_MICROS = (-62_135_596_800_000_000, 253_402_300_799_999_999)


def _outside_datetime(table: pa.Table, spec: DatasetSpec, problems: RowProblems) -> pa.Table:
    """Timestamps a Python datetime cannot hold: ``out_of_range`` here, and null for the checks that follow."""
    for col in spec.columns:
        if col.dtype != "timestamp":
            continue
        micros = table[col.name].combine_chunks().cast(pa.int64())
        low, high = _DATETIME_MICROS
        outside = pc.fill_null(pc.or_(pc.less(micros, low), pc.greater(micros, high)), False)
        if pc.any(outside).as_py():
            problems.add(np.flatnonzero(outside.to_numpy(zero_copy_only=False)), f"out_of_range:{col.name}")
            kept = pc.if_else(outside, pa.scalar(None, table[col.name].type), table[col.name].combine_chunks())
            table = table.set_column(table.schema.get_field_index(col.name), col.name, kept)
    return table


def _check_values(table: pa.Table, spec: DatasetSpec, now: datetime, problems: RowProblems) -> None:
    table = _outside_datetime(table, spec, problems)
    scalar_columns = [c for c in spec.columns if c.dtype != "list<int64>"]
    frame = table.select([c.name for c in scalar_columns]).to_pandas(types_mapper=pd.ArrowDtype)
    schema = pandera.DataFrameSchema(
        {c.name: pandera.Column(None, _value_checks(c, spec, now), nullable=c.nullable) for c in scalar_columns}
    )
    try:
        schema.validate(frame, lazy=True)
    except pandera.errors.SchemaErrors as err:
        cases = err.failure_cases.dropna(subset=["index"])
        for (column, check), group in cases.groupby(["column", "check"], sort=True):
            code = "null" if check == "not_nullable" else str(check)
            rows = group["index"].to_numpy(dtype=np.int64)
            if code == "null":  # a value that failed conversion, or was not finite, is null now: it has its reason
                already = [problems.rows_with(f"{c}:{column}") for c in ("invalid_type", "non_finite", "out_of_range")]
                rows = np.setdiff1d(rows, np.concatenate(already))
            problems.add(rows, f"{code}:{column}")
    for col in spec.columns:
        if col.dtype == "list<int64>":
            _check_list_column(col, table[col.name].combine_chunks(), problems)


def _value_checks(col: ColumnSpec, spec: DatasetSpec, now: datetime) -> list[pandera.Check]:
    checks = []
    if col.dtype == "timestamp":
        low, high = col.timestamp_bounds()
        if low is not None:
            checks.append(pandera.Check.ge(pd.Timestamp(low), error="out_of_range"))
        if high is not None:
            checks.append(pandera.Check.le(pd.Timestamp(high), error="out_of_range"))
        if col.role == "timestamp":
            limit = pd.Timestamp(now + timedelta(seconds=spec.max_future_seconds))
            checks.append(pandera.Check.le(limit, error="future_timestamp"))
    elif col.allow_non_finite:  # NaN and ±infinity land as they are: bounds apply to finite values
        low = -np.inf if col.min is None else float(col.min)
        high = np.inf if col.max is None else float(col.max)
        checks.append(pandera.Check(lambda s: _within_or_non_finite(s, low, high), error="out_of_range"))
    else:
        if col.min is not None:
            checks.append(pandera.Check.ge(col.min, error="out_of_range"))
        if col.max is not None:
            checks.append(pandera.Check.le(col.max, error="out_of_range"))
    if col.allowed is not None:
        checks.append(pandera.Check.isin(col.allowed, error="not_allowed"))
    if col.pattern is not None:
        checks.append(pandera.Check(lambda s: _fullmatch(s, col.pattern), error="pattern_mismatch"))
    return checks


def _fullmatch(values: pd.Series, pattern: str) -> pd.Series:
    """Whether each value matches ``pattern`` in full, as serving checks a request (``re.fullmatch``), not
    only at its start (pandera's ``str_matches``); nulls pass (``nullable`` judges them).

    Arrow's RE2 runs it, anchored around a group (``a|b`` is ``^(?:a|b)$``, not ``^a|b$``: pandas' own
    ``fullmatch`` on Arrow strings gets that wrong); a pattern RE2 cannot run (a lookahead, a backreference)
    goes value by value through Python's ``re``, which the spec validated it with.
    """
    text = pa.array(values, pa.string())
    try:
        matched = pc.match_substring_regex(text, f"^(?:{pattern})$")
    except pa.ArrowInvalid:
        compiled = compile_pattern(pattern)
        matched = pa.array([None if v is None else compiled.fullmatch(v) is not None for v in text.to_pylist()],
                           pa.bool_())
    return pd.Series(np.asarray(matched.fill_null(True)), index=values.index)


def _within_or_non_finite(values: pd.Series, low: float, high: float) -> pd.Series:
    floats = values.astype("float64")
    return ~np.isfinite(floats) | ((floats >= low) & (floats <= high))


def _check_list_column(col: ColumnSpec, values: pa.ListArray, problems: RowProblems) -> None:
    """Nulls and element bounds of a multi-hot column (pandera does not look inside lists)."""
    if not col.nullable:
        is_null = ~np.asarray(values.is_valid())
        problems.add(np.setdiff1d(np.flatnonzero(is_null), problems.rows_with(f"invalid_type:{col.name}")),
                     f"null:{col.name}")
    flat = pc.list_flatten(values).to_numpy(zero_copy_only=False)
    parents = pc.list_parent_indices(values).to_numpy()
    out = np.zeros(len(flat), dtype=bool)
    if col.min is not None:
        out |= flat < float(col.min)
    if col.max is not None:
        out |= flat > float(col.max)
    problems.add(np.unique(parents[out]), f"out_of_range:{col.name}")
