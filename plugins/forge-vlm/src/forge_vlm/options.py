"""Option classes shared by forge-vlm's families: the vision tower (``[model.vision]``), the
``llava`` family's ``[model]`` section with its nested ``[model.language]`` component, and the
image-text datasets' options. Kept free of torch: Forge imports this module to validate configs.
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.api import ComponentConfig, LlamaOptions, component
from forge_lm.validators import FieldError, non_negative, one_of, positive

ACTIVATIONS = ("quick_gelu", "gelu_tanh", "gelu")


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


@attrs.frozen
class ViTOptions:
    """``[model.vision]``: a ViT encoder. CLIP's tower is the defaults with ``activation =
    "quick_gelu"``, ``pre_norm = true``, ``class_token = true``; SigLIP's is ``activation =
    "gelu_tanh"``, ``pre_norm = false``, ``class_token = false``, ``patch_bias = true``."""

    image_size: int = attrs.field(default=224, validator=positive, metadata=_doc("Square images of this side."))
    patch_size: int = attrs.field(default=14, validator=positive, metadata=_doc("Square patches of this side."))
    channels: int = attrs.field(default=3, validator=positive, metadata=_doc("Colour channels of an image."))
    width: int = attrs.field(default=768, validator=positive, metadata=_doc("Hidden size of the tower."))
    depth: int = attrs.field(default=12, validator=positive, metadata=_doc("Encoder blocks."))
    heads: int = attrs.field(default=12, validator=positive, metadata=_doc("Attention heads."))
    mlp_dim: int | None = attrs.field(
        default=None, validator=positive, metadata=_doc("Hidden size of each block's MLP; unset = 4 * width.")
    )
    norm_eps: float = attrs.field(default=1e-5, validator=positive, metadata=_doc("Epsilon of every layer norm."))
    activation: str = attrs.field(
        default="quick_gelu",
        validator=one_of(*ACTIVATIONS),
        metadata=_doc("MLP activation: 'quick_gelu' (CLIP), 'gelu_tanh' (SigLIP), 'gelu'."),
    )
    positions: str = attrs.field(
        default="learned",
        validator=one_of("learned", "rope2d"),
        metadata=_doc("'learned' position embeddings (CLIP, SigLIP), or 2-D rotary positions in attention."),
    )
    class_token: bool = attrs.field(default=True, metadata=_doc("Prepend a learned class token (CLIP)."))
    patch_bias: bool = attrs.field(default=False, metadata=_doc("The patch embedding has a bias (SigLIP)."))
    pre_norm: bool = attrs.field(
        default=True, metadata=_doc("A layer norm on the embeddings before the blocks (CLIP's pre_layrnorm).")
    )
    feature_layer: int = attrs.field(
        default=-2,
        metadata=_doc(
            "Which hidden state is the features (Llava's vision_feature_layer): 0 the embeddings, k the output "
            "of block k, negative counted from the end (-1 the last block)."
        ),
    )
    feature_select: str = attrs.field(
        default="default",
        validator=one_of("default", "full"),
        metadata=_doc(
            "Llava's vision_feature_select_strategy: 'default' drops the first position (the class token), "
            "'full' keeps every position."
        ),
    )

    def __attrs_post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise FieldError(
                "patch_size", f"image_size ({self.image_size}) must be divisible by patch_size ({self.patch_size})"
            )
        if self.width % self.heads:
            raise FieldError("heads", f"width ({self.width}) must be divisible by heads ({self.heads})")
        if not -self.depth - 1 <= self.feature_layer <= self.depth:
            raise FieldError(
                "feature_layer", f"must be between {-self.depth - 1} and {self.depth} (depth {self.depth})"
            )
        if self.positions == "rope2d" and (self.width // self.heads) % 4:
            raise FieldError("positions", f"'rope2d' needs a head size divisible by 4, got {self.width // self.heads}")
        if self.feature_select == "default" and self.positions_per_image == 1:
            raise FieldError("feature_select", "'default' would drop the only position; use 'full'")

    @property
    def hidden_dim(self) -> int:
        return self.mlp_dim if self.mlp_dim is not None else 4 * self.width

    @property
    def grid(self) -> int:
        """Patches along each side of an image."""
        return self.image_size // self.patch_size

    @property
    def positions_per_image(self) -> int:
        """The tower's sequence: every patch, and the class token if any."""
        return self.grid**2 + int(self.class_token)

    @property
    def tokens_per_image(self) -> int:
        """Feature vectors one image gives (``feature_select`` applied)."""
        return self.positions_per_image - (1 if self.feature_select == "default" else 0)

    @property
    def feature_index(self) -> int:
        """``feature_layer`` as an index into the ``depth + 1`` hidden states."""
        return self.feature_layer % (self.depth + 1)


