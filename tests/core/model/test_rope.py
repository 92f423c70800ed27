"""apply_rope against its defining formula, ``x * cos + rotate_half(x) * sin`` in fp32."""

from __future__ import annotations

import pytest
import torch

from forge_lm.model.rope import apply_rope, rope_tables, rotate_half


def formula(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x32 = x.float()
    return (x32 * cos + rotate_half(x32) * sin).type_as(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_apply_rope_is_bitwise_the_rotate_half_formula(dtype):
    """Forward and backward: the roll with a signed sine table is the same arithmetic."""
    cos, sin = rope_tables(64, 40, 10000.0)
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, 40, 64, generator=generator).to(dtype)
    grad = torch.randn(2, 3, 40, 64, generator=generator).to(dtype)
    outputs, grads = [], []
    for rotate in (apply_rope, formula):
        leaf = x.clone().requires_grad_()
        out = rotate(leaf, cos, sin)
        out.backward(grad)
        outputs.append(out)
        grads.append(leaf.grad)
    assert outputs[0].dtype == dtype
    assert torch.equal(outputs[0], outputs[1])
    assert torch.equal(grads[0], grads[1])
    # A quarter turn at position 1 is not the identity: the tables did rotate the vectors.
    assert not torch.equal(outputs[0][:, :, 1], x[:, :, 1])


def test_rotate_half_turns_each_pair_a_quarter():
    x = torch.tensor([1.0, 2.0, 3.0, 4.0])  # pairs (1, 3) and (2, 4)
    assert rotate_half(x).tolist() == [-3.0, -4.0, 1.0, 2.0]
