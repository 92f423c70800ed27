"""Image-text datasets: ``image_text`` (JSON-lines records ``{"image": path, "text": ...}``, images
through Pillow) and ``synthetic_image_text`` (generated images whose colour decides the text).

A record is one document: for each image, ``tokens_per_image`` image tokens (where the text's
``<image>`` marker stands, or before the text when it has none), the text's tokens, then the
tokenizer's eos. Documents are packed whole into rows of ``seq_len + 1`` tokens (a document
that does not fit starts the next row; the rest of the row is padding), at most ``max_images``
images per row; without ``pack`` each row holds one document. A row gives one sample:

- ``input_ids`` ``[seq_len]`` int64 and ``labels`` ``[seq_len]`` (the next token; IGNORE_INDEX
  where that is an image token, padding, or the next document's: the loss is on text only);
- ``document_ids`` ``[seq_len]``: the document's index in the row (padding: one more);
- ``pixel_values`` float32 ``[max_images, 3, image_size, image_size]``, resized (bicubic) and
  normalised (``(x / 255 - mean) / std``), zeros in unused slots; ``image_mask`` bool
  ``[max_images]``, real images first, in the order of their markers.

The image token id and ``tokens_per_image`` are the model's (``DataContext.model``: the one
place they are set). A missing, unreadable or corrupt image skips its record, counted
(``skipped_images``, one warning naming the first, a ``vlm/image_skipped`` event per skip), never a crash; a record
whose ``<image>`` markers and images differ in number is refused, naming the line. Image
paths are relative to the JSON-lines file's folder and may not lead out of its folder tree
(``..``, absolute paths, links) unless ``allow_outside`` is set.

Every data-parallel rank packs the same rows and keeps every ``dp_size``-th (row ``k`` on rank
``k % dp_size``): the position, ``{"record", "carry", "row"}`` (carry: the record that opens the
next row, -1 for none), is the same on every rank and
resumes any layout exactly, at the cost of each rank reading every record.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from forge_lm.api import record_event
from forge_lm.components import IGNORE_INDEX, DataContext
from forge_lm.errors import ConfigError, ForgeError
from forge_vlm.options import ImageOptions, ImageTextOptions, SyntheticImageTextOptions

MARKER = "<image>"


class _Document:
    """One record, ready to pack: its tokens (image tokens included) and its images."""

    def __init__(self, tokens: list[int], images: list[torch.Tensor]) -> None:
        self.tokens, self.images = tokens, images


class PackedImageText(torch.utils.data.IterableDataset):
    """Rows packed from a source of documents (see the module docstring). ``document(i)`` gives
    record ``i`` (None: skipped); the records repeat endlessly."""

    def __init__(self, context: DataContext, options: ImageOptions, pack: bool, records: int) -> None:
        model = context.model
        if model is None or not hasattr(model, "tokens_per_image") or not callable(getattr(model, "image_token", None)):
            raise ConfigError(
                "the image-text datasets take the image token and tokens_per_image from the model: choose a "
                "vision-language [model] name (llava), not "
                f"{type(model).__name__ if model is not None else 'none'}."
            )
        self.context, self.options, self.pack, self.records = context, options, pack, records
        self.image_token = int(model.image_token(context.vocab_size))
        self.tokens_per_image = int(model.tokens_per_image)
        vision = getattr(model, "vision", None)
        self.image_size = int(getattr(vision, "image_size", 0))
        self.channels = int(getattr(vision, "channels", 3))
        self.row_len = context.seq_len + 1
        if self.tokens_per_image + 1 > self.row_len:
            raise ConfigError(
                f"[train] seq_len = {context.seq_len} cannot hold one image ({self.tokens_per_image} image tokens) "
                "and a text token; raise seq_len or make [model.vision] give fewer tokens."
            )
        self._record = 0  # the next record to read
        self._carry: int | None = None  # a record read that did not fit the row before: it opens the next
        self._row = 0  # rows packed so far, over every rank
        self.skipped_images = 0

    # -- the position ------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        # carry -1: none (a state keeps the kinds of its values from the start)
        return {"record": self._record, "carry": -1 if self._carry is None else self._carry, "row": self._row}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._record, self._row = int(state["record"]), int(state["row"])
        carry = int(state.get("carry", -1))
        self._carry = None if carry < 0 else carry

    # -- packing -----------------------------------------------------------------------------------

    def document(self, index: int) -> _Document | None:
        raise NotImplementedError

    def _next_document(self) -> tuple[int, _Document]:
        if self._carry is not None:
            index, self._carry = self._carry, None
            document = self.document(index)
            if document is not None:
                return index, document
        for _ in range(self.records + 1):
            index = self._record
            self._record += 1
            document = self.document(index % self.records)
            if document is not None:
                return index, document
        raise ForgeError(
            f"no record of the data gives a usable sample ({self.skipped_images} images skipped); check the "
            "image paths and files."
        )

    def _pack_row(self) -> dict[str, torch.Tensor]:
        tokens: list[int] = []
        documents: list[int] = []
        images: list[torch.Tensor] = []
        while True:
            index, document = self._next_document()
            doc_tokens = document.tokens[: self.row_len]
            fits = len(tokens) + len(doc_tokens) <= self.row_len
            room = len(images) + len(document.images) <= self.options.max_images
            if tokens and (not fits or not room or not self.pack):
                self._carry = index
                break
            # A document longer than a row, or with more images than its slots, is cut: it keeps the
            # images whose whole run of image tokens it holds, and ends before the next run.
            kept_images = _images_within(doc_tokens, document.images, self.image_token, self.tokens_per_image)
            kept_images = kept_images[: self.options.max_images - len(images)]
            doc_tokens = _cut_after_images(doc_tokens, len(kept_images), self.image_token, self.tokens_per_image)
            documents.extend([documents[-1] + 1 if documents else 0] * len(doc_tokens))
            tokens.extend(doc_tokens)
            images.extend(kept_images)
            if not self.pack or len(tokens) >= self.row_len:
                break
        return self._sample(tokens, documents, images)

    def _sample(self, tokens: list[int], documents: list[int], images: list[torch.Tensor]) -> dict[str, torch.Tensor]:
        pad = self.row_len - len(tokens)
        last = (documents[-1] + 1) if documents else 0
        row = torch.tensor(tokens + [0] * pad, dtype=torch.int64)
        doc = torch.tensor(documents + [last] * pad, dtype=torch.int64)
        labels = row[1:].clone()
        ignored = (doc[1:] != doc[:-1]) | (row[1:] == self.image_token)
        labels[ignored] = IGNORE_INDEX
        if pad:
            labels[len(tokens) - 1 :] = IGNORE_INDEX
        pixels = torch.zeros(self.options.max_images, self.channels, self.image_size, self.image_size)
        mask = torch.zeros(self.options.max_images, dtype=torch.bool)
        for slot, image in enumerate(images):
            pixels[slot], mask[slot] = image, True
        return {
            "input_ids": row[:-1],
            "labels": labels,
            "document_ids": doc[:-1],
            "pixel_values": pixels,
            "image_mask": mask,
        }

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        while True:
            row = self._pack_row()
            self._row += 1
            if (self._row - 1) % self.context.dp_size == self.context.dp_rank:
                yield row

    # -- shared by the sources -----------------------------------------------------------------

    def normalise(self, rgb: torch.Tensor) -> torch.Tensor:
        """``[3, H, W]`` values in [0, 1] -> normalised with the options' mean and std."""
        return normalise(rgb, self.options)

    def with_markers(self, ids_of: Any, text: str, images: int, where: str) -> list[int]:
        """The document's tokens (:func:`tokens_with_markers`), eos not included."""
        return tokens_with_markers(ids_of, text, images, self.image_token, self.tokens_per_image, where)

    def skip(self, where: str, why: str) -> None:
        self.skipped_images += 1
        if self.skipped_images == 1:
            print(
                f"forge-vlm: warning: {where}: {why}; the record is skipped (skips are counted, "
                "each one a 'vlm/image_skipped' event).",
                file=sys.stderr,
            )
        record_event("vlm/image_skipped", where=where, reason=why, count=self.skipped_images)