class AroundALanguageModel:
    """What the core and the datasets read from a vision-language family's options, taken from
    its ``[model.language]`` (``language``) and its ``image_token_id``: the options of the
    language family, its ``vocab_size``, ``max_seq_len`` and ``init_std``, and the image token
    id in a vocabulary. Shared by llava's and cross_attention's options."""

    language: ComponentConfig
    image_token_id: int | None

    @property
    def language_options(self) -> Any:
        chosen = self.language
        if chosen.options is not None:
            return chosen.options
        if chosen.component is not None:
            return chosen.component.options_class()
        return LlamaOptions()

    @property
    def vocab_size(self) -> int | None:
        return self.language_options.vocab_size

    @property
    def max_seq_len(self) -> int:
        return self.language_options.max_seq_len

    @property
    def init_std(self) -> float:
        return self.language_options.init_std

    def image_token(self, vocab_size: int) -> int:
        """The image token id in a vocabulary of ``vocab_size`` ids (unset: the last one)."""
        return self.image_token_id if self.image_token_id is not None else vocab_size - 1


@attrs.frozen
class LlavaOptions(AroundALanguageModel):
    """``[model]`` with ``name = "llava"``: a vision tower, an MLP projector and any registered
    language family (``[model.language]``), whose ``vocab_size``, ``max_seq_len`` and
    ``init_std`` are the model's."""

    language: ComponentConfig = component(
        "models", "llama", "The language model: any registered family that can run from embeddings."
    )
    vision: ViTOptions = attrs.field(factory=ViTOptions, metadata=_doc("The vision tower ([model.vision])."))
    image_token_id: int | None = attrs.field(
        default=None,
        validator=non_negative,
        metadata=_doc("Id standing in the text for each image feature; unset = the last id of the vocabulary."),
    )
    projector_bias: bool = attrs.field(default=True, metadata=_doc("The projector's linear layers have biases."))
    projector_activation: str = attrs.field(
        default="gelu", validator=one_of(*ACTIVATIONS), metadata=_doc("The projector's activation.")
    )
    freeze_vision: bool = attrs.field(default=False, metadata=_doc("Train no parameter of the vision tower."))
    freeze_language: bool = attrs.field(default=False, metadata=_doc("Train no parameter of the language model."))
    vision_checkpoint: str | None = attrs.field(
        default=None,
        metadata=_doc(
            "A Hugging Face CLIP or SigLIP vision checkpoint directory (config.json, *.safetensors) whose weights "
            "start the tower; its shapes must fit [model.vision]."
        ),
    )

    @property
    def tokens_per_image(self) -> int:
        return self.vision.tokens_per_image


@attrs.define
class ImageOptions:
    """How a dataset turns images into ``pixel_values``: the size comes from the model."""

    mean: tuple[float, float, float] = attrs.field(
        default=(0.48145466, 0.4578275, 0.40821073),
        converter=tuple,
        metadata=_doc("Per-channel mean subtracted after scaling to [0, 1] (CLIP's; SigLIP's is 0.5)."),
    )
    std: tuple[float, float, float] = attrs.field(
        default=(0.26862954, 0.26130258, 0.27577711),
        converter=tuple,
        metadata=_doc("Per-channel std divided by (CLIP's; SigLIP's is 0.5)."),
    )
    max_images: int = attrs.field(
        default=1, validator=positive, metadata=_doc("Image slots per sequence (pixel_values' second dimension).")
    )

    def __attrs_post_init__(self) -> None:
        for key in ("mean", "std"):
            value = getattr(self, key)
            if len(value) != 3:
                raise FieldError(key, f"needs 3 values (R, G, B), got {len(value)}")
        if any(s <= 0 for s in self.std):
            raise FieldError("std", f"must be > 0, got {self.std}")


@attrs.define
class ImageTextOptions(ImageOptions):
    """``[data]`` with ``name = "image_text"``: JSON-lines records ``{"image": path, "text": ...}``."""

    path: str = attrs.field(default="", metadata=_doc("The JSON-lines file; image paths are relative to its folder."))
    allow_outside: bool = attrs.field(
        default=False,
        metadata=_doc("Follow image paths that lead out of the JSON-lines file's folder tree (absolute, '..', links)."),
    )
    pack: bool = attrs.field(default=True, metadata=_doc("Pack several samples per sequence (document ids)."))

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        if not self.path:
            raise FieldError("path", "is required: the JSON-lines file of image-text records")


@attrs.define
class SyntheticImageTextOptions(ImageOptions):
    """``[data]`` with ``name = "synthetic_image_text"``: generated images whose colour the text names."""

    text_tokens: int = attrs.field(
        default=8, validator=positive, metadata=_doc("Text tokens after each image (they depend on the image).")
    )
    classes: int = attrs.field(
        default=4, validator=positive, metadata=_doc("Distinct images (colours); each has its own text.")
    )
    pack: bool = attrs.field(default=True, metadata=_doc("Pack several samples per sequence (document ids)."))
