"""Every key of every section, the core's and each built-in component's, refuses a value of the
wrong type with one message naming the section, the key, the type expected and the value given;
every float refuses inf, -inf and nan; numbers must fit the types training uses."""

from __future__ import annotations

import math
import types
import typing
from collections.abc import Iterator
from typing import Any

import attrs
import pytest

from forge_lm.config import ForgeConfig, structure_config
from forge_lm.config._schema import ARRAY, CATEGORY, KEYED, MANY
from forge_lm.errors import ConfigError
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.validators import FieldError, between, finite, non_negative, positive

BUILTINS = PluginManager(PluginSettings(), entry_points=False)


def _inner(tp: Any) -> Any:
    """``X`` of ``X | None``."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        (tp,) = [arg for arg in typing.get_args(tp) if arg is not type(None)]
    return tp


def _nest(where: str, value: dict[str, Any]) -> dict[str, Any]:
    for part in reversed(where.split(".")):
        value = {part: value}
    return value


def _keys() -> Iterator[tuple[str, str, Any, dict[str, Any]]]:
    """(where, key, type, the table that holds the key besides it) of every plain value a config
    can set: the core's sections and every built-in component's options."""

    def walk(cls: type, where: str, base: dict[str, Any]) -> Iterator[tuple[str, str, Any, dict[str, Any]]]:
        for field in attrs.fields(attrs.resolve_types(cls)):
            if field.metadata.get(ARRAY):
                continue
            if field.metadata.get(MANY):
                for component in BUILTINS.registry.components(field.metadata[CATEGORY]):
                    sub = {field.name: [component.name]}
                    yield from walk(component.options_class, f"{where}.{component.name}", sub)
                continue
            if field.metadata.get(KEYED):  # [eval.datasets.<set>]: the entry's own keys, then each component's
                entry = f"{where}.{field.name}.some_set".strip(".")
                for setting in attrs.fields(attrs.resolve_types(field.metadata[KEYED])):
                    if not setting.metadata.get(CATEGORY):
                        yield entry, setting.name, setting.type, {}
                        continue
                    for component in BUILTINS.registry.components(setting.metadata[CATEGORY]):
                        base = {"name": component.name, **_required(component.options_class)}
                        yield from walk(component.options_class, entry, base)
                continue
            if field.metadata.get(CATEGORY):
                for component in BUILTINS.registry.components(field.metadata[CATEGORY]):
                    base = {"name": component.name, **_required(component.options_class)}
                    yield from walk(component.options_class, f"{where}.{field.name}".strip("."), base)
                continue
            if attrs.has(field.type):
                yield from walk(field.type, f"{where}.{field.name}".strip("."), {})
                continue
            yield where, field.name, field.type, base

    yield from walk(ForgeConfig, "", {})


def _required(cls: type) -> dict[str, Any]:
    """Values for the options a component requires (a dataset's path): only the key under test is wrong."""
    fields = attrs.fields(attrs.resolve_types(cls))
    return {f.name: "data.bin" for f in fields if f.default is attrs.NOTHING and f.type is str}


def _load(where: str, base: dict[str, Any], key: str, value: Any) -> Any:
    if "backends" in base:  # a metrics backend: its options sit beside the list that selects it
        section, backend = where.split(".")
        data = {section: {**base, backend: {key: value}}}
    else:
        data = _nest(where, {**base, key: value})
    return structure_config(data, BUILTINS.registry)


WRONG: dict[Any, tuple[Any, str]] = {
    int: ("8", "expected an integer, got string '8'"),
    float: ("0.5", "expected a number, got string '0.5'"),
    bool: ("true", "expected true or false, got string 'true'"),
    str: (3, "expected a string, got integer 3"),
}

KEYS = list(_keys())


def _wrong_value(tp: Any) -> tuple[Any, str]:
    tp = _inner(tp)
    if tp in WRONG:
        return WRONG[tp]
    origin = typing.get_origin(tp)
    if origin is list and attrs.has(typing.get_args(tp)[0]):
        return "x", "expected an array of tables"
    if origin in (list, tuple):
        return "x", "expected an array, got string 'x'"
    raise AssertionError(f"no wrong value for {tp}")


def test_the_walk_sees_every_section_and_the_built_in_components():
    sections = {where.split(".")[0] for where, *_ in KEYS}
    assert sections == {
        "model", "train", "tokenizer", "data", "optimizer", "scheduler", "loss", "eval", "checkpoint",
        "resilience", "metrics", "distributed", "profiling",
    }  # fmt: skip
    assert ("model.ffn", "hidden_multiplier") in {(where, key) for where, key, *_ in KEYS}
    assert ("metrics.jsonl", "filename") in {(where, key) for where, key, *_ in KEYS}
    assert len(KEYS) > 60


@pytest.mark.parametrize(
    ("where", "key", "tp", "base"), KEYS, ids=[f"{w}.{k}({b.get('name', '')})" for w, k, _, b in KEYS]
)
def test_a_value_of_the_wrong_type_names_section_key_expected_type_and_value(where, key, tp, base):
    value, expected = _wrong_value(tp)
    with pytest.raises(ConfigError) as caught:
        _load(where, base, key, value)
    assert str(caught.value).startswith(f"[{where}] {key}: {expected}"), str(caught.value)


FLOATS = [(w, k, tp, b) for w, k, tp, b in KEYS if _inner(tp) is float]
FLOAT_TUPLES = [
    (w, k, tp, b)
    for w, k, tp, b in KEYS
    if typing.get_origin(_inner(tp)) is tuple and float in typing.get_args(_inner(tp))
]


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    ("where", "key", "tp", "base"), FLOATS, ids=[f"{w}.{k}({b.get('name', '')})" for w, k, _, b in FLOATS]
)
def test_every_float_refuses_inf_and_nan_from_toml(where, key, tp, base, bad):
    with pytest.raises(ConfigError) as caught:
        _load(where, base, key, bad)
    assert str(caught.value) == f"[{where}] {key}: expected a finite number, got float {bad!r}."


