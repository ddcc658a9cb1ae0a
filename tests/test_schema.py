"""Dataset specs: the shipped ones load; broken ones fail with a message that names the problem."""

from __future__ import annotations

from pathlib import Path

import pytest

from recloop.schema import SpecError, builtin_specs, load_spec

GOOD = """
name: mine
columns:
  - {name: id, role: event_id, dtype: string}
  - {name: t, role: timestamp, dtype: timestamp}
  - {name: y, role: label, dtype: int8, allowed: [0, 1]}
"""


def test_shipped_specs_load_with_their_roles():
    assert {"synthetic", "criteo"} <= set(builtin_specs())
    synthetic = load_spec("synthetic")
    assert (synthetic.event_id, synthetic.timestamp, synthetic.label) == ("event_id", "ts", "label")
    assert (synthetic.user_key, synthetic.item_key) == ("user_id", "item_id")
    assert [c.name for c in synthetic.by_role("multi_hot")] == ["history"]
    criteo = load_spec("criteo")
    assert criteo.file_fields[0] == "label" and len(criteo.file_fields) == 40
    assert len(criteo.by_role("categorical")) == 26 and len(criteo.by_role("numeric")) == 13


def test_a_users_own_spec_file_loads(tmp_path: Path):
    path = tmp_path / "mine.yaml"
    path.write_text(GOOD)
    spec = load_spec(path)
    assert spec.name == "mine" and spec.user_key is None


@pytest.mark.parametrize(
    ("text", "message"),
    [
        pytest.param(GOOD.replace("role: label", "role: categorical"), "exactly one label", id="no-label"),
        pytest.param(GOOD + "  - {name: id, role: numeric, dtype: int64, min: 0, max: 9}\n", "listed twice",
                     id="duplicate-column"),
        pytest.param(GOOD + "  - {name: c, role: numeric, dtype: float64, min: 0}\n", "needs both min and max",
                     id="unbounded-model-input"),
        pytest.param(GOOD + "  - {name: c, role: numeric, dtype: int64, min: 0, max: 9, allow_non_finite: true}\n",
                     "only applies to float columns", id="non-finite-int"),
        pytest.param(GOOD.replace("dtype: timestamp", "dtype: string"), "role timestamp needs dtype", id="role-dtype"),
        pytest.param(GOOD + "  - {name: c, role: categorical, dtype: string, pattern: '(['}\n",
                     "not a valid regular expression", id="bad-regex"),
        pytest.param(GOOD.replace("dtype: int8", "dtype: int8, nullable: true"), "cannot be nullable",
                     id="nullable-label"),
        pytest.param(GOOD + "  - {name: u, role: user_key, dtype: int64, nullable: true}\n", "cannot be nullable",
                     id="nullable-user-key"),
        pytest.param(GOOD + "  - {name: i, role: item_key, dtype: string, nullable: true}\n", "cannot be nullable",
                     id="nullable-item-key"),
        pytest.param(GOOD + "  - {name: c, role: numeric, dtype: float64, min: low, max: 1}\n", "must be numbers",
                     id="text-bound"),
        pytest.param(GOOD + "  - {name: c, role: colour, dtype: string}\n", "columns.3.role", id="unknown-role"),
        pytest.param(GOOD.replace("format: table", "") + "format: criteo_tsv\n", "criteo", id="criteo-no-start"),
        pytest.param(GOOD + "  - {name: c, role: numeric, dtype: float64, min: 1000, max: 1}\n", "min 1000.0 is above max 1.0",
                     id="bounds-upside-down"),  # every row was quarantined as out of range
        pytest.param(GOOD.replace("dtype: timestamp", "dtype: timestamp, min: '2030-01-01', max: '2000-01-01'"),
                     "is above max", id="time-bounds-upside-down"),
        pytest.param("name: [unclosed\n", "not valid YAML", id="bad-yaml"),
        pytest.param("name: x\ncolumns: [\n  - {name: a\n", "at line 3, column 3", id="bad-yaml-in-one-line"),
        pytest.param("- just\n- a list\n", "mapping at the top level", id="not-a-mapping"),
    ],
)
def test_a_broken_spec_is_refused_with_a_clear_message(tmp_path: Path, text: str, message: str):
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match="broken.yaml") as err:
        load_spec(path)
    assert message in str(err.value) and "\n" not in str(err.value)  # one line (YAML's own report took five)


def test_a_spec_that_is_not_text_is_named(tmp_path: Path):
    path = tmp_path / "binary.yaml"
    path.write_bytes(bytes(range(256)))
    with pytest.raises(SpecError, match="binary.yaml is not UTF-8 text"):  # was: 'utf-8' codec can't decode…
        load_spec(path)


def test_unknown_spec_name_lists_the_shipped_ones():
    with pytest.raises(SpecError, match="synthetic"):
        load_spec("no-such-spec")
    with pytest.raises(SpecError, match="does not exist"):
        load_spec("missing.yaml")
