"""The presets for an 8-GPU node of 80 GB (configs/llama3_1b.toml, llama3_8b.toml, moe_8x1b.toml):
each passes ``forge config validate --world-size 8 --device-memory-gib 80`` here, without a GPU;
their parameter counts equal the published sizes, counted by formula from their sizes; their
estimate per GPU is below 80 GiB and equals, within 1%, the estimate written out in this file
from memory.py's documented terms; and a launch too small for them is refused, naming the
shortfall."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from forge_lm.cli import main
from forge_lm.config import load_config, model_options
from forge_lm.distributed.mesh import ParallelDims
from forge_lm.errors import ConfigError
from forge_lm.model.memory import estimate_memory
from forge_lm.plugins import PluginManager
from forge_lm.train.preflight import GIB, SimulatedLaunch, validation_report

CONFIGS = Path(__file__).resolve().parents[3] / "configs"
NODE = SimulatedLaunch(world_size=8, device_memory_gib=80)
VOCAB = 128_256  # Llama 3's vocabulary

# Published parameter counts (Hugging Face model cards / safetensors index totals).
LLAMA_3_2_1B = 1_235_814_400
LLAMA_3_1_8B = 8_030_261_248


@pytest.fixture(scope="module")
def registry():
    return PluginManager().registry  # the installed first-party plugins: forge-moe for the MoE preset


def preset(registry, name: str, *overrides: str):
    return load_config(CONFIGS / name, list(overrides), registry)


def llama_parameters(dim, n_layers, kv_dim, hidden, *, tied, ffn_per_block=None) -> int:
    """By hand: embedding (and an untied head), per block wq and wo (dim x dim), wk and wv
    (dim x kv_dim), SwiGLU's three matrices (or ``ffn_per_block``), two norm scales; the final norm."""
    ffn = 3 * dim * hidden if ffn_per_block is None else ffn_per_block
    block = 2 * dim * dim + 2 * dim * kv_dim + ffn + 2 * dim
    return VOCAB * dim * (1 if tied else 2) + n_layers * block + dim


def moe_parameters() -> tuple[int, int]:
    """(all, active per token) of the MoE preset: 8 experts of hidden 3072, top 2, a router of
    8 x dim per block, around the 1B preset's attention and embedding."""
    dim, experts, top_k, hidden = 2048, 8, 2, 3072
    router = experts * dim
    total = llama_parameters(dim, 16, 512, 0, tied=True, ffn_per_block=experts * 3 * dim * hidden + router)
    active = llama_parameters(dim, 16, 512, 0, tied=True, ffn_per_block=top_k * 3 * dim * hidden + router)
    return total, active


def documented_estimate(config, parameters: int, shards: int) -> float:
    """memory.py's per-rank estimate written out: fp32 weights, fp32 gradients and AdamW's two
    fp32 moments (4 + 4 + 8 bytes) per parameter over the shards; activations per token: per
    block dim * (16 * 2 + 16) bytes in bf16 (0.6 of it kept with selective checkpointing), times
    the blocks, plus each logit in bf16 and its fp32 copy and gradient (2 + 8 bytes). Leaves out
    the RoPE tables (4 MB), under the test's tolerance."""
    model, train = model_options(config), config.train
    per_block = model.dim * (16 * 2 + 16)
    kept = {"none": 1.0, "selective": 0.6}[train.activation_checkpointing] * model.n_layers * per_block
    tokens = train.batch_size * train.seq_len
    return parameters * 16 / shards + tokens * (kept + VOCAB * (2 + 8))


CASES = [
    ("llama3_1b.toml", LLAMA_3_2_1B),
    ("llama3_8b.toml", LLAMA_3_1_8B),
    ("moe_8x1b.toml", moe_parameters()[0]),
]


