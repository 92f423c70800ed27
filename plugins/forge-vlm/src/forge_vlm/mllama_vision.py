"""Llama 3.2 Vision's (Mllama's) tiled vision tower.

An image arrives cut into ``max_num_tiles`` tiles (padding tiles masked by ``aspect_ratio_mask``)
with the id of its tile layout (``aspect_ratio_ids``, 1-based; 0 is no image). Per tile: patch
embedding, a learned per-layout tile embedding (gated), a class token, positions mixed by a gate
between one table for every tile and a per-layout table, a layer norm, the patch axis padded to
a multiple of 8; then ``depth`` local layers over each tile's positions, a layer norm, a second
gated tile embedding, and ``global_depth`` gated layers over all tiles of an image together.
The features are the last state concatenated with the local layers' outputs listed in
``intermediate_layers`` (interleaved, as Mllama flattens them):
``[images, tiles, patches + 1, width * (1 + len(intermediate_layers))]``.

Attention masking is Mllama's as transformers computes it: a position is masked only against
positions that are both padding (padding patches, or masked tiles); real positions attend to
every position of the image.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from forge_lm.api import Linear
from forge_lm.errors import ForgeError

if TYPE_CHECKING:
    from forge_lm.components import Initializer
    from forge_vlm.mllama_options import MllamaVisionOptions


class VisionAttention(nn.Module):
    """Multi-head self-attention without biases; ``mask`` is added to the scores."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads, self.head_dim = heads, width // heads
        self.wq = Linear(width, width, bias=False)
        self.wk = Linear(width, width, bias=False)
        self.wv = Linear(width, width, bias=False)
        self.wo = Linear(width, width, bias=False)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = (
            w(x).view(batch, seq, self.heads, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv)
        )
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [N, H, S, Dh]
        return self.wo(out.transpose(1, 2).reshape(batch, seq, -1))


class VisionLayer(nn.Module):
    """Pre-norm layer (LayerNorm with bias, attention, GELU MLP with biases); a gated layer
    scales each residual update by ``tanh(gate)``."""

    def __init__(self, options: MllamaVisionOptions, gated: bool) -> None:
        super().__init__()
        width = options.width
        self.attention_norm = nn.LayerNorm(width, eps=options.norm_eps)
        self.attention = VisionAttention(width, options.heads)
        self.ffn_norm = nn.LayerNorm(width, eps=options.norm_eps)
        self.fc1 = Linear(width, options.mlp_dim, bias=True)
        self.fc2 = Linear(options.mlp_dim, width, bias=True)
        self.gated = gated
        if gated:
            self.attn_gate = nn.Parameter(torch.full((1,), math.pi / 4))
            self.ffn_gate = nn.Parameter(torch.full((1,), math.pi / 4))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        update = self.attention(self.attention_norm(x), mask)
        x = x + (torch.tanh(self.attn_gate) * update if self.gated else update)
        update = self.fc2(F.gelu(self.fc1(self.ffn_norm(x))))
        return x + (torch.tanh(self.ffn_gate) * update if self.gated else update)

    def init_weights(self, init: Initializer) -> None:
        for norm in (self.attention_norm, self.ffn_norm):
            init.ones(norm.weight)
            init.zeros(norm.bias)
        for weight in (self.attention.wq.weight, self.attention.wk.weight, self.attention.wv.weight):
            init.normal(weight, init.std)
        init.normal(self.attention.wo.weight, init.residual_std)
        init.normal(self.fc1.weight, init.std)
        init.normal(self.fc2.weight, init.residual_std)
        init.zeros(self.fc1.bias)
        init.zeros(self.fc2.bias)
        if self.gated:  # Meta's starting value: tanh(pi / 4) lets about 0.66 of each update through
            init.constant(self.attn_gate, math.pi / 4)
            init.constant(self.ffn_gate, math.pi / 4)


class TileEmbedding(nn.Module):
    """A learned vector per (tile layout, tile), added to every position of the tile, gated."""

    def __init__(self, layouts: int, tiles: int, width: int) -> None:
        super().__init__()
        self.tiles, self.width = tiles, width
        self.embedding = nn.Embedding(layouts + 1, tiles * width)  # id 0: no image
        self.gate = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        # x: [N, tiles, positions, width]
        per_tile = self.embedding(aspect_ratio_ids).view(-1, self.tiles, 1, self.width)
        return x + torch.tanh(self.gate) * per_tile


class TilePositions(nn.Module):
    """Positions: ``(1 - tanh(gate))`` times one table shared by every tile plus ``tanh(gate)``
    times a table per (tile layout, tile)."""

    def __init__(self, layouts: int, tiles: int, positions: int, width: int) -> None:
        super().__init__()
        self.tiles, self.positions, self.width = tiles, positions, width
        self.gate = nn.Parameter(torch.zeros(1))
        self.embedding = nn.Parameter(torch.zeros(positions, width))
        self.tile_embedding = nn.Embedding(layouts + 1, tiles * positions * width)

    def forward(self, x: torch.Tensor, aspect_ratio_ids: torch.Tensor) -> torch.Tensor:
        gate = torch.tanh(self.gate)
        x = x + (1 - gate) * self.embedding.view(1, 1, self.positions, self.width)
        per_tile = self.tile_embedding(aspect_ratio_ids).view(-1, self.tiles, self.positions, self.width)
        return x + gate * per_tile


