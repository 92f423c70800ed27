"""Forge plugin module of forge-vlm (entry point ``vlm`` in the group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins and validate configs. It
holds the hook implementations; the option classes live in :mod:`forge_vlm.options`, the torch
code in :mod:`forge_vlm.vision` (the ViT tower), :mod:`forge_vlm.llava` (the ``llava`` family)
and :mod:`forge_vlm.data` (image-text datasets), imported only when a run builds them.
"""

from __future__ import annotations

from forge_lm import hookimpl
from forge_vlm.mllama_options import CrossAttentionOptions
from forge_vlm.options import ImageTextOptions, LlavaOptions, SyntheticImageTextOptions

FORGE_LM_PLUGIN_API = ">=1,<2"


@hookimpl
def forge_lm_register_models(register):
    register(
        "llava",
        "forge_vlm.llava:build_llava",
        config=LlavaOptions,
        description="LLaVA: ViT tower, MLP projector, image features in place of image tokens in any language family",
    )
    register(
        "cross_attention",
        "forge_vlm.mllama:build_cross_attention",
        config=CrossAttentionOptions,
        description="Llama 3.2 Vision (Mllama): tiled vision tower, gated cross-attention among any family's blocks",
    )


@hookimpl
def forge_lm_register_datasets(register):
    register(
        "image_text",
        "forge_vlm.data:build_image_text",
        config=ImageTextOptions,
        description="JSON-lines image-text records (images through Pillow), packed, loss on the text only",
    )
    register(
        "synthetic_image_text",
        "forge_vlm.data:build_synthetic_image_text",
        config=SyntheticImageTextOptions,
        description="Generated images with text that depends on them; for tests and smoke runs",
    )
