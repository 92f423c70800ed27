"""Checked reads of a Hugging Face ``config.json``, for the importers (Llama here, Mixtral in
forge-moe): every number is checked before it sizes anything.

A ``config.json`` is untrusted input: a size that is missing, zero, negative, fractional, a
string or absurdly large, or a table that is not a table, is refused with a
:class:`~forge_lm.errors.ForgeError` naming ``config.json`` and the field, never left to fail
later as a ``ZeroDivisionError`` or an ``AttributeError`` that looks like a plugin's bug.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from forge_lm.errors import ForgeError

CONFIG_FILE = "config.json"
MAX_SIZE = 2**63 - 1  # the largest size a tensor dimension can have; anything above is not a size
_REQUIRED = object()


class HFConfigReader:
    """Typed reads of ``hf_config``; ``architecture`` (``"Llama"``) names the model in messages.

    A field set to ``null`` reads as absent: its default, or a refusal if it has none."""

    def __init__(self, hf_config: Mapping[str, Any], architecture: str) -> None:
        self.config = hf_config
        self.architecture = architecture

    def refuse(self, key: str, problem: str) -> ForgeError:
        return ForgeError(
            f"{CONFIG_FILE} does not describe a {self.architecture} model Forge can import: {problem}. Correct "
            f"{key} in {CONFIG_FILE} (or save the model again with save_pretrained)."
        )

    def _absent(self, key: str, default: Any) -> Any:
        if default is _REQUIRED:
            raise self.refuse(key, f"it has no {key}")
        return default

    def positive_int(self, key: str, default: Any = _REQUIRED) -> Any:
        """``key`` as an integer from 1 to :data:`MAX_SIZE` (``default`` if absent, which may be None)."""
        value = self.config.get(key)
        if value is None:
            return self._absent(key, default)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= MAX_SIZE:
            raise self.refuse(key, f"{key} is {shown(value)}, not a positive integer")
        return value

    def positive_number(self, key: str, default: Any = _REQUIRED, *, value: Any = _REQUIRED) -> float:
        """``key`` as a finite number > 0; ``value``: read that instead of the top-level field."""
        return self._number(key, default, value, zero_allowed=False)

    def non_negative_number(self, key: str, default: Any = _REQUIRED) -> float:
        return self._number(key, default, _REQUIRED, zero_allowed=True)

    def _number(self, key: str, default: Any, value: Any, *, zero_allowed: bool) -> float:
        if value is _REQUIRED:
            value = self.config.get(key)
        if value is None:
            return self._absent(key, default)
        bound = 0 if zero_allowed else math.nextafter(0.0, 1.0)
        if not isinstance(value, int | float) or isinstance(value, bool) or not _finite_at_least(value, bound):
            kind = "a finite number >= 0" if zero_allowed else "a finite number > 0"
            raise self.refuse(key, f"{key} is {shown(value)}, not {kind}")
        return float(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.config.get(key)
        if value is None:
            return default
        if not isinstance(value, bool):
            raise self.refuse(key, f"{key} is {shown(value)}, not true or false")
        return value

    def table(self, key: str) -> dict[str, Any]:
        """``key`` as a JSON object (``{}`` if absent)."""
        value = self.config.get(key)
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise self.refuse(key, f"{key} is {shown(value)}, not a table (a JSON object)")
        return value

    def rope_theta(self, default: float) -> float:
        """RoPE's base: ``rope_parameters.rope_theta`` (transformers >= 5), else ``rope_theta``."""
        rope = self.table("rope_parameters")
        if rope.get("rope_theta") is not None:
            return self.positive_number("rope_parameters.rope_theta", value=rope["rope_theta"])
        return self.positive_number("rope_theta", default)

    def decoder_sizes(self, *, explicit_head_dim: bool = False) -> dict[str, Any]:
        """The sizes every decoder of Forge's shape has, checked against each other: ``dim``,
        ``n_layers``, ``n_heads``, ``n_kv_heads``, ``vocab_size``, ``max_seq_len`` and the
        feed-forward's ``hidden`` (``intermediate_size``).

        ``explicit_head_dim``: also read ``head_dim`` (Qwen3 sets it apart from ``hidden_size /
        num_attention_heads``), returned as ``head_dim``: the size where it differs from that
        quotient, None where it is absent or the same (Forge's ``head_dim`` left unset)."""
        dim = self.positive_int("hidden_size")
        heads = self.positive_int("num_attention_heads")
        kv_heads = self.positive_int("num_key_value_heads", heads)
        head_dim = self.positive_int("head_dim", None) if explicit_head_dim else None
        if head_dim is not None:
            if head_dim % 2:
                raise self.refuse("head_dim", f"head_dim is {head_dim}, odd; RoPE needs an even head size")
        elif dim % heads:
            raise self.refuse(
                "num_attention_heads", f"hidden_size ({dim}) is not a multiple of num_attention_heads ({heads})"
            )
        if heads % kv_heads:
            raise self.refuse(
                "num_key_value_heads",
                f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({kv_heads})",
            )
        if head_dim is None and (dim // heads) % 2:
            raise self.refuse(
                "num_attention_heads",
                f"hidden_size / num_attention_heads = {dim // heads} is odd; RoPE needs an even head size",
            )
        sizes = {
            "dim": dim,
            "n_layers": self.positive_int("num_hidden_layers"),
            "n_heads": heads,
            "n_kv_heads": kv_heads,
            "vocab_size": self.positive_int("vocab_size"),
            "max_seq_len": self.positive_int("max_position_embeddings", 2048),
            "hidden": self.positive_int("intermediate_size"),
        }
        if explicit_head_dim:
            sizes["head_dim"] = head_dim if head_dim is not None and heads * head_dim != dim else None
        return sizes


def _finite_at_least(value: float, bound: float) -> bool:
    try:
        return math.isfinite(value) and value >= bound
    except OverflowError:  # an integer too large for a float
        return False


def shown(value: Any) -> str:
    """``value`` for a message, cut short: a hostile file may hold a long string."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def listed(names: list[str], most: int = 5) -> str:
    """The first ``most`` of ``names`` for a message, and how many more there are."""
    shown_names = ", ".join(names[:most])
    return shown_names + (f" and {len(names) - most} more" if len(names) > most else "")
