"""Built-in tokenizers."""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


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
        config="forge_lm.default_plugins.options.tokenizers:HfTokenizerOptions",
        description="A local Hugging Face tokenizer.json (pip install forge-lm[hf])",
    )
