"""The memmap dataset: shards read with the dtype their metadata states, never a guessed one."""

from __future__ import annotations

import json

import numpy as np
import pytest

from forge_lm.errors import ConfigError, ForgeError


def write_bin(path, tokens, stored_as, **metadata):
    np.asarray(tokens, dtype=stored_as).tofile(path)
    path.with_suffix(".json").write_text(json.dumps(metadata))
    return path


def stream_of(dataset):
    return dataset.tokens.read(0, len(dataset.tokens)).tolist()


def test_an_even_count_of_uint16_tokens_reads_as_uint16_not_uint32(tmp_path, build_dataset, byte_context):
    # 6 uint16 tokens are 12 bytes, exactly 3 uint32s: only the metadata tells them apart.
    tokens = [40000, 1, 2, 65535, 7, 300]
    write_bin(tmp_path / "a.bin", tokens, "<u2", dtype="uint16")
    dataset = build_dataset(
        "memmap",
        {"path": str(tmp_path / "a.bin"), "eval_fraction": 0.0},
        byte_context(seq_len=5, vocab_size=65536, tokenizer=None),
    )
    assert stream_of(dataset) == tokens


def test_uint32_tokens_above_the_uint16_range_read_exactly(tmp_path, build_dataset, byte_context):
    tokens = [70000, 0, 123456, 5, 99999, 1, 2, 3]
    write_bin(tmp_path / "a.bin", tokens, "<u4", dtype="uint32", num_tokens=8)
    context = byte_context(seq_len=7, vocab_size=200_000, tokenizer=None)
    dataset = build_dataset("memmap", {"path": str(tmp_path / "a.bin"), "eval_fraction": 0.0}, context)
    assert stream_of(dataset) == tokens
    sample = next(iter(dataset))
    assert sample["input_ids"].tolist() == tokens[:7]
    assert sample["labels"].tolist() == tokens[1:]


def test_npy_shards_are_read_with_their_own_dtype(tmp_path, build_dataset, byte_context):
    tokens = np.arange(100, 150, dtype=np.int32)
    np.save(tmp_path / "a.npy", tokens)
    dataset = build_dataset("memmap", {"path": str(tmp_path / "a.npy")}, byte_context(tokenizer=None))
    assert stream_of(dataset) == tokens.tolist()


def test_a_directory_of_shards_is_one_stream_and_windows_straddle_shards(tmp_path, build_dataset, byte_context):
    rng = np.random.default_rng(0)
    parts = [rng.integers(0, 256, size=n) for n in (7, 30, 11)]
    write_bin(tmp_path / "s0.bin", parts[0], "<u2", dtype="uint16")
    np.save(tmp_path / "s1.npy", parts[1].astype(np.uint16))
    write_bin(tmp_path / "s2.bin", parts[2], "<u4", dtype="uint32")
    (tmp_path / "notes.txt").write_text("not a shard")
    reference = np.concatenate(parts)
    dataset = build_dataset("memmap", {"path": str(tmp_path), "eval_fraction": 0.0}, byte_context(seq_len=4))
    assert len(dataset) == (48 - 1) // 4
    samples = {tuple(s["input_ids"].tolist()): s["labels"].tolist() for s in [dataset.sample(k) for k in range(11)]}
    expected = {tuple(reference[k * 4 : k * 4 + 4]): reference[k * 4 + 1 : k * 4 + 5].tolist() for k in range(11)}
    assert samples == expected


def test_a_glob_selects_shards_in_sorted_order(tmp_path, build_dataset, byte_context):
    write_bin(tmp_path / "b.bin", [3, 4, 5], "<u2", dtype="uint16")
    write_bin(tmp_path / "a.bin", [0, 1, 2], "<u2", dtype="uint16")
    write_bin(tmp_path / "c.bin", [9, 9, 9], "<u2", dtype="uint16")
    context = byte_context(seq_len=2, tokenizer=None)
    dataset = build_dataset("memmap", {"path": str(tmp_path / "[ab].bin"), "eval_fraction": 0.0}, context)
    assert stream_of(dataset) == [0, 1, 2, 3, 4, 5]


