"""Independent references for the core's own components (for its conformance runs)."""

from __future__ import annotations

from pathlib import Path

import torch

from forge_lm.components import IGNORE_INDEX
from forge_lm.metrics.jsonl import read_metrics


def cross_entropy_by_hand(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """-log softmax at the label, averaged over counted positions, written out in full."""
    flat_logits = logits.reshape(-1, logits.shape[-1]).double()
    flat_labels = labels.reshape(-1)
    keep = flat_labels != IGNORE_INDEX
    log_z = torch.logsumexp(flat_logits[keep], dim=-1)
    picked = flat_logits[keep].gather(1, flat_labels[keep].unsqueeze(1)).squeeze(1)
    return (log_z - picked).mean()


def cross_entropy_with_z_loss_by_hand(z_loss_weight: float):
    """The reference of a cross-entropy with ``z_loss_weight``: adds ``weight * mean(log Z**2)``."""

    def reference(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        flat_logits = logits.reshape(-1, logits.shape[-1]).double()
        keep = labels.reshape(-1) != IGNORE_INDEX
        log_z = flat_logits[keep].exp().sum(dim=-1).log()  # no max-shift: the kit's logits are small
        return cross_entropy_by_hand(logits, labels) + z_loss_weight * log_z.square().mean()

    return reference


LOSS_REFERENCES = {"cross_entropy": cross_entropy_by_hand, "chunked_cross_entropy": cross_entropy_by_hand}


def read_jsonl(run_dir: Path, output: str) -> list[tuple[int, dict[str, float]]]:
    records = read_metrics(run_dir / "metrics.jsonl")
    return [(r.pop("step"), r) for r in records]


def read_console(run_dir: Path, output: str) -> list[tuple[int, dict[str, float]]]:
    """Parse ``step 1/200 [0:01] | loss 3.25 | lr 0.0001`` lines (``step 1 | ...`` too: a run of
    unknown length, or an older Forge's)."""
    recorded = []
    for line in output.splitlines():
        if not line.startswith("step "):
            continue
        head, *pairs = line.split(" | ")
        metrics = {key: float(value) for key, value in (pair.split(" ", 1) for pair in pairs)}
        recorded.append((int(head.split()[1].split("/")[0]), metrics))
    return recorded


def read_tensorboard(run_dir: Path, output: str) -> list[tuple[int, dict[str, float]]]:
    """The scalars of the default ``tensorboard`` subfolder, read with TensorBoard's EventAccumulator."""
    from forge_lm.metrics.tensorboard import read_scalars

    return read_scalars(run_dir / "tensorboard")


METRICS_READERS = {"jsonl": read_jsonl, "console": read_console, "tensorboard": read_tensorboard}
