"""A tokenizer from a Hugging Face ``tokenizer.json`` file, run by the ``tokenizers`` library.

Any tokenizer the library can load works (BPE, WordPiece, Unigram, with their normalisers
and pre-tokenisers). The file is read from local disk only; nothing is downloaded. Which
token ends a document is the ``eos_token`` option, or else the ``eos_token`` of a
``tokenizer_config.json`` beside the file, or else the first of the usual end tokens
(``</s>``, ``<|endoftext|>``, ...) in the vocabulary. ``tokenizers`` is an optional
dependency (``pip install forge-lm[hf]``), imported when the tokenizer is built.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from forge_lm.errors import ConfigError, PluginError
from forge_lm.tokenizers.patterns import nested_repetition, regex_patterns

INSTALL_HINT = "pip install forge-lm[hf]"

# End-of-document tokens of common tokenizer families, tried in this order.
USUAL_EOS_TOKENS = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eos|>")


class HfTokenizer:
    """Wraps a ``tokenizers.Tokenizer``.

    ``encode`` adds no special tokens (no BOS or template from a post-processor): datasets
    decide where documents start and end, with :attr:`eos_id`. ``decode`` drops special
    tokens, so decoding a packed sequence reads as text.
    """

    def __init__(self, tokenizer: Any, eos_token: str, path: Path | None = None) -> None:
        self._tokenizer = tokenizer
        self.eos_token = eos_token
        self.path = path  # the tokenizer.json it was read from, if any (forge export-hf copies it)
        self.eos_id: int = tokenizer.token_to_id(eos_token)
        # One past the largest id rather than get_vocab_size(): vocabularies may skip ids,
        # and the model's embedding must cover every id the tokenizer can produce.
        self.vocab_size: int = max(tokenizer.get_vocab(with_added_tokens=True).values()) + 1

    def encode(self, text: str) -> list[int]:
        try:
            return self._tokenizer.encode(text, add_special_tokens=False).ids
        except BaseException as exc:
            # The library's Rust panics (its regex engine's retry limit, reached on some text by a
            # pattern that backtracks) reach Python as pyo3's PanicException, a BaseException.
            if type(exc).__name__ != "PanicException":
                raise
            raise ConfigError(
                f"[tokenizer] path: '{self.path}': the tokenizers library failed while encoding a text that "
                f"begins {text[:40]!r}: {' '.join(str(exc).split())}. A regular expression of the tokenizer "
                "backtracks too much on it; simplify that pattern, or use another tokenizer.json."
            ) from None

    def decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=True)


def _tokenizer_class() -> type:
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise PluginError(
            f"tokenizer 'hf' needs the tokenizers package, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return Tokenizer


def load_tokenizer(path: str | Path) -> Any:
    """The ``tokenizers.Tokenizer`` in ``path``, or a ConfigError saying what is wrong with it."""
    path = Path(path).expanduser()
    tokenizer_class = _tokenizer_class()
    if not path.is_file():
        what = "is a directory" if path.is_dir() else "does not exist"
        raise ConfigError(
            f"[tokenizer] path: '{path}' {what}; set it to a tokenizer.json file (the one a Hugging Face "
            "tokenizer saves with tokenizer.save(...) or save_pretrained(...))."
        )
    try:
        tokenizer = tokenizer_class.from_file(str(path))
    except Exception as exc:  # the Rust library raises a bare Exception for any unreadable file
        raise ConfigError(
            f"[tokenizer] path: '{path}' is not a tokenizer.json the tokenizers library reads: {exc}"
        ) from exc
    _vet_patterns(tokenizer, path)
    return tokenizer


def _vet_patterns(tokenizer: Any, path: Path) -> None:
    """Refuse a regular expression that backtracks catastrophically (:mod:`.patterns`), read
    from the loaded tokenizer's own serialisation: what the library parsed is what it runs."""
    tree = json.loads(tokenizer.to_str())
    for where, pattern in regex_patterns(tree):
        nested = nested_repetition(pattern)
        if nested is not None:
            raise ConfigError(
                f"[tokenizer] path: '{path}': the regular expression {pattern!r} ({where}) repeats {nested!r}, "
                "a repetition inside a repetition: on some text it tries exponentially many ways to match "
                "(catastrophic backtracking) and encoding hangs. Rewrite it without the nested repetition "
                "(e.g. '(a+)+' as 'a+'), or use another tokenizer.json."
            )


def choose_eos_token(tokenizer: Any, path: Path, configured: str | None) -> str:
    """The end-of-document token: the option, else tokenizer_config.json's, else a usual one."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    if configured is not None:
        if configured not in vocab:
            raise ConfigError(
                f"[tokenizer] eos_token: {configured!r} is not in the vocabulary of '{path}'. "
                f"Its special tokens: {_special_tokens(tokenizer)}."
            )
        return configured
    candidates = [_eos_from_tokenizer_config(path.parent / "tokenizer_config.json"), *USUAL_EOS_TOKENS]
    for candidate in candidates:
        if candidate is not None and candidate in vocab:
            return candidate
    raise ConfigError(
        f"[tokenizer] eos_token: '{path}' has none of the usual end-of-document tokens "
        f"({', '.join(USUAL_EOS_TOKENS)}); set eos_token to the token that ends a document. "
        f"Its special tokens: {_special_tokens(tokenizer)}."
    )


def _eos_from_tokenizer_config(config_path: Path) -> str | None:
    # transformers keeps eos_token beside tokenizer.json, as a string or as an AddedToken table.
    try:
        eos = json.loads(config_path.read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None  # no readable config beside the file: fall back to the usual tokens
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _special_tokens(tokenizer: Any) -> str:
    added = sorted(token.content for token in tokenizer.get_added_tokens_decoder().values() if token.special)
    return ", ".join(repr(token) for token in added) if added else "(none)"


def build_hf_tokenizer(options) -> HfTokenizer:
    path = Path(options.path).expanduser()
    tokenizer = load_tokenizer(path)
    return HfTokenizer(tokenizer, choose_eos_token(tokenizer, path, options.eos_token), path)