@pytest.mark.parametrize(("where", "key", "tp", "base"), FLOAT_TUPLES, ids=[f"{w}.{k}" for w, k, _, _ in FLOAT_TUPLES])
def test_every_array_of_floats_refuses_inf_and_nan_items(where, key, tp, base):
    size = len(typing.get_args(_inner(tp)))
    with pytest.raises(ConfigError) as caught:
        _load(where, base, key, [0.5] * (size - 1) + [math.nan])
    assert str(caught.value) == f"[{where}] {key}: expected a finite number, got float nan."


def test_there_are_floats_and_float_arrays_to_check():
    assert ("optimizer", "lr") in {(w, k) for w, k, *_ in FLOATS}
    assert ("train", "grad_clip") in {(w, k) for w, k, *_ in FLOATS}
    assert ("optimizer", "betas") in {(w, k) for w, k, *_ in FLOAT_TUPLES}


# -- the same through files and the command line --------------------------------------------------


@pytest.mark.parametrize("text", ["inf", "-inf", "nan", "+inf", "Infinity"])
@pytest.mark.parametrize("key", ["optimizer.lr", "optimizer.weight_decay", "train.grad_clip", "model.rope_theta"])
def test_non_finite_overrides_are_refused(error, key, text):
    section, name = key.split(".")
    assert error(None, f"--{key}={text}") == f"[{section}] {name}: expected a finite number, got '{text}'."


def test_lr_inf_in_a_toml_file_is_refused_like_nan(error):
    assert error("[optimizer]\nlr = inf\n") == "[optimizer] lr: expected a finite number, got float inf."
    assert error("[optimizer]\nlr = nan\n") == "[optimizer] lr: expected a finite number, got float nan."


def test_betas_with_inf_are_refused(error):
    assert error(None, "--optimizer.betas=[0.9, inf]") == "[optimizer] betas: expected a finite number, got float inf."


@pytest.mark.parametrize("text", ["1e300", "1e39", "-4e38"])
def test_floats_beyond_float32_are_refused(error, text):
    assert error(None, f"--optimizer.lr={text}") == (
        f"[optimizer] lr: expected a number of magnitude at most 3.403e+38 (float32), got '{text}'."
    )


def test_float32_range_floats_are_accepted(load):
    assert load(None, "--metrics.peak_flops=3e38").metrics.peak_flops == 3e38


