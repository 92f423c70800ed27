"""A tokenizer that gives the end-of-text id 256 but declares 256 ids: the embedding has no row
for it."""

from kit_mutant_base import Utf8Tokenizer

CATEGORY = "tokenizers"
EXPECTED_CHECK = "ids_lie_in_the_vocabulary"


class OffByOne(Utf8Tokenizer):
    vocab_size = 256  # bug: 257 ids exist


def factory(options):
    return OffByOne()
