"""Tokenizer contract: ``factory(options) -> tokenizer`` with ``encode``, ``decode``,
``vocab_size`` and ``eos_id`` (:class:`forge_lm.components.Tokenizer`): ``encode`` adds no
end-of-text id (datasets place it between documents), ``decode`` gives no text for it.

Extra: ``lossless=False`` for tokenizers whose normalisation changes text on a round trip.
"""

from __future__ import annotations

from forge_lm.testing._kit import Subject, category_check

CONTROL = "".join(chr(c) for c in range(32) if chr(c) not in "\t\n") + "\x7f\x85"
"""Control characters other than tab and newline: text from the web holds them."""

PLANES = "".join(chr(plane * 0x10000 + 0x100) for plane in range(17))
"""One character from each of Unicode's 17 planes (U+0100, U+10100, ... U+100100): the first
three hold assigned characters, the rest are reserved or private use, all valid in UTF-8."""

TEXTS = [
    "Hello, Forge!",
    "  spaces\tand\nnewlines  ",
    "Ünïcödé: 東京 🔥",
    "",
    f"control {CONTROL} characters",
    f"planes {PLANES}",
    "\r\n\x00",
]


def _shown(text: str) -> str:
    return repr(text) if len(text) <= 40 else repr(text[:37]) + "..."


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
            f"{subject.label}: encode({_shown(text)}) gives ids {bad[:5]}; the kit expects Python ints within "
            f"[0, vocab_size) = [0, {tokenizer.vocab_size})"
        )


@category_check("tokenizers")
def check_decode_inverts_encode(subject: Subject) -> None:
    """Over plain text, tabs and newlines, control characters, a character of every Unicode
    plane and the empty string."""
    if not subject.extras.get("lossless", True):
        return  # the author declared the round trip lossy; the vocabulary check still runs
    tokenizer = subject.build()
    for text in TEXTS:
        again = tokenizer.decode(tokenizer.encode(text))
        if again != text:
            lost = sorted({f"U+{ord(c):04X}" for c in text} - {f"U+{ord(c):04X}" for c in again})
            detail = f"; characters lost: {', '.join(lost[:8])}" if lost else ""
            raise AssertionError(
                f"{subject.label}: decode(encode({_shown(text)})) gives {_shown(again)}; the kit expects the text back "
                f"unchanged (pass lossless=False for a tokenizer that normalises text){detail}"
            )


@category_check("tokenizers")
def check_encode_adds_no_end_of_text_id(subject: Subject) -> None:
    """Datasets put ``eos_id`` between documents themselves: ``encode`` must not add it (nor
    anything for the empty string)."""
    tokenizer = subject.build()
    empty = tokenizer.encode("")
    assert list(empty) == [], (
        f"{subject.label}: encode('') gives {list(empty)[:5]}; the kit expects [] (encode adds no special ids: "
        "datasets place eos_id between documents)"
    )
    for text in TEXTS:
        ids = list(tokenizer.encode(text))
        assert tokenizer.eos_id not in ids, (
            f"{subject.label}: encode({_shown(text)}) holds eos_id {tokenizer.eos_id} at position "
            f"{ids.index(tokenizer.eos_id)} of {len(ids)}; the kit expects no end-of-text id from encode (datasets "
            "place it between documents)"
        )


@category_check("tokenizers")
def check_decode_gives_no_text_for_the_end_of_text_id(subject: Subject) -> None:
    """A packed sequence (document, ``eos_id``, document) decodes to the two texts joined."""
    tokenizer = subject.build()
    first, second = tokenizer.encode("first document."), tokenizer.encode(" Second one.")
    joined = tokenizer.decode([*first, tokenizer.eos_id, *second])
    expected = tokenizer.decode([*first, *second])
    assert joined == expected, (
        f"{subject.label}: decode of two documents with eos_id {tokenizer.eos_id} between them gives {joined!r}; "
        f"the kit expects {expected!r}, the documents without it (decode gives no text for special ids)"
    )
