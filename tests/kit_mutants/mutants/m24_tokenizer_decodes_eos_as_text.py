"""A tokenizer that decodes the end-of-text id to its name '<|endoftext|>'."""

from kit_mutant_base import Utf8Tokenizer

CATEGORY = "tokenizers"
EXPECTED_CHECK = "decode_gives_no_text_for_the_end_of_text_id"


class Showing(Utf8Tokenizer):
    def decode(self, ids):
        parts = [super(Showing, self).decode([i]) if i < 256 else "<|endoftext|>" for i in ids]  # bug
        return bytes(b for p in parts for b in p.encode()).decode()


def factory(options):
    return Showing()
