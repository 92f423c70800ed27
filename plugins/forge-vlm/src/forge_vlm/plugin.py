"""Forge plugin module of forge-vlm (entry point ``vlm`` in the group ``forge_lm``).

Kept free of heavy imports: Forge imports this module to list plugins and validate configs. It
holds the hook implementations; the option classes live in :mod:`forge_vlm.options` and
:mod:`forge_vlm.mllama_options` (named by import path, so that listing plugins imports neither
them nor the config schema they build on), the torch code in :mod:`forge_vlm.vision` (the ViT
tower), :mod:`forge_vlm.llava` (the ``llava`` family) and :mod:`forge_vlm.data` (image-text
datasets), imported only when a run builds them.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from forge_lm import hookimpl

FORGE_LM_PLUGIN_API = ">=1.2,<2"  # 1.2: options classes named by import path


@hookimpl
def forge_lm_register_models(register):
    register(
        "llava",
        "forge_vlm.llava:build_llava",
        config="forge_vlm.options:LlavaOptions",
        description="LLaVA: ViT tower, MLP projector, image features in place of image tokens in any language family",
    )
    register(
        "cross_attention",
        "forge_vlm.mllama:build_cross_attention",
        config="forge_vlm.mllama_options:CrossAttentionOptions",
        description="Llama 3.2 Vision (Mllama): tiled vision tower, gated cross-attention among any family's blocks",
    )


@hookimpl
def forge_lm_register_datasets(register):
    register(
        "image_text",
        "forge_vlm.data:build_image_text",
        config="forge_vlm.options:ImageTextOptions",
        description="JSON-lines image-text records (images through Pillow), packed, loss on the text only",
    )
    register(
        "synthetic_image_text",
        "forge_vlm.data:build_synthetic_image_text",
        config="forge_vlm.options:SyntheticImageTextOptions",
        description="Generated images with text that depends on them; for tests and smoke runs",
    )


class _ImageTokenRate:
    """``image_tokens_per_sec`` beside the core's ``tokens_per_sec``: the image tokens the model
    placed (its ``image_tokens_seen``, this rank's, times the data-parallel ranks) over the time
    between two logged steps (evaluation and checkpoint time included)."""

    def __init__(self) -> None:
        self.start: float | None = None
        self.seen = 0

    def step_end(self, context: Any, metrics: dict[str, float]) -> dict[str, float] | None:
        seen = getattr(context.model, "image_tokens_seen", None)
        if not isinstance(seen, int) or isinstance(seen, bool):
            return None
        now = time.perf_counter()
        if self.start is None or seen < self.seen:  # the first step, or a new run in this process
            self.start, self.seen = now, seen
            return {"image_tokens_per_sec": 0.0} if "loss" in metrics else None
        if "loss" not in metrics:  # only the logged steps' metrics are kept
            return None
        rate = (seen - self.seen) * _data_parallel_size() / max(now - self.start, 1e-9)
        self.start, self.seen = now, seen
        return {"image_tokens_per_sec": rate}


def _data_parallel_size() -> int:
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_rate = _ImageTokenRate()


@hookimpl
def forge_lm_train_start(context):
    _rate.start = None


@hookimpl
def forge_lm_step_end(context, step, metrics):
    return _rate.step_end(context, metrics)


def _cross_attention_module() -> Any:
    """forge_vlm.mllama if it was imported (no cross_attention model can exist otherwise), else None."""
    return sys.modules.get("forge_vlm.mllama")


def _llava_class() -> type | None:
    """forge_vlm.llava.Llava if it was imported (no llava model can exist otherwise), else None."""
    return getattr(sys.modules.get("forge_vlm.llava"), "Llava", None)


@hookimpl
def forge_lm_hf_export(model, config):
    llava = _llava_class()
    if llava is not None and isinstance(model, llava):
        from forge_vlm import hf_llava

        return hf_llava.to_llava(model)
    module = _cross_attention_module()
    if module is None or not isinstance(model, module.CrossAttentionModel):
        return None
    from forge_vlm import hf_mllama

    return hf_mllama.to_mllama(model)


@hookimpl
def forge_lm_hf_import(hf_config, state):
    if hf_config.get("model_type") == "llava":
        from forge_vlm import hf_llava

        return hf_llava.from_llava(hf_config, state)
    if hf_config.get("model_type") != "mllama":
        return None
    from forge_vlm import hf_mllama

    return hf_mllama.from_mllama(hf_config, state)
