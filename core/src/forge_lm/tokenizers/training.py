"""``forge train-tokenizer``'s work: train a byte-level BPE and write it as ``tokenizer.json``.

The result is a file the ``hf`` tokenizer component loads as it is (``[tokenizer] name =
"hf"``, ``path = ".../tokenizer.json"``), so ``forge prepare-data`` and ``forge train`` can use
it. Its design follows from what that component does and from exact round trips:

* Byte-level pre-tokenizer and decoder, with all 256 byte symbols in the vocabulary
  (``initial_alphabet``): any UTF-8 text, including characters never seen in training,
  encodes to known ids and decodes back to the same text.
* No normaliser (NFC, lowercasing... would change the text) and no prefix space (it would
  add a space that decoding keeps): ``decode(encode(text)) == text``.
* Two special tokens at fixed ids: :data:`END_OF_TEXT` (id 0), which the ``hf`` component
  picks as its end-of-document token, and :data:`PADDING` (id 1). No post-processor, so
  encoding never inserts them. Like every added special token of the ``tokenizers`` library,
  the *literal* string ``<|endoftext|>`` in a text is matched and encoded as the special id
  (and ``hf`` decoding drops it); the training reports how often the corpus holds such a string.

Training is deterministic: the same inputs and settings give a byte-identical file.
``tokenizers`` is the optional ``hf`` extra, imported only when training starts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs

from forge_lm.data.prepare import FORMATS, read_documents, resolve_inputs
from forge_lm.errors import ForgeError
from forge_lm.safe_write import write_atomically

END_OF_TEXT = "<|endoftext|>"
PADDING = "<|pad|>"
# Their order is their ids: the trainer gives special tokens the first ids, in this order.
SPECIAL_TOKENS = (END_OF_TEXT, PADDING)
BYTE_TOKENS = 256
MIN_VOCAB_SIZE = BYTE_TOKENS + len(SPECIAL_TOKENS)
TOKENIZER_FILE = "tokenizer.json"
INSTALL_HINT = "pip install forge-lm[hf]"


@attrs.frozen
class TrainedTokenizer:
    path: Path  # the tokenizer.json written
    vocab_size: int  # ids in the vocabulary, special tokens included
    requested_vocab_size: int
    min_frequency: int
    documents: int
    bytes_read: int
    special_ids: dict[str, int]
    literal_specials: dict[str, int]  # special-token strings found in the training text, and how often
    eos_token: str  # the end-of-document token the hf component picks for this file (see CLI note)

    @property
    def reached_requested_size(self) -> bool:
        return self.vocab_size >= self.requested_vocab_size


def check_settings(vocab_size: int, min_frequency: int, format: str) -> None:
    if vocab_size < MIN_VOCAB_SIZE:
        raise ForgeError(
            f"--vocab-size must be at least {MIN_VOCAB_SIZE} ({BYTE_TOKENS} byte tokens + "
            f"{len(SPECIAL_TOKENS)} special tokens), got {vocab_size}; merges are learned on top of those."
        )
    if min_frequency < 1:
        raise ForgeError(f"--min-frequency must be at least 1, got {min_frequency}.")
    if format not in FORMATS:
        raise ForgeError(f"unknown input format {format!r}; use 'text' or 'jsonl'.")


def output_file(output: Path, force: bool) -> Path:
    """``output/tokenizer.json``, checked before any training time is spent.

    Only that one file is written, so the directory may hold other things (shards, a config);
    an existing tokenizer.json is replaced only with ``force``. A missing directory is created
    only once training succeeds, but here it is checked that it can be: its nearest existing
    folder above is a directory Forge may write in.
    """
    if os.path.lexists(output) and not output.is_dir():
        what = "a dangling symbolic link" if not output.exists() else "a file"
        raise ForgeError(f"--output '{output}' is {what}; give a directory (tokenizer.json is written into it).")
    _check_can_create(output)
    path = output / TOKENIZER_FILE
    if path.is_dir():
        raise ForgeError(f"'{path}' is a directory; remove it or choose another --output.")
    if path.exists() and not force:
        raise ForgeError(f"'{path}' already exists; pass --force to replace it, or choose another --output.")
    return path


def _check_can_create(output: Path) -> None:
    """Refuse ``output`` when it is missing and cannot be created: the nearest existing path above
    it is not a directory, or one Forge may not create entries in."""
    if output.is_dir():
        return
    above = output.absolute().parent
    while not os.path.lexists(above) and above != above.parent:
        above = above.parent
    if not above.is_dir():
        raise ForgeError(
            f"--output '{output}' cannot be created: '{above}' is not a directory; choose another --output."
        )
    if not os.access(above, os.W_OK | os.X_OK):
        raise ForgeError(f"--output '{output}' cannot be created: '{above}' is not writable; choose another --output.")


def train_tokenizer(
    inputs: Sequence[str],
    output: Path,
    *,
    vocab_size: int,
    min_frequency: int = 2,
    format: str = "text",
    text_field: str = "text",
    force: bool = False,
    on_progress: Callable[[int, int], None] = lambda done, total: None,
    on_read: Callable[[], None] = lambda: None,
) -> TrainedTokenizer:
    """Train on ``inputs`` and write ``output/tokenizer.json``.

    ``on_progress(bytes_done, bytes_total)`` is called as documents are read; ``on_read()``
    once all are, when the trainer goes on to learn its merges (which reports no progress).
    """
    check_settings(vocab_size, min_frequency, format)
    files = resolve_inputs(inputs, format)
    path = output_file(output, force)
    modules = _tokenizers_modules()
    tokenizer = new_tokenizer(modules)
    trainer = modules.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=list(SPECIAL_TOKENS),
        # Every byte gets a token even if the corpus never uses it, so unseen text still encodes.
        initial_alphabet=modules.pre_tokenizers.ByteLevel.alphabet(),
        # Our own progress display covers the reading; the library's bars would draw over it.
        show_progress=False,
    )
    stats = _ReadStats()
    tokenizer.train_from_iterator(_documents(files, format, text_field, stats, on_progress, on_read), trainer)
    if not stats.documents:
        raise ForgeError(f"the inputs ({', '.join(inputs)}) hold no text; nothing was written.")

    special_ids = {token: tokenizer.token_to_id(token) for token in SPECIAL_TOKENS}
    expected_ids = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    if special_ids != expected_ids:  # the documented ids are a promise: never write a file that breaks it
        raise RuntimeError(f"special tokens got ids {special_ids}, not {expected_ids}")
    _save(tokenizer, path)
    return TrainedTokenizer(
        path=path,
        vocab_size=tokenizer.get_vocab_size(with_added_tokens=True),
        requested_vocab_size=vocab_size,
        min_frequency=min_frequency,
        documents=stats.documents,
        bytes_read=stats.bytes_read,
        special_ids=special_ids,
        literal_specials={token: count for token, count in stats.literal_specials.items() if count},
        eos_token=_eos_token_for_hf(path),
    )


def new_tokenizer(modules: Any) -> Any:
    """An untrained byte-level BPE with the pipeline this module's docstring describes."""
    tokenizer = modules.Tokenizer(modules.models.BPE())
    # add_prefix_space=False: a prefix space would come back from decode as an extra space.
    # The GPT-2 split (use_regex) keeps merges within words, numbers and punctuation runs.
    tokenizer.pre_tokenizer = modules.pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = modules.decoders.ByteLevel()
    return tokenizer


