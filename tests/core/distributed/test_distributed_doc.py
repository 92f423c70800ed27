"""docs/distributed.md's table of the ``[distributed]`` section says what the config has."""

from __future__ import annotations

import re
from pathlib import Path

import attrs

from forge_lm.config import DistributedSection

DOC = Path(__file__).resolve().parents[3] / "docs" / "distributed.md"


def test_the_section_table_lists_every_key_with_its_default():
    text = DOC.read_text(encoding="utf-8")
    table = text[text.index("## The `[distributed]` section") :].split("\n\n")[1]
    rows = dict(re.findall(r"^\| `(\w+)` \| `?([^|`]+?)`? \|", table, re.MULTILINE))
    fields = {f.name: _default(f) for f in attrs.fields(DistributedSection)}
    assert sorted(rows) == sorted(fields)
    for key, default in fields.items():
        written = rows[key]
        if attrs.has(type(default)):  # a table of its own ([distributed.compression]), described in its section
            assert written == "(table)", key
            continue
        if isinstance(default, bool):
            assert written == str(default).lower(), key
        else:
            assert (float(written) == default) if isinstance(default, int | float) else (written == default), key


def _default(field: attrs.Attribute) -> object:
    """A field's default value; a table's section is declared ``factory=Section``, so its default
    is an ``attrs.Factory`` and the value is what the factory makes."""
    default = field.default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        assert not default.takes_self, field.name  # a section's defaults depend on nothing else
        return default.factory()
    return default
