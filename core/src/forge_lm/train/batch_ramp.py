"""The batch-size ramp, ``[train.batch_ramp]``: the global batch grows during training.

The batch grows through the number of micro-batches per step, never their size, so a step's
memory stays what ``batch_size`` makes it. With ``P`` sequences per micro-batch over the run
(``batch_size`` x data-parallel ranks), the ramp starts at ``start_batch_size / P`` micro-batches
per rank and grows by ``increment / P`` at a time up to ``grad_accum_steps``. With ``n`` such
increases over ``ramp_steps`` steps (or ``ramp_tokens`` tokens), the step that follows ``s``
steps (``t`` tokens) trained has ``start + floor(s * n / ramp_steps) * increment`` sequences
(``floor(t * n / ramp_tokens)``), as Megatron-LM's ``--rampup-batch-size`` grows with the
samples consumed; integers only, so every rank and every resume computes the same batch.

What depends on it stays exact across a resume without any state of its own: the batch of a
step is a function of the steps and tokens trained, both in the checkpoint; ``tokens_seen``
counts each step's own tokens; the data loader's position counts the micro-batches read. The
learning-rate schedule counts optimizer steps, as without a ramp (``max_steps`` includes the
ramp's smaller steps). ``lr_scaling`` scales a smaller step's learning rate by ``batch / full``
(``linear``) or its square root (``sqrt``), applied around the optimizer's step only, so the
scheduler never sees it and any scheduler composes with it.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import Any

import attrs
import torch

from forge_lm import events
from forge_lm.errors import ConfigError


@attrs.frozen
class StepBatch:
    """One step's batch: ``micro_batches`` per rank, ``batch_size`` sequences and ``tokens``
    over all ranks, and the factor of its learning rate."""

    micro_batches: int
    batch_size: int
    tokens: int
    lr_factor: float = 1.0
    ramping: bool = False  # whether the run has a ramp (then the batch is logged)

    def logged(self) -> dict[str, float]:
        """What the step's metrics show of the ramp (nothing without one)."""
        return {"batch_size": self.batch_size, "tokens_per_step": self.tokens} if self.ramping else {}

    def applied(self, lr: Any) -> Any:
        """``lr`` (the scheduled rate) as this step's optimizer uses it."""
        return lr if self.lr_factor == 1.0 else lr * self.lr_factor

    @contextlib.contextmanager
    def scaled_lr(self, optimizer: torch.optim.Optimizer) -> Iterator[None]:
        """The optimizer's rates times ``lr_factor`` for the ``with`` body (its step), then the
        scheduled ones again: the scheduler's own arithmetic never sees the factor."""
        if self.lr_factor == 1.0:
            yield
            return
        scheduled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
            group["lr"] = lr * self.lr_factor
        try:
            yield
        finally:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr


class BatchRamp:
    """Which :class:`StepBatch` each step has (the module docstring). Without a ramp, every step
    has the configured batch."""

    def __init__(
        self,
        *,
        sequences_per_micro: int,
        seq_len: int,
        full: int,
        start: int | None = None,
        increment: int = 1,
        ramp_steps: int = 0,
        ramp_tokens: int = 0,
        lr_scaling: str = "none",
    ) -> None:
        """Counts in micro-batches per rank: ``full`` (grad_accum_steps), ``start``, ``increment``."""
        self.sequences_per_micro, self.seq_len, self.full = sequences_per_micro, seq_len, full
        self.start = full if start is None else start
        self.increment = increment
        self.increases = (self.full - self.start) // increment
        self.ramp_steps, self.ramp_tokens = ramp_steps, ramp_tokens
        self.lr_scaling = lr_scaling
        self._last: int | None = None  # the micro-batches of the last step planned, for the event

    @classmethod
    def for_run(cls, config: Any, tokens_per_step: int) -> BatchRamp:
        """The run's ramp; ``tokens_per_step``: the full global batch in tokens (it holds the
        data-parallel ranks). A ramp that does not fit them is a ConfigError naming the option."""
        train, ramp = config.train, config.train.batch_ramp
        per_micro = tokens_per_step // (train.seq_len * train.grad_accum_steps)  # batch_size x dp ranks
        if ramp.start_batch_size is None:
            return cls(sequences_per_micro=per_micro, seq_len=train.seq_len, full=train.grad_accum_steps)
        full = per_micro * train.grad_accum_steps
        ranks = per_micro // train.batch_size
        unit = f"batch_size x data-parallel ranks = {train.batch_size} x {ranks} = {per_micro}"
        increment = per_micro if ramp.increment is None else ramp.increment
        for key, value in (("start_batch_size", ramp.start_batch_size), ("increment", increment)):
            if value % per_micro:
                raise ConfigError(
                    f"[train.batch_ramp] {key} = {value} is not a multiple of {unit} sequences: the global batch "
                    "grows by whole micro-batches on every rank."
                )
        if ramp.start_batch_size >= full:
            raise ConfigError(
                f"[train.batch_ramp] start_batch_size = {ramp.start_batch_size} must be below the full global batch "
                f"(batch_size x grad_accum_steps x data-parallel ranks = {full} sequences)."
            )
        if (full - ramp.start_batch_size) % increment:
            raise ConfigError(
                f"[train.batch_ramp] increment = {increment} does not divide the growth from start_batch_size to the "
                f"full global batch ({full} - {ramp.start_batch_size} = {full - ramp.start_batch_size} sequences)."
            )
        return cls(
            sequences_per_micro=per_micro,
            seq_len=train.seq_len,
            full=train.grad_accum_steps,
            start=ramp.start_batch_size // per_micro,
            increment=increment // per_micro,
            ramp_steps=ramp.ramp_steps,
            ramp_tokens=ramp.ramp_tokens,
            lr_scaling=ramp.lr_scaling,
        )

    @classmethod
    def check(cls, config: Any, dp_size: int) -> None:
        """Refuse (ConfigError) a ramp that does not fit ``dp_size`` data-parallel ranks, as a
        run of that layout would: for ``forge config validate``."""
        train = config.train
        cls.for_run(config, train.batch_size * train.seq_len * train.grad_accum_steps * dp_size)

    @property
    def ramping(self) -> bool:
        return self.start < self.full

    def micro_batches(self, steps: int, tokens: int) -> int:
        """Micro-batches per rank of the step after ``steps`` steps and ``tokens`` tokens trained."""
        if not self.ramping:
            return self.full
        done, length = (steps, self.ramp_steps) if self.ramp_steps else (tokens, self.ramp_tokens)
        return self.start + min(self.increases, done * self.increases // length) * self.increment

    def at(self, steps: int, tokens: int) -> StepBatch:
        """The batch of the step after ``steps`` steps and ``tokens`` tokens trained; a batch size
        the run had not had at the step before is a ``batch_size`` event."""
        micro = self.micro_batches(steps, tokens)
        sequences = micro * self.sequences_per_micro
        ratio = micro / self.full
        factor = {"none": 1.0, "linear": ratio, "sqrt": math.sqrt(ratio)}[self.lr_scaling] if self.ramping else 1.0
        if self.ramping and micro != self._last:
            events.record("batch_size", batch_size=sequences, micro_batches=micro, lr_factor=factor)
        self._last = micro
        return StepBatch(micro, sequences, sequences * self.seq_len, factor, self.ramping)
