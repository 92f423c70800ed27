"""A tokenizer with no vocabulary file: each UTF-8 byte is a token, plus end-of-text."""

from __future__ import annotations

from collections.abc import Sequence


class ByteTokenizer:
    vocab_size = 257
    eos_id = 256
    # The end-of-text id has no text of its own; this is the name it gets in Hugging Face form
    # (forge export-hf), where every token needs one.
    eos_token = "<|endoftext|>"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def build_byte_tokenizer(options) -> ByteTokenizer:
    return ByteTokenizer()
