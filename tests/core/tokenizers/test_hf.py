"""The 'hf' tokenizer: a local tokenizer.json, encoding and decoding exactly as the tokenizers library does."""

from __future__ import annotations

import json
import sys

import pytest
from tokenizers import Tokenizer

from forge_lm.config import load_config, structure_options
from forge_lm.errors import ConfigError, PluginError
from forge_lm.plugins import PluginManager, PluginSettings

TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Plugins forge models; the fox sleeps.",
    "  spaces\tand\nnewlines  ",
    "Ünïcödé: 東京 🔥",
    "",
]


@pytest.fixture(scope="module")
def manager() -> PluginManager:
    return PluginManager(PluginSettings(autoload=False))


def build(manager, **table):
    component = manager.registry.resolve("tokenizers", "hf")
    return component.build(structure_options(manager.registry, component, table, "tokenizer"))


@pytest.mark.parametrize("text", TEXTS)
def test_encode_gives_the_ids_of_the_tokenizers_library_without_special_tokens(manager, bpe_json, text):
    reference = Tokenizer.from_file(str(bpe_json))

    ids = build(manager, path=str(bpe_json)).encode(text)

    assert ids == reference.encode(text, add_special_tokens=False).ids


def test_encode_merges_bytes_into_learned_pieces(manager, bpe_json):
    text = "The quick brown fox jumps over the lazy dog."

    ids = build(manager, path=str(bpe_json)).encode(text)

    assert len(ids) < len(text.encode("utf-8"))  # trained merges apply: fewer tokens than bytes


@pytest.mark.parametrize("text", TEXTS)
def test_decode_matches_the_tokenizers_library_and_restores_the_text(manager, bpe_json, text):
    reference = Tokenizer.from_file(str(bpe_json))
    ids = reference.encode(text, add_special_tokens=False).ids

    decoded = build(manager, path=str(bpe_json)).decode(ids)

    assert decoded == reference.decode(ids) == text


def test_decode_leaves_out_the_end_of_document_token(manager, bpe_json):
    tokenizer = build(manager, path=str(bpe_json))

    assert tokenizer.decode([*tokenizer.encode("one doc"), tokenizer.eos_id, *tokenizer.encode("two")]) == "one doctwo"


def test_vocab_size_is_one_past_the_largest_id_of_the_file(manager, bpe_json):
    vocab = json.loads(bpe_json.read_text())["model"]["vocab"]

    tokenizer = build(manager, path=str(bpe_json))

    assert tokenizer.vocab_size == max(vocab.values()) + 1 == 320


def test_eos_defaults_to_endoftext_when_the_file_has_it(manager, bpe_json):
    tokenizer = build(manager, path=str(bpe_json))

    assert tokenizer.eos_id == Tokenizer.from_file(str(bpe_json)).token_to_id("<|endoftext|>") == 0


def test_eos_prefers_closing_s_over_endoftext(manager, make_bpe_json):
    path = make_bpe_json(["<|endoftext|>", "</s>"])

    tokenizer = build(manager, path=str(path))

    assert tokenizer.eos_id == Tokenizer.from_file(str(path)).token_to_id("</s>") == 1


def test_eos_token_option_picks_the_given_token(manager, make_bpe_json):
    path = make_bpe_json(["<|endoftext|>", "<sep>", "</s>"])

    tokenizer = build(manager, path=str(path), eos_token="<sep>")

    assert tokenizer.eos_id == Tokenizer.from_file(str(path)).token_to_id("<sep>") == 1


def test_eos_comes_from_a_tokenizer_config_beside_the_file(manager, make_bpe_json):
    path = make_bpe_json(["<|endoftext|>", "<|im_end|>"])
    (path.parent / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|im_end|>"}}))

    tokenizer = build(manager, path=str(path))

    assert tokenizer.eos_id == Tokenizer.from_file(str(path)).token_to_id("<|im_end|>") == 1


def test_a_file_without_a_usual_eos_token_asks_for_eos_token(manager, make_bpe_json):
    path = make_bpe_json(["<pad>", "<doc_end>"])

    with pytest.raises(ConfigError, match=r"\[tokenizer\] eos_token: .*set eos_token.*'<doc_end>', '<pad>'"):
        build(manager, path=str(path))


def test_an_eos_token_outside_the_vocabulary_is_refused_with_the_special_tokens(manager, bpe_json):
    with pytest.raises(ConfigError, match=r"eos_token: '</s>' is not in the vocabulary .*'<\|endoftext\|>'"):
        build(manager, path=str(bpe_json), eos_token="</s>")


def test_a_missing_file_names_the_path_and_what_to_give(manager, tmp_path):
    missing = tmp_path / "nope" / "tokenizer.json"

    with pytest.raises(ConfigError, match=r"\[tokenizer\] path: '.*nope/tokenizer.json' does not exist; set it to a"):
        build(manager, path=str(missing))


def test_a_file_that_is_not_a_tokenizer_is_refused(manager, tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text('{"not": "a tokenizer"}')

    with pytest.raises(ConfigError, match=r"is not a tokenizer\.json the tokenizers library reads"):
        build(manager, path=str(bad))


def test_without_the_tokenizers_package_the_error_names_the_extra(manager, bpe_json, monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)  # what an absent package looks like to import

    with pytest.raises(PluginError, match=r"`pip install forge-lm\[hf\]`"):
        build(manager, path=str(bpe_json))


def test_a_config_selecting_hf_must_give_a_path(manager):
    with pytest.raises(ConfigError, match=r"\[tokenizer\] path: required by tokenizer 'hf', but not set"):
        load_config(None, ["--tokenizer.name=hf"], manager.registry)


def test_a_config_selecting_hf_builds_it_from_the_section(manager, bpe_json):
    config = load_config(None, ["--tokenizer.name=hf", f"--tokenizer.path={bpe_json}"], manager.registry)

    component = manager.registry.resolve("tokenizers", config.tokenizer.name)
    tokenizer = component.build(config.tokenizer.options)

    assert tokenizer.encode("the fox") == Tokenizer.from_file(str(bpe_json)).encode("the fox").ids