@attrs.define
class _ReadStats:
    documents: int = 0
    bytes_read: int = 0
    literal_specials: dict[str, int] = attrs.field(factory=lambda: dict.fromkeys(SPECIAL_TOKENS, 0))


def _documents(
    files: Sequence[Path],
    format: str,
    text_field: str,
    stats: _ReadStats,
    on_progress: Callable[[int, int], None],
    on_read: Callable[[], None],
) -> Iterator[str]:
    # The trainer pulls from this generator; a ForgeError raised here (a non-UTF-8 file, a bad
    # JSON line) comes out of train_from_iterator unchanged, before anything is written.
    try:
        total = sum(path.stat().st_size for path in files)
        for text, size in read_documents(files, format, text_field):
            stats.bytes_read += size
            if text.strip():  # same rule as prepare-data: blank documents hold nothing to learn
                stats.documents += 1
                for token in SPECIAL_TOKENS:
                    stats.literal_specials[token] += text.count(token)
                yield text
            on_progress(stats.bytes_read, total)
    except OSError as exc:  # a file that vanished or is not readable (permissions, I/O error)
        # read_documents names the file itself; an error of the sizes' stat carries its name.
        name = exc.filename if exc.filename is not None else "an input file"
        raise ForgeError(f"cannot read '{name}': {exc.strerror or exc}.") from None
    on_read()


def _save(tokenizer: Any, path: Path) -> None:
    # Written whole beside the target, then renamed over it (forge_lm.safe_write): an interrupted
    # run leaves either the old file or the new one, never half a tokenizer.json, and writes
    # through no link. A link at tokenizer.json itself is replaced (--output names the user's
    # file; what the link pointed at is untouched).
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ForgeError(
            f"cannot create the output directory '{path.parent}': {exc.strerror or exc}; choose another --output."
        ) from None
    try:
        write_atomically(path, tokenizer.to_str(pretty=True), replace_link=True)
    except OSError as exc:
        raise ForgeError(f"cannot write '{path}': {exc.strerror or exc}.") from None


def _eos_token_for_hf(path: Path) -> str:
    # The hf component prefers the eos_token of a tokenizer_config.json beside the file, so a
    # stale one in the output directory could make it pick another token than <|endoftext|>.
    from forge_lm.tokenizers.hf import choose_eos_token, load_tokenizer

    return choose_eos_token(load_tokenizer(path), path, None)


def _tokenizers_modules() -> Any:
    try:
        import tokenizers
        from tokenizers import decoders, models, pre_tokenizers, trainers  # noqa: F401  (submodules loaded)
    except ImportError:
        raise ForgeError(
            f"train-tokenizer needs the tokenizers package, which is not installed. Install it with `{INSTALL_HINT}`."
        ) from None
    return tokenizers
