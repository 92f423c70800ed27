"""A tiny language-model-shaped problem for optimizer checks.

It has every parameter role an optimizer may treat differently: an embedding table, a
hidden weight matrix with a bias, a norm scale and an output head.
"""

from __future__ import annotations

import io

import torch
from torch import nn

VOCAB, DIM, BATCH, SEQ = 32, 16, 8, 12

# Command-line overrides for a Forge model that trains in about a second on a CPU (2 blocks of
# width 32, grouped-query attention): ``forge train *TINY_MODEL, "--train.seq_len=16", ...``.
TINY_MODEL = (
    "--model.dim=32",
    "--model.n_layers=2",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.max_seq_len=64",
)


class TinyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.hidden = nn.Linear(DIM, DIM)
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.embed(ids)
        h = h + torch.tanh(self.hidden(h))
        return self.head(self.norm(h))  # [batch, seq, vocab]


def tiny_model(seed: int = 0) -> TinyModel:
    torch.manual_seed(seed)
    return TinyModel()


def tiny_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return ids, torch.roll(ids, shifts=-1, dims=1)  # learnable: predict the next token


def tiny_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    ids, targets = batch
    return nn.functional.cross_entropy(model(ids).flatten(0, 1), targets.flatten())


def plain_round_trip(state: object) -> object:
    """``state`` saved and loaded the way checkpoints are: no arbitrary unpickling allowed."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    try:
        return torch.load(buffer, weights_only=True)
    except Exception as exc:  # any failure means the state is not plain data
        raise AssertionError(
            f"state cannot be loaded with torch.load(weights_only=True): {exc}. Keep state to "
            "tensors, numbers, strings, lists and dicts, so checkpoints never unpickle code."
        ) from exc
