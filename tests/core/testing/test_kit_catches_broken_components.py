"""The conformance kit fails components that break their contract, saying what is wrong.

Each test registers a deliberately broken component through an in-process plugin and
expects the matching check to fail with its message.
"""

from __future__ import annotations

import attrs
import pytest
import torch
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.components import IGNORE_INDEX, WarmupOptions
from forge_lm.data.synthetic import SyntheticTokens
from forge_lm.testing import check_component, component_checks


def _with_plugin(manager, category: str, name: str, factory, config=None):
    class Broken:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @hookimpl
        def forge_lm_register_optimizers(self, register):
            if category == "optimizers":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_schedulers(self, register):
            if category == "schedulers":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_losses(self, register):
            if category == "losses":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_datasets(self, register):
            if category == "datasets":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_metrics_backends(self, register):
            if category == "metrics_backends":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_tokenizers(self, register):
            if category == "tokenizers":
                register(name, factory, config=config, description="broken on purpose")

        @hookimpl
        def forge_lm_register_feed_forwards(self, register):
            if category == "feed_forwards":
                register(name, factory, config=config, description="broken on purpose")

    info = manager.add_plugin(Broken(), "broken", distribution="forge-broken", version="9.9")
    assert info.status == "ok", info.reason
    return manager


def _failure(manager, category, name, check_suffix, **extras) -> str:
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks(category, name, manager=manager, **extras)}
    with pytest.raises(AssertionError) as caught:
        checks[check_suffix]()
    return str(caught.value)


def test_optimizer_that_never_updates_fails_the_tiny_problem(manager):
    _with_plugin(manager, "optimizers", "frozen", lambda options, model: torch.optim.SGD(model.parameters(), lr=0.0))
    message = _failure(manager, "optimizers", "frozen", "lowers_the_loss_of_a_tiny_problem")
    assert message.startswith("optimizer 'frozen' did not lower the loss of the tiny problem:")


def test_optimizer_that_skips_parameters_fails_the_coverage_check(manager):
    _with_plugin(
        manager, "optimizers", "partial", lambda options, model: torch.optim.SGD(model.head.parameters(), lr=0.1)
    )
    message = _failure(manager, "optimizers", "partial", "covers_every_trainable_parameter_once")
    assert message.startswith(
        "optimizer 'partial' leaves parameters out: ['embed.weight', 'hidden.weight', 'hidden.bias', 'norm.weight']; "
        "the kit expects all 5 trainable parameters in its groups, found 1"
    )


class _ForgetfulSGD(torch.optim.SGD):
    """Momentum SGD whose state dict drops the momentum buffers: resume is not exact."""

    def state_dict(self):
        state = super().state_dict()
        state["state"] = {}
        return state


def test_optimizer_losing_state_fails_the_round_trip(manager):
    _with_plugin(
        manager,
        "optimizers",
        "forgetful",
        lambda options, model: _ForgetfulSGD(model.parameters(), lr=0.1, momentum=0.9),
    )
    message = _failure(manager, "optimizers", "forgetful", "state_dict_round_trip_resumes_exactly")
    assert "after a state_dict round trip, parameter 'embed.weight' differs from the uninterrupted run" in message


def test_scheduler_starting_at_zero_fails_the_warmup_check(manager):
    def zero_start(options, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, s / max(1, options.warmup_steps)))

    _with_plugin(manager, "schedulers", "zero_start", zero_start, config=WarmupOptions)
    message = _failure(manager, "schedulers", "zero_start", "follows_the_documented_warmup")
    assert message.startswith("scheduler 'zero_start' with warmup_steps=4 runs its first step at learning rate 0.0; ")
    assert "the kit expects (0 + 1) / 4 = 0.25 times the base rate" in message


def test_scheduler_exceeding_the_peak_fails_the_bounds_check(manager):
    def overshoot(options, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.5 if s == 50 else 1.0)

    _with_plugin(manager, "schedulers", "overshoot", overshoot)
    message = _failure(manager, "schedulers", "overshoot", "stays_within_zero_and_the_peak")
    assert message.startswith("scheduler 'overshoot' leaves [0, base_lr] at (step, lr) [(50, 1.5)] (1 of 100 steps); ")


