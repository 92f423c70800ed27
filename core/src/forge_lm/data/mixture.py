"""The ``mixture`` dataset: samples drawn from several datasets in set proportions.

Sample ``i`` of a rank comes from source ``j`` with probability ``p_j`` proportional to
``weight_j ** (1 / temperature)`` (temperature > 1 flattens the mixture towards uniform,
< 1 sharpens it). The choice is a function of ``(seed, i)`` alone, drawn from counter-based
randomness, so there is no random state to save: the state is ``i`` plus each source's own
state. It is also the same on every data-parallel rank (each source shards itself), so the
ranks draw from the same source at each step and rank 0's state resumes all of them. (A
streaming ``hf_text`` source, whose position differs from rank to rank, gathers every rank's
position into its own state when it is saved, so this holds for it too.)

``phases`` change the weights over time: sample ``i`` uses the weights of the first phase
whose ``until_sample`` exceeds ``i``, and ``weights`` once every phase is over. Samples
without ``document_ids`` (from a source that does not track documents) get all zeros, so
that every sample of the mixture has the same keys.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from forge_lm.components import DataContext
from forge_lm.data._random import uniform
from forge_lm.data.loader import local_state
from forge_lm.errors import ConfigError, ForgeError

_SALT = 0x6D6978  # keeps the mixture's draws apart from other users of the same seed


def probabilities(weights: Sequence[float], temperature: float) -> list[float]:
    """Source probabilities: ``weight ** (1 / temperature)``, normalised."""
    scaled = [weight ** (1.0 / temperature) if weight > 0 else 0.0 for weight in weights]
    total = sum(scaled)
    return [value / total for value in scaled]


class Mixture:
    """Draws each sample from one of ``sources`` by the (phased) probabilities."""

    def __init__(
        self,
        sources: Sequence[Any],
        schedule: Sequence[tuple[int, Sequence[float]]],
        final: Sequence[float],
        seed: int,
    ) -> None:
        self.sources = list(sources)
        self.seed = seed
        self._ends = [until for until, _ in schedule]  # sorted: validated by the options
        self._cumulative = [list(itertools.accumulate(p)) for p in [*(w for _, w in schedule), final]]
        self._drawn = 0  # samples this rank has drawn

    def source_of(self, index: int) -> int:
        """Which source gives sample ``index``."""
        cumulative = self._cumulative[bisect.bisect_right(self._ends, index)]
        draw = uniform(self.seed, _SALT, index) * cumulative[-1]
        return min(bisect.bisect_right(cumulative, draw), len(cumulative) - 1)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        iterators = [iter(source) for source in self.sources]
        while True:
            choice = self.source_of(self._drawn)
            try:
                sample = next(iterators[choice])
            except StopIteration:
                raise ForgeError(
                    f"source {choice} of the mixture ran out of samples; a mixture's sources must be endless."
                ) from None
            self._drawn += 1  # with the source's own state, advanced before the sample is handed out
            if "document_ids" not in sample:
                sample = {**sample, "document_ids": torch.zeros_like(sample["input_ids"])}
            yield sample

    def state_dict(self) -> dict[str, Any]:
        return {"drawn": self._drawn, "sources": [source.state_dict() for source in self.sources]}

    def local_state_dict(self) -> dict[str, Any]:
        """The sources' local states where they have them (see forge_lm.data.loader.local_state)."""
        return {"drawn": self._drawn, "sources": [local_state(source)[0] for source in self.sources]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state["sources"]
        if len(saved) != len(self.sources):
            raise ForgeError(
                f"the saved data state is for a mixture of {len(saved)} sources, but this mixture has "
                f"{len(self.sources)}; resume with the same [[data.sources]] or start a new run."
            )
        for source, source_state in zip(self.sources, saved, strict=True):
            source.load_state_dict(source_state)
        self._drawn = int(state["drawn"])


def build_mixture(options: Any, context: DataContext) -> Mixture:
    if context.registry is None:
        raise ConfigError(
            "dataset 'mixture' builds its sources through the component registry, but none was given "
            "(DataContext.registry is None)."
        )
    sources = [
        context.registry.resolve("datasets", chosen.name).build_for_run(chosen.options, context)
        for chosen in options.sources
    ]
    weights = options.weights or [1.0] * len(sources)
    schedule = [(phase.until_sample, probabilities(phase.weights, options.temperature)) for phase in options.phases]
    return Mixture(sources, schedule, probabilities(weights, options.temperature), context.seed)