def test_train_and_eval_windows_are_disjoint_and_cover_the_data(tmp_path, build_dataset, byte_context):
    write_bin(tmp_path / "a.bin", np.arange(201) % 250, "<u2", dtype="uint16")
    table = {"path": str(tmp_path / "a.bin"), "eval_fraction": 0.1}
    train = build_dataset("memmap", table, byte_context(seq_len=2))
    held = build_dataset("memmap", table, byte_context(seq_len=2, split="eval"))
    assert list(held.windows) == [9, 19, 29, 39, 49, 59, 69, 79, 89, 99]
    assert sorted([*train.windows, *held.windows]) == list(range(100))
    firsts = {int(held.sample(j)["input_ids"][0]) for j in range(len(held))}
    assert firsts == {2 * k for k in held.windows}


def test_document_ids_come_from_the_metadata_eos_else_the_tokenizer_else_none(tmp_path, build_dataset, byte_context):
    tokens = [1, 2, 9, 3, 4, 9, 5, 6, 7]
    write_bin(tmp_path / "meta.bin", tokens, "<u2", dtype="uint16", eos_id=9)
    np.save(tmp_path / "bare.npy", np.array([1, 2, 256, 3, 4, 256, 5, 6, 7]))
    table = {"eval_fraction": 0.0}
    meta = build_dataset(
        "memmap", {**table, "path": str(tmp_path / "meta.bin")}, byte_context(seq_len=8, tokenizer=None)
    )
    bare = build_dataset("memmap", {**table, "path": str(tmp_path / "bare.npy")}, byte_context(seq_len=8))
    blind = build_dataset(
        "memmap", {**table, "path": str(tmp_path / "bare.npy")}, byte_context(seq_len=8, tokenizer=None)
    )
    assert meta.sample(0)["document_ids"].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert bare.sample(0)["document_ids"].tolist() == [0, 0, 1, 1, 1, 2, 2, 2]
    assert blind.sample(0)["document_ids"].tolist() == [0] * 8


def test_a_bin_without_metadata_is_an_error_naming_the_metadata_file(tmp_path, build_dataset, byte_context):
    np.arange(10, dtype="<u2").tofile(tmp_path / "tokens.bin")
    with pytest.raises(ForgeError, match=r"no metadata file '.*tokens.json'") as error:
        build_dataset("memmap", {"path": str(tmp_path / "tokens.bin")}, byte_context())
    assert '{"dtype": "uint16"}' in str(error.value)
    assert "forge prepare-data" in str(error.value)


@pytest.mark.parametrize(
    ("metadata", "message"),
    [
        ({"dtype": "float32"}, "dtype 'float32', which is not a token dtype; use one of uint8, uint16"),
        ({"num_tokens": 10}, "does not state the dtype"),
        ({"dtype": "uint16", "num_tokens": 12}, "holds 10 tokens but its metadata states num_tokens = 12"),
        ({"dtype": "uint32"}, "20 bytes, not a whole number of uint32 tokens"),
        ([1, 2], "must hold a JSON object"),
    ],
)
def test_wrong_metadata_is_an_error_saying_what_is_wrong(tmp_path, build_dataset, byte_context, metadata, message):
    np.arange(10, dtype="<u2")[:10].tofile(tmp_path / "a.bin")
    if metadata == {"dtype": "uint32"}:
        (tmp_path / "a.bin").write_bytes(b"\0" * 20 + b"\1\2")  # 22 bytes
        message = "22 bytes, not a whole number of uint32 tokens"
    (tmp_path / "a.json").write_text(json.dumps(metadata))
    with pytest.raises(ForgeError, match=message):
        build_dataset("memmap", {"path": str(tmp_path / "a.bin")}, byte_context())


