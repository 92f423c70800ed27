"""The harness itself: a clean resume of the shared run passes every check it makes."""

import pytest
from _hostile import Case, case_params

CASES = [
    Case(
        "resume-continues",
        ("train", "{tiny}", "--train.max_steps=6", "--train.output_dir={run}"),
        0,
        "$",
        needs_run=True,
    )
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    _ws, outcome = run_case(case)
    assert outcome.stderr.count("forge:") == 0
