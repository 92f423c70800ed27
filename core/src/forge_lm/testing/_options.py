"""Checks every component gets, whatever its category."""

from __future__ import annotations

import attrs

from forge_lm.config import to_data
from forge_lm.plugins import CATEGORIES
from forge_lm.testing._kit import Subject, category_check


def check_options_round_trip_through_a_config_table(subject: Subject) -> None:
    options = subject.options()
    assert attrs.has(type(options)), (
        f"{subject.label}: options are a {type(options).__name__}; the kit expects an attrs class instance"
    )
    again = subject.options(**to_data(options))
    assert again == options, (
        f"{subject.label}: options change when written out and read back: {options} -> {again}; the kit "
        "expects them equal"
    )


for _category in CATEGORIES:
    category_check(_category)(check_options_round_trip_through_a_config_table)