def test_corrupt_files_are_errors_naming_them(tmp_path, build_dataset, byte_context):
    (tmp_path / "a.json").write_text("{dtype: uint16")
    np.arange(10, dtype="<u2").tofile(tmp_path / "a.bin")
    with pytest.raises(ForgeError, match=r"a.json' is not valid JSON"):
        build_dataset("memmap", {"path": str(tmp_path / "a.bin")}, byte_context())
    (tmp_path / "b.npy").write_bytes(b"\x93NUMPY garbage")
    with pytest.raises(ForgeError, match=r"b.npy' is not a readable .npy file"):
        build_dataset("memmap", {"path": str(tmp_path / "b.npy")}, byte_context())
    np.save(tmp_path / "c.npy", np.zeros((4, 4), dtype=np.int32))
    with pytest.raises(ForgeError, match="2-D array of int32; a token shard is a 1-D integer array"):
        build_dataset("memmap", {"path": str(tmp_path / "c.npy")}, byte_context())


def test_missing_paths_and_empty_directories_are_config_errors(tmp_path, build_dataset, byte_context):
    with pytest.raises(ConfigError, match=r"path '.*nowhere' does not exist"):
        build_dataset("memmap", {"path": str(tmp_path / "nowhere")}, byte_context())
    with pytest.raises(ConfigError, match=r"holds no .bin, .npy files"):
        build_dataset("memmap", {"path": str(tmp_path)}, byte_context())
    with pytest.raises(ConfigError, match="required by dataset 'memmap'"):
        build_dataset("memmap", {}, byte_context())


def test_a_sequence_longer_than_the_shards_is_a_config_error(tmp_path, build_dataset, byte_context):
    write_bin(tmp_path / "a.bin", range(10), "<u2", dtype="uint16")
    with pytest.raises(ConfigError, match="holds 10 tokens, fewer than seq_len \\+ 1 = 17"):
        build_dataset("memmap", {"path": str(tmp_path / "a.bin")}, byte_context(seq_len=16))


def test_shards_made_with_another_tokenizer_are_refused(tmp_path, build_dataset, byte_context):
    write_bin(tmp_path / "a.bin", range(100), "<u2", dtype="uint16", eos_id=50256, vocab_size=50257, tokenizer="gpt2")
    with pytest.raises(
        ConfigError, match="eos_id = 50256 \\(tokenizer gpt2\\), but the run's tokenizer has eos_id = 256"
    ):
        build_dataset("memmap", {"path": str(tmp_path / "a.bin")}, byte_context())
    with pytest.raises(ConfigError, match="vocabulary of 50257 ids but the model's has 257"):
        build_dataset("memmap", {"path": str(tmp_path / "a.bin")}, byte_context(tokenizer=None))


def test_token_ids_outside_the_vocabulary_are_refused_when_read(tmp_path, build_dataset, byte_context):
    np.save(tmp_path / "a.npy", np.array([1, 2, 3, 999, 4, 5, 6, 7, 8]))
    dataset = build_dataset("memmap", {"path": str(tmp_path / "a.npy"), "eval_fraction": 0.0}, byte_context(seq_len=8))
    with pytest.raises(ForgeError, match="token id 999, outside the model's vocabulary of 257"):
        next(iter(dataset))


def test_shards_made_with_different_tokenizers_cannot_be_mixed(tmp_path, build_dataset, byte_context):
    write_bin(tmp_path / "a.bin", range(10), "<u2", dtype="uint16", eos_id=256)
    write_bin(tmp_path / "b.bin", range(10), "<u2", dtype="uint16", eos_id=0)
    with pytest.raises(ConfigError, match=r"different tokenizers \(eos_id: '.*a.bin': 256, '.*b.bin': 0\)"):
        build_dataset("memmap", {"path": str(tmp_path)}, byte_context(seq_len=4))
