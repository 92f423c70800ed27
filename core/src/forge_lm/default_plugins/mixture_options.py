"""Options of the built-in ``mixture`` dataset (:mod:`forge_lm.default_plugins.datasets`).

In their own module, named by import path at registration: its sources are component tables
(:func:`forge_lm.config.component_array`), and listing plugins does not import the config schema.
"""

from __future__ import annotations

import attrs

from forge_lm.config import ComponentConfig, component_array
from forge_lm.validators import FieldError, positive


def _check_weights(key: str, weights: list[float], count: int) -> None:
    if len(weights) != count:
        raise FieldError(key, f"has {len(weights)} weights for {count} sources; give one per [[data.sources]]")
    if any(weight < 0 for weight in weights) or not any(weight > 0 for weight in weights):
        raise FieldError(key, f"weights must be >= 0 with at least one > 0, got {weights}")


@attrs.define
class MixturePhase:
    until_sample: int = attrs.field(validator=positive)  # these weights hold for samples [previous, until)
    weights: list[float] = attrs.field(factory=list)


@attrs.define
class MixtureOptions:
    sources: list[ComponentConfig] = component_array(
        "datasets", "The mixed datasets: [[data.sources]] tables, each with its own name and options."
    )
    weights: list[float] = attrs.field(factory=list)  # one per source; empty = equal
    temperature: float = attrs.field(default=1.0, validator=positive)  # p ~ weight ** (1 / temperature)
    phases: list[MixturePhase] = attrs.field(factory=list)  # earlier weights; `weights` apply after the last

    def __attrs_post_init__(self) -> None:
        if not self.sources:
            raise FieldError("sources", "a mixture needs at least one source: add [[data.sources]] tables")
        if self.weights:
            _check_weights("weights", self.weights, len(self.sources))
        ends = [phase.until_sample for phase in self.phases]
        if ends != sorted(set(ends)):
            raise FieldError("phases", f"until_sample must increase from phase to phase, got {ends}")
        for index, phase in enumerate(self.phases):
            _check_weights(f"phases[{index}].weights", phase.weights, len(self.sources))