def test_integers_beyond_64_bits_are_refused_from_files_and_overrides(error):
    assert error(None, "--train.max_steps=99999999999999999999") == (
        "[train] max_steps: expected an integer between -2**63 and 2**63 - 1 (64 bits), got '99999999999999999999'."
    )
    assert error("[train]\nmax_steps = 99999999999999999999\n") == (
        "[train] max_steps: expected an integer between -2**63 and 2**63 - 1 (64 bits), got integer "
        "99999999999999999999."
    )


def test_a_very_long_value_is_shortened_in_the_message(error):
    message = error(None, f"--train.max_steps={'9' * 400}")
    assert message == (
        f"[train] max_steps: expected an integer between -2**63 and 2**63 - 1 (64 bits), got '{'9' * 59}...{'9' * 9}' "
        "(402 characters)."
    )


@pytest.mark.parametrize("seed", [-(2**31), 0, 2**31 - 1])
def test_seeds_are_32_bit_integers(load, seed):
    assert load(None, f"--train.seed={seed}").train.seed == seed


@pytest.mark.parametrize("seed", [-(2**31) - 1, 2**31, 2**63 - 1])
def test_seeds_beyond_32_bits_are_refused(error, seed):
    assert error(None, f"--train.seed={seed}") == (
        f"[train] seed: must be between -2147483648 and 2147483647, got {seed}."
    )


def test_a_string_vocab_size_in_a_toml_file_is_a_type_error_not_a_vocabulary_mismatch(error):
    assert error('[model]\nvocab_size = "257"\n') == "[model] vocab_size: expected an integer, got string '257'."


def test_the_same_vocab_size_on_the_command_line_is_typed_by_the_field(load):
    assert load(None, "--model.vocab_size=257").model.options.vocab_size == 257


def test_an_array_of_tables_names_the_table_and_the_key(error):
    mixture = '[data]\nname = "mixture"\n[[data.sources]]\nname = "synthetic"\n'
    assert error(mixture + '[[data.phases]]\nuntil_sample = "10"\n') == (
        "[data.phases[0]] until_sample: expected an integer, got string '10'."
    )
    assert error(mixture + "[[data.phases]]\nuntil_sample = 10\n[[data.phases]]\nuntil_sample = 20\nweight = 1\n") == (
        "[data.phases[1]] weight: unknown key. Did you mean 'weights'? Valid keys: 'until_sample', 'weights'."
    )
    assert error(mixture + "[[data.phases]]\n") == "[data.phases[0]] until_sample: required, but not set."
    assert error('[data]\nname = "mixture"\nphases = 3\n[[data.sources]]\nname = "synthetic"\n') == (
        "[data] phases: expected an array of tables ([[data.phases]]), got integer 3."
    )


def test_memory_check_is_a_train_key_that_defaults_to_on(load):
    assert load().train.memory_check is True
    assert load(None, "--train.memory_check=false").train.memory_check is False


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:3"])
def test_device_names_of_the_documented_forms_are_accepted(load, device):
    assert load(None, f"--train.device={device}").train.device == device


@pytest.mark.parametrize("device", ["", "mps", "meta", "cpu:0", "cuda:x", "CUDA"])
def test_other_device_names_are_refused_when_the_config_is_loaded(error, device):
    assert error(None, f"--train.device={device}") == (
        f"[train] device: must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {device!r}."
    )


# -- the validators, for options built in code -----------------------------------------------------


@attrs.define
class _Options:
    rate: float = attrs.field(default=1.0, validator=positive)
    decay: float = attrs.field(default=0.0, validator=non_negative)
    scale: float | None = attrs.field(default=None, validator=finite)
    count: int = attrs.field(default=1, validator=between(1, 10))


@pytest.mark.parametrize("field", ["rate", "decay", "scale"])
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_validators_refuse_non_finite_floats_built_in_code(field, bad):
    with pytest.raises(FieldError) as caught:
        _Options(**{field: bad})
    assert (caught.value.key, caught.value.message) == (field, f"must be a finite number, got {bad!r}")


def test_validators_keep_their_messages_for_finite_values():
    with pytest.raises(FieldError, match=r"^rate: must be > 0, got -1\.0$"):
        _Options(rate=-1.0)
    with pytest.raises(FieldError, match=r"^decay: must be >= 0, got -0\.5$"):
        _Options(decay=-0.5)
    with pytest.raises(FieldError, match=r"^count: must be between 1 and 10, got 11$"):
        _Options(count=11)
    assert _Options(scale=None, count=10).count == 10
