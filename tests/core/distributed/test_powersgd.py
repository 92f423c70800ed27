"""PowerSGD's arithmetic on one process (replicas played by one process), against the formulas it
implements, and the layouts ``forge config validate`` refuses for it (exit 2, naming the setting).

The multi-rank runs are in test_reduce_choices.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forge_lm.cli import main
from forge_lm.distributed.compression import LowRankStep

ROOT = Path(__file__).resolve().parents[3]
DEBUG = str(ROOT / "configs" / "debug.toml")
POWERSGD = "--distributed.compression.method=powersgd"


def _round(matrices: list[torch.Tensor], factor: torch.Tensor) -> tuple[list, list, list]:
    """One PowerSGD round over the replicas ``matrices`` (one each), the sums done by hand."""
    steps = [LowRankStep([m], [factor]) for m in matrices]
    left = sum(step.left_factors() for step in steps)
    right = sum(step.right_factors(left) for step in steps)
    results = [step.finish(right, len(matrices)) for step in steps]
    means, errors, factors = ([r[i][0] for r in results] for i in range(3))
    return means, errors, factors


def test_one_round_is_the_projection_of_the_mean_on_the_summed_left_factor() -> None:
    generator = torch.Generator().manual_seed(0)
    m1, m2 = (torch.randn(12, 7, generator=generator, dtype=torch.float64) for _ in range(2))
    q = torch.randn(7, 3, generator=generator, dtype=torch.float64)
    means, errors, factors = _round([m1, m2], q)
    # The formula: P = orthonormal basis of (M1 + M2) Q; the result is P P^T mean(M); each
    # replica's error is the part of its own matrix outside P's span.
    basis = torch.linalg.qr((m1 + m2) @ q).Q
    projection = basis @ basis.T
    expected = projection @ (m1 + m2) / 2
    for mean in means:  # every replica ends with the same gradient
        torch.testing.assert_close(mean, expected)
    torch.testing.assert_close(errors[0], m1 - projection @ m1)
    torch.testing.assert_close(errors[1], m2 - projection @ m2)
    # The errors' mean is what the mean lost, and the next warm start is the mean's right factor.
    torch.testing.assert_close((errors[0] + errors[1]) / 2, (m1 + m2) / 2 - expected)
    torch.testing.assert_close(basis @ factors[0].T, expected)
    assert torch.linalg.matrix_rank(means[0]) == 3


def test_full_rank_factors_lose_nothing() -> None:
    generator = torch.Generator().manual_seed(1)
    matrices = [torch.randn(5, 4, generator=generator, dtype=torch.float64) for _ in range(3)]
    means, errors, _ = _round(matrices, torch.randn(4, 4, generator=generator, dtype=torch.float64))
    torch.testing.assert_close(means[0], sum(matrices) / 3)
    # A replica's own matrix may reach outside the mean's column space; the errors cancel out.
    assert sum(errors).abs().max() < 1e-12


def test_error_feedback_hands_on_everything_compression_left_out() -> None:
    # Over T rounds with error feedback, what was sent plus the error still held is the sum of
    # the gradients: sum_t out_t + e_T = sum_t g_t (one replica, rank 1 of an 8 x 6 matrix).
    generator = torch.Generator().manual_seed(2)
    gradients = [torch.randn(8, 6, generator=generator, dtype=torch.float64) for _ in range(6)]
    factor = torch.randn(6, 1, generator=generator, dtype=torch.float64)
    error = torch.zeros(8, 6, dtype=torch.float64)
    sent = torch.zeros(8, 6, dtype=torch.float64)
    for gradient in gradients:
        (mean,), (error,), (factor,) = _round([gradient + error], factor)
        sent += mean
        assert error.abs().max() > 1e-3  # rank 1 loses something every round
    torch.testing.assert_close(sent + error, sum(gradients))


def test_a_zero_gradient_gives_zeros_not_nan() -> None:
    means, errors, factors = _round([torch.zeros(6, 5)], torch.randn(5, 2))
    assert torch.equal(means[0], torch.zeros(6, 5))
    assert torch.isfinite(factors[0]).all()
    assert torch.equal(errors[0], torch.zeros(6, 5))


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        pytest.param([], "needs dp_replicate >= 2 (now 1)", id="no-replicas"),
        pytest.param(["--distributed.dp_replicate=2", "--distributed.tp=2"], "with tp = 2", id="tp"),
        pytest.param(
            ["--distributed.dp_replicate=2", "--distributed.pp=2", "--model.tie_embeddings=false"],
            "with pp = 2",
            id="pp",
        ),
        pytest.param(["--distributed.dp_replicate=2", "--train.precision=fp16"], 'precision = "fp16"', id="fp16"),
        pytest.param(
            ["--distributed.dp_replicate=2", "--train.grad_accum_steps=2"],
            "needs [distributed] defer_grad_reduction = true",
            id="accumulation",
        ),
    ],
)
def test_validate_refuses_compression_where_it_cannot_run(capsys, overrides: list[str], named: str) -> None:
    assert main(["config", "validate", DEBUG, POWERSGD, *overrides]) == 2
    err = capsys.readouterr().err
    assert '[distributed.compression] method = "powersgd"' in err
    assert named in err


def test_validate_accepts_compression_on_replicas(capsys) -> None:
    overrides = [
        "--distributed.dp_replicate=2",
        "--train.grad_accum_steps=2",
        "--distributed.defer_grad_reduction=true",
    ]
    assert main(["config", "validate", DEBUG, POWERSGD, "--distributed.reduce_dtype=bf16", *overrides]) == 0, (
        capsys.readouterr().err
    )
