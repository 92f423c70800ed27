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
    assert 0 <= tokenizer.eos_id < tokenizer.vocab_size, (
        f"{subject.label}: eos_id is {tokenizer.eos_id}; the kit expects it within [0, vocab_size) = "
        f"[0, {tokenizer.vocab_size})"
    )
    for text in TEXTS:
        ids = tokenizer.encode(text)
        bad = [i for i in ids if not (isinstance(i, int) and 0 <= i < tokenizer.vocab_size)]
        assert not bad, (
            f"{subject.label}: encode({text!r}) gives ids {bad[:5]}; the kit expects Python ints within "
            f"[0, vocab_size) = [0, {tokenizer.vocab_size})"
        )


@category_check("tokenizers")
def check_decode_inverts_encode(subject: Subject) -> None:
    if not subject.extras.get("lossless", True):
        return  # the author declared the round trip lossy; the vocabulary check still runs
    tokenizer = subject.build()
    for text in TEXTS:
        again = tokenizer.decode(tokenizer.encode(text))
        assert again == text, (
            f"{subject.label}: decode(encode({text!r})) gives {again!r}; the kit expects the text back unchanged "
            "(pass lossless=False for a tokenizer that normalises text)"
        )
