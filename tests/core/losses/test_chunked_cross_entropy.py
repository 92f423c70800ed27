"""``chunked_cross_entropy``: cross_entropy's value and gradients, with no full fp32 logits kept for backward."""

from __future__ import annotations

import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from forge_lm.losses.aux import collect_aux

CHUNK_SIZES = [1, 5, 7, 24, 4096]  # 24 tokens: single-token, uneven, exact-fit and oversized chunks


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("z_loss_weight", [0.0, 1e-2])
def test_chunked_gives_cross_entropys_value_and_gradients(chunk_size, z_loss_weight, build_loss, problem):
    logits, labels = problem(torch.float32)
    plain = build_loss("cross_entropy", z_loss_weight=z_loss_weight)(logits, labels)
    (plain_grad,) = torch.autograd.grad(plain, logits)

    chunked = build_loss("chunked_cross_entropy", chunk_size=chunk_size, z_loss_weight=z_loss_weight)(logits, labels)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)

    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_grad, plain_grad, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("chunk_size", CHUNK_SIZES)
@pytest.mark.parametrize("z_loss_weight", [0.0, 0.5])
def test_chunked_value_and_gradient_match_the_formula(chunk_size, z_loss_weight, build_loss, problem, expected):
    logits, labels = problem(torch.float64)
    loss = build_loss("chunked_cross_entropy", chunk_size=chunk_size, z_loss_weight=z_loss_weight)(logits, labels)
    loss.backward()

    want = expected(logits, labels, z_loss_weight)
    torch.testing.assert_close(loss, torch.tensor(want["loss"], dtype=torch.float64), rtol=1e-12, atol=0)
    torch.testing.assert_close(logits.grad, want["grad"], rtol=1e-10, atol=1e-14)
    assert torch.all(logits.grad[labels == -100] == 0)


def test_chunked_on_bf16_logits_matches_cross_entropy_and_returns_bf16_gradients(build_loss, problem):
    logits, labels = problem(torch.bfloat16)
    plain = build_loss("cross_entropy", z_loss_weight=1e-2)(logits, labels)
    (plain_grad,) = torch.autograd.grad(plain, logits)

    chunked = build_loss("chunked_cross_entropy", chunk_size=5, z_loss_weight=1e-2)(logits, labels)
    (chunked_grad,) = torch.autograd.grad(chunked, logits)

    assert chunked.dtype == torch.float32
    assert chunked_grad.dtype == torch.bfloat16
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=0)
    torch.testing.assert_close(chunked_grad, plain_grad)  # bf16 tolerance: one rounding of the same fp32 values


def saved_for_backward(loss_fn, logits: torch.Tensor, labels: torch.Tensor) -> list[torch.Tensor]:
    """Every tensor autograd stores between this forward and its backward."""
    saved: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss_fn(logits, labels)
    return saved


def test_chunked_keeps_only_views_of_the_logits_and_small_tensors_for_backward(build_loss, problem):
    logits, labels = problem(torch.bfloat16)
    tokens, vocab = labels.numel(), logits.shape[-1]

    saved = saved_for_backward(build_loss("chunked_cross_entropy", chunk_size=5, z_loss_weight=1e-2), logits, labels)

    storage = logits.untyped_storage().data_ptr()
    wide = [t for t in saved if t.ndim == 2 and t.shape[-1] == vocab]
    narrow = [t for t in saved if not (t.ndim == 2 and t.shape[-1] == vocab)]
    assert wide, "the probe saw nothing: it would pass whatever the loss kept"
    assert all(t.dtype == torch.bfloat16 and t.untyped_storage().data_ptr() == storage for t in wide)
    assert all(t.numel() <= tokens for t in narrow)  # labels, masks and scalars


def test_plain_cross_entropy_keeps_an_fp32_copy_of_the_whole_logits(build_loss, problem):
    # What the chunked loss avoids, seen by the same probe.
    logits, labels = problem(torch.bfloat16)
    tokens, vocab = labels.numel(), logits.shape[-1]

    saved = saved_for_backward(build_loss("cross_entropy"), logits, labels)

    assert any(t.dtype == torch.float32 and tuple(t.shape) == (tokens, vocab) for t in saved)


class PeakFp32(TorchDispatchMode):
    """Tracks the most elements held at once by fp32 tensors of at least ``min_numel`` elements."""

    def __init__(self, min_numel: int) -> None:
        super().__init__()
        self.min_numel, self.live, self.peak = min_numel, {}, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in out if isinstance(out, tuple | list) else [out]:
            if isinstance(tensor, torch.Tensor) and tensor.dtype == torch.float32 and tensor.numel() >= self.min_numel:
                self.live[id(tensor)] = tensor.numel()
                weakref.finalize(tensor, self.live.pop, id(tensor), None)  # freed: no longer counted
        self.peak = max(self.peak, sum(self.live.values()))
        return out


@pytest.mark.parametrize(("name", "bound"), [("cross_entropy", None), ("chunked_cross_entropy", 8)])
def test_fp32_memory_through_forward_and_backward_is_a_few_chunks_not_the_whole_logits(name, bound, build_loss):
    tokens, vocab, chunk = 256, 500, 8
    logits = torch.randn(1, tokens, vocab, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, vocab, (1, tokens))
    options = {"chunk_size": chunk} if name == "chunked_cross_entropy" else {}

    with PeakFp32(min_numel=vocab) as probe:
        build_loss(name, z_loss_weight=1e-2, **options)(logits, labels).backward()

    if bound is None:  # the plain loss: at least one fp32 copy of all the logits
        assert probe.peak >= tokens * vocab
    else:  # a bounded number of chunk-sized fp32 tensors, however many tokens
        assert 0 < probe.peak <= bound * chunk * vocab


def test_chunked_logs_the_same_z_loss_as_cross_entropy(build_loss, problem):
    logits, labels = problem(torch.float64)
    with collect_aux() as plain:
        build_loss("cross_entropy", z_loss_weight=1e-2)(logits, labels)
    with collect_aux() as chunked:
        build_loss("chunked_cross_entropy", chunk_size=5, z_loss_weight=1e-2)(logits, labels)

    assert chunked.loss_terms.keys() == {"z_loss"}
    assert chunked.loss_terms["z_loss"].item() == pytest.approx(plain.loss_terms["z_loss"].item(), rel=1e-12)


def test_chunked_evaluates_without_autograd(build_loss, problem, expected):
    logits, labels = problem(torch.float64)
    with torch.no_grad():
        loss = build_loss("chunked_cross_entropy", chunk_size=5)(logits, labels)

    assert not loss.requires_grad
    torch.testing.assert_close(loss, torch.tensor(expected(logits, labels, 0.0)["loss"], dtype=torch.float64))


def test_chunked_defaults_to_4096_token_chunks_and_no_z_loss(builtins):
    component = builtins.registry.resolve("losses", "chunked_cross_entropy")

    assert (component.options_class().chunk_size, component.options_class().z_loss_weight) == (4096, 0.0)
