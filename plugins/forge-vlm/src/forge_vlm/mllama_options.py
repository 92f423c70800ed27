"""Options of the ``cross_attention`` family and of Mllama's tiled vision tower. Kept free of
torch: Forge imports this module to validate configs."""

from __future__ import annotations

import types
from collections.abc import Mapping
from typing import Any

import attrs

from forge_lm.api import ComponentConfig, component, structure_options
from forge_lm.validators import FieldError, non_negative, one_of, positive
from forge_vlm.options import AroundALanguageModel, ViTOptions

MLLAMA_ASPECT_RATIOS = ((1, 1), (1, 2), (1, 3), (1, 4), (2, 1), (2, 2), (3, 1), (4, 1))


def _doc(text: str) -> dict[str, str]:
    return {"doc": text}


def _ratios(value: Any) -> tuple[tuple[int, int], ...]:
    return tuple(tuple(int(side) for side in pair) for pair in value)


@attrs.frozen
class MllamaVisionOptions:
    """``[model.vision]`` with ``[model] tower = "mllama"``: Llama 3.2 Vision's tower. An image is cut
    into up to ``max_num_tiles`` tiles of ``image_size``; each tile's patches and a class token
    run through ``depth`` local layers, then the tiles of an image together through
    ``global_depth`` gated layers; the features are the last state concatenated with the local
    layers' outputs at ``intermediate_layers``."""

    image_size: int = attrs.field(default=448, validator=positive, metadata=_doc("Square tiles of this side."))
    patch_size: int = attrs.field(default=14, validator=positive, metadata=_doc("Square patches of this side."))
    channels: int = attrs.field(default=3, validator=positive, metadata=_doc("Colour channels of an image."))
    width: int = attrs.field(default=1280, validator=positive, metadata=_doc("Hidden size of the tower."))
    depth: int = attrs.field(default=32, validator=positive, metadata=_doc("Local (per-tile) layers."))
    global_depth: int = attrs.field(default=8, validator=non_negative, metadata=_doc("Gated global layers."))
    heads: int = attrs.field(default=16, validator=positive, metadata=_doc("Attention heads."))
    mlp_dim: int = attrs.field(default=5120, validator=positive, metadata=_doc("Hidden size of each layer's MLP."))
    norm_eps: float = attrs.field(default=1e-5, validator=positive, metadata=_doc("Epsilon of the layers' norms."))
    max_num_tiles: int = attrs.field(default=4, validator=positive, metadata=_doc("Tiles an image is cut into."))
    aspect_ratios: tuple[tuple[int, int], ...] = attrs.field(
        default=MLLAMA_ASPECT_RATIOS,
        converter=_ratios,
        metadata=_doc("The tile layouts (rows, columns) an image may have; aspect_ratio_ids count them from 1."),
    )
    intermediate_layers: tuple[int, ...] = attrs.field(
        default=(3, 7, 15, 23, 30),
        converter=tuple,
        metadata=_doc("Local layers whose outputs join the features (Mllama's intermediate_layers_indices)."),
    )

    def __attrs_post_init__(self) -> None:
        if self.image_size % self.patch_size:
            raise FieldError(
                "patch_size", f"image_size ({self.image_size}) must be divisible by patch_size ({self.patch_size})"
            )
        if self.width % self.heads:
            raise FieldError("heads", f"width ({self.width}) must be divisible by heads ({self.heads})")
        bad = [i for i in self.intermediate_layers if not 0 <= i < self.depth]
        if bad:
            raise FieldError("intermediate_layers", f"{bad} are not local layers 0 .. {self.depth - 1}")
        if any(rows * cols > self.max_num_tiles or min(rows, cols) < 1 for rows, cols in self.aspect_ratios):
            raise FieldError("aspect_ratios", f"each layout needs 1 .. max_num_tiles ({self.max_num_tiles}) tiles")

    @property
    def patches(self) -> int:
        """Positions of one tile: its patches and the class token."""
        return (self.image_size // self.patch_size) ** 2 + 1

    @property
    def output_dim(self) -> int:
        """Width of a feature: the last state and each intermediate layer's."""
        return self.width * (1 + len(self.intermediate_layers))

    @property
    def tokens_per_image(self) -> int:
        return self.max_num_tiles * self.patches


TOWERS: dict[str, type] = {"mllama": MllamaVisionOptions, "vit": ViTOptions}


def _tower_options(value: Any, options: CrossAttentionOptions) -> Any:
    """``[model.vision]`` as the options class of the tower that ``tower`` (set before this field)
    names. The config loader hands the table over as plain data (the field is typed as a table,
    so that one field may hold either class); it is checked here as the loader checks a section."""
    if options.tower not in TOWERS:  # converters run before validators: name the bad tower here
        raise FieldError("tower", f"must be one of {', '.join(map(repr, TOWERS))}, got {options.tower!r}")
    wanted = TOWERS[options.tower]
    if isinstance(value, wanted):
        return value
    if not isinstance(value, Mapping):
        raise FieldError(
            "vision", f"is a {type(value).__name__}; tower = {options.tower!r} takes a table of {wanted.__name__}"
        )
    # Messages read "... for model family 'cross_attention' with tower = 'vit'".
    owner = types.SimpleNamespace(
        category="models", name=f"cross_attention' with tower = '{options.tower}", options_class=wanted
    )
    return structure_options(None, owner, value, "model.vision")


@attrs.frozen
class CrossAttentionOptions(AroundALanguageModel):
    """``[model]`` with ``name = "cross_attention"``: a vision tower, a linear projector to the
    language model's width, and gated cross-attention layers among the blocks of any registered
    language family (``[model.language]``), whose ``vocab_size``, ``max_seq_len`` and
    ``init_std`` are the model's."""

    language: ComponentConfig = component(
        "models", "llama", "The language model: any registered family that can wrap its blocks (WrapsBlocks)."
    )
    tower: str = attrs.field(
        default="mllama",
        validator=one_of(*TOWERS),
        metadata=_doc(
            "The vision tower: 'mllama' (Llama 3.2 Vision's tiled tower) or 'vit' (forge-vlm's ViT, llava's "
            "tower); [model.vision] holds that tower's options."
        ),
    )
    # Typed as a table for the loader; always a MllamaVisionOptions or ViTOptions after init.
    vision: dict[str, Any] = attrs.field(
        factory=dict,
        converter=attrs.Converter(_tower_options, takes_self=True),
        metadata=_doc(
            "The vision tower's options ([model.vision]), unset = that tower's defaults. tower = 'mllama': image_size "
            "(of a tile), patch_size, channels, width, depth, global_depth, heads, mlp_dim, norm_eps, max_num_tiles, "
            "aspect_ratios, intermediate_layers (Llama 3.2 Vision's by default); tower = 'vit': llava's [model.vision] "
            "options (ViTOptions)."
        ),
    )
    image_token_id: int | None = attrs.field(
        default=None,
        validator=non_negative,
        metadata=_doc("The id of the one marker standing in the text for each image; unset = the last id."),
    )
    every_n_blocks: int = attrs.field(
        default=4, validator=positive, metadata=_doc("A cross-attention layer after every k-th block of the language.")
    )
    cross_attention_layers: tuple[int, ...] | None = attrs.field(
        default=None,
        converter=lambda v: None if v is None else tuple(v),
        metadata=_doc(
            "Instead of every_n_blocks: Mllama's indices of the cross-attention layers in the combined list of "
            "blocks and cross-attention layers."
        ),
    )
    empty_rows: str = attrs.field(
        default="zero",
        validator=one_of("zero", "attend_all"),
        metadata=_doc(
            "Text that sees no image yet: 'zero' (no change, as Meta's reference) or 'attend_all' (its attention "
            "part attends to every image state, as transformers' Mllama; an import sets it)."
        ),
    )
    extra_token_ids: int = attrs.field(
        default=0,
        validator=non_negative,
        metadata=_doc(
            "Ids vocab_size .. vocab_size + n - 1 with an embedding but no logit (Mllama's image marker 128256 is "
            "one of 8); needs a language family that runs from embeddings."
        ),
    )
    freeze_vision: bool = attrs.field(default=False, metadata=_doc("Train no parameter of the vision tower."))
    freeze_language: bool = attrs.field(
        default=False, metadata=_doc("Train no parameter of the language model (the cross-attention layers train).")
    )

    @property
    def tokens_per_image(self) -> int:
        """Marker tokens per image in the text: one (the datasets read it)."""
        return 1

    @property
    def states_per_image(self) -> int:
        """Vision states one image gives the cross-attention layers: every tile's positions
        (Mllama's tower), or the ViT's selected features."""
        return self.vision.tokens_per_image

    @property
    def tower_width(self) -> int:
        """Width of the tower's features (the projector's input)."""
        return self.vision.output_dim if self.tower == "mllama" else self.vision.width
