"""The training step's loss parallelism, in one process: which losses declare it, and that the
loop runs forward, loss and backward inside the region that keeps the logits split.

What the region does to the numbers and the logits under tp = 2 is checked on real ranks in
tests/core/distributed/test_tensor_parallel.py.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from forge_lm.components import IGNORE_INDEX
from forge_lm.config import load_config
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed import ParallelDims, tensor_parallel
from forge_lm.distributed.tensor_parallel import loss_parallel_for
from forge_lm.errors import ForgeError
from forge_lm.losses.vocab_parallel import VocabParallelLoss
from forge_lm.model import build_model
from forge_lm.train import step
from forge_lm.train.builders import build_dataset


def _loss(manager, name: str, **options: object):
    overrides = [f"--loss.name={name}", *(f"--loss.{key}={value}" for key, value in options.items())]
    return load_config(None, overrides, manager.registry).loss.build()


def test_plain_cross_entropy_declares_loss_parallelism_and_the_z_loss_and_chunked_losses_do_not(manager) -> None:
    assert isinstance(_loss(manager, "cross_entropy"), VocabParallelLoss)
    assert not isinstance(_loss(manager, "cross_entropy", z_loss_weight=1e-4), VocabParallelLoss)
    assert not isinstance(_loss(manager, "chunked_cross_entropy"), VocabParallelLoss)


def test_the_declared_loss_is_the_cross_entropy_on_full_logits(manager) -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 11, generator=generator, dtype=torch.bfloat16)
    labels = torch.randint(0, 11, (2, 5), generator=generator)
    labels[0, 0] = IGNORE_INDEX
    expected = F.cross_entropy(logits.float().flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX)
    got = _loss(manager, "cross_entropy")(logits, labels)
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_the_region_opens_only_under_tp_for_a_declared_loss(manager) -> None:
    declared, z_loss = _loss(manager, "cross_entropy"), _loss(manager, "cross_entropy", z_loss_weight=1e-4)
    assert isinstance(loss_parallel_for(1, declared), contextlib.nullcontext)
    assert isinstance(loss_parallel_for(2, z_loss), contextlib.nullcontext)
    region = loss_parallel_for(2, declared)
    assert not isinstance(region, contextlib.nullcontext)
    with region:
        assert tensor_parallel._keep_logits_split
        with pytest.raises(ForgeError, match="cannot be nested"), loss_parallel_for(2, declared):
            pass
        assert tensor_parallel._keep_logits_split  # the refused inner region left the outer one open
    assert not tensor_parallel._keep_logits_split


def test_the_step_runs_forward_loss_and_backward_inside_the_region(
    tiny_config, manager, one_process_parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With tp = 2 declared (one process: the model is not split, the region changes no
    number), the loop asks for the region with the run's loss, and the model's forward, the
    loss and the backward through the head all happen while it is open."""
    config = tiny_config("--train.grad_clip=0", "--train.grad_accum_steps=2")
    torch.manual_seed(0)
    model = build_model(config.model, 257, manager.registry)
    batches = iter(BatchLoader(build_dataset(config, manager.registry, None, 257, "train"), 4))
    inside: dict[str, list[bool]] = {"forward": [], "loss": [], "backward": []}
    asked: list[tuple[int, object]] = []
    state = {"open": False}

    @contextlib.contextmanager
    def region():
        state["open"] = True
        try:
            yield
        finally:
            state["open"] = False

    def recording_region(tp: int, loss_fn: object) -> contextlib.AbstractContextManager:
        asked.append((tp, loss_fn))
        return region()

    parts = one_process_parts(model, config)
    parts.dims = ParallelDims(tp=2)
    declared = parts.loss_fn

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        inside["loss"].append(state["open"])
        return declared(logits, labels)

    parts.loss_fn = VocabParallelLoss(loss_fn)
    model.output.register_forward_hook(lambda *_: inside["forward"].append(state["open"]))
    model.output.register_full_backward_hook(lambda *_: inside["backward"].append(state["open"]))
    monkeypatch.setattr(step, "loss_parallel_for", recording_region)
    step.compute_gradients(parts, batches, config)
    assert asked == [(2, parts.loss_fn)] * 2  # once per micro-batch
    assert inside == {"forward": [True, True], "loss": [True, True], "backward": [True, True]}
    assert all(param.grad is not None for param in model.parameters())
