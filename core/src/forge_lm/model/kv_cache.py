"""A key/value cache for incremental decoding: each layer's past keys and values, preallocated."""

from __future__ import annotations

import torch

from forge_lm.errors import ForgeError


class KVCache:
    """Keys and values of the tokens seen so far, for every layer, in buffers of ``max_len`` slots.

    A forward pass with a cache reads ``length`` (the position of its first token), each
    attention layer calls :meth:`update` with the keys and values of the new tokens, and the
    model calls :meth:`advance` once all layers are done. Buffers are allocated by the first
    update of each layer, in the dtype and on the device of its keys (so an autocast forward
    caches bf16), with shape ``[batch, kv_heads, max_len, head_dim]``: grouped-query attention
    caches only its ``kv_heads`` heads.
    """

    def __init__(self, max_len: int) -> None:
        if max_len < 1:
            raise ForgeError(f"a KV cache needs max_len >= 1, got {max_len}.")
        self.max_len = max_len
        self.length = 0  # tokens already cached; the next token's position
        self._keys: dict[int, torch.Tensor] = {}
        self._values: dict[int, torch.Tensor] = {}

    def check_room(self, new_tokens: int) -> None:
        """Raise if ``new_tokens`` more tokens do not fit."""
        if self.length + new_tokens > self.max_len:
            raise ForgeError(
                f"the KV cache holds {self.max_len} tokens; {self.length} are cached and {new_tokens} more "
                "do not fit. Create the cache with a larger max_len."
            )

    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new ``keys``/``values`` ``[batch, kv_heads, new, head_dim]`` of ``layer``.

        Returns every cached key and value of that layer, the new ones included:
        ``[batch, kv_heads, length + new, head_dim]`` each.
        """
        new = keys.shape[2]
        self.check_room(new)
        if layer not in self._keys:
            batch, heads, _, head_dim = keys.shape
            shape = (batch, heads, self.max_len, head_dim)
            self._keys[layer] = keys.new_zeros(shape)
            self._values[layer] = values.new_zeros(shape)
        end = self.length + new
        self._keys[layer][:, :, self.length : end] = keys
        self._values[layer][:, :, self.length : end] = values
        return self._keys[layer][:, :, :end], self._values[layer][:, :, :end]

    def advance(self, new_tokens: int) -> None:
        """Mark ``new_tokens`` more positions as cached (called by the model after its last layer)."""
        self.length += new_tokens

    def reset(self) -> None:
        """Forget every cached token (the buffers are kept for reuse)."""
        self.length = 0
