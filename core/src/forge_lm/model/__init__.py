"""The dense Llama-style language model: building it, counting its FLOPs, sampling, HF conversion.

``build_model(config.model, vocab_size, registry)`` is the one way to construct the model;
:mod:`forge_lm.model.generate` samples from it, :mod:`forge_lm.model.flops` counts its cost and
:mod:`forge_lm.model.hf` converts it to and from Hugging Face Llama.
"""

from forge_lm.model.kv_cache import KVCache
from forge_lm.model.transformer import Block, Transformer, build_model

__all__ = ["Block", "KVCache", "Transformer", "build_model"]