class MllamaVisionTower(nn.Module):
    """``forward(pixel_values [N, tiles, C, H, W], aspect_ratio_ids [N], aspect_ratio_mask
    [N, tiles]) -> [N, tiles, positions, output_dim]`` for ``N`` images."""

    def __init__(self, options: MllamaVisionOptions) -> None:
        super().__init__()
        self.options = options
        width, tiles, layouts = options.width, options.max_num_tiles, len(options.aspect_ratios)
        self.patch_embedding = nn.Conv2d(
            options.channels, width, kernel_size=options.patch_size, stride=options.patch_size, bias=False
        )
        self.class_embedding = nn.Parameter(torch.zeros(width))
        self.pre_tile = TileEmbedding(layouts, tiles, width)
        self.positions = TilePositions(layouts, tiles, options.patches, width)
        self.post_tile = TileEmbedding(layouts, tiles, width)
        self.norm_pre = nn.LayerNorm(width)
        self.norm_post = nn.LayerNorm(width)
        self.layers = nn.ModuleList(VisionLayer(options, gated=False) for _ in range(options.depth))
        self.global_layers = nn.ModuleList(VisionLayer(options, gated=True) for _ in range(options.global_depth))

    def blocks(self) -> list[nn.Module]:
        return [*self.layers, *self.global_layers]

    def forward(
        self, pixel_values: torch.Tensor, aspect_ratio_ids: torch.Tensor, aspect_ratio_mask: torch.Tensor
    ) -> torch.Tensor:
        options = self.options
        images, tiles = pixel_values.shape[:2]
        expected = (options.max_num_tiles, options.channels, options.image_size, options.image_size)
        if pixel_values.ndim != 5 or tuple(pixel_values.shape[1:]) != expected:
            raise ForgeError(
                f"Mllama's tower takes pixel_values [images, {', '.join(map(str, expected))}] (tiles, channels, "
                f"height, width); got {tuple(pixel_values.shape)}."
            )
        if aspect_ratio_ids.shape != (images,) or aspect_ratio_mask.shape != (images, tiles):
            raise ForgeError(
                f"aspect_ratio_ids {tuple(aspect_ratio_ids.shape)} and aspect_ratio_mask "
                f"{tuple(aspect_ratio_mask.shape)} must be [{images}] and [{images}, {tiles}]."
            )
        if bool((aspect_ratio_ids < 0).any()) or bool((aspect_ratio_ids > len(options.aspect_ratios)).any()):
            raise ForgeError(f"aspect_ratio_ids must be 0 .. {len(options.aspect_ratios)} (the tile layouts).")
        width = options.width
        dtype = self.patch_embedding.weight.dtype
        patches = self.patch_embedding(pixel_values.flatten(0, 1).to(dtype))  # [N*tiles, width, g, g]
        x = patches.flatten(2).transpose(1, 2).reshape(images, tiles, -1, width)
        x = self.pre_tile(x, aspect_ratio_ids)
        cls = self.class_embedding.view(1, 1, 1, width).expand(images, tiles, 1, width)
        x = self.positions(torch.cat([cls, x], dim=2), aspect_ratio_ids)  # [N, tiles, P, width]
        x = self.norm_pre(x)
        positions = x.shape[2]
        padded = positions + (-positions) % 8  # Mllama pads each tile's positions to a multiple of 8
        x = F.pad(x, (0, 0, 0, padded - positions))
        mask = self._mask(aspect_ratio_mask, positions, padded, x.dtype)
        h = x.reshape(images, tiles * padded, width)
        kept = []
        for index, layer in enumerate(self.layers):
            h = layer(h, mask)
            if index in options.intermediate_layers:
                kept.append(h)
        h = self.norm_post(h)
        h = self.post_tile(h.view(images, tiles, padded, width), aspect_ratio_ids).view(images, tiles * padded, width)
        for layer in self.global_layers:
            h = layer(h, mask)
        by_index = dict(zip([i for i in range(options.depth) if i in options.intermediate_layers], kept, strict=True))
        intermediate = [by_index[i] for i in options.intermediate_layers]  # in the order the options list them
        if intermediate:
            # Mllama stacks them on a new last axis and flattens: feature d of layer k at d * K + k.
            h = torch.cat([h, torch.stack(intermediate, dim=-1).flatten(-2)], dim=-1)
        features = h
        return features.view(images, tiles, padded, -1)[:, :, :positions]

    @staticmethod
    def _mask(aspect_ratio_mask: torch.Tensor, positions: int, padded: int, dtype: torch.dtype) -> torch.Tensor:
        """``[N, 1, tiles * padded, tiles * padded]`` additive: the dtype's lowest value where query
        and key are both padding (a padding position or a masked tile), else 0."""
        images, tiles = aspect_ratio_mask.shape
        padding = (aspect_ratio_mask == 0)[:, :, None].expand(images, tiles, padded).clone()
        padding[:, :, positions:] = True
        padding = padding.reshape(images, tiles * padded).to(dtype)
        both = padding[:, :, None] * padding[:, None, :]
        return (both * torch.finfo(dtype).min)[:, None]

    def init_weights(self, init: Initializer) -> None:
        """Weights ``normal(0, init.std)``; the tile and position gates 0 (the shared positions alone
        at first), the global layers' gates pi / 4, norms 1 and biases 0."""
        init.normal(self.patch_embedding.weight, init.std)
        init.normal(self.class_embedding, init.std)
        for tile in (self.pre_tile, self.post_tile):
            init.normal(tile.embedding.weight, init.std)
            init.zeros(tile.gate)
        init.zeros(self.positions.gate)
        init.normal(self.positions.embedding, init.std)
        init.normal(self.positions.tile_embedding.weight, init.std)
        for norm in (self.norm_pre, self.norm_post):
            init.ones(norm.weight)
            init.zeros(norm.bias)
        for layer in self.blocks():
            init.module(layer)