def test_loss_counting_ignored_positions_fails(manager):
    def counts_everything(options):
        return lambda logits, labels: F.cross_entropy(
            logits.flatten(0, 1), labels.flatten().clamp(min=0), ignore_index=IGNORE_INDEX
        )

    _with_plugin(manager, "losses", "leaky", counts_everything)
    message = _failure(
        manager, "losses", "leaky", "ignores_positions_labelled_ignore_index", reference=lambda lg, lb: 0
    )
    assert message.startswith("loss 'leaky' passes gradient to ignored positions")
    assert "the kit expects exactly 0 there" in message


def test_loss_summed_instead_of_averaged_fails_the_token_mean_check(manager):
    def summed(options):
        return lambda logits, labels: F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        )

    _with_plugin(manager, "losses", "summed", summed)
    message = _failure(manager, "losses", "summed", "is_a_mean_over_counted_tokens", reference=lambda lg, lb: 0)
    assert "loss 'summed' is not a mean over non-ignored tokens" in message


def test_loss_differing_from_its_reference_fails(manager):
    _with_plugin(
        manager, "losses", "ce", lambda options: lambda lg, lb: F.cross_entropy(lg.flatten(0, 1), lb.flatten())
    )
    message = _failure(manager, "losses", "ce", "matches_its_reference", reference=lambda lg, lb: torch.tensor(0.0))
    assert "loss 'ce' differs from its reference" in message


def test_third_party_loss_without_a_reference_is_told_to_supply_one(manager):
    _with_plugin(
        manager, "losses", "ce", lambda options: lambda lg, lb: F.cross_entropy(lg.flatten(0, 1), lb.flatten())
    )
    message = _failure(manager, "losses", "ce", "matches_its_reference")
    assert message == (
        "loss 'ce': give the kit an independent implementation to compare with: "
        "component_checks('losses', name, reference=my_reference)"
    )


class _NoResume(SyntheticTokens):
    def load_state_dict(self, state):
        pass  # forgets the position: restarts from the beginning


def test_dataset_ignoring_its_state_fails_the_round_trip(manager):
    _with_plugin(manager, "datasets", "no_resume", lambda options, context: _NoResume(context))
    message = _failure(manager, "datasets", "no_resume", "state_round_trip_restores_the_next_sample")
    assert message.startswith(
        "dataset 'no_resume': after load_state_dict of its state_dict() the dataset does not continue where the "
        "state was taken (sample 0 differs after 3 samples were taken)"
    )


class _StaleLocalState(SyntheticTokens):
    def local_state_dict(self):
        return {**self.state_dict(), **SyntheticTokens(self.context).state_dict()}  # the start, not the position


def test_dataset_whose_local_state_loses_the_position_fails_the_round_trip(manager):
    _with_plugin(manager, "datasets", "stale_local", lambda options, context: _StaleLocalState(context))
    message = _failure(manager, "datasets", "stale_local", "state_round_trip_restores_the_next_sample")
    assert message.startswith(
        "dataset 'stale_local': after load_state_dict of its local_state_dict() the dataset does not continue"
    )


class _SameForEveryRank(SyntheticTokens):
    def __init__(self, context):
        super().__init__(attrs.evolve(context, dp_rank=0, dp_size=1))


def test_dataset_giving_every_rank_the_same_data_fails(manager):
    _with_plugin(manager, "datasets", "unsharded", lambda options, context: _SameForEveryRank(context))
    message = _failure(manager, "datasets", "unsharded", "data_parallel_ranks_get_distinct_samples")
    assert message.startswith("dataset 'unsharded': ranks 0 and 1 of 2 receive the same samples")
    assert "the kit expects 0 in common" in message


class _DropsNaN:
    def __init__(self):
        self.records = []

    def start(self, config, manifest):
        pass

    def log(self, step, metrics):
        self.records.append((step, {k: v for k, v in metrics.items() if v == v}))

    def finish(self, summary):
        pass


def test_metrics_backend_losing_values_fails_the_read_back(manager):
    backend = _DropsNaN()
    _with_plugin(manager, "metrics_backends", "lossy", lambda options, context: backend)
    message = _failure(
        manager, "metrics_backends", "lossy", "records_what_was_logged", read_back=lambda d, o: backend.records
    )
    assert message.startswith("metrics backend 'lossy' lost 'loss' at step 5: ")


class _Stray(_DropsNaN):
    def start(self, config, manifest):
        open("stray.txt", "w").close()


def test_metrics_backend_writing_outside_the_run_directory_fails(manager):
    _with_plugin(manager, "metrics_backends", "stray", lambda options, context: _Stray())
    message = _failure(manager, "metrics_backends", "stray", "writes_nowhere_but_the_run_directory")
    assert message.startswith("metrics backend 'stray' wrote outside the run directory: ['stray.txt']; ")


