"""The ``cross_attention`` family: Llama 3.2 Vision's (Mllama's) form of a vision-language model.

A vision tower, Mllama's tiled one (:mod:`forge_vlm.mllama_vision`, ``tower = "mllama"``) or
forge-vlm's ViT (:mod:`forge_vlm.vision`, ``tower = "vit"``), turns each image into states, a
linear projector maps them to the language model's width, and gated cross-attention layers
(:mod:`forge_vlm.cross_attention`) among the blocks of any registered language family that can
wrap its blocks let the text attend to them. The gates start at zero: a fresh model is its
language model.

``forward(input_ids, document_ids=None, *, pixel_values=None, image_mask=None,
aspect_ratio_ids=None, aspect_ratio_mask=None, cross_attention_mask=None, kv_cache=None,
positions=None)``. ``pixel_values``:

- 6-D ``[B, images, tiles, C, H, W]`` with ``aspect_ratio_ids`` ``[B, images]`` and
  ``aspect_ratio_mask`` ``[B, images, tiles]``, as transformers' Mllama processor gives them
  (an image slot with aspect ratio id 0 is padding); Mllama's tower only;
- 5-D ``[B, images, C, H, W]`` with ``image_mask`` ``[B, images]`` (forge-vlm's batches): each
  image one tile, of layout (1, 1) (the ViT: one image);
- 4-D ``[images, C, H, W]``, the images of the whole batch in order, each row taking as many
  as it has markers.

Each image has one ``image_token_id`` marker in the text; a token sees the images of its own
document whose marker is at or before it (``cross_attention_mask`` ``[B, T, images, tiles]``,
transformers' layout, overrides that). Without ``pixel_values`` the model is its language model
alone. With a ``kv_cache`` (:meth:`new_kv_cache`) the image states' keys and values are computed
at the prefill and kept for the tokens decoded after it, which see every image whose marker the
prefill held.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from forge_lm.api import KVCache, Linear, swiglu_hidden
from forge_lm.components import ModelContext, RunsFromEmbeddings
from forge_lm.errors import ForgeError
from forge_vlm.cross_attention import GatedCrossAttention, join_cross_attention, marker_visibility, placement
from forge_vlm.mllama_options import CrossAttentionOptions
from forge_vlm.mllama_vision import MllamaVisionTower
from forge_vlm.vision import VisionTower


class CrossAttentionCache(KVCache):
    """The language model's cache, plus each cross-attention layer's keys and values of the
    prefill's images and which image states the decoded tokens see."""

    def __init__(self, max_len: int) -> None:
        super().__init__(max_len)
        self.cross: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.seen: torch.Tensor | None = None  # [B, states]: what the last cached token sees

    def reset(self) -> None:
        super().reset()
        self.cross, self.seen = {}, None


