"""The ``llava`` model family: a vision tower, an MLP projector, and any language family.

Each image goes through the tower (:class:`~forge_vlm.vision.VisionTower`, its selected
features ``[tokens_per_image, width]``) and the projector (linear, activation, linear: Llava's
``multi_modal_projector``) into the language model's width; the results replace the token
embeddings at the image-token positions of the text, image by image in order, as transformers'
``LlavaForConditionalGeneration`` does; then the language family's blocks, norm and head run
from those embeddings (:class:`~forge_lm.components.RunsFromEmbeddings`: a family without
``embed`` and ``forward_embeddings`` is refused for llava, named).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from forge_lm.components import CountsFlops, ModelContext, RunsFromEmbeddings
from forge_lm.errors import ConfigError, ForgeError
from forge_vlm.options import LlavaOptions
from forge_vlm.vision import VisionTower, activation, vision_flops_per_image

if TYPE_CHECKING:
    from forge_lm.components import Initializer


class Projector(nn.Module):
    """Llava's ``multi_modal_projector``: ``linear_2(act(linear_1(features)))``."""

    def __init__(self, width: int, dim: int, act: str, bias: bool) -> None:
        super().__init__()
        self.act = act
        self.linear_1 = nn.Linear(width, dim, bias=bias)
        self.linear_2 = nn.Linear(dim, dim, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(features)))

    def init_weights(self, init: Initializer) -> None:
        for linear in (self.linear_1, self.linear_2):
            init.normal(linear.weight, init.std)
            if linear.bias is not None:
                init.zeros(linear.bias)


class _Scaled:
    """An Initializer with other ``std`` / ``residual_std``, for a part of the model whose depth
    is not the root's (the tower's blocks, the language model's): every value still comes from
    the root's initializer, by the tensor's name in the whole model."""

    def __init__(self, init: Initializer, residual_std: float) -> None:
        self._init = init
        self.std, self.seed, self.residual_std = init.std, init.seed, residual_std

    def module(self, module: nn.Module) -> None:
        from forge_lm.components import InitializesWeights

        if isinstance(module, InitializesWeights) and callable(module.init_weights):
            module.init_weights(self)
        else:  # the default rule, with this std
            self._init.module(module)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._init, name)


