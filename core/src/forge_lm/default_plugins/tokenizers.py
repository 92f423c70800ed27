"""Built-in tokenizers."""

from __future__ import annotations

import attrs

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@attrs.define
class HfTokenizerOptions:
    path: str  # a local tokenizer.json (Hugging Face tokenizers format); required
    # The token that ends a document; None: the eos_token of a tokenizer_config.json beside the
    # file, else the first of </s>, <|endoftext|>, <|end_of_text|>, <eos> in the vocabulary.
    eos_token: str | None = None


@hookimpl
def forge_lm_register_tokenizers(register):
    register(
        "bytes",
        "forge_lm.tokenizers.byte_level:build_byte_tokenizer",
        description="UTF-8 bytes as tokens (256 ids) plus an end-of-text id; no dependencies",
    )
    register(
        "hf",
        "forge_lm.tokenizers.hf:build_hf_tokenizer",
        config=HfTokenizerOptions,
        description="A local Hugging Face tokenizer.json (pip install forge-lm[hf])",
    )
