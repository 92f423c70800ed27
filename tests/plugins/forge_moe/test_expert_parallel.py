"""Expert parallelism: 2 CPU ranks (gloo) with ``ep = 2`` (so FSDP2 runs too) give the losses and
gradients of one process on the same global batch, experts and attention alike; a bad ``ep``
is a ConfigError before anything is built.

The launch (``workers/ep_worker.py``) runs every case once; the tests read its numbers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed import ParallelDims, TransformContext, apply_model_transforms, ordered_transforms
from forge_lm.errors import ConfigError
from forge_lm.model import build_model
from forge_lm.testing.distributed import torchrun
from forge_moe.expert_parallel import expert_parallel_transform
from forge_moe.experts import grouped_mm_works

WORKER = Path(__file__).parent / "workers" / "ep_worker.py"
ATOL = 1e-5  # fp32; the differences seen are ~1e-8 (a 2x expert gradient would be ~1e-2)
CASES = ("softmax", "sigmoid", "dropping", "checkpointed")


@pytest.fixture(scope="module")
def ep_run(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("ep") / "result.json"
    done = torchrun([str(WORKER), str(out)], nproc=2, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("case", CASES)
def test_ep2_gives_the_single_process_loss_and_gradients(ep_run, case):
    numbers = ep_run[case]
    checkpointing = ["activation_checkpointing"] if case == "checkpointed" else []
    assert numbers["applied"] == ["expert_parallel", "moe_load_sync", *checkpointing, "fsdp2"]
    assert numbers["loss"] == pytest.approx(numbers["ref_loss"], abs=ATOL)
    assert numbers["grad_scale"] > 1e-2  # the gradients compared are not vanishingly small
    worst = max(numbers["grad_diff"], key=numbers["grad_diff"].get)
    assert numbers["grad_diff"][worst] < ATOL, worst
    assert any(".experts." in name for name in numbers["grad_diff"])  # expert weights are among them
    assert any(".attention." in name for name in numbers["grad_diff"])
    # Reference defect 2: expert gradients EP times too large. The norms agree to fp32 rounding.
    for name, ratio in numbers["expert_grad_norm_ratio"].items():
        assert ratio == pytest.approx(1.0, abs=1e-5), name
    assert numbers["grad_norm"] == pytest.approx(numbers["ref_grad_norm"], rel=1e-5)  # forge's cross-mesh norm


def test_ep2_experts_are_split_dtensors_in_their_own_fsdp_unit(ep_run):
    layout = ep_run["softmax"]["expert_layout"]
    assert layout == {
        "dtensor": True,
        "mesh_dims": ["efsdp", "ep"],  # FSDP2 over efsdp (1 rank here) x the ep split
        "local_experts": 2,  # of 4
        "fsdp_unit": "FSDPGroupedExperts",
    }


def test_capacity_applies_per_rank_and_drops_only_when_asked(ep_run):
    assert ep_run["softmax"]["drop_fraction"] == [0.0, 0.0]
    assert ep_run["sigmoid"]["drop_fraction"] == [0.0, 0.0]
    assert ep_run["checkpointed"]["drop_fraction"] == [0.0, 0.0]  # no capacity factor
    assert all(0.0 < f < 0.5 for f in ep_run["dropping"]["drop_fraction"])  # and still matches, per rank


def test_sigmoid_bias_moves_by_the_load_summed_over_the_ranks(ep_run):
    numbers = ep_run["sigmoid"]
    assert numbers["bias"] == numbers["ref_bias"]  # exact: multiples of the rate
    assert any(value != 0.0 for row in numbers["bias"] for value in row)
    assert numbers["bias_same_on_ranks"]
    assert numbers["local_only_bias_differs"]  # each rank's own load would have given another bias


def test_ep2_checkpoint_holds_the_full_experts_and_loads_into_one_process(ep_run):
    assert ep_run["softmax"]["checkpoint_diff"] == 0.0


def test_ep2_training_loop_step_matches_the_single_process_step(ep_run):
    """The loop's own step: interleaved rows, 2 micro-batches, the router's z-loss, the global norm."""
    numbers = ep_run["loop"]
    assert numbers["z_loss_logged"]
    assert numbers["loss"] == pytest.approx(numbers["ref_loss"], abs=ATOL)
    assert numbers["grad_norm"] == pytest.approx(numbers["ref_grad_norm"], rel=1e-5)
    worst = max(numbers["grad_diff"], key=numbers["grad_diff"].get)
    assert numbers["grad_diff"][worst] < ATOL, worst


def test_ep2_gradient_clipping_matches_the_single_process_clipping(ep_run):
    numbers = ep_run["loop"]
    assert "clip_error" not in numbers, numbers["clip_error"]
    assert numbers["grad_norm"] > 0.05  # the clipping did scale
    worst = max(numbers["clipped_grad_diff"], key=numbers["clipped_grad_diff"].get)
    assert numbers["clipped_grad_diff"][worst] < ATOL * numbers["clipped_scale"] / numbers["grad_scale"], worst


# -- one process ---------------------------------------------------------------------------------


def test_first_forward_with_the_auto_kernel_works_under_activation_checkpointing(moe_manager):
    """The grouped_mm probe (run at the first forward) used to add its own saved tensors to the
    checkpointed forward, which then failed its recomputation check in backward."""
    config = _config(
        moe_manager, "--model.ffn.name=moe", "--model.ffn.n_experts=4", "--train.activation_checkpointing=full"
    )
    torch.manual_seed(0)
    model = build_model(config.model, 61, moe_manager.registry).train()
    context = TransformContext(config, ParallelDims(), None, torch.device("cpu"), None)
    assert apply_model_transforms(model, context, moe_manager.registry) == ["activation_checkpointing"]
    grouped_mm_works.cache_clear()  # as in a fresh process: the probe runs inside the first forward
    ids = torch.randint(0, 61, (2, 16), generator=torch.Generator().manual_seed(0))
    torch.nn.functional.cross_entropy(model(ids).flatten(0, 1), ids.flatten()).backward()
    assert all(p.grad is not None for p in model.parameters())


def _config(moe_manager, *overrides: str):
    return load_config(None, ["--model.dim=32", "--model.n_heads=4", *overrides], moe_manager.registry)


def test_ep_that_does_not_divide_n_experts_is_a_config_error(moe_manager):
    config = _config(moe_manager, "--model.ffn.name=moe", "--model.ffn.n_experts=4", "--distributed.ep=3")
    with pytest.raises(ConfigError, match=r"\[model.ffn\] n_experts = 4 .*\[distributed\] ep = 3"):
        moe_manager.configure(config)
    # The transform checks again, before it touches any mesh (a library caller may skip configure).
    dims = ParallelDims(dp_shard=3, ep=3)
    context = TransformContext(config, dims, None, torch.device("cpu"), None)
    with pytest.raises(ConfigError, match=r"\[model.ffn\] n_experts = 4"):
        expert_parallel_transform(None).apply(torch.nn.Linear(1, 1), context)


def test_ep_without_moe_layers_is_a_config_error(moe_manager):
    config = _config(moe_manager, "--distributed.ep=2")
    with pytest.raises(ConfigError, match=r"\[distributed\] ep = 2 .*\[model.ffn\] name = 'swiglu'"):
        moe_manager.configure(config)


@pytest.mark.parametrize("ep", range(1, 9))
def test_ep_passes_exactly_when_it_divides_n_experts(moe_manager, ep):
    config = _config(moe_manager, "--model.ffn.name=moe", "--model.ffn.n_experts=8", f"--distributed.ep={ep}")
    if 8 % ep == 0:
        moe_manager.configure(config)  # no ConfigError; ep = 3, 5, 6, 7 show the same call refuses
    else:
        with pytest.raises(ConfigError, match=rf"n_experts = 8 cannot be split evenly over \[distributed\] ep = {ep}"):
            moe_manager.configure(config)


def test_transforms_sit_in_the_model_parallel_slot_before_fsdp2(moe_manager):
    names = [name for name, _ in ordered_transforms(moe_manager.registry)]
    assert names.index("expert_parallel") < names.index("moe_load_sync") < names.index("fsdp2")
    assert {t.slot for name, t in ordered_transforms(moe_manager.registry) if name.startswith(("expert", "moe"))} == {
        "model_parallel"
    }
    off = TransformContext(
        _config(moe_manager, "--model.ffn.name=moe"), ParallelDims(), None, torch.device("cpu"), None
    )
    assert not any(t.enabled(off) for name, t in ordered_transforms(moe_manager.registry) if name != "compile")
