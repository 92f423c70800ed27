"""The default corpus: Python's standard library source, split by module, packed, learnable."""

from __future__ import annotations

import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from forge_lm.data.stdlib import MODULES
from forge_lm.errors import ConfigError, ForgeError

STDLIB = Path(sysconfig.get_paths()["stdlib"])


def source_bytes(module: str) -> bytes:
    """Independent of the dataset's reader: the module's file, as bytes."""
    path = STDLIB / f"{module}.py"
    return (path if path.is_file() else STDLIB / module / "__init__.py").read_bytes()


def expected_stream(modules: list[str]) -> list[int]:
    return [token for module in modules for token in [*source_bytes(module), 256]]


def test_modules_are_a_fixed_sorted_list_found_in_this_python():
    assert list(MODULES) == sorted(MODULES)
    assert all((STDLIB / f"{m}.py").is_file() or (STDLIB / m / "__init__.py").is_file() for m in MODULES)
    size = sum(len(source_bytes(m)) for m in MODULES)
    assert 1_000_000 < size < 5_000_000  # "a few MB"


def test_eval_holds_out_every_twentieth_module_and_train_the_rest(build_dataset, byte_context):
    train = build_dataset("python_stdlib", {}, byte_context())
    held = build_dataset("python_stdlib", {}, byte_context(split="eval"))
    eval_modules = [m for k, m in enumerate(MODULES) if (k + 1) % 20 == 0]  # 0.05 = 1/20
    train_modules = [m for m in MODULES if m not in eval_modules]
    assert held.tokens.read(0, len(held.tokens)).tolist() == expected_stream(eval_modules)
    assert train.tokens.read(0, len(train.tokens)).tolist() == expected_stream(train_modules)


def test_eval_fraction_sets_how_many_modules_are_held_out(build_dataset, byte_context):
    held = build_dataset("python_stdlib", {"eval_fraction": 0.25}, byte_context(split="eval"))
    eos_count = int((held.tokens.read(0, len(held.tokens)) == 256).sum())
    assert eos_count == len(MODULES) // 4


def test_samples_are_the_source_text_with_next_byte_labels(build_dataset, byte_context, take):
    dataset = build_dataset("python_stdlib", {}, byte_context(seq_len=64))
    stream = dataset.tokens.read(0, len(dataset.tokens))
    starts = {stream[k * 64 : k * 64 + 64].tobytes(): k * 64 for k in range(len(dataset))}
    for sample in take(dataset, 20):
        ids, labels = sample["input_ids"].numpy(), sample["labels"].numpy()
        start = starts[ids.tobytes()]  # every input is a stretch of the stream, at a window start
        assert (stream[start + 1 : start + 65] == labels).all()


def test_samples_are_shuffled_rather_than_in_file_order(build_dataset, byte_context, take):
    dataset = build_dataset("python_stdlib", {}, byte_context(seq_len=64))
    first = [bytes(sample["input_ids"].tolist()) for sample in take(dataset, 50)]
    in_order = [bytes(dataset.tokens.read(k * 64, 64).tolist()) for k in range(50)]
    assert first != in_order


def test_the_text_is_learnable_a_bigram_model_beats_uniform_by_far(build_dataset, byte_context):
    # Fit bigram counts on the train split, measure cross-entropy on eval: text is predictable,
    # so it must sit far below the log(257) = 5.55 nats of guessing.
    train = build_dataset("python_stdlib", {}, byte_context()).tokens
    held = build_dataset("python_stdlib", {}, byte_context(split="eval")).tokens
    a, b = train.read(0, len(train)), held.read(0, len(held))
    counts = np.ones((257, 257))  # add-one smoothing
    np.add.at(counts, (a[:-1], a[1:]), 1)
    probs = counts / counts.sum(axis=1, keepdims=True)
    cross_entropy = -np.log(probs[b[:-1], b[1:]]).mean()
    assert cross_entropy < 0.6 * math.log(257), cross_entropy


def test_building_without_a_tokenizer_or_with_too_small_a_vocabulary_is_a_config_error(build_dataset, byte_context):
    with pytest.raises(ConfigError, match="needs a tokenizer"):
        build_dataset("python_stdlib", {}, byte_context(tokenizer=None))
    with pytest.raises(ConfigError, match="vocab_size to at least 257"):
        build_dataset("python_stdlib", {}, byte_context(vocab_size=200))


def test_a_sequence_longer_than_the_split_is_a_config_error(build_dataset, byte_context):
    with pytest.raises(ConfigError, match="lower \\[train\\] seq_len"):
        build_dataset("python_stdlib", {}, byte_context(split="eval", seq_len=10_000_000))


def test_an_eval_fraction_holding_out_no_module_is_a_config_error(build_dataset, byte_context):
    with pytest.raises(ConfigError, match="eval split of dataset 'python_stdlib' has no modules"):
        build_dataset("python_stdlib", {"eval_fraction": 0.0}, byte_context(split="eval"))
    with pytest.raises(ConfigError, match="eval_fraction: must be at least 0 and below 1"):
        build_dataset("python_stdlib", {"eval_fraction": 1.0}, byte_context())


def test_a_python_without_source_files_gets_a_clear_error(tmp_path, monkeypatch):
    from forge_lm.data import stdlib

    monkeypatch.setattr(stdlib, "stdlib_directory", lambda: tmp_path)
    with pytest.raises(ForgeError, match="source files are not installed"):
        stdlib.read_documents()