def normalise(rgb: torch.Tensor, options: ImageOptions) -> torch.Tensor:
    """``[3, H, W]`` values in [0, 1] -> ``(rgb - mean) / std`` with the options' per-channel values."""
    mean = torch.tensor(options.mean).view(3, 1, 1)
    std = torch.tensor(options.std).view(3, 1, 1)
    return (rgb - mean) / std


def tokens_with_markers(
    ids_of: Any, text: str, images: int, image_token: int, tokens_per_image: int, where: str
) -> list[int]:
    """``text``'s tokens with ``tokens_per_image`` image tokens where each ``<image>`` stands (before
    the text when it has no marker and one image). The marker and image counts must agree, and
    the text's own tokens may not include the image token (each refused, naming ``where``)."""
    pieces = text.split(MARKER)
    markers = len(pieces) - 1
    if markers == 0 and images == 1:
        pieces, markers = ["", text], 1
    if markers != images:
        more = "more images than <image> markers" if images > markers else "an <image> marker with no image"
        raise ForgeError(
            f"{where}: {more} ({images} images, {markers} markers); give one image per marker (a text with "
            "one image and no marker puts the image before the text)."
        )
    tokens: list[int] = []
    for number, piece in enumerate(pieces):
        if number:
            tokens.extend([image_token] * tokens_per_image)
        ids = ids_of(piece) if piece else []
        if image_token in ids:
            raise ForgeError(
                f"{where}: the tokenizer gives the image token id {image_token} for the text itself; set "
                "[model] image_token_id to an id the tokenizer never produces."
            )
        tokens.extend(ids)
    return tokens


