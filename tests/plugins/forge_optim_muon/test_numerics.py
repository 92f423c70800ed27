"""Muon's numbers against independent references: torch.optim.Muon, and the algorithm written out here."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forge_lm.config import ModelSection
from forge_lm.hardware import cpu_multiplies_bf16
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager
from forge_optim_muon import optimizer as muon_module
from forge_optim_muon.optimizer import Muon, newton_schulz, orthogonalize, resolve_ns_dtype

QUINTIC = (3.4445, -4.7750, 2.0315)


def reference_newton_schulz(g: torch.Tensor, coefficients=QUINTIC, steps: int = 5, eps: float = 1e-7) -> torch.Tensor:
    """The quintic iteration for one matrix, written out in float64 on its wide orientation."""
    a, b, c = coefficients
    x = g.double()
    tall = x.shape[0] > x.shape[1]
    if tall:
        x = x.T
    x = x / max(torch.linalg.norm(x).item(), eps)  # Frobenius norm
    for _ in range(steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.T if tall else x


def reference_muon(w, grads, lr, momentum, nesterov, weight_decay, scale_rule):
    """Muon on one matrix, written out in float64: EMA momentum, NS, decoupled decay, scaled step."""
    w, buf = w.double(), torch.zeros_like(w, dtype=torch.float64)
    rows, cols = w.shape
    scale = max(1.0, rows / cols) ** 0.5 if scale_rule == "original" else 0.2 * max(rows, cols) ** 0.5
    for g in grads:
        buf = momentum * buf + (1 - momentum) * g.double()
        update = (1 - momentum) * g.double() + momentum * buf if nesterov else buf
        w = w * (1 - lr * weight_decay) - lr * scale * reference_newton_schulz(update)
    return w


def _steps(optimizer, params, grads_per_step):
    for grads in grads_per_step:
        for p, g in zip(params, grads, strict=True):
            p.grad = g.clone()
        optimizer.step()


@pytest.mark.parametrize("shape", [(24, 40), (40, 24)], ids=["wide", "tall"])
@pytest.mark.parametrize(
    ("nesterov", "update_scale", "weight_decay"),
    [(True, "original", 0.0), (False, "original", 0.1), (True, "match_rms_adamw", 0.1)],
    ids=["nesterov-original", "heavy_ball-decay", "nesterov-match_rms_adamw"],
)
def test_update_on_a_2d_parameter_matches_torch_optim_muon(shape, nesterov, update_scale, weight_decay):
    torch.manual_seed(0)
    start = torch.randn(shape) * 0.1
    ours, theirs = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    other = torch.nn.Parameter(torch.randn(shape))  # shares our batch: batching must not change the numbers
    hyper = {"lr": 0.05, "momentum": 0.9, "nesterov": nesterov, "weight_decay": weight_decay}
    optimizer = Muon([ours, other], **hyper, update_scale=update_scale, ns_dtype="bfloat16")
    reference = torch.optim.Muon([theirs], **hyper, adjust_lr_fn=update_scale)
    grads = [torch.randn(shape) for _ in range(4)]
    _steps(optimizer, [ours, other], [[g, torch.randn(shape)] for g in grads])
    _steps(reference, [theirs], [[g] for g in grads])
    assert not torch.equal(ours, start)
    torch.testing.assert_close(ours, theirs, rtol=1.3e-6, atol=1e-7)  # float32 tolerance


@pytest.mark.parametrize(
    ("nesterov", "update_scale", "weight_decay"),
    [(True, "original", 0.0), (False, "original", 0.1), (True, "match_rms_adamw", 0.01)],
    ids=["nesterov-original", "heavy_ball-decay", "nesterov-match_rms_adamw"],
)
def test_float32_steps_equal_the_algorithm_written_out(nesterov, update_scale, weight_decay):
    torch.manual_seed(1)
    shapes = [(16, 48), (48, 16), (32, 32)]
    params = [torch.nn.Parameter(torch.randn(s) * 0.1) for s in shapes]
    start = [p.detach().clone() for p in params]
    grads = [[torch.randn(s) for s in shapes] for _ in range(3)]
    optimizer = Muon(
        params, lr=0.02, momentum=0.95, nesterov=nesterov, weight_decay=weight_decay, update_scale=update_scale,
        ns_dtype="float32",
    )  # fmt: skip
    _steps(optimizer, params, grads)
    for i, param in enumerate(params):
        expected = reference_muon(start[i], [g[i] for g in grads], 0.02, 0.95, nesterov, weight_decay, update_scale)
        torch.testing.assert_close(param.double(), expected, rtol=0, atol=2e-6)


def test_newton_schulz_coefficients_and_steps_are_configurable():
    torch.manual_seed(2)
    g = torch.randn(20, 30)
    cubic = (1.5, -0.5, 0.0)  # the classic cubic iteration: converges to the exact U V^T
    out = orthogonalize(g, coefficients=cubic, steps=30, dtype=torch.float32)
    torch.testing.assert_close(out.double(), reference_newton_schulz(g, cubic, 30), rtol=0, atol=1e-5)
    u, _, vh = torch.linalg.svd(g.double(), full_matrices=False)
    torch.testing.assert_close(out.double(), u @ vh, rtol=0, atol=1e-4)


def test_stacked_expert_weights_are_orthogonalised_per_expert():
    torch.manual_seed(3)
    experts = torch.randn(3, 40, 24) * 0.1
    stacked = torch.nn.Parameter(experts.clone())
    slices = [torch.nn.Parameter(e.clone()) for e in experts]
    hyper = {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.1}
    optimizer = Muon([stacked], **hyper, update_scale="match_rms_adamw", ns_dtype="bfloat16")
    reference = torch.optim.Muon(slices, **hyper, adjust_lr_fn="match_rms_adamw")  # scale from [40, 24]
    grads = [torch.randn(3, 40, 24) for _ in range(3)]
    _steps(optimizer, [stacked], [[g] for g in grads])
    _steps(reference, slices, [list(g.unbind(0)) for g in grads])
    torch.testing.assert_close(stacked.detach(), torch.stack([s.detach() for s in slices]), rtol=1.3e-6, atol=1e-7)


def test_same_shape_matrices_are_orthogonalised_together_in_one_batch(monkeypatch):
    batches = []
    original = muon_module.newton_schulz

    def recording(batch, *args, **kwargs):
        batches.append(tuple(batch.shape))
        return original(batch, *args, **kwargs)

    monkeypatch.setattr(muon_module, "newton_schulz", recording)
    config = ModelSection(dim=64, n_layers=2, n_heads=4)  # SwiGLU hidden 192
    model = build_model(config, 97, PluginManager().registry)
    optimizer = Muon([p for p in model.parameters() if p.ndim == 2 and p.shape[0] != 97], ns_dtype="float32")
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    # wq, wk, wv, wo of both layers in one batch, w1 and w3 (192 x 64, seen transposed) in another, w2 in a third.
    assert sorted(batches) == [(2, 64, 192), (4, 64, 192), (8, 64, 64)]


def test_bfloat16_newton_schulz_is_close_to_float32_and_orthogonalises():
    torch.manual_seed(4)
    g = torch.randn(8, 64, 192)
    bf16 = newton_schulz(g.bfloat16()).float()
    fp32 = newton_schulz(g)
    error = torch.linalg.norm(bf16 - fp32) / torch.linalg.norm(fp32)
    assert error < 0.02
    singular = torch.linalg.svdvals(bf16)
    assert singular.min() > 0.6  # the quintic's target band around 1
    assert singular.max() < 1.25


@pytest.mark.parametrize(
    ("avx512_bf16", "amx", "cpu_dtype"),
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_auto_ns_dtype_is_bfloat16_where_the_hardware_multiplies_it(monkeypatch, avx512_bf16, amx, cpu_dtype):
    """bfloat16 on CUDA and on CPUs with AVX-512 BF16 or AMX (torch's feature detection stood in
    for, so the test means the same on every machine), float32 on other CPUs."""
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    assert resolve_ns_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert resolve_ns_dtype("auto", torch.device("cpu")) == cpu_dtype
    assert resolve_ns_dtype("float32", torch.device("cuda")) == torch.float32
    assert resolve_ns_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16


def test_the_cpu_check_agrees_with_proc_cpuinfo():
    """Against an independent source where there is one: the flags Linux reports."""
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo off Linux")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split())
    assert cpu_multiplies_bf16() == bool({"avx512_bf16", "amx_tile"} & flags)


def test_zero_gradient_gives_a_zero_update():
    p = torch.nn.Parameter(torch.randn(8, 12))
    before = p.detach().clone()
    p.grad = torch.zeros_like(p)
    Muon([p], ns_dtype="float32").step()
    assert torch.equal(p.detach(), before)


def test_vectors_are_refused_by_muon_groups():
    with pytest.raises(ValueError, match="belongs in an 'adamw' group"):
        Muon([torch.nn.Parameter(torch.zeros(4))])
