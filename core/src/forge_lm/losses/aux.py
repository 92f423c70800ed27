"""The one way any module adds to the training loss or to the logged metrics.

A module (an MoE router, a z-loss on some logits, a regulariser) calls
:func:`report_aux_loss` during its forward pass with a value whose weight it has already
applied; the training loop runs every forward inside :func:`collect_aux`, adds the total to
the loss it backpropagates, and logs each named value. Modules call :func:`report_metric` for
statistics that are logged but not differentiated. Outside a collector (inference, export)
both calls do nothing, so modules need not know whether they are being trained.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import attrs
import torch


@attrs.define
class AuxCollector:
    """What modules reported during one forward pass, summed per name."""

    losses: dict[str, torch.Tensor] = attrs.Factory(dict)
    metrics: dict[str, float] = attrs.Factory(dict)

    def total(self) -> torch.Tensor | None:
        """The sum of every auxiliary loss, or None if nothing was reported."""
        return sum(self.losses.values()) if self.losses else None  # type: ignore[return-value]

    def logged(self) -> dict[str, float]:
        """Every reported loss (detached) and metric, as plain floats."""
        return {**{name: float(value.detach()) for name, value in self.losses.items()}, **self.metrics}


_ACTIVE: contextvars.ContextVar[AuxCollector | None] = contextvars.ContextVar("forge_lm_aux", default=None)


@contextlib.contextmanager
def collect_aux() -> Iterator[AuxCollector]:
    collector = AuxCollector()
    token = _ACTIVE.set(collector)
    try:
        yield collector
    finally:
        _ACTIVE.reset(token)


def collecting() -> bool:
    """Whether a training step is collecting reports now: modules may skip computing statistics
    (and the device syncs they cost) when nothing would receive them."""
    return _ACTIVE.get() is not None


def report_aux_loss(name: str, value: torch.Tensor) -> None:
    """Add ``value`` (a weighted scalar, part of the graph) to the training loss under ``name``."""
    collector = _ACTIVE.get()
    if collector is not None:
        previous = collector.losses.get(name)
        collector.losses[name] = value if previous is None else previous + value


def report_metric(name: str, value: float | torch.Tensor) -> None:
    """Log ``value`` under ``name`` for this step (not differentiated; last report wins)."""
    collector = _ACTIVE.get()
    if collector is not None:
        collector.metrics[name] = float(value.detach()) if isinstance(value, torch.Tensor) else float(value)
