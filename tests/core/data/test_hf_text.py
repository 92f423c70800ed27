"""The hf_text dataset: local text and JSON-lines files through Hugging Face datasets."""

from __future__ import annotations

import json
import sys

import pytest

from forge_lm.errors import ConfigError, ForgeError

DOCUMENTS = [f"document {k}: " + "lorem ipsum " * (k % 5 + 1) for k in range(40)]


def expected_stream(texts):
    return [token for text in texts for token in [*text.encode(), 256]]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": text, "n": k}) + "\n" for k, text in enumerate(DOCUMENTS)))
    return path


def test_jsonl_rows_are_documents_split_every_tenth_to_eval(tmp_path, jsonl, build_dataset, byte_context):
    table = {"path": str(jsonl), "format": "jsonl", "eval_fraction": 0.1, "cache_dir": str(tmp_path / "cache")}
    train = build_dataset("hf_text", table, byte_context())
    held = build_dataset("hf_text", table, byte_context(split="eval"))
    held_rows = [DOCUMENTS[k] for k in (9, 19, 29, 39)]
    assert held.tokens.read(0, len(held.tokens)).tolist() == expected_stream(held_rows)
    train_rows = [text for text in DOCUMENTS if text not in held_rows]
    assert train.tokens.read(0, len(train.tokens)).tolist() == expected_stream(train_rows)


def test_text_files_are_one_document_each_in_sorted_order(tmp_path, build_dataset, byte_context):
    (tmp_path / "b.txt").write_text("second file\nwith two lines\n")
    (tmp_path / "a.txt").write_text("first file\n")
    table = {"path": str(tmp_path / "*.txt"), "eval_fraction": 0.0, "cache_dir": str(tmp_path / "cache")}
    dataset = build_dataset("hf_text", table, byte_context(seq_len=4))
    expected = expected_stream(["first file\n", "second file\nwith two lines\n"])
    assert dataset.tokens.read(0, len(dataset.tokens)).tolist() == expected


def test_text_lines_become_documents_when_sampled_by_line(tmp_path, build_dataset, byte_context):
    (tmp_path / "a.txt").write_text("one\n\ntwo\nthree\n")
    table = {"path": str(tmp_path / "a.txt"), "sample_by": "line", "eval_fraction": 0.0}
    dataset = build_dataset("hf_text", {**table, "cache_dir": str(tmp_path / "cache")}, byte_context(seq_len=4))
    assert dataset.tokens.read(0, len(dataset.tokens)).tolist() == expected_stream(["one\n", "two\n", "three\n"])


def test_samples_resume_exactly_from_a_saved_state(tmp_path, jsonl, build_dataset, byte_context, take):
    table = {"path": str(jsonl), "format": "json", "cache_dir": str(tmp_path / "cache")}
    dataset = build_dataset("hf_text", table, byte_context())
    iterator = iter(dataset)
    _ = [next(iterator) for _ in range(5)]
    state = dataset.state_dict()
    expected = [next(iterator)["input_ids"].tolist() for _ in range(6)]
    resumed = build_dataset("hf_text", table, byte_context())
    resumed.load_state_dict(state)
    assert [sample["input_ids"].tolist() for sample in take(resumed, 6)] == expected


def test_a_missing_text_field_is_a_config_error_listing_the_fields(tmp_path, jsonl, build_dataset, byte_context):
    table = {"path": str(jsonl), "format": "jsonl", "text_field": "body", "cache_dir": str(tmp_path / "cache")}
    with pytest.raises(ConfigError, match="no field 'body'; set text_field to one of 'text', 'n'"):
        build_dataset("hf_text", table, byte_context())


def test_a_malformed_json_file_is_an_error_naming_it(tmp_path, build_dataset, byte_context):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    table = {"path": str(tmp_path / "bad.jsonl"), "format": "jsonl", "cache_dir": str(tmp_path / "cache")}
    with pytest.raises(ForgeError, match=r"cannot read '.*bad.jsonl' as jsonl"):
        build_dataset("hf_text", table, byte_context())


def test_files_of_another_format_are_refused(tmp_path, build_dataset, byte_context):
    (tmp_path / "a.csv").write_text("text\nhello\n")
    with pytest.raises(ConfigError, match=r"reads .txt, .text, .md files; '.*a.csv' is not one"):
        build_dataset("hf_text", {"path": str(tmp_path / "a.csv")}, byte_context())


def test_without_the_datasets_library_the_error_names_the_extra(
    tmp_path, jsonl, build_dataset, byte_context, monkeypatch
):
    monkeypatch.setitem(sys.modules, "datasets", None)  # makes `import datasets` fail
    with pytest.raises(ForgeError, match=r"pip install forge-lm\[hf\]"):
        build_dataset("hf_text", {"path": str(jsonl), "format": "jsonl"}, byte_context())
