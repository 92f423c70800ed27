"""The memory estimate: parameter counts against hand-computed formulas and really built models,
bytes per rank, the device's limit, and the refusal of a run that cannot fit."""

from __future__ import annotations

import math
import os
from typing import ClassVar

import attrs
import pytest
import torch

from forge_lm.config import load_config
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.errors import ConfigError, PluginError
from forge_lm.model import available_memory, build_model, memory, transformer
from forge_lm.model.available_memory import MemoryLimit, host_available_memory, memory_limit
from forge_lm.model.memory import (
    check_memory,
    count_parameters,
    estimate_memory,
    format_bytes,
    format_count,
    lower_bound,
    optimizer_states,
)
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.preflight import validation_report

BYTES = 257  # the byte tokenizer's vocabulary


def config_of(manager: PluginManager, *overrides: str):
    return load_config(None, list(overrides), manager.registry)


def real_count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # a tied tensor once


def swiglu_hidden(dim: int, multiplier: float = 8 / 3, multiple_of: int = 64) -> int:
    return multiple_of * math.ceil(multiplier * dim / multiple_of)


def hand_count(dim, n_layers, n_heads, kv_heads, vocab, *, tied=True, qk_norm=False, hidden=None) -> int:
    """The Llama layout by hand: embedding (and head), per block wq/wk/wv/wo, SwiGLU's three
    matrices and two norm scales (and QK-norm's two head_dim scales), the final norm."""
    head_dim = dim // n_heads
    hidden = swiglu_hidden(dim) if hidden is None else hidden
    attention = dim * dim + 2 * dim * kv_heads * head_dim + dim * dim
    block = attention + 3 * dim * hidden + 2 * dim + (2 * head_dim if qk_norm else 0)
    return vocab * dim * (1 if tied else 2) + n_layers * block + dim


# -- parameter counts ----------------------------------------------------------------------------


def test_the_default_models_count_is_the_hand_formula_and_the_real_models(manager):
    config = config_of(manager)
    torch.manual_seed(0)
    real = build_model(config.model, BYTES, manager.registry)

    counted = count_parameters(config.model, BYTES, manager.registry)

    assert counted.parameters == hand_count(256, 4, 4, 4, BYTES) == real_count(real) == 3_279_360
    assert counted.exact
    assert counted.parameter_bytes == 4 * counted.parameters  # fp32
    assert counted.buffer_bytes == 2 * 2048 * 64 * 4  # RoPE cos and sin, [max_seq_len, head_dim] fp32


@pytest.mark.parametrize(
    ("overrides", "fields"),
    [
        pytest.param(("--model.tie_embeddings=false",), {"tied": False}, id="untied"),
        pytest.param(("--model.n_kv_heads=2",), {"kv_heads": 2}, id="grouped-query"),
        pytest.param(("--model.qk_norm=true",), {"qk_norm": True}, id="qk-norm"),
        pytest.param(("--model.norm=layernorm",), {}, id="layernorm"),
        pytest.param(
            ("--model.ffn.hidden_multiplier=4", "--model.ffn.multiple_of=32"), {"hidden": 1024}, id="wider-ffn"
        ),
    ],
)
def test_variants_are_counted_exactly(manager, overrides, fields):
    config = config_of(manager, *overrides)
    real = build_model(config.model, BYTES, manager.registry)
    hand = {"dim": 256, "n_layers": 4, "n_heads": 4, "kv_heads": 4, "vocab": BYTES, **fields}
    kv_heads = hand.pop("kv_heads")

    assert count_parameters(config.model, BYTES, manager.registry).parameters == real_count(real)
    assert real_count(real) == hand_count(hand.pop("dim"), hand.pop("n_layers"), hand.pop("n_heads"), kv_heads, **hand)


def test_a_moe_model_is_counted_exactly():
    pytest.importorskip("forge_moe")
    manager = PluginManager(PluginSettings(allow=("moe",)))
    config = config_of(
        manager,
        "--model.ffn.name=moe",
        "--model.ffn.n_experts=6",
        "--model.ffn.top_k=2",
        "--model.ffn.n_shared_experts=1",
        "--model.ffn.every_n_layers=2",
        "--model.ffn.router.name=sigmoid_topk",
    )
    torch.manual_seed(0)
    real = build_model(config.model, BYTES, manager.registry)

    counted = count_parameters(config.model, BYTES, manager.registry)

    assert counted.parameters == real_count(real)
    assert counted.parameters > hand_count(256, 4, 4, 4, BYTES)  # experts make it larger than the dense model
    assert counted.buffer_bytes == sum(b.numel() * b.element_size() for b in real.buffers())