class UnreadableImage(Exception):
    """An image file that does not exist or that Pillow cannot decode; the message says which."""


def read_image(location: Path, image_size: int, shown_as: str) -> torch.Tensor:
    """The image at ``location`` as ``[3, image_size, image_size]`` values in [0, 1]: read by
    Pillow, converted to RGB (any mode), resized (bicubic, aspect not kept). Raises
    :class:`UnreadableImage` naming ``shown_as`` for a missing, unreadable or corrupt file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(location) as image:
            image.load()
            rgb = image.convert("RGB").resize((image_size, image_size), Image.Resampling.BICUBIC)
    except FileNotFoundError:
        raise UnreadableImage(f"the image '{shown_as}' does not exist") from None
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as exc:
        raise UnreadableImage(f"the image '{shown_as}' cannot be read ({type(exc).__name__}: {exc})") from None
    values = torch.frombuffer(bytearray(rgb.tobytes()), dtype=torch.uint8)
    return values.view(image_size, image_size, 3).permute(2, 0, 1).float() / 255.0


def _images_within(tokens: list[int], images: list[torch.Tensor], image_token: int, per_image: int) -> list:
    """The images whose whole run of image tokens is inside ``tokens`` (a cut document keeps those)."""
    whole = sum(1 for t in tokens if t == image_token) // per_image
    return images[:whole]


def _cut_after_images(tokens: list[int], keep: int, image_token: int, per_image: int) -> list[int]:
    """``tokens`` cut before the image token run of image number ``keep`` (0-based)."""
    seen = 0
    for position, token in enumerate(tokens):
        if token == image_token:
            if seen == keep * per_image:
                return tokens[:position]
            seen += 1
    return tokens


class ImageText(PackedImageText):
    """``image_text``: JSON-lines records ``{"image": path or [paths], "text": str}``."""

    def __init__(self, options: ImageTextOptions, context: DataContext) -> None:
        from forge_lm.api import check_tokenizer

        self.file = Path(options.path)
        if not self.file.is_file():
            raise ConfigError(f"[data] path = '{options.path}' is not a file; give the JSON-lines file of records.")
        self.folder = self.file.resolve().parent
        self.allow_outside = options.allow_outside
        self.lines = [line for line in self.file.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not self.lines:
            raise ConfigError(f"[data] path = '{options.path}' holds no records.")
        self.tokenizer = check_tokenizer(context.tokenizer, context.vocab_size, "image_text")
        super().__init__(context, options, options.pack, len(self.lines))

    def document(self, index: int) -> _Document | None:
        where = f"{self.file}, line {index + 1}"
        try:
            record = json.loads(self.lines[index])
        except ValueError as exc:
            raise ForgeError(f"{where} is not JSON: {exc}") from None
        if not isinstance(record, dict) or not isinstance(record.get("text"), str):
            raise ForgeError(f'{where}: a record is {{"image": path, "text": str}}')
        paths = record.get("image", [])
        paths = [paths] if isinstance(paths, str) else paths
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            raise ForgeError(f"{where}: 'image' is a path or a list of paths")
        tokens = self.with_markers(self.tokenizer.encode, record["text"], len(paths), where)
        images = []
        for path in paths:
            image = self._read(path, where)
            if image is None:
                return None
            images.append(image)
        return _Document([*tokens, self.tokenizer.eos_id], images)

    def _read(self, path: str, where: str) -> torch.Tensor | None:
        location = self.folder / path
        if not self.allow_outside:
            resolved = location.resolve()
            if not resolved.is_relative_to(self.folder) or Path(path).is_absolute():
                raise ForgeError(
                    f"{where}: the image path '{path}' leads out of {self.folder} (the records' folder tree); "
                    "move the image under it, or set [data] allow_outside = true."
                )
        try:
            pixels = read_image(location, self.image_size, path)
        except UnreadableImage as exc:
            self.skip(where, str(exc))
            return None
        return self.normalise(pixels)


# Distinct colours of the synthetic images, as (R, G, B) in [0, 1].
_PALETTE = [(1, 0, 0), (0, 1, 0), (0, 0, 1), (1, 1, 0), (1, 0, 1), (0, 1, 1), (1, 1, 1), (0, 0, 0)]


class SyntheticImageText(PackedImageText):
    """``synthetic_image_text``: record ``i`` is an image of one of ``classes`` colours (drawn
    from (seed, i)) and that colour's own ``text_tokens`` tokens, so the text can be predicted
    only from the image: the loss falls as the model learns to look."""

    def __init__(self, options: SyntheticImageTextOptions, context: DataContext) -> None:
        if options.classes > len(_PALETTE):
            raise ConfigError(f"[data] classes = {options.classes}: at most {len(_PALETTE)} colours.")
        self.synthetic = options
        super().__init__(context, options, options.pack, records=1 << 40)
        words = [t for t in range(context.vocab_size) if t != self.image_token]
        generator = torch.Generator().manual_seed(context.seed)
        self.texts = [
            [words[int(i)] for i in torch.randint(0, len(words), (options.text_tokens,), generator=generator)]
            for _ in range(options.classes)
        ]

    def document(self, index: int) -> _Document:
        offset = 1 << 41 if self.context.split == "eval" else 0
        generator = torch.Generator().manual_seed((self.context.seed << 42) + offset + index)
        colour = int(torch.randint(0, self.synthetic.classes, (1,), generator=generator))
        rgb = torch.tensor(_PALETTE[colour], dtype=torch.float32).view(3, 1, 1)
        noise = 0.05 * torch.randn(3, self.image_size, self.image_size, generator=generator)
        image = self.normalise((rgb + noise).clamp(0, 1).expand(3, self.image_size, self.image_size))
        tokens = [self.image_token] * self.tokens_per_image + self.texts[colour]
        return _Document(tokens, [image])


def build_image_text(options: ImageTextOptions, context: DataContext) -> ImageText:
    return ImageText(options, context)


def build_synthetic_image_text(options: SyntheticImageTextOptions, context: DataContext) -> SyntheticImageText:
    return SyntheticImageText(options, context)
