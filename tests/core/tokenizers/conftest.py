"""A small byte-level BPE tokenizer.json, trained here with the tokenizers library (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Forge pre-trains language models with plugins.",
    "The dog sleeps; the fox runs over the hills.",
    "Tokenizers split text into pieces that the model reads.",
] * 4


def train_byte_level_bpe(path: Path, special_tokens: list[str]) -> Path:
    """Train a byte-level BPE (GPT-2 style: every byte has a token, so any text round-trips)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=special_tokens, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(SENTENCES, trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture
def bpe_json(tmp_path: Path) -> Path:
    """tokenizer.json of a byte-level BPE whose only special token is ``<|endoftext|>``."""
    return train_byte_level_bpe(tmp_path / "tokenizer.json", ["<|endoftext|>"])


@pytest.fixture
def make_bpe_json(tmp_path: Path):
    """Build a tokenizer.json with the given special tokens, in its own folder under tmp_path."""

    def make(special_tokens: list[str], folder: str = "custom") -> Path:
        (tmp_path / folder).mkdir()
        return train_byte_level_bpe(tmp_path / folder / "tokenizer.json", special_tokens)

    return make
