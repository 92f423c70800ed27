"""Image prompts for ``forge generate --image`` (:class:`forge_lm.components.PromptsWithImages`).

An image is read as the run's image-text data reads it (Pillow, RGB, resized to the tower's
``image_size`` bicubically, normalised with the run's ``[data]`` mean and std, CLIP's when the
run's data is not image data), and its image tokens stand where the data puts them: at each
``<image>`` of the prompt, one marker per image, or before the text when the prompt holds no
marker and there is one image. The images are ``pixel_values`` ``[num_images, C, H, W]`` in
order, transformers' processors' layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from forge_lm.errors import ForgeError
from forge_vlm.data import UnreadableImage, normalise, read_image, tokens_with_markers
from forge_vlm.options import ImageOptions


def image_options(config: Any) -> ImageOptions:
    """The run's image options (its ``[data]``'s when that is image data; the defaults else)."""
    data = getattr(getattr(config, "data", None), "options", None)
    return data if isinstance(data, ImageOptions) else ImageOptions()


def image_prompt(
    text: str,
    images: Sequence[str],
    tokenizer: Any,
    config: Any,
    *,
    image_token: int,
    tokens_per_image: int,
    image_size: int,
) -> tuple[list[int], dict[str, torch.Tensor]]:
    """``(prompt ids, {"pixel_values": [num_images, 3, image_size, image_size]})`` for ``text``
    and the image files ``images`` (see the module docstring)."""
    if not images:
        raise ForgeError("an image prompt needs at least one image (--image PATH).")
    ids = tokens_with_markers(tokenizer.encode, text, len(images), image_token, tokens_per_image, "the prompt")
    options = image_options(config)
    pixels = []
    for path in images:
        try:
            pixels.append(normalise(read_image(Path(path), image_size, str(path)), options))
        except UnreadableImage as exc:
            raise ForgeError(f"--image: {exc}; give an image file Pillow reads (PNG, JPEG, ...).") from None
    return ids, {"pixel_values": torch.stack(pixels)}
