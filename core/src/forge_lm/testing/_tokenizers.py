"""Tokenizer contract: ``factory(options) -> tokenizer`` with ``encode``, ``decode``,
``vocab_size`` and ``eos_id``.

Extra: ``lossless=False`` for tokenizers whose normalisation changes text on a round trip.
"""

from __future__ import annotations

from forge_lm.testing._kit import Subject, category_check

TEXTS = ["Hello, Forge!", "  spaces\tand\nnewlines  ", "Ünïcödé: 東京 🔥", ""]


@category_check("tokenizers")
def check_ids_lie_in_the_vocabulary(subject: Subject) -> None:
    tokenizer = subject.build()
    assert 0 <= tokenizer.eos_id < tokenizer.vocab_size, f"{subject.label}: eos_id outside the vocabulary"
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert all(isinstance(i, int) and 0 <= i < tokenizer.vocab_size for i in ids), (
            f"{subject.label}: encode({text!r}) gives ids outside [0, {tokenizer.vocab_size})"
        )


@category_check("tokenizers")
def check_decode_inverts_encode(subject: Subject) -> None:
    if not subject.extras.get("lossless", True):
        return  # the author declared the round trip lossy; the vocabulary check still runs
    tokenizer = subject.build()
    for text in TEXTS:
        assert tokenizer.decode(tokenizer.encode(text)) == text, f"{subject.label}: decode(encode({text!r})) differs"