def test_the_lower_bound_is_the_model_without_its_feed_forward_layers(manager):
    config = config_of(manager, "--model.qk_norm=true", "--model.n_kv_heads=2", "--model.tie_embeddings=false")
    bound = lower_bound(config.model, BYTES)
    counted = count_parameters(config.model, BYTES, manager.registry)

    assert bound.parameters == counted.parameters - 4 * 3 * 256 * swiglu_hidden(256)
    assert bound.buffer_bytes == counted.buffer_bytes
    assert not bound.exact


def test_the_lower_bound_counts_any_size_without_building_or_overflowing(manager):
    config = config_of(manager, "--model.n_layers=1000000000", "--model.max_seq_len=100000000000")
    bound = lower_bound(config.model, BYTES)
    assert bound.parameters == BYTES * 256 + 10**9 * (4 * 256 * 256 + 2 * 256) + 256
    assert bound.buffer_bytes == 2 * 10**11 * 64 * 4


def test_blocks_beyond_the_built_ones_count_as_the_smallest_built_one(manager, monkeypatch):
    monkeypatch.setattr(memory, "MAX_BUILT_LAYERS", 2)
    config = config_of(manager, "--model.n_layers=5")

    counted = count_parameters(config.model, BYTES, manager.registry)

    assert counted.parameters == hand_count(256, 5, 4, 4, BYTES)
    assert not counted.exact


def test_counting_allocates_nothing_and_leaves_the_seeded_generator_alone(manager):
    config = config_of(manager, "--model.dim=4096", "--model.n_heads=32", "--model.n_layers=64")
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)

    counted = count_parameters(config.model, BYTES, manager.registry)  # 13B parameters: 52 GB if allocated

    assert torch.equal(torch.rand(3), expected)
    assert counted.parameters == hand_count(4096, 64, 32, 32, BYTES)


# -- optimizer state -------------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "states"), [("adamw", 2), ("lion", 1), ("schedule_free_adamw", 2)])
def test_built_in_optimizers_keep_their_known_number_of_states(manager, name, states):
    assert optimizer_states(manager.registry.resolve("optimizers", name)) == states


def test_muon_keeps_at_most_two_states():
    pytest.importorskip("forge_optim_muon")
    manager = PluginManager(PluginSettings(allow=("muon",)))
    assert optimizer_states(manager.registry.resolve("optimizers", "muon")) == 2


@attrs.define
class _DeclaringOptions:
    FORGE_LM_OPTIMIZER_STATES: ClassVar[float] = 3


@attrs.define
class _WrongOptions:
    FORGE_LM_OPTIMIZER_STATES: ClassVar[object] = "two"


@attrs.define
class _SilentOptions:
    lr: float = 1e-3


def _optimizer_plugin(options: type, name: str) -> object:
    class Plugin:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        @staticmethod
        def forge_lm_register_optimizers(register):
            register(name, lambda options, model: None, config=options, description="test optimizer")

    return Plugin()


@pytest.mark.parametrize(
    ("options", "states"), [(_DeclaringOptions, 3.0), (_SilentOptions, memory.DEFAULT_OPTIMIZER_STATES)]
)
def test_an_optimizer_declares_its_states_on_its_options_class_or_gets_the_default(options, states):
    manager = PluginManager(PluginSettings(), entry_points=False)
    manager.add_plugin(_optimizer_plugin(options, "mine"), "mine")
    assert optimizer_states(manager.registry.resolve("optimizers", "mine")) == states


def test_a_declared_number_of_states_that_is_not_a_number_is_the_plugins_bug():
    manager = PluginManager(PluginSettings(), entry_points=False)
    manager.add_plugin(_optimizer_plugin(_WrongOptions, "mine"), "mine")
    with pytest.raises(PluginError, match=r"declares FORGE_LM_OPTIMIZER_STATES = 'two'; it must be a number >= 0"):
        optimizer_states(manager.registry.resolve("optimizers", "mine"))


