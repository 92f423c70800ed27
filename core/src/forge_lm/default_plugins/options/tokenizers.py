"""Options of the built-in tokenizers (:mod:`forge_lm.default_plugins.tokenizers`).

Named by import path at registration, so that listing plugins imports none of them.
"""

from __future__ import annotations

import attrs


@attrs.define
class HfTokenizerOptions:
    path: str  # a local tokenizer.json (Hugging Face tokenizers format); required
    # The token that ends a document; None: the eos_token of a tokenizer_config.json beside the
    # file, else the first of </s>, <|endoftext|>, <|end_of_text|>, <eos> in the vocabulary.
    eos_token: str | None = None
