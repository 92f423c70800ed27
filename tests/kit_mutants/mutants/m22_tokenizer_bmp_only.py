"""A code-point tokenizer with a 16-bit vocabulary: characters beyond the Basic Multilingual
Plane (emoji, rare CJK) become an unknown id."""

CATEGORY = "tokenizers"
EXPECTED_CHECK = "decode_inverts_encode"


class Ucs2:
    vocab_size, eos_id = 65536, 0xFFFF
    unknown = 0xFFFD

    def encode(self, text):
        return [ord(c) if ord(c) < 0xFFFF else self.unknown for c in text]  # bug: planes 1-16 lost

    def decode(self, ids):
        return "".join(chr(i) for i in ids if i != self.eos_id)


def factory(options):
    return Ucs2()