# -- bytes per rank ----------------------------------------------------------------------------------


def test_the_estimate_of_the_default_run_on_cpu_is_the_formula(manager):
    config = config_of(manager)
    estimate = estimate_memory(config, BYTES, manager.registry, ParallelDims(), None)

    weights = 4 * 3_279_360
    tokens = 16 * 128
    activations = tokens * (4 * 256 * (16 * 4 + 16) + BYTES * (4 + 8))
    assert (estimate.weights, estimate.gradients, estimate.optimizer_state) == (
        weights + 2 * 2048 * 64 * 4,
        weights,
        2 * weights,
    )
    assert estimate.activations == activations
    assert estimate.total == estimate.weights + estimate.gradients + estimate.optimizer_state + activations
    assert (estimate.optimizer, estimate.states, estimate.shards) == ("adamw", 2.0, 1)


@pytest.mark.parametrize(
    ("overrides", "device", "autocast", "per_token"),
    [
        ((), "cpu", None, 4 * 128 * 4),  # auto on CPU at 128 tokens: eager, fp32 probabilities
        ((), "cpu", torch.bfloat16, 4 * 128 * 2),  # bf16 probabilities
        (("--train.seq_len=256", "--model.max_seq_len=256"), "cpu", None, 0),  # beyond fp32's eager limit: SDPA
        (("--train.seq_len=256", "--model.max_seq_len=256"), "cpu", torch.bfloat16, 4 * 256 * 2),
        (("--model.attention_backend=sdpa",), "cpu", None, 0),
        ((), "cuda", torch.bfloat16, 0),  # auto on CUDA: FlexAttention
        ((), None, None, 0),  # device unknown: not counted
    ],
)
def test_eager_attention_adds_its_probabilities_per_block(manager, overrides, device, autocast, per_token):
    """Eager attention keeps every head's [T, T] probabilities for backward: heads * seq_len
    values per token and block, in the compute dtype, on top of the rest of the block's."""
    config = config_of(manager, *overrides)
    where = torch.device(device) if device else None
    with_device = estimate_memory(config, BYTES, manager.registry, ParallelDims(), autocast, where)
    without = estimate_memory(config, BYTES, manager.registry, ParallelDims(), autocast)
    tokens = 16 * config.train.seq_len
    assert with_device.activations - without.activations == tokens * 4 * per_token  # 4 blocks


def test_eager_attention_memory_is_what_backward_keeps():
    """The per-token figure against autograd: the tensors eager attention saves for backward,
    beyond SDPA's, are one [B, H, T, T] tensor in the compute dtype."""
    from forge_lm.model.attention import attention_mask, eager_attention

    saved: list[torch.Tensor] = []

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tensor)
        return tensor

    q, k, v = (torch.randn(2, 4, 32, 8, requires_grad=True) for _ in range(3))
    bias, _ = attention_mask(None, 0, 32, torch.device("cpu"), "eager")
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        eager_attention(q, k, v, bias)
    square = [t for t in saved if t.shape[-2:] == (32, 32) and t.shape[0] == 2]
    distinct = {t.untyped_storage().data_ptr() for t in square}
    assert len(distinct) == 1  # the probabilities, saved by softmax and by the product with v
    assert square[0].shape == (2, 4, 32, 32)


def test_sharding_divides_weights_gradients_and_optimizer_state_and_tp_divides_activations(manager):
    config = config_of(manager, "--optimizer.name=lion", "--model.tie_embeddings=false", "--train.grad_accum_steps=8")
    one = estimate_memory(config, BYTES, manager.registry, ParallelDims(), None)
    dims = ParallelDims(dp_replicate=3, dp_shard=2, tp=2, pp=2)

    sharded = estimate_memory(config, BYTES, manager.registry, dims, None)

    buffers = 2 * 2048 * 64 * 4
    assert sharded.shards == 8
    assert sharded.weights == pytest.approx((one.weights - buffers) / 8 + buffers)
    assert sharded.gradients == pytest.approx(one.gradients / 8)
    assert sharded.optimizer_state == pytest.approx(one.gradients / 8)  # lion: one state
    tokens = 16 * 128
    # 2 of 4 blocks per stage, 2 micro-batches in flight (1f1b: min(pp, grad_accum_steps)), tp splits blocks.
    blocks = 2 * 2 * 256 * 80 / 2
    assert sharded.activations == pytest.approx(tokens * (blocks + BYTES * 12))