class _Lowercasing:
    vocab_size = 257
    eos_id = 256

    def encode(self, text):
        return list(text.lower().encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode()


def test_lossy_tokenizer_fails_the_round_trip_unless_declared_lossy(manager):
    _with_plugin(manager, "tokenizers", "lower", lambda options: _Lowercasing())
    message = _failure(manager, "tokenizers", "lower", "decode_inverts_encode")
    assert message.startswith("tokenizer 'lower': decode(encode('Hello, Forge!')) gives 'hello, forge!'; ")
    check_component("tokenizers", "lower", manager=manager, lossless=False)  # declared lossy: passes


def test_check_component_reports_every_failure_at_once(manager):
    _with_plugin(manager, "tokenizers", "lower", lambda options: _Lowercasing())
    with pytest.raises(AssertionError) as caught:
        check_component("tokenizers", "lower", manager=manager)
    assert str(caught.value).startswith(
        "tokenizers:lower:decode_inverts_encode: tokenizer 'lower': decode(encode('Hello, Forge!')) gives"
    )
    assert "\n" not in str(caught.value)  # one failure: the vocabulary check passes


def test_optimizer_failure_states_the_pass_mark(manager):
    _with_plugin(manager, "optimizers", "frozen", lambda options, model: torch.optim.SGD(model.parameters(), lr=0.0))
    message = _failure(manager, "optimizers", "frozen", "lowers_the_loss_of_a_tiny_problem")
    assert "in 40 steps (a fall of 0.0%); the kit expects it to fall by at least 20%" in message


def test_scheduler_without_warmup_steps_skips_the_warmup_check(manager):
    def flat(options, optimizer, total_steps):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)

    _with_plugin(manager, "schedulers", "flat", flat)
    checks = {c.id.rsplit(":", 1)[1]: c for c in component_checks("schedulers", "flat", manager=manager)}
    with pytest.raises(pytest.skip.Exception, match="have no warmup_steps field"):
        checks["follows_the_documented_warmup"]()
    check_component("schedulers", "flat", manager=manager)  # the skip is no failure


def test_scheduler_with_a_different_warmup_curve_fails(manager):
    def squared(options, optimizer, total_steps):
        w = options.warmup_steps
        return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: ((s + 1) / w) ** 2 if s < w else 1.0)

    _with_plugin(manager, "schedulers", "squared", squared, config=WarmupOptions)
    message = _failure(manager, "schedulers", "squared", "follows_the_documented_warmup")
    assert "first difference at step 0: 0.0625 instead of 0.25" in message


class _Doubling(torch.nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)

    def forward(self, x):
        return self.proj(x)


def test_feed_forward_with_a_plan_naming_no_submodule_fails_the_capability_check(manager):
    class Planned(_Doubling):
        def tensor_parallel_plan(self):
            return {"w1": None}  # the layer has "proj", not "w1"

    _with_plugin(manager, "feed_forwards", "planned", lambda options, dim, index: Planned(dim))
    message = _failure(manager, "feed_forwards", "planned", "the_capabilities_it_claims_are_well_formed")
    assert "tensor_parallel_plan() names ['w1'], which are not submodules of the layer" in message


def test_feed_forward_claiming_no_active_parameters_fails_the_capability_check(manager):
    class Idle(_Doubling):
        def active_parameter_count(self):
            return 0

    _with_plugin(manager, "feed_forwards", "idle", lambda options, dim, index: Idle(dim))
    message = _failure(manager, "feed_forwards", "idle", "the_capabilities_it_claims_are_well_formed")
    assert "active_parameter_count() returned 0; the kit expects an int between 1 and" in message


def test_capabilities_are_recognised_by_protocol_not_by_name():
    # The core asks with isinstance on forge_lm.components' runtime-checkable protocols.
    from forge_lm.components import CountsActiveParameters, InitializesWeights, OwnFSDPUnit, TensorParallelizable
    from forge_lm.model.swiglu import SwiGLU

    swiglu = SwiGLU(8, 16)
    assert isinstance(swiglu, TensorParallelizable)
    assert isinstance(swiglu, InitializesWeights)
    assert not isinstance(swiglu, CountsActiveParameters)
    assert not isinstance(swiglu, OwnFSDPUnit)
    swiglu.fsdp_mesh_dims = ("dp_shard",)
    assert isinstance(swiglu, OwnFSDPUnit)
