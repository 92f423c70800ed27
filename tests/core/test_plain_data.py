"""forge_lm.plain_data, the one walker every check of untrusted plain data goes through: what it
calls plain is what json writes and reads back unchanged (the reference), with one depth limit,
cycles named as cycles, and the allowances a caller opts into (tensors, integer keys, NaN)."""

from __future__ import annotations

import json
import math
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch

from forge_lm.plain_data import DEEPER, MAX_DEPTH, copy_containers, find_not_plain, short_repr, to_plain


def _nested(levels: int, leaf=None) -> list:
    """``levels`` lists, one inside the other, around ``leaf`` (None: an empty innermost list)."""
    nested: list = [] if leaf is None else [leaf]
    for _ in range(levels - 1):
        nested = [nested]
    return nested


def _lists(value):
    """``value`` with tuples as lists: what json gives back for a tuple."""
    if isinstance(value, dict):
        return {key: _lists(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_lists(item) for item in value]
    return value


def _json_keeps(value) -> bool:
    """The reference: strict json writes ``value`` and reads back the same thing."""
    try:
        return json.loads(json.dumps(value, allow_nan=False)) == _lists(value)
    except (TypeError, ValueError):
        return False


shared = [1, 2]
looped: list = [1]
looped.append(looped)
looped_dict: dict = {"a": {}}
looped_dict["a"]["back"] = looped_dict

CASES = {
    "scalars": [None, True, 0, -3, 2.5, "ü"],
    "nested": {"a": [1, {"b": (2, 3.0)}], "c": OrderedDict(d="e")},
    "the same list twice": [shared, shared],  # not a cycle
    "float subclass": np.float64(0.25),  # a float: json writes it
    "nan": {"x": float("nan")},
    "inf in a list": [1.0, -math.inf],
    "numpy nan": [np.float64("nan")],
    "int key": {1: "a"},
    "bool key": {True: "a"},
    "tuple key": {(1, 2): 3},
    "none key": {None: 1},
    "numpy int": {"n": np.int64(3)},
    "numpy bool": [np.bool_(True)],
    "numpy array": {"a": np.zeros(2)},
    "tensor": {"t": torch.zeros(1)},
    "set": {"s": {1}},
    "bytes": [b"x"],
    "object": [object()],
    "path": {"p": Path("/x")},
    "cycle": looped,
    "dict cycle": looped_dict,
}


@pytest.mark.parametrize("name", CASES)
def test_plain_means_what_strict_json_writes_and_reads_back_unchanged(name):
    value = CASES[name]
    assert (find_not_plain(value) is None) == _json_keeps(value)


@pytest.mark.parametrize(
    ("value", "where", "reason", "kind"),
    [
        ({"a": {"b": {1}}}, "state.a.b", "is a set", "type"),
        ({"a": [0, float("nan")]}, "state.a[1]", "is nan, not a finite number", "number"),
        ({"a": [{2: 0}]}, "state.a[0]", "has the key 2, not a string", "key"),
        ({"n": np.int64(3)}, "state.n", "is a int64", "type"),
        ({"t": torch.ones(1)}, "state.t", "is a Tensor", "type"),
        ({"loop": looped}, "state.loop[1]", "contains itself (a cycle)", "cycle"),
        ({"loop": looped_dict}, "state.loop.a.back", "contains itself (a cycle)", "cycle"),
    ],
)
def test_the_first_problem_is_named_with_its_place(value, where, reason, kind):
    found = find_not_plain(value)
    assert (found.at("state"), found.reason, found.kind) == (where, reason, kind)
    assert found.describe("state") == f"{where} {reason}"


def test_subscripts_tell_an_integer_key_from_a_string_one():
    found = find_not_plain({"a": {3: [{"4": {1}}]}}, int_keys=True)
    assert found.at("state", subscripts=True) == "state['a'][3][0]['4']"
    assert found.at("state") == "state.a[3][0].4"


def test_one_depth_limit_for_every_container():
    assert find_not_plain(_nested(MAX_DEPTH, leaf=1)) is None
    assert find_not_plain({"k": _nested(MAX_DEPTH - 1)}) is None
    found = find_not_plain(_nested(MAX_DEPTH + 1))
    assert found.kind == "depth"
    assert found.steps == (0,) * MAX_DEPTH
    assert found.reason == f"is nested more than {MAX_DEPTH} levels deep"
    deep = {"k": _nested(10_000)}  # past Python's recursion limit: refused, not a RecursionError
    assert find_not_plain(deep).kind == "depth"
    assert MAX_DEPTH == 64


def test_the_allowances_a_caller_opts_into():
    state = {3: [float("nan"), math.inf], "t": torch.zeros(2)}
    assert find_not_plain(state).kind == "key"
    assert find_not_plain(state, int_keys=True).kind == "number"
    assert find_not_plain(state, int_keys=True, non_finite=True).kind == "type"  # the tensor
    assert find_not_plain(state, tensors=True, int_keys=True, non_finite=True) is None
    found = find_not_plain({True: 1}, int_keys=True)  # a bool is an int to Python, not a key here
    assert found.reason == "has the key True, not a string or an integer"


def test_to_plain_makes_anything_json_writes_strictly():
    class Loud:
        def __repr__(self):
            raise RuntimeError("no repr")

    value = {
        1: (float("nan"), -math.inf, np.float32(0.5), torch.tensor(2)),
        "p": Path("/tmp/x"),
        "o": Loud(),
        "loop": looped,
        "deep": _nested(10_000),
    }
    plain = to_plain(value)
    assert find_not_plain(plain) is None
    assert json.loads(json.dumps(plain, allow_nan=False)) == plain
    assert plain["1"] == ["nan", "-inf", 0.5, 2]
    assert plain["p"] == "/tmp/x"
    assert plain["o"] == "<a Loud>"
    inner = plain["loop"]
    for _ in range(MAX_DEPTH - 1):
        inner = inner[1]
    assert inner == DEEPER


def test_copy_containers_copies_dicts_and_lists_and_shares_leaves():
    leaf = torch.zeros(1)
    state = {"a": [1, {"b": leaf}], "c": (2, 3)}
    copy = copy_containers(state)
    assert copy == {"a": [1, {"b": leaf}], "c": [2, 3]}
    state["a"][1]["b2"] = 0
    state["a"].append(4)
    assert copy == {"a": [1, {"b": leaf}], "c": [2, 3]}
    assert copy["a"][1]["b"] is leaf
    assert copy_containers(looped) is not looped  # a cycle stops at the depth limit


def test_short_repr_cuts_long_text_and_survives_a_failing_repr():
    assert short_repr("x" * 100) == repr("x" * 100)[:37] + "..."
    assert short_repr((1, 2)) == "(1, 2)"
