"""A run's tokenizer in Hugging Face form, written beside an exported model (``forge export-hf``).

``transformers.AutoTokenizer.from_pretrained(out_dir)`` then encodes text to the ids Forge's
tokenizer gives it (``encode(text, add_special_tokens=False)``) and decodes ids to the same
text, so the exported model scores and writes raw text as the Forge model does.

* ``bytes``: a ``tokenizer.json`` built here. Each UTF-8 byte is the token whose id is the
  byte's value, and the end-of-text id 256 is the special token ``<|endoftext|>``. Bytes become
  tokens through the byte-level alphabet of GPT-2 (a printable character per byte) with no
  splitting, no prefix space and no merges, so encoding never joins or reorders bytes; its
  decoder replaces bytes that are not valid UTF-8 with U+FFFD exactly as Forge's
  ``bytes(...).decode("utf-8", errors="replace")`` does (a byte-fallback decoder would not).
* ``hf``: the run's ``tokenizer.json``, copied as it is.

Both get a ``tokenizer_config.json`` naming the end-of-text token, the padding token where the
tokenizer has one (``<|pad|>`` of ``forge train-tokenizer``, or another usual padding special
token; the ``bytes`` tokenizer has none), and no beginning-of-text token (Forge adds none),
with ``clean_up_tokenization_spaces`` off so decoding keeps every space. Like any special token
of the ``tokenizers`` library, the literal text ``<|endoftext|>`` encodes as the special id in
Hugging Face form, where Forge's ``bytes`` tokenizer encodes its 13 bytes. Other tokenizers (a
plugin's) have no known Hugging Face form.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from forge_lm.errors import ForgeError
from forge_lm.tokenizers.byte_level import ByteTokenizer
from forge_lm.tokenizers.hf import HfTokenizer

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"  # read by transformers releases before 5


def hf_tokenizer_files(tokenizer: Any) -> list[str]:
    """The names :func:`save_hf_tokenizer` writes for ``tokenizer``: none for a tokenizer without
    a known Hugging Face form."""
    if isinstance(tokenizer, (ByteTokenizer, HfTokenizer)):
        return [TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE]
    return []


def save_hf_tokenizer(tokenizer: Any, out_dir: str | Path, model_max_length: int) -> list[str]:
    """Write ``tokenizer`` into ``out_dir`` in Hugging Face form; returns the names of the files
    written, or an empty list when the tokenizer has no known Hugging Face form. No file is
    written through a link: a link at any of their names is refused before anything is written.
    The run's own ``tokenizer.json``, when it is ``out_dir/tokenizer.json``, is kept as it is."""
    from forge_lm.model.hf import make_export_dir, refuse_export_links, write_export_file

    names = hf_tokenizer_files(tokenizer)
    if not names:
        return []
    out = Path(out_dir)
    # Read or built before anything is written: building needs the tokenizers package.
    content: bytes | None
    if isinstance(tokenizer, ByteTokenizer):
        content = byte_tokenizer(tokenizer).to_str(pretty=True).encode("utf-8")
    elif tokenizer.path is None:  # made in memory: its own serialisation
        content = tokenizer._tokenizer.to_str(pretty=True).encode("utf-8")
    elif is_same_file(tokenizer.path, out / TOKENIZER_FILE):
        content = None  # already there
    else:
        content = Path(tokenizer.path).read_bytes()
    out = make_export_dir(out)
    refuse_export_links(out, names)
    if content is not None:
        write_export_file(out / TOKENIZER_FILE, content)
    special = {"eos_token": tokenizer.eos_token}
    pad = padding_token(tokenizer)
    if pad is not None:  # batched generation and evaluation in transformers pad with it
        special["pad_token"] = pad
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **special,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    write_export_file(out / TOKENIZER_CONFIG_FILE, (json.dumps(config, indent=2) + "\n").encode("utf-8"))
    write_export_file(out / SPECIAL_TOKENS_MAP_FILE, (json.dumps(special, indent=2) + "\n").encode("utf-8"))
    return names


USUAL_PADDING_TOKENS = ("<|pad|>", "<pad>", "[PAD]", "<|padding|>")


def padding_token(tokenizer: Any) -> str | None:
    """The first usual padding token that is one of ``tokenizer``'s special (added) tokens, or
    None (the ``bytes`` tokenizer has no padding id)."""
    if not isinstance(tokenizer, HfTokenizer):
        return None
    added = tokenizer._tokenizer.get_added_tokens_decoder().values()
    specials = {token.content for token in added if token.special}
    return next((token for token in USUAL_PADDING_TOKENS if token in specials), None)


def is_same_file(source: str | Path, target: Path) -> bool:
    """Whether ``target`` (not a link) is the file ``source``: copying one onto the other would empty it."""
    try:
        return not os.path.islink(target) and os.path.samefile(source, target)
    except OSError:  # either is missing
        return False


def byte_tokenizer(tokenizer: ByteTokenizer) -> Any:
    """A ``tokenizers.Tokenizer`` giving the ids of Forge's ``bytes`` tokenizer."""
    modules = _tokenizers_module()
    symbols = byte_symbols()
    vocab = {symbols[byte]: byte for byte in range(256)}
    vocab[tokenizer.eos_token] = tokenizer.eos_id
    hf = modules.Tokenizer(modules.models.BPE(vocab=vocab, merges=[]))
    # No regex split and no prefix space: the whole text is one run of byte symbols, which a
    # BPE without merges leaves one token per byte.
    hf.pre_tokenizer = modules.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    hf.decoder = modules.decoders.ByteLevel()
    hf.add_special_tokens([modules.AddedToken(tokenizer.eos_token, special=True, normalized=False)])
    probe = "A\n\t é€😀"
    if hf.encode(probe, add_special_tokens=False).ids != tokenizer.encode(probe):  # never write a wrong file
        raise RuntimeError("the Hugging Face form of the bytes tokenizer does not give Forge's ids")
    return hf


def byte_symbols() -> dict[int, str]:
    """GPT-2's byte-level alphabet: byte -> a printable character standing for it.

    Printable Latin-1 bytes stand for themselves; the others (controls, space, DEL, NBSP, soft
    hyphen) take the characters from U+0100 on, in byte order. This is the mapping the
    ``tokenizers`` library's ByteLevel pre-tokenizer and decoder apply.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    symbols = {byte: chr(byte) for byte in printable}
    others = (byte for byte in range(256) if byte not in symbols)
    symbols.update({byte: chr(256 + n) for n, byte in enumerate(others)})
    return symbols


def _tokenizers_module() -> Any:
    try:
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers  # noqa: F401  (submodules loaded)
    except ImportError:
        raise ForgeError(
            "writing the tokenizer in Hugging Face form needs the tokenizers package, which is not installed. "
            "Install it with `pip install forge-lm[hf]`."
        ) from None
    return tokenizers