def test_the_parameter_formulas_give_the_published_sizes_and_the_moe_about_1b_active():
    assert llama_parameters(2048, 16, 512, 8192, tied=True) == LLAMA_3_2_1B
    assert llama_parameters(4096, 32, 1024, 14336, tied=False) == LLAMA_3_1_8B
    total, active = moe_parameters()
    assert (round(total / 1e9, 2), round(active / 1e9, 2)) == (2.85, 1.03)


@pytest.mark.parametrize(("name", "parameters"), CASES, ids=[name for name, _ in CASES])
def test_preset_fits_a_simulated_node_of_8_gpus_with_80_gib(registry, name, parameters):
    config = preset(registry, name)
    assert config.train.precision == "bf16"
    assert config.distributed.dp_shard == -1
    report = validation_report(config, registry, NODE)
    assert "weights sharded 8 ways" in report
    assert "per GPU given by --device-memory-gib" in report
    assert "Simulated: 8 ranks (--world-size)" in report
    # The estimate behind the report, on the layout it resolved (dp_shard = -1: the 8 ranks).
    estimate = estimate_memory(config, VOCAB, registry, ParallelDims(dp_shard=8), torch.bfloat16, torch.device("cuda"))
    assert estimate.count.exact
    assert estimate.count.parameters == parameters
    assert estimate.total < 80 * GIB
    assert estimate.total == pytest.approx(documented_estimate(config, parameters, 8), rel=0.01)
    spare = re.search(r", ([\d.]+) GB to spare\.", report)
    assert spare
    assert float(spare.group(1)) == pytest.approx((80 * GIB - estimate.total) / 1e9, rel=0.01)


def test_the_8b_on_one_gpu_of_80_gib_is_refused_naming_the_shortfall(registry):
    config = preset(registry, "llama3_8b.toml")
    needed = documented_estimate(config, LLAMA_3_1_8B, 1)  # nothing sharded: 128 GB of state alone
    with pytest.raises(ConfigError) as refused:
        validation_report(config, registry, SimulatedLaunch(world_size=1, device_memory_gib=80))
    message = str(refused.value)
    assert message.startswith("the run needs about 170 GB of memory per rank, more than the 85.9 GB (80 GiB) per GPU")
    short = re.search(
        r"Simulated: 1 rank \(--world-size\), 80 GiB per GPU \(--device-memory-gib\), no GPU used "
        r"here: ([\d.]+) GB short per GPU\.$",
        message,
    )
    assert short
    assert float(short.group(1)) == pytest.approx((needed - 80 * GIB) / 1e9, rel=0.01)


def test_without_the_options_the_tokenizer_a_preset_names_must_exist_here(registry):
    # The simulation reads [model] vocab_size when the user's tokenizer is not here; a plain
    # validate, which checks the config for this machine, still reads the tokenizer.
    with pytest.raises(ConfigError, match=r"^\[tokenizer\] path: 'tokenizer/tokenizer.json' does not exist"):
        validation_report(preset(registry, "llama3_1b.toml"), registry)


def test_forge_config_validate_takes_the_node_on_the_command_line(capsys):
    path = str(CONFIGS / "llama3_8b.toml")
    assert main(["config", "validate", path, "--world-size", "8", "--device-memory-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"{path} is valid.\nestimate: 8.03B parameters; about 57.5 GB per rank")
    assert "The tokenizer was not read here" in out
    assert main(["config", "validate", path, "--world-size", "8", "--device-memory-gib", "-80"]) == 2
    assert capsys.readouterr().err.startswith(
        "forge: error: argument --device-memory-gib: must be a number > 0, got -80"
    )


def test_a_simulated_world_size_checks_the_degrees_product_as_a_launch_would(registry):
    config = preset(registry, "llama3_8b.toml", "--distributed.dp_shard=4")
    with pytest.raises(ConfigError, match=r"= 4, but 8 processes were launched.*\(Simulated: 8 ranks given by"):
        validation_report(config, registry, NODE)
    assert "weights sharded 4 ways" in validation_report(config, registry, SimulatedLaunch(4, 80))
