"""The one way any module adds to the training loss or to the logged metrics.

A module (an MoE router, a regulariser on some activations) calls :func:`report_aux_loss`
during its forward pass with a value whose weight it has already applied; the training loop
runs every forward inside :func:`collect_aux`, adds the total to the loss it backpropagates,
and logs each named value. Modules call :func:`report_metric` for statistics that are logged
but not differentiated. Outside a collector (inference, export) these calls do nothing, so
modules need not know whether they are being trained.

A loss function whose returned value already includes a regulariser (the z-loss of
:mod:`forge_lm.losses.cross_entropy`) calls :func:`report_loss_term` with that weighted term.
The loop backpropagates the returned value as it is, but logs ``loss`` (and ``eval/loss``,
and the perplexity) as the value minus its terms, that is the data loss alone, and each term
under its own name: a regulariser never inflates the numbers that are compared across runs.
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
    metrics: dict[str, float | torch.Tensor] = attrs.Factory(dict)  # tensors read only when logged
    # Weighted terms a loss function already added to the value it returned (see report_loss_term).
    loss_terms: dict[str, torch.Tensor] = attrs.Factory(dict)

    def total(self) -> torch.Tensor | None:
        """The sum of every auxiliary loss, or None if nothing was reported."""
        return sum(self.losses.values()) if self.losses else None  # type: ignore[return-value]

    def data_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` (the value a loss function returned) without the terms it reported, detached."""
        loss = loss.detach()
        for term in self.loss_terms.values():
            loss = loss - term.detach()
        return loss

    def logged(self) -> dict[str, float]:
        """Every reported loss and loss term (detached) and metric, as plain floats: the tensors
        are read together, in one transfer per device."""
        reported = {**self.losses, **self.loss_terms}
        values = {**{name: value.detach() for name, value in reported.items()}, **self.metrics}
        by_device: dict[torch.device, list[str]] = {}
        for name, value in values.items():
            if isinstance(value, torch.Tensor):
                by_device.setdefault(value.device, []).append(name)
        out = {name: value for name, value in values.items() if not isinstance(value, torch.Tensor)}
        for names in by_device.values():
            read = torch.stack([values[name].double().reshape(()) for name in names]).tolist()
            out.update(zip(names, read, strict=True))
        return {name: out[name] for name in values}


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


def report_loss_term(name: str, value: torch.Tensor) -> None:
    """Name a weighted regulariser that the calling loss function has already added to the value
    it returns (its ``z_loss``, say): logged as ``name``, left out of the logged ``loss``, and not
    added to the objective again."""
    collector = _ACTIVE.get()
    if collector is not None:
        previous = collector.loss_terms.get(name)
        collector.loss_terms[name] = value if previous is None else previous + value


def report_metric(name: str, value: float | torch.Tensor) -> None:
    """Log ``value`` under ``name`` for this step (not differentiated; last report wins). A
    tensor is kept on its device and read only when the step is logged: reporting costs no wait."""
    collector = _ACTIVE.get()
    if collector is not None:
        collector.metrics[name] = value.detach() if isinstance(value, torch.Tensor) else float(value)
