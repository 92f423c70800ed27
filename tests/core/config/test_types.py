"""Typing of values: overrides are text typed by the field they set; file values must match.

A ``--section.key=value`` override arrives as text and is parsed by the type of its field. A
TOML file value arrives typed and must already have the field's type: ``n_heads = "8"`` is
an error, never a silent conversion.
"""

from __future__ import annotations

import pytest

from forge_lm.config import CliValue, ComponentConfig, converter
from forge_lm.default_plugins.options.metrics import JsonlOptions

# -- overrides: good values -------------------------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [("500", 500), ("1", 1), ("+7", 7)])
def test_an_int_override_is_parsed_as_an_integer(load, text, expected):
    steps = load(None, f"--train.max_steps={text}").train.max_steps
    assert (steps, type(steps)) == (expected, int)


def test_a_negative_int_override_reaches_a_field_without_a_bound(load):
    assert load(None, "--train.seed=-3").train.seed == -3


@pytest.mark.parametrize(("text", "expected"), [("1e-3", 1e-3), ("0.002", 0.002), ("2", 2.0), ("3E-4", 3e-4)])
def test_a_float_override_is_parsed_as_a_float_including_exponent_notation(load, text, expected):
    lr = load(None, f"--optimizer.lr={text}").optimizer.options.lr
    assert (lr, type(lr)) == (expected, float)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("true", True),
        ("false", False),
        ("yes", True),
        ("no", False),
        ("1", True),
        ("0", False),
        ("on", True),
        ("off", False),
        ("TRUE", True),
        ("No", False),
    ],
)
def test_a_bool_override_accepts_the_usual_words_for_true_and_false(load, text, expected):
    value = load(None, f"--optimizer.decay_embeddings={text}").optimizer.options.decay_embeddings
    assert value is expected


@pytest.mark.parametrize("text", ["123", "true", "1e-3", "none"])  # empty: refused (tests/hostile)
def test_a_str_override_stays_the_exact_text_as_a_plain_string(load, text):
    output_dir = load(None, f"--train.output_dir={text}").train.output_dir
    assert (output_dir, type(output_dir)) == (text, str)


def test_a_tuple_override_is_a_toml_inline_array_typed_item_by_item(load):
    betas = load(None, "--optimizer.betas=[0.8, 0.9]").optimizer.options.betas
    assert (betas, type(betas)) == ((0.8, 0.9), tuple)


def test_integer_items_of_a_float_tuple_override_become_floats(load):
    betas = load(None, "--optimizer.betas=[0, 0]").optimizer.options.betas
    assert (betas, [type(b) for b in betas]) == ((0.0, 0.0), [float, float])


def test_a_list_override_is_a_toml_inline_array_of_strings(load):
    config = load(None, '--metrics.backends=["jsonl"]')
    assert config.metrics.backends == [ComponentConfig("jsonl", JsonlOptions())]


@pytest.mark.parametrize("text", ["none", "None", "NULL", "null"])
def test_none_or_null_clears_an_optional_field(load, text):
    config = load(
        """
        [model]
        vocab_size = 1000
        """,
        f"--model.vocab_size={text}",
    )
    assert config.model.options.vocab_size is None


def test_an_optional_field_takes_a_value_of_its_inner_type(load):
    vocab_size = load(None, "--model.vocab_size=50000").model.options.vocab_size
    assert (vocab_size, type(vocab_size)) == (50000, int)


