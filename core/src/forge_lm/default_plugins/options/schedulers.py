"""Options of the built-in learning-rate schedules (:mod:`forge_lm.default_plugins.schedulers`).

Named by import path at registration, so that listing plugins imports none of them, nor
:mod:`forge_lm.components`, which they build on.
"""

from __future__ import annotations

import attrs

from forge_lm.components import WarmupOptions
from forge_lm.validators import fraction, one_of


@attrs.define
class ConstantOptions(WarmupOptions):
    pass


@attrs.define
class CosineOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.1, validator=fraction)  # final lr / peak lr


@attrs.define
class LinearOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # final lr / peak lr


@attrs.define
class WsdOptions(WarmupOptions):
    decay_fraction: float = attrs.field(default=0.2, validator=fraction)  # share of the run spent cooling down
    cooldown: str = attrs.field(default="sqrt", validator=one_of("sqrt", "linear", "cosine"))
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # final lr / peak lr


@attrs.define
class RexOptions(WarmupOptions):
    min_lr_ratio: float = attrs.field(default=0.0, validator=fraction)  # floor, as a fraction of the peak