class Llava(nn.Module):
    """``forward(input_ids [B, T], document_ids=None, *, pixel_values=None, image_mask=None,
    kv_cache=None, positions=None) -> logits [B, T, vocab]``.

    ``pixel_values``: ``[B, max_images, C, H, W]`` with ``image_mask`` ``[B, max_images]``
    (True: a real image; the training batches' layout), or ``[num_images, C, H, W]`` over the
    batch in order (transformers' processors' layout; ``image_mask`` None). The ``k``-th image
    of the batch fills the ``k``-th run of ``tokens_per_image`` image tokens (row by row). The
    counts must agree: more images than image tokens, or image tokens without an image, are
    refused. Decoding with a cache takes the images in the prefill; later steps take none."""

    batch_inputs = ("pixel_values", "image_mask")

    def __init__(self, options: LlavaOptions, language: nn.Module, vocab_size: int) -> None:
        super().__init__()
        self.config = options
        self.vocab_size = vocab_size
        self.image_token_id = options.image_token(vocab_size)
        if not 0 <= self.image_token_id < vocab_size:
            raise ConfigError(
                f"[model] image_token_id = {self.image_token_id} is outside the vocabulary of {vocab_size} ids; "
                f"set it below {vocab_size} (or raise [model.language] vocab_size)."
            )
        self.vision = VisionTower(options.vision, options.vision_checkpoint)
        self.projector = Projector(
            options.vision.width, _width(language), options.projector_activation, options.projector_bias
        )
        self.language = language
        self.image_tokens_seen = 0  # image tokens trained on by this rank (the image_tokens_per_sec metric)
        self._freeze()

    def _freeze(self) -> None:
        """The training stage: a frozen part's parameters get no gradient, and the optimizer
        (which takes only parameters that require one) never sees them."""
        for part, frozen in ((self.vision, self.config.freeze_vision), (self.language, self.config.freeze_language)):
            if frozen:
                part.requires_grad_(False)

    # -- capabilities ----------------------------------------------------------------------------

    def blocks(self) -> list[nn.Module]:
        """The tower's blocks, then the language model's: each an FSDP2 unit, checkpointed alone."""
        return [*self.vision.blocks, *self.language.blocks()]

    @property
    def max_seq_len(self) -> int:
        """The language model's longest sequence (forge_lm.components.GenerationLimits, with vocab_size)."""
        return self.config.max_seq_len

    def new_kv_cache(self, max_len: int | None = None) -> Any:
        return self.language.new_kv_cache(max_len)

    def image_prompt(self, text: str, images: Any, tokenizer: Any, config: Any) -> Any:
        """``forge generate --image``'s prompt (:class:`forge_lm.components.PromptsWithImages`):
        the images read and placed as the run's data does (:mod:`forge_vlm.prompt`)."""
        from forge_vlm.prompt import image_prompt

        return image_prompt(
            text,
            images,
            tokenizer,
            config,
            image_token=self.image_token_id,
            tokens_per_image=self.config.tokens_per_image,
            image_size=self.config.vision.image_size,
        )

    def get_output_embeddings(self) -> nn.Module | None:
        """The language model's head (parameter roles: 'output')."""
        head = getattr(self.language, "output", None)
        return head if isinstance(head, nn.Module) else None

    def flops_per_token(self, seq_len: int) -> float:
        """The language model's FLOPs per token, plus the tower's and the projector's per image
        token (an image's FLOPs spread over its ``tokens_per_image`` positions). MFU counts every
        token so: with fewer image tokens than that, it reads high by the tower's share."""
        if isinstance(self.language, CountsFlops):
            language = float(self.language.flops_per_token(seq_len))
        else:
            language = 6.0 * sum(p.numel() for p in self.language.parameters())
        options = self.config.vision
        projector = 6.0 * sum(p.numel() for p in self.projector.parameters())
        vision = vision_flops_per_image(options, len(self.vision.blocks)) / options.tokens_per_image
        return language + vision + projector

    def init_weights(self, init: Initializer) -> None:
        vision_depth = max(1, len(self.vision.blocks))
        self.vision.init_weights(_Scaled(init, init.std / math.sqrt(2 * vision_depth)))
        init.module(self.projector)
        language_layers = getattr(self.language.config, "n_layers", None)
        residual = init.std / math.sqrt(2 * language_layers) if isinstance(language_layers, int) else init.std
        self.language.init_weights(_Scaled(init, residual))

    # -- forward -----------------------------------------------------------------------------------

    def image_features(self, images: torch.Tensor) -> torch.Tensor:
        """``[num_images, tokens_per_image, dim]``: what stands in the text for each image."""
        return self.projector(self.vision(images))

    def forward(
        self,
        input_ids: torch.Tensor,
        document_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_mask: torch.Tensor | None = None,
        kv_cache: Any = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        h = self.language.embed(input_ids)  # [B, T, dim]
        markers = input_ids == self.image_token_id
        images = self._images(pixel_values, image_mask, input_ids.shape[0])
        decoding = kv_cache is not None and getattr(kv_cache, "length", 0) > 0
        if images is None:
            if not decoding and bool(markers.any()):
                raise ForgeError(
                    f"the input holds {int(markers.sum())} image tokens (id {self.image_token_id}) but no "
                    "pixel_values: pass the images they stand for (pixel_values=), or remove the markers."
                )
        else:
            wanted = int(markers.sum())
            given = images.shape[0] * self.config.tokens_per_image
            if wanted != given:
                more = "more images than image markers" if given > wanted else "image markers without an image"
                raise ForgeError(
                    f"{more}: {images.shape[0]} images of {self.config.tokens_per_image} tokens each need {given} "
                    f"image tokens (id {self.image_token_id}) in input_ids, which holds {wanted}. Put "
                    f"tokens_per_image = {self.config.tokens_per_image} image tokens in the text for each image."
                )
            if self.training:
                self.image_tokens_seen += wanted
            if images.shape[0]:
                features = self.image_features(images).to(h.dtype)
                h = h.masked_scatter(markers.unsqueeze(-1), features)
        return self.language.forward_embeddings(h, document_ids, kv_cache, positions)

    def _images(self, pixel_values: torch.Tensor | None, image_mask: torch.Tensor | None, batch: int) -> Any:
        """The batch's images ``[num_images, C, H, W]`` in order, from either layout (or None)."""
        if pixel_values is None:
            if image_mask is not None and bool(image_mask.any()):
                raise ForgeError("image_mask marks images but no pixel_values were given.")
            return None
        if pixel_values.ndim == 5:
            if image_mask is None:
                image_mask = torch.ones(pixel_values.shape[:2], dtype=torch.bool, device=pixel_values.device)
            if pixel_values.shape[0] != batch or tuple(image_mask.shape) != tuple(pixel_values.shape[:2]):
                raise ForgeError(
                    f"pixel_values {list(pixel_values.shape)} with image_mask "
                    f"{list(image_mask.shape)}: training batches give [batch, max_images, C, H, W] and "
                    f"[batch, max_images] for a batch of {batch} rows."
                )
            return pixel_values[image_mask.bool()]
        if pixel_values.ndim == 4:
            if image_mask is not None:
                raise ForgeError(
                    "image_mask goes with pixel_values [batch, max_images, C, H, W]; with "
                    "[num_images, C, H, W] every image is real: leave image_mask out."
                )
            return pixel_values
        raise ForgeError(
            f"pixel_values of shape {list(pixel_values.shape)}: give [num_images, C, H, W] (as transformers' "
            "processors do) or [batch, max_images, C, H, W] with image_mask."
        )


def _width(language: nn.Module) -> int:
    dim = getattr(getattr(language, "config", None), "dim", None)
    if not isinstance(dim, int):
        raise ConfigError(
            f"the language model {type(language).__name__} keeps no config.dim (its hidden size); llava needs it "
            "to size the projector."
        )
    return dim


def build_llava(options: LlavaOptions, context: ModelContext) -> Llava:
    """The ``llava`` family's factory: the language family ``[model.language]`` selects, built
    through the registry, joined to the tower and the projector."""
    chosen = options.language
    family = chosen.component if chosen.component is not None else context.registry.resolve("models", chosen.name)
    if family.name == "llava":
        raise ConfigError("[model.language] name = 'llava': the language model of llava must be a text family.")
    language_options = chosen.options if chosen.options is not None else family.options_class()
    build = family.build if family.plugin.builtin else family.build_for_run
    language = build(language_options, context)
    if not isinstance(language, nn.Module) or not isinstance(language, RunsFromEmbeddings):
        where = f" from {family.plugin.label}"
        raise ConfigError(
            f"[model.language] name = '{family.name}'{where} cannot be llava's language model: its model "
            f"({type(language).__name__}) has no embed(input_ids) and forward_embeddings(embeddings, ...) "
            "(forge_lm.components.RunsFromEmbeddings), through which image features enter among the token "
            "embeddings. Choose a family that has them (llama, or one subclassing forge_lm's Transformer)."
        )
    return Llava(options, language, context.vocab_size)