# -- overrides: bad values --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--model.n_heads=8.5", "[model] n_heads: expected an integer, got '8.5'."),
        ("--model.n_heads=eight", "[model] n_heads: expected an integer, got 'eight'."),
        ("--model.n_heads=none", "[model] n_heads: expected an integer, got 'none'."),
        ("--model.n_heads=", "[model] n_heads: expected an integer, got ''."),
        ("--model.vocab_size=big", "[model] vocab_size: expected an integer, got 'big'."),
        ("--optimizer.lr=fast", "[optimizer] lr: expected a number, got 'fast'."),
        ("--optimizer.decay_embeddings=maybe", "[optimizer] decay_embeddings: expected true or false, got 'maybe'."),
        (
            "--optimizer.betas=0.9",
            "[optimizer] betas: expected a TOML array such as '[1, 2]' or '[\"a\", \"b\"]', got '0.9'.",
        ),
        ("--optimizer.betas=[0.9, 0.95, 0.99]", "[optimizer] betas: expected an array of 2 items, got 3."),
        ('--optimizer.betas=["a", 0.9]', "[optimizer] betas: expected a number, got string 'a'."),
        (
            "--metrics.backends=jsonl",
            "[metrics] backends: expected a TOML array such as '[1, 2]' or '[\"a\", \"b\"]', got 'jsonl'.",
        ),
        (
            "--metrics.backends=[jsonl]",
            "[metrics] backends: expected a TOML array such as '[1, 2]' or '[\"a\", \"b\"]', got '[jsonl]'.",
        ),
        ("--metrics.backends=[1]", "[metrics] backends: expected a string, got integer 1."),
        ("--metrics.console.digits=many", "[metrics.console] digits: expected an integer, got 'many'."),
    ],
)
def test_an_override_that_does_not_fit_its_field_type_names_section_key_and_the_text(error, override, expected):
    assert error(None, override) == expected


def test_an_array_override_nested_too_deeply_to_parse_is_a_type_error_not_a_traceback(error):
    # tomllib parses nested arrays recursively: thousands of levels exhaust Python's recursion limit.
    message = error(None, "--metrics.backends=" + "[" * 5000 + "]" * 5000)
    assert message.startswith("[metrics] backends: expected a TOML array such as '[1, 2]'")


# -- file values are strict -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "expected"),
    [
        ('[model]\nn_heads = "8"\n', "[model] n_heads: expected an integer, got string '8'."),
        ("[model]\nn_heads = 8.5\n", "[model] n_heads: expected an integer, got float 8.5."),
        ("[model]\nn_heads = true\n", "[model] n_heads: expected an integer, got boolean True."),
        ('[model]\nvocab_size = "none"\n', "[model] vocab_size: expected an integer, got string 'none'."),
        ("[optimizer]\nlr = true\n", "[optimizer] lr: expected a number, got boolean True."),
        ('[optimizer]\nlr = "1e-3"\n', "[optimizer] lr: expected a number, got string '1e-3'."),
        ("[optimizer]\ndecay_embeddings = 1\n", "[optimizer] decay_embeddings: expected true or false, got integer 1."),
        (
            '[optimizer]\ndecay_embeddings = "yes"\n',
            "[optimizer] decay_embeddings: expected true or false, got string 'yes'.",
        ),
        ('[optimizer]\nbetas = "0.9"\n', "[optimizer] betas: expected an array, got string '0.9'."),
        ("[optimizer]\nbetas = [0.9]\n", "[optimizer] betas: expected an array of 2 items, got 1."),
        ("[train]\noutput_dir = 3\n", "[train] output_dir: expected a string, got integer 3."),
        ('[metrics]\nbackends = "console"\n', "[metrics] backends: expected an array, got string 'console'."),
        ("[optimizer]\nname = 5\n", "[optimizer] name: expected a string, got integer 5."),
    ],
)
def test_a_file_value_of_the_wrong_type_is_an_error_not_a_conversion(error, toml, expected):
    assert error(toml) == expected


def test_a_file_integer_for_a_float_field_is_accepted_as_a_float(load):
    lr = load("[optimizer]\nlr = 1\n").optimizer.options.lr
    assert (lr, type(lr)) == (1.0, float)


def test_a_file_array_for_a_tuple_field_becomes_a_tuple(load):
    assert load("[optimizer]\nbetas = [0.8, 0.99]\n").optimizer.options.betas == (0.8, 0.99)


# -- the converter on its own -----------------------------------------------------------------


def test_the_converter_types_command_line_text_but_not_plain_strings():
    assert converter.structure(CliValue("8"), int) == 8
    with pytest.raises(ValueError, match=r"^expected an integer, got string '8'$"):
        converter.structure("8", int)


def test_the_converter_never_takes_a_bool_for_a_number():
    with pytest.raises(ValueError, match=r"^expected a number, got boolean False$"):
        converter.structure(False, float)