def test_bf16_and_activation_checkpointing_keep_less(manager):
    registry, dims = manager.registry, ParallelDims()
    plain = estimate_memory(config_of(manager), BYTES, registry, dims, torch.bfloat16)
    full = estimate_memory(config_of(manager, "--train.activation_checkpointing=full"), BYTES, registry, dims, None)
    tokens = 16 * 128

    assert plain.activations == tokens * (4 * 256 * (16 * 2 + 16) + BYTES * (2 + 8))
    assert full.activations == tokens * (4 * 256 * 4 + 256 * 80 + BYTES * 12)


def test_a_billion_blocks_are_counted_from_the_built_ones(manager, monkeypatch):
    built = []
    original = transformer.build_model
    monkeypatch.setattr(
        transformer, "build_model", lambda section, *a: built.append(section.options.n_layers) or original(section, *a)
    )
    config = config_of(manager, "--model.n_layers=1000000000")

    estimate = estimate_memory(config, BYTES, manager.registry, ParallelDims(), None)

    assert built == [memory.MAX_BUILT_LAYERS]
    assert estimate.count.parameters == hand_count(256, 10**9, 4, 4, BYTES)
    assert not estimate.count.exact
    assert estimate.total > 10**15


def test_a_feed_forward_that_cannot_be_built_on_meta_leaves_the_lower_bound(manager, monkeypatch):
    def unsupported(*args, **kwargs):
        raise NotImplementedError("no meta kernel")

    monkeypatch.setattr(memory, "count_parameters", unsupported)
    estimate = estimate_memory(config_of(manager), BYTES, manager.registry, ParallelDims(), None)
    assert estimate.count == lower_bound(config_of(manager).model, BYTES)


# -- the limit and the refusal -------------------------------------------------------------------------


def test_host_memory_is_memavailable_or_a_lower_cgroup_limit(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    (proc / "meminfo").write_text("MemTotal:       16000000 kB\nMemAvailable:    8000000 kB\n")
    assert host_available_memory(proc, cgroup) == 8_000_000 * 1024
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text("100\n")
    assert host_available_memory(proc, cgroup) == 8_000_000 * 1024
    (cgroup / "memory.max").write_text("3000000000\n")
    assert host_available_memory(proc, cgroup) == 3_000_000_000 - 100
    job = cgroup / "slurm" / "job_7"  # the process's own group, named in /proc/self/cgroup
    job.mkdir(parents=True)
    (job / "memory.max").write_text("2000000000\n")
    (job / "memory.current").write_text("500000000\n")
    (proc / "self").mkdir()
    (proc / "self" / "cgroup").write_text("0::/slurm/job_7\n")
    assert host_available_memory(proc, cgroup) == 1_500_000_000


def test_host_memory_falls_back_to_sysconf_without_proc(tmp_path):
    assert host_available_memory(tmp_path / "none", tmp_path / "none") == (
        os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    )


def test_cpu_memory_is_shared_by_the_processes_on_the_host(monkeypatch):
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 12_000)
    assert memory_limit(torch.device("cpu")) == MemoryLimit(12_000, "of available memory on this host")
    assert memory_limit(torch.device("cpu"), processes_on_host=4) == MemoryLimit(
        3_000, "of available memory on this host, shared by its 4 processes"
    )


def test_a_run_that_cannot_fit_is_refused_with_the_estimate_and_the_limit(manager, monkeypatch):
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 100_000_000)  # 100 MB
    agreed = []

    def agree(flag: bool) -> bool:  # what every rank says; here, one rank
        agreed.append(flag)
        return flag

    config = config_of(manager)

    with pytest.raises(ConfigError) as refused:
        check_memory(config, BYTES, manager.registry, ParallelDims(), torch.device("cpu"), None, agree)

    assert agreed == [True]  # every rank is told
    assert str(refused.value).startswith(
        "the run needs about 244 MB of memory per rank, more than the 100 MB of available memory on this host: "
        "3.28M parameters; weights 14.2 MB, gradients 13.1 MB, optimizer state 26.2 MB (adamw: 2 per parameter), "
        "activations 191 MB. Make the model smaller"
    )
    assert str(refused.value).endswith("[train] memory_check = false starts it anyway.")


