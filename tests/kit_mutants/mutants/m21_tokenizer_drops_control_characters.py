"""A tokenizer that cleans text by keeping printable characters only (and tab, newline): the
control characters of web text are lost."""

from kit_mutant_base import Utf8Tokenizer

CATEGORY = "tokenizers"
EXPECTED_CHECK = "decode_inverts_encode"


class Cleaning(Utf8Tokenizer):
    def encode(self, text):
        kept = "".join(c for c in text if c.isprintable() or c in "\t\n")  # bug: lossy
        return super().encode(kept)


def factory(options):
    return Cleaning()