class CrossAttentionModel(nn.Module):
    """See the module docstring. ``language`` is the language family's model with the
    cross-attention layers joined; ``config`` the family's options."""

    batch_inputs = ("pixel_values", "image_mask", "aspect_ratio_ids", "aspect_ratio_mask", "cross_attention_mask")

    def __init__(
        self,
        options: CrossAttentionOptions,
        vocab_size: int,
        language: nn.Module,
        cross_layers: list[GatedCrossAttention],
        places: list[tuple[int, str]],
    ) -> None:
        super().__init__()
        self.config = options
        self.vocab_size = vocab_size
        self.image_token_id = options.image_token(vocab_size)
        self.image_tokens_seen = 0  # vision states trained on by this rank (the image_tokens_per_sec metric)
        dim = language.config.dim
        self.vit = options.tower == "vit"
        self.vision = VisionTower(options.vision) if self.vit else MllamaVisionTower(options.vision)
        self.projector = Linear(options.tower_width, dim, bias=True)
        self.places = places
        self.feed = join_cross_attention(language, cross_layers, places, options.language.name)
        self.language = language
        self.extra_embeddings = nn.Embedding(options.extra_token_ids, dim) if options.extra_token_ids else None
        if self.image_token_id >= vocab_size + options.extra_token_ids:
            raise ForgeError(
                f"[model] image_token_id = {self.image_token_id} is outside the vocabulary ({vocab_size} ids and "
                f"{options.extra_token_ids} extra_token_ids)."
            )
        # The tile layout of a one-tile image, for images given without aspect ratios (the ViT: 1).
        ratios = getattr(options.vision, "aspect_ratios", ((1, 1),))
        self._single_tile_id = 1 + ratios.index((1, 1)) if (1, 1) in ratios else 0

    # -- capabilities ---------------------------------------------------------------------------

    def blocks(self) -> list[nn.Module]:
        """The language model's blocks (those with cross-attention layers wrap them), then the
        vision tower's layers."""
        vision = list(self.vision.blocks) if self.vit else self.vision.blocks()
        return [*self.language.blocks(), *vision]

    @property
    def max_seq_len(self) -> int:
        """The language model's longest sequence (forge_lm.components.GenerationLimits, with vocab_size)."""
        return self.config.max_seq_len

    def new_kv_cache(self, max_len: int | None = None) -> CrossAttentionCache:
        return CrossAttentionCache(max_len if max_len is not None else self.config.max_seq_len)

    def image_prompt(self, text: str, images: Any, tokenizer: Any, config: Any) -> Any:
        """``forge generate --image``'s prompt (:class:`forge_lm.components.PromptsWithImages`):
        one marker per image where the prompt's ``<image>`` stands (before the text for one image
        and no marker), each image one tile of the tower's size (:mod:`forge_vlm.prompt`)."""
        from forge_vlm.prompt import image_prompt

        return image_prompt(
            text,
            images,
            tokenizer,
            config,
            image_token=self.image_token_id,
            tokens_per_image=1,
            image_size=self.config.vision.image_size,
        )

    def cross_layers(self) -> list[GatedCrossAttention]:
        return [m for m in self.language.modules() if isinstance(m, GatedCrossAttention)]

    def flops_per_token(self, seq_len: int) -> float:
        """The language model's FLOPs (its own count, else ``6 * parameters``), plus ``6 *``
        the cross-attention layers' parameters and their attention over one image's states, plus
        the vision tower and projector counted for one image per sequence of ``seq_len``
        (``6 * parameters * states per image / seq_len``): the data decide the real number."""
        from forge_lm.components import CountsFlops

        cross = self.cross_layers()
        cross_params = sum(p.numel() for layer in cross for p in layer.parameters())
        language_params = sum(p.numel() for p in self.language.parameters()) - cross_params
        language = (
            self.language.flops_per_token(seq_len) if isinstance(self.language, CountsFlops) else 6.0 * language_params
        )
        states = self.config.states_per_image
        attention = sum(6.0 * layer.n_heads * layer.head_dim * 2 * states for layer in cross)
        vision_params = sum(p.numel() for p in [*self.vision.parameters(), *self.projector.parameters()])
        return language + 6.0 * cross_params + attention + 6.0 * vision_params * states / seq_len

    def init_weights(self, init: Any) -> None:
        init.module(self.language)  # its blocks' cross-attention layers included
        init.module(self.vision)
        init.normal(self.projector.weight, init.std)
        init.zeros(self.projector.bias)
        if self.extra_embeddings is not None:
            init.normal(self.extra_embeddings.weight, init.std)

    # -- forward --------------------------------------------------------------------------------

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        kv_cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        aspect_ratio_ids: torch.Tensor | None = None,
        aspect_ratio_mask: torch.Tensor | None = None,
        cross_attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if input_ids.ndim != 2:
            raise ForgeError(f"input_ids must be [batch, seq]; got shape {tuple(input_ids.shape)}.")
        cache = kv_cache if isinstance(kv_cache, CrossAttentionCache) else None
        if kv_cache is not None and cache is None:
            raise ForgeError("a cross_attention model decodes with its own cache: use model.new_kv_cache().")
        if pixel_values is not None:
            pixels, ratio_ids, ratio_mask, image_mask = self._images(
                input_ids, pixel_values, image_mask, aspect_ratio_ids, aspect_ratio_mask
            )
            states = self._states(pixels, ratio_ids, ratio_mask)  # [B, images * tiles * patches, dim]
            if self.training:  # the image_tokens_per_sec metric: the vision states of the real images
                self.image_tokens_seen += int(image_mask.sum()) * (states.shape[1] // max(image_mask.shape[1], 1))
            visible = self._visible(input_ids, document_ids, image_mask, ratio_mask, cross_attention_mask)
            if cache is not None:
                cache.cross = {}
                cache.seen = visible[:, -1]
            self.feed.set(states, visible, cache.cross if cache is not None else None)
        elif cache is not None and cache.seen is not None:
            visible = cache.seen[:, None].expand(-1, input_ids.shape[1], -1)
            if cross_attention_mask is not None:
                visible = self._expand_tiles(cross_attention_mask.bool())
            self.feed.set(None, visible, cache.cross)
        else:
            self.feed.set(None, None, None)  # text alone: the cross-attention layers are skipped
        if self.extra_embeddings is None:
            return self.language(input_ids, document_ids, kv_cache, positions)
        return self.language.forward_embeddings(self._embed(input_ids), document_ids, kv_cache, positions)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings; ids past the vocabulary from ``extra_embeddings``."""
        extra = self.extra_embeddings.num_embeddings
        if bool((input_ids < 0).any()) or bool((input_ids >= self.vocab_size + extra).any()):
            raise ForgeError(f"input_ids must be 0 .. {self.vocab_size + extra - 1} (the vocabulary and extra ids).")
        beyond = input_ids >= self.vocab_size
        h = self.language.embed(input_ids.clamp(max=self.vocab_size - 1))
        return torch.where(beyond[..., None], self.extra_embeddings((input_ids - self.vocab_size).clamp(min=0)), h)

    def _images(
        self,
        input_ids: torch.Tensor,
        pixel_values: torch.Tensor,
        image_mask: torch.Tensor | None,
        aspect_ratio_ids: torch.Tensor | None,
        aspect_ratio_mask: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(pixels [B, M, tiles, C, H, W], aspect_ratio_ids [B, M], aspect_ratio_mask [B, M, tiles],
        image_mask [B, M])`` from any of the three layouts."""
        batch = input_ids.shape[0]
        tiles = 1 if self.vit else self.config.vision.max_num_tiles
        if self.vit and pixel_values.ndim == 6:
            raise ForgeError(
                "the ViT tower (tower = 'vit') takes one tile per image: pixel_values [images, C, H, W] or "
                f"[batch, images, C, H, W] with image_mask; got {tuple(pixel_values.shape)}."
            )
        if pixel_values.ndim == 4:  # the batch's images in order: each row takes one per marker
            counts = (input_ids == self.image_token_id).sum(dim=1).tolist()
            if sum(counts) != pixel_values.shape[0]:
                raise ForgeError(
                    f"{pixel_values.shape[0]} images for {sum(counts)} image markers (id {self.image_token_id}) in "
                    "input_ids; each image needs one marker."
                )
            slots = max(max(counts), 1)
            rows = pixel_values.new_zeros(batch, slots, *pixel_values.shape[1:])
            image_mask = torch.zeros(batch, slots, dtype=torch.bool, device=pixel_values.device)
            for b, chunk in enumerate(pixel_values.split(counts)):
                rows[b, : len(chunk)], image_mask[b, : len(chunk)] = chunk, True
            pixel_values = rows
        if pixel_values.ndim == 5:  # one tile per image, layout (1, 1)
            if not self._single_tile_id:
                raise ForgeError("the vision tower's aspect_ratios have no (1, 1) layout for one-tile images.")
            slots = pixel_values.shape[1]
            if image_mask is None:
                image_mask = torch.ones(batch, slots, dtype=torch.bool, device=pixel_values.device)
            padded = pixel_values.new_zeros(batch, slots, tiles, *pixel_values.shape[2:])
            padded[:, :, 0] = pixel_values
            pixel_values = padded
            aspect_ratio_ids = image_mask.long() * self._single_tile_id
            aspect_ratio_mask = torch.zeros(batch, slots, tiles, dtype=torch.long, device=pixel_values.device)
            aspect_ratio_mask[:, :, 0] = image_mask.long()
        if pixel_values.ndim != 6 or aspect_ratio_ids is None or aspect_ratio_mask is None:
            raise ForgeError(
                "pixel_values must be [images, C, H, W], [batch, images, C, H, W] (with image_mask) or "
                "[batch, images, tiles, C, H, W] with aspect_ratio_ids and aspect_ratio_mask; got "
                f"{tuple(pixel_values.shape)}."
            )
        if image_mask is None:
            image_mask = aspect_ratio_ids > 0
        return pixel_values, aspect_ratio_ids, aspect_ratio_mask, image_mask.bool()

    def _states(
        self, pixels: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        batch = pixels.shape[0]
        if self.vit:  # one tile per image: the tower sees [B * images, C, H, W]
            return self.projector(self.vision(pixels.flatten(0, 2))).reshape(batch, -1, self.projector.out_features)
        features = self.vision(pixels.flatten(0, 1), aspect_ratio_ids.flatten(), aspect_ratio_mask.flatten(0, 1))
        return self.projector(features).reshape(batch, -1, self.projector.out_features)

    def _expand_tiles(self, per_tile: torch.Tensor) -> torch.Tensor:
        """``[B, T, M, tiles]`` -> ``[B, T, M * tiles * patches]``: the mask over the image states."""
        patches = self.config.states_per_image if self.vit else self.config.vision.patches
        return per_tile[..., None].expand(*per_tile.shape, patches).flatten(2)

    def _visible(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None,
        image_mask: torch.Tensor,
        aspect_ratio_mask: torch.Tensor,
        cross_attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """``[B, T, states]``: which image states each token sees (its images' real tiles)."""
        if cross_attention_mask is not None:
            return self._expand_tiles(cross_attention_mask.bool())
        sees = marker_visibility(input_ids, self.image_token_id, image_mask, document_ids)  # [B, T, M]
        return self._expand_tiles(sees[..., None] & aspect_ratio_mask.bool()[:, None])


def _language_family(options: CrossAttentionOptions, registry: Any) -> tuple[Any, Any]:
    chosen = options.language
    family = chosen.component if chosen.component is not None else registry.resolve("models", chosen.name)
    return family, chosen.options if chosen.options is not None else family.options_class()


def build_cross_attention(options: CrossAttentionOptions, context: ModelContext) -> CrossAttentionModel:
    """Factory of the ``cross_attention`` family: the language family's model (built by its own
    factory), Mllama's tower, a projector, and a cross-attention layer per place."""
    family, language_options = _language_family(options, context.registry)
    build = family.build if family.plugin.builtin else family.build_for_run
    language = build(language_options, context)
    if options.extra_token_ids and not isinstance(language, RunsFromEmbeddings):
        raise ForgeError(
            f"[model] extra_token_ids = {options.extra_token_ids} needs a language family that runs from "
            f"embeddings (embed, forward_embeddings); '{options.language.name}' does not. Set extra_token_ids = 0."
        )
    n_blocks = len(language.blocks()) if hasattr(language, "blocks") else 0
    combined = list(options.cross_attention_layers) if options.cross_attention_layers is not None else None
    places = placement(n_blocks, options.every_n_blocks, combined)
    config = language.config
    dim, n_heads = config.dim, config.n_heads
    n_kv_heads = getattr(config, "kv_heads", None) or getattr(config, "n_kv_heads", None) or n_heads
    hidden = _ffn_hidden(language, dim)
    layers = [
        GatedCrossAttention(
            dim, dim, n_heads, n_kv_heads, hidden, norm_eps=config.norm_eps, empty_rows=options.empty_rows
        )
        for _ in places
    ]
    model = CrossAttentionModel(options, context.vocab_size, language, layers, places)
    if options.freeze_vision:
        model.vision.requires_grad_(False)
    if options.freeze_language:
        model.language.requires_grad_(False)
        for layer in layers:
            layer.requires_grad_(True)
    return model


def _ffn_hidden(language: nn.Module, dim: int) -> int:
    """The cross-attention layers' SwiGLU width: the language blocks' (Mllama's layers share
    one ``intermediate_size``), else Llama's default for ``dim``."""
    for block in language.blocks():
        w1 = getattr(getattr(block, "feed_forward", None), "w1", None)
        if isinstance(w1, nn.Linear):
            return w1.out_features
    return swiglu_hidden(dim, 8 / 3, 256)
