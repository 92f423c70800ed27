"""``forge prepare-data``: shards plus metadata that the memmap dataset reads back exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from forge_lm.cli._main import main
from forge_lm.data.prepare import prepare
from forge_lm.errors import ForgeError

TEXTS = {"b.txt": "The second file.\nIt has two lines.\n", "a.txt": "First: héllo wörld\n", "c.md": "# third\n"}


def prepare_data(*args: str) -> int:
    return main(["prepare-data", *args, "--no-plugin-autoload"])


def reference_stream(texts: list[str]) -> list[int]:
    """Tokenizing the text directly with the byte tokenizer: UTF-8 bytes, then eos (256)."""
    return [token for text in texts for token in [*text.encode("utf-8"), 256]]


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for name, text in TEXTS.items():
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def test_prepared_shards_read_back_as_the_directly_tokenized_text(
    tmp_path, corpus, build_dataset, byte_context, capsys
):
    assert prepare_data(str(corpus), "--output", str(tmp_path / "out"), "--tokenizer.name=bytes") == 0
    expected = reference_stream([TEXTS["a.txt"], TEXTS["b.txt"], TEXTS["c.md"]])  # sorted file order
    dataset = build_dataset("memmap", {"path": str(tmp_path / "out"), "eval_fraction": 0.0}, byte_context(seq_len=8))
    assert dataset.tokens.read(0, len(dataset.tokens)).tolist() == expected
    window = dataset.sample(2)
    assert window["input_ids"].tolist() == expected[16:24]
    assert window["labels"].tolist() == expected[17:25]
    assert f"Wrote {len(expected)} tokens (3 documents, uint16) to 1 shard(s)" in capsys.readouterr().out


def test_shards_hold_shard_tokens_each_with_metadata_stating_dtype_and_tokenizer(tmp_path, corpus):
    assert prepare_data(str(corpus / "*.txt"), "-o", str(tmp_path / "out"), "--shard-tokens", "20") == 0
    total = len(reference_stream([TEXTS["a.txt"], TEXTS["b.txt"]]))  # 23 + 36 = 59 tokens
    shards = sorted((tmp_path / "out").glob("*.bin"))
    assert [shard.name for shard in shards] == ["shard_00000.bin", "shard_00001.bin", "shard_00002.bin"]
    assert [shard.stat().st_size for shard in shards] == [40, 40, 2 * (total - 40)]  # uint16: 2 bytes a token
    metadata = json.loads((tmp_path / "out" / "shard_00002.json").read_text())
    assert metadata == {
        "format": "forge-lm-tokens/1",
        "dtype": "uint16",
        "num_tokens": total - 40,
        "eos_id": 256,
        "vocab_size": 257,
        "tokenizer": "bytes",
    }


def test_jsonl_lines_are_documents_from_the_text_field(tmp_path, build_dataset, byte_context):
    rows = [{"body": "one", "id": 1}, {"body": "two two", "id": 2}]
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(rows[0]) + "\n\n" + json.dumps(rows[1]) + "\n")
    assert prepare_data(str(path), "--format", "jsonl", "--text-field", "body", "-o", str(tmp_path / "out")) == 0
    dataset = build_dataset("memmap", {"path": str(tmp_path / "out"), "eval_fraction": 0.0}, byte_context(seq_len=4))
    assert dataset.tokens.read(0, len(dataset.tokens)).tolist() == reference_stream(["one", "two two"])


class WideTokenizer:
    """More than 65536 ids: each character becomes 65536 + its code point."""

    vocab_size = 70_000
    eos_id = 69_999

    def encode(self, text):
        return [65_536 + ord(c) for c in text]


def test_a_vocabulary_above_65536_ids_is_stored_as_uint32_and_read_back(tmp_path, build_dataset, byte_context):
    (tmp_path / "a.txt").write_text("abcd")
    result = prepare([str(tmp_path / "a.txt")], tmp_path / "out", WideTokenizer(), tokenizer_name="wide")
    assert result.dtype == "uint32"
    assert result.num_tokens == 5
    context = byte_context(seq_len=4, vocab_size=70_000, tokenizer=WideTokenizer())
    dataset = build_dataset("memmap", {"path": str(tmp_path / "out"), "eval_fraction": 0.0}, context)
    assert dataset.tokens.read(0, 5).tolist() == [65_633, 65_634, 65_635, 65_636, 69_999]


def test_progress_is_reported_in_bytes_up_to_the_total(tmp_path, corpus):
    seen = []
    prepare(
        [str(corpus)], tmp_path / "out", WideTokenizer(), tokenizer_name="wide", on_progress=lambda *a: seen.append(a)
    )
    total = sum(len(text.encode()) for text in TEXTS.values())
    assert seen[-1] == (total, total)
    assert [done for done, _ in seen] == sorted(done for done, _ in seen)


def test_an_output_directory_with_shards_is_refused(tmp_path, corpus, capsys):
    assert prepare_data(str(corpus), "-o", str(tmp_path / "out")) == 0
    assert prepare_data(str(corpus), "-o", str(tmp_path / "out")) == 2
    assert "already holds shards (shard_00000.bin, ...); choose an empty directory" in capsys.readouterr().err


def test_a_link_among_the_shard_names_is_refused_and_its_target_left_alone(tmp_path, corpus, capsys):
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_00000.json").symlink_to(victim)

    assert prepare_data(str(corpus), "-o", str(out)) == 2

    err = capsys.readouterr().err
    assert f"forge: error: '{out / 'shard_00000.json'}' is a symbolic link (to '{victim}')" in err
    assert "Choose an empty directory for --output" in err
    assert victim.read_text() == "keep me\n"
    assert sorted(path.name for path in out.iterdir()) == ["shard_00000.json"]  # nothing written beside it


def test_existing_shard_metadata_counts_as_existing_shards(tmp_path, corpus, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "shard_00000.json").write_text("{}\n")

    assert prepare_data(str(corpus), "-o", str(out)) == 2

    assert "already holds shards (shard_00000.json, ...); choose an empty directory" in capsys.readouterr().err
    assert (out / "shard_00000.json").read_text() == "{}\n"


def test_a_shard_name_taken_while_writing_is_never_written_through(tmp_path, corpus, monkeypatch):
    # A link planted after the output was checked: the shard is created with O_EXCL | O_NOFOLLOW.
    from forge_lm.data import prepare as prepare_module

    victim = tmp_path / "victim.txt"
    victim.write_text("keep me\n")
    out = tmp_path / "out"
    check = prepare_module._check_output

    def check_then_plant(output):
        check(output)
        (output / "shard_00000.json").symlink_to(victim)

    monkeypatch.setattr(prepare_module, "_check_output", check_then_plant)

    with pytest.raises(ForgeError, match="is a symbolic link"):
        prepare([str(corpus)], out, WideTokenizer(), tokenizer_name="wide")

    assert victim.read_text() == "keep me\n"
    assert sorted(path.name for path in out.iterdir()) == ["shard_00000.json"]  # the link is not removed


def test_an_output_that_is_a_file_is_a_clear_error(tmp_path, corpus, capsys):
    (tmp_path / "out").write_text("not a folder\n")

    assert prepare_data(str(corpus), "-o", str(tmp_path / "out")) == 2
    assert f"forge: error: --output '{tmp_path / 'out'}' is a file, not a directory" in capsys.readouterr().err

    assert prepare_data(str(corpus), "-o", str(tmp_path / "out" / "sub")) == 2
    assert f"forge: error: cannot create or read the output directory '{tmp_path / 'out' / 'sub'}'" in (
        capsys.readouterr().err
    )
    assert (tmp_path / "out").read_text() == "not a folder\n"


def test_an_unreadable_input_is_named_and_leaves_no_shards(tmp_path, corpus, monkeypatch, capsys):
    # Simulated, as /proc/self/mem is: opening works, reading fails with an I/O error (no file name).
    broken = corpus / "b.txt"
    read_bytes = Path.read_bytes

    def fail(path: Path) -> bytes:
        if path == broken:
            raise OSError(5, "Input/output error")
        return read_bytes(path)

    monkeypatch.setattr(Path, "read_bytes", fail)

    assert prepare_data(str(corpus), "-o", str(tmp_path / "out"), "--shard-tokens", "2") == 2

    assert f"forge: error: cannot read '{broken}': Input/output error." in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []


def test_bad_input_is_an_error_naming_the_line_and_leaves_no_shards(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"text": "fine"}\n{"text": oops}\n')
    assert prepare_data(str(path), "--format", "jsonl", "-o", str(tmp_path / "out"), "--shard-tokens", "2") == 2
    assert f"forge: error: {path}:2 is not valid JSON" in capsys.readouterr().err
    assert list((tmp_path / "out").iterdir()) == []
    path.write_text('{"body": "x"}\n')
    assert prepare_data(str(path), "--format", "jsonl", "-o", str(tmp_path / "out")) == 2
    assert (
        "has no text field 'text' (its keys: 'body'); name the right one with --text-field" in capsys.readouterr().err
    )


def test_missing_inputs_and_unknown_tokenizers_are_usage_errors(tmp_path, corpus, capsys):
    assert prepare_data(str(tmp_path / "nothing.txt"), "-o", str(tmp_path / "out")) == 2
    assert "input '" in capsys.readouterr().err
    assert prepare_data(str(corpus), "-o", str(tmp_path / "out"), "--tokenizer.name=bites") == 2
    assert "unknown tokenizer 'bites'. Did you mean 'bytes'?" in capsys.readouterr().err


def test_the_command_is_listed_with_its_options(capsys):
    with pytest.raises(SystemExit):
        main(["prepare-data", "--help"])
    out = capsys.readouterr().out
    assert all(flag in out for flag in ("--output", "--format", "--text-field", "--shard-tokens", "--config"))


def test_shard_dtype_follows_the_vocabulary_size():
    from forge_lm.data.shards import token_dtype

    assert token_dtype(257) == np.dtype("<u2")
    assert token_dtype(65_536) == np.dtype("<u2")
    assert token_dtype(65_537) == np.dtype("<u4")
