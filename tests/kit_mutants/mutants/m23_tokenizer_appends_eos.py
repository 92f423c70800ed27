"""A tokenizer whose encode appends the end-of-text id, as a Hugging Face post-processor does:
datasets then put it twice between documents."""

from kit_mutant_base import Utf8Tokenizer

CATEGORY = "tokenizers"
EXPECTED_CHECK = "encode_adds_no_end_of_text_id"


class Appending(Utf8Tokenizer):
    def encode(self, text):
        return [*super().encode(text), self.eos_id]  # bug


def factory(options):
    return Appending()
