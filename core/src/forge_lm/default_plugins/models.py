"""Built-in model family and attention layers.

``llama``: the decoder-only transformer of :mod:`forge_lm.model.transformer`, its options the
``[model]`` section (:class:`forge_lm.config.LlamaOptions`). ``gqa``: grouped-query attention
with RoPE (multi-head when ``n_kv_heads = n_heads``); ``sliding_window``: the same layer, each
query seeing only the ``window`` most recent keys (Mistral, Gemma's local layers).
"""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_models(register):
    register(
        "llama",
        "forge_lm.model.transformer:build_llama",
        config="forge_lm.config:LlamaOptions",  # by path: forge_lm.config is not cheap
        description="Llama-style decoder: RoPE, pluggable attention and feed-forward, RMSNorm, tied or untied head",
    )


@hookimpl
def forge_lm_register_attentions(register):
    register(
        "gqa",
        "forge_lm.model.attention:build_gqa",
        description="Grouped-query causal self-attention with RoPE and optional QK-norm (SDPA, flex or eager)",
    )
    register(
        "sliding_window",
        "forge_lm.model.attention:build_sliding_window",
        config="forge_lm.default_plugins.options.models:SlidingWindowOptions",
        description="Grouped-query attention over the `window` most recent keys only (Mistral)",
    )
