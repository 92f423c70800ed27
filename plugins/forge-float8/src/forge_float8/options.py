"""The options of forge-float8's ``float8`` transform: the keys of ``[transforms.float8]``.

Named by import path in :mod:`forge_float8.plugin`'s registration, so that listing plugins does
not import this module (nor attrs).
"""

from __future__ import annotations

from typing import Any

import attrs

from forge_lm.validators import FieldError, one_of

# torchao's recipe names (torchao.float8.Float8LinearRecipeName), passed through unchanged.
RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def _patterns(instance: Any, attribute: Any, value: list[str]) -> None:
    for pattern in value:
        if not pattern.strip():
            raise FieldError(attribute.name, "patterns must not be empty")


@attrs.define
class Float8Options:
    """The keys of ``[transforms.float8]``; the plugin's README explains each."""

    enabled: bool = False
    recipe: str = attrs.field(default="tensorwise", validator=one_of(*RECIPES))
    # fnmatch patterns of module names (as model.named_modules() gives them). Empty include:
    # every Linear layer is a candidate. The output head and layers whose sizes float8
    # matmuls cannot take are skipped whatever these say.
    include: list[str] = attrs.field(factory=list, validator=_patterns)
    exclude: list[str] = attrs.field(factory=list, validator=_patterns)
    # FSDP2 gathers the weights already cast to float8 (half the bytes of bf16); tensorwise only.
    fsdp_float8_all_gather: bool = False
