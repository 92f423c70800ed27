"""Gradient clipping in one process: the same norm and the same gradients as torch's
``clip_grad_norm_``, and on the CPU gradients that need no scaling are left untouched."""

from __future__ import annotations

import math

import pytest
import torch

from forge_lm.distributed.grads import clip_grad_norm, clip_grads


def _parameters(scale: float, seed: int = 0) -> list[torch.nn.Parameter]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 4, 2), (1,)]
    parameters = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in shapes]
    for parameter in parameters:
        parameter.grad = torch.randn(parameter.shape, generator=generator) * scale
    parameters.append(torch.nn.Parameter(torch.ones(2)))  # no gradient: left out of the norm
    return parameters


@pytest.mark.parametrize("scale", [10.0, 1e-3])  # a norm well above the limit, one well below
def test_clipping_is_torchs_clip_grad_norm(scale):
    ours, reference = _parameters(scale), _parameters(scale)
    norm = clip_grads(ours, max_norm=1.0)
    expected = torch.nn.utils.clip_grad_norm_([p for p in reference if p.grad is not None], max_norm=1.0)
    assert norm.dtype == torch.float32
    assert norm.ndim == 0
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for mine, theirs in zip(ours, reference, strict=True):
        if theirs.grad is None:
            assert mine.grad is None
        else:
            torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-6, atol=0)
    clipped = math.sqrt(sum(float(p.grad.pow(2).sum()) for p in ours if p.grad is not None))
    assert clipped == pytest.approx(min(float(expected), 1.0), rel=1e-5)


def test_gradients_below_the_limit_are_not_rewritten_on_the_cpu():
    parameters = _parameters(1e-3)
    before = [p.grad.clone() for p in parameters if p.grad is not None]
    # An in-place write (torch's multiplication by a scale of 1.0 is one) bumps a tensor's version.
    versions = [p.grad._version for p in parameters if p.grad is not None]
    norm = clip_grads(parameters, max_norm=1.0)
    assert float(norm) < 1.0
    after = [p.grad for p in parameters if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))
    assert [g._version for g in after] == versions
    scaled = _parameters(10.0)  # and the counter does tell: a scaled gradient's moves
    first = [p.grad._version for p in scaled if p.grad is not None]
    clip_grads(scaled, max_norm=1.0)
    assert all(p.grad._version > v for p, v in zip([p for p in scaled if p.grad is not None], first, strict=True))


@pytest.mark.parametrize("max_norm", [0.0, math.inf])
def test_no_limit_measures_the_norm_only(max_norm):
    parameters = _parameters(10.0)
    before = [p.grad.clone() for p in parameters if p.grad is not None]
    norm = clip_grad_norm(parameters, max_norm)
    expected = torch.linalg.vector_norm(torch.cat([g.flatten() for g in before]))
    assert norm == pytest.approx(float(expected), rel=1e-6)
    assert all(
        torch.equal(p.grad, b) for p, b in zip([p for p in parameters if p.grad is not None], before, strict=True)
    )


def test_without_gradients_the_norm_is_zero():
    assert float(clip_grads([torch.nn.Parameter(torch.ones(3))], max_norm=1.0)) == 0.0


def test_on_an_accelerator_the_norm_is_never_read(monkeypatch):
    """Off the CPU (the meta device stands in for a GPU here) the scale is applied unread: a read
    would make the host wait for the device."""
    reads = []
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        original = getattr(torch.Tensor, name)

        def counting(tensor, *args, _original=original, _name=name, **kwargs):
            reads.append((_name, tensor.device.type))
            return _original(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counting)
    parameters = [torch.nn.Parameter(torch.empty(4, 3, device="meta")) for _ in range(2)]
    for parameter in parameters:
        parameter.grad = torch.empty(4, 3, device="meta")
    norm = clip_grads(parameters, max_norm=1.0)
    assert norm.device.type == "meta"
    assert [read for read in reads if read[1] == "meta"] == []
