"""The core's Hugging Face conversion: its dense model as ``LlamaForCausalLM``, or with
QK-norm as ``Qwen3ForCausalLM``, both ways.

Both hooks are ``trylast``: every other plugin is asked first, so a plugin whose components
make up a model (or that reads a model type) converts it, and this one answers only for the
core's own dense model and for ``model_type = "llama"`` and ``"qwen3"``. The conversion code lives in
:mod:`forge_lm.model.hf.llama` and is imported when a hook is called, not when plugins are listed.
"""

from __future__ import annotations

from forge_lm.hookspecs import hookimpl

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl(trylast=True)
def forge_lm_hf_export(model, config):
    from forge_lm.model.hf.llama import dense_export

    return dense_export(model, config)


@hookimpl(trylast=True)
def forge_lm_hf_import(hf_config, state):
    from forge_lm.model.hf.llama import dense_import

    return dense_import(hf_config, state)