def test_a_run_that_fits_starts_and_memory_check_false_skips_the_check(manager, monkeypatch):
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 100_000_000)
    args = (BYTES, manager.registry, ParallelDims(), torch.device("cpu"), None)
    small = config_of(manager, "--train.batch_size=1")
    assert check_memory(small, *args).total < 100_000_000
    assert check_memory(config_of(manager, "--train.memory_check=false"), *args) is None


def test_another_ranks_refusal_stops_this_rank_too(manager, monkeypatch):
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 10**12)
    with pytest.raises(ConfigError, match=r"^another rank's share of the run does not fit in its memory"):
        check_memory(
            config_of(manager), BYTES, manager.registry, ParallelDims(), torch.device("cpu"), None, lambda _: True
        )


def test_validation_reports_the_estimate_and_refuses_what_train_would(manager, monkeypatch):
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 24_600_000_000)
    assert validation_report(config_of(manager, "--train.device=cpu"), manager.registry) == (
        "estimate: 3.28M parameters; about 244 MB per rank (weights 14.2 MB, gradients 13.1 MB, optimizer state "
        "26.2 MB (adamw: 2 per parameter), activations 191 MB); 24.6 GB of available memory on this host."
    )
    with pytest.raises(ConfigError, match=r"^the run needs at least 59 PB of memory per rank"):
        validation_report(config_of(manager, "--train.device=cpu", "--model.n_layers=1000000000"), manager.registry)
    unchecked = config_of(manager, "--train.device=cpu", "--model.n_layers=1000000000", "--train.memory_check=false")
    assert validation_report(unchecked, manager.registry).endswith(
        "; more than the 24.6 GB of available memory on this host ([train] memory_check = false)."
    )


def test_validation_of_a_config_for_another_machine_reports_the_estimate_unchecked(manager, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    report = validation_report(config_of(manager, "--train.device=cuda"), manager.registry)
    assert report.startswith("estimate: 3.28M parameters; about ")
    assert report.endswith(
        "; not checked against a device here: [train] device: 'cuda' asked for, but CUDA is not available; use "
        "'cpu' or 'auto'."
    )


def test_validation_checks_the_vocabulary_against_the_tokenizer(manager):
    with pytest.raises(ConfigError, match=r"^\[model\] vocab_size: 100 is smaller than the tokenizer's vocabulary"):
        validation_report(config_of(manager, "--model.vocab_size=100"), manager.registry)


@pytest.mark.parametrize(
    ("size", "text"),
    [(999, "0.999 kB"), (14_200_000, "14.2 MB"), (24.6e9, "24.6 GB"), (46.1e15, "46.1 PB"), (3e18, "3,000 PB")],
)
def test_byte_sizes_are_written_with_three_digits(size, text):
    assert format_bytes(size) == text


@pytest.mark.parametrize(
    ("n", "text"), [(7, "7"), (3_279_360, "3.28M"), (67_100_000_000, "67.1B"), (2 * 10**17, "200,000T")]
)
def test_parameter_counts_are_written_with_three_digits(n, text):
    assert format_count(n) == text


def test_validation_applies_the_layout_rules_a_launch_would(manager):
    with pytest.raises(ConfigError, match=r"^\[distributed\] tp = 3 must divide \[model\] n_heads = 4"):
        validation_report(config_of(manager, "--distributed.tp=3"), manager.registry)


def test_validation_outside_torchrun_takes_dp_shard_minus_one_as_one_rank_that_ep_divides(manager, monkeypatch):
    pytest.importorskip("forge_moe")
    moe = PluginManager(PluginSettings(allow=("moe",)))
    monkeypatch.setattr(available_memory, "host_available_memory", lambda: 10**12)
    report = validation_report(config_of(moe, "--model.ffn.name=moe", "--distributed.ep=2"), moe.registry)
    assert "weights sharded" not in report
    sharded = validation_report(config_of(manager, "--distributed.dp_shard=4", "--distributed.tp=2"), manager.registry)
    assert "weights sharded 8 ways" in sharded
