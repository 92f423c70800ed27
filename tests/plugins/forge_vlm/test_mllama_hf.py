"""Mllama conversion: a tiny random MllamaForConditionalGeneration imported into Forge gives
transformers' logits (fp32, 1e-4) for the same pixel values, aspect ratios, masks and ids, and
a Forge cross_attention model exported loads in transformers with the same logits."""

from __future__ import annotations

import pytest
import torch

from forge_lm.config import structure_config
from forge_lm.errors import ForgeError
from forge_lm.model import build_model
from forge_vlm.hf_mllama import from_mllama, to_mllama

from .test_mllama import LANGUAGE, VISION, table

ATOL = 1e-4
VOCAB = 64
MARK = VOCAB  # Mllama's marker is the first id past the vocabulary


def hf_config():
    from transformers import MllamaConfig

    vision = {
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_global_layers": 1,
        "attention_heads": 4,
        "intermediate_size": 48,
        "vision_output_dim": 64,
        "image_size": 16,
        "patch_size": 4,
        "max_num_tiles": 4,
        "intermediate_layers_indices": [0],
        "supported_aspect_ratios": [[1, 1], [1, 2], [2, 1], [2, 2]],
    }
    text = {
        "vocab_size": VOCAB,
        "hidden_size": 32,
        "num_hidden_layers": 5,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 48,
        "cross_attention_layers": [1, 4],
        "max_position_embeddings": 64,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
    }
    config = MllamaConfig(vision_config=vision, text_config=text, image_token_index=MARK)
    config._attn_implementation = "eager"
    return config


def open_hf_gates(model) -> None:
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "gate" in name or "norm" in name:
                param.copy_(0.5 + torch.rand(param.shape, generator=generator))


def inputs(vocab: int = VOCAB, mark: int = MARK):
    """Two rows as Mllama's processor lays them out: bos, the marker, text; row 1 has two images."""
    generator = torch.Generator().manual_seed(4)
    ids = torch.randint(3, min(vocab, mark), (2, 10), generator=generator)
    ids[:, 0] = 0
    ids[0, 1] = ids[1, 1] = ids[1, 5] = mark
    pixels = torch.randn(2, 2, 4, 3, 16, 16, generator=generator)
    aspect_ids = torch.tensor([[4, 0], [1, 2]])
    aspect_mask = torch.tensor([[[1, 1, 1, 1], [0, 0, 0, 0]], [[1, 0, 0, 0], [1, 1, 0, 0]]])
    cross = torch.zeros(2, 10, 2, 4, dtype=torch.long)
    cross[0, 1:, 0] = aspect_mask[0, 0]
    cross[1, 1:, 0] = aspect_mask[1, 0]
    cross[1, 5:, 1] = aspect_mask[1, 1]
    return {
        "input_ids": ids,
        "pixel_values": pixels,
        "aspect_ratio_ids": aspect_ids,
        "aspect_ratio_mask": aspect_mask,
    }, cross


@pytest.fixture(scope="module")
def manager():
    from forge_lm.plugins import PluginManager, PluginSettings

    return PluginManager(PluginSettings(allow=("vlm",)))


def forge_from(manager, model_table: dict, state: dict | None = None):
    config = structure_config({"model": model_table, "train": {"seq_len": 32}}, manager.registry)
    model = build_model(config.model, VOCAB, manager.registry, seed=0)
    if state is not None:
        model.load_state_dict(state, strict=True)
    return model.eval()


@pytest.fixture(scope="module")
def imported(manager):
    from transformers import MllamaForConditionalGeneration

    torch.manual_seed(0)
    hf = MllamaForConditionalGeneration(hf_config()).eval()
    open_hf_gates(hf)
    model_table, state = from_mllama(hf.config.to_dict(), hf.state_dict())
    return hf, forge_from(manager, model_table, state)


def test_import_gives_transformers_logits(imported):
    hf, forge = imported
    batch, cross = inputs()
    with torch.no_grad():
        expected = hf(**batch, cross_attention_mask=cross).logits
        given = forge(
            batch["input_ids"], **{k: v for k, v in batch.items() if k != "input_ids"}, cross_attention_mask=cross
        )
        from_markers = forge(batch["input_ids"], **{k: v for k, v in batch.items() if k != "input_ids"})
    torch.testing.assert_close(given, expected, rtol=0, atol=ATOL)
    # The masks Forge derives from the markers are the processor's.
    torch.testing.assert_close(from_markers, expected, rtol=0, atol=ATOL)


def test_export_loads_in_transformers_with_the_same_logits(manager, imported):
    from transformers import MllamaConfig, MllamaForConditionalGeneration

    _, forge = imported
    hf_dict, state = to_mllama(forge)
    config = MllamaConfig(**{k: v for k, v in hf_dict.items() if k != "architectures"})
    config._attn_implementation = "eager"
    hf = MllamaForConditionalGeneration(config).eval()
    hf.load_state_dict(state, strict=True)
    batch, cross = inputs()
    with torch.no_grad():
        expected = forge(batch["input_ids"], **{k: v for k, v in batch.items() if k != "input_ids"})
        torch.testing.assert_close(hf(**batch, cross_attention_mask=cross).logits, expected, rtol=0, atol=ATOL)


def test_a_forge_trained_form_exports_too(manager):
    """A cross_attention model built in Forge (every 2 blocks, no extra ids) round-trips."""
    forge = forge_from(manager, table(image_token_id=63))
    hf_dict, state = to_mllama(forge)
    assert hf_dict["text_config"]["cross_attention_layers"] == [2, 5]
    assert state["model.language_model.embed_tokens.weight"].shape == (VOCAB + 8, 32)


def test_a_language_model_mllama_cannot_express_is_refused(manager):
    language = {**LANGUAGE, "qk_norm": True}
    forge = forge_from(manager, {"name": "cross_attention", "language": language, "vision": VISION})
    with pytest.raises(ForgeError, match="no Hugging Face Mllama form: the language model needs norm = 'rmsnorm'"):
        to_mllama(forge)


def test_the_plugins_export_hook_writes_a_directory_transformers_loads(manager, imported, tmp_path):
    from transformers import MllamaForConditionalGeneration

    from forge_lm.model.hf import export_with_plugins

    _, forge = imported
    out = export_with_plugins(manager, forge, forge.config, tmp_path / "hf")
    hf = MllamaForConditionalGeneration.from_pretrained(out).eval()
    batch, cross = inputs()
    with torch.no_grad():
        expected = forge(batch["input_ids"], **{k: v for k, v in batch.items() if k != "input_ids"})
        torch.testing.assert_close(hf(**batch, cross_attention_mask=cross).logits, expected, rtol=0, atol=ATOL)
