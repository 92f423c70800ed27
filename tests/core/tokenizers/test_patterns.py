"""The vetting of a tokenizer's regular expressions (forge_lm.tokenizers.patterns): the nested
repetitions that backtrack catastrophically are found, the patterns real tokenizers use are not
refused, and a panic of the regex engine while encoding is a clear error."""

from __future__ import annotations

import pytest

from forge_lm.errors import ConfigError
from forge_lm.tokenizers.hf import HfTokenizer, load_tokenizer
from forge_lm.tokenizers.patterns import nested_repetition, regex_patterns

# The pre-tokenizer patterns of GPT-2, Llama 3 and Qwen 2, and a DeepSeek-style class pattern.
FAMILIES = [
    r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""",
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"""
    r"""|\s+(?!\S)|\s+""",
    "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
]


@pytest.mark.parametrize("pattern", FAMILIES)
def test_the_patterns_of_common_tokenizers_pass(pattern):
    assert nested_repetition(pattern) is None


@pytest.mark.parametrize(
    ("pattern", "nested"),
    [
        ("(a+)+$", "(a+)+"),
        (r"(?:\s*\w+)*x", r"(?:\s*\w+)*"),
        ("(a{1,3})+", "(a{1,3})+"),
        ("(a+){2,}", "(a+){2,}"),
        ("(x(a*))+?", "(x(a*))+?"),
        (r"([\])]+b)*", r"([\])]+b)*"),  # a ] and a ) inside a class close nothing
    ],
)
def test_a_repetition_inside_an_unbounded_repetition_is_found(pattern, nested):
    assert nested_repetition(pattern) == nested


@pytest.mark.parametrize("pattern", ["(a)+", "(?:ab)+", "(ab){2}", "(a+){3}", r"\(a+\)+", "[(]a+[)]+", "a{2}b{x}"])
def test_bounded_or_single_repetitions_pass(pattern):
    assert nested_repetition(pattern) is None


def test_every_regex_of_a_tokenizer_json_is_found_with_its_place():
    tree = {
        "normalizer": {"pattern": {"Regex": "x+"}},
        "pre_tokenizer": {"pretokenizers": [{"pattern": {"String": "a"}}]},
    }
    assert list(regex_patterns(tree)) == [("normalizer.pattern", "x+")]


def _tokenizer_splitting_with(path, pattern: str):
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({"<|endoftext|>": 0, "a": 1, "!": 2}, unk_token="<|endoftext|>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), "isolated")
    tokenizer.save(str(path))
    return path


def test_loading_refuses_a_nested_repetition_naming_file_and_pattern(tmp_path):
    path = _tokenizer_splitting_with(tmp_path / "tokenizer.json", "(a+)+$")
    with pytest.raises(ConfigError, match=r"tokenizer\.json': the regular expression '\(a\+\)\+\$' \(pre_tokenizer"):
        load_tokenizer(path)


def test_a_regex_panic_while_encoding_is_a_config_error(tmp_path):
    # (a|a)+$ holds no nested repetition, yet overlapping alternatives backtrack too: Oniguruma's
    # retry limit ends the search with a Rust panic, which must not escape as a raw traceback.
    path = _tokenizer_splitting_with(tmp_path / "tokenizer.json", "(a|a)+$")
    tokenizer = HfTokenizer(load_tokenizer(path), "<|endoftext|>", path)
    with pytest.raises(ConfigError, match=r"failed while encoding a text that begins 'aaaa.*simplify that pattern"):
        tokenizer.encode("a" * 40 + "!")
