"""Fixtures for forge-float8: a plugin manager with the plugin, tiny runs, their losses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from forge_lm.config import ForgeConfig, load_config
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL

REPO = Path(__file__).resolve().parents[3]
DEBUG_CONFIG = REPO / "configs" / "float8_debug.toml"
README = REPO / "plugins" / "forge-float8" / "README.md"

# A tiny model whose Linear sizes are all multiples of 16 (32, 16 for the key/value heads, 128
# for the feed-forward layer), so that float8 converts every Linear layer but the head. A constant
# learning rate: a run stopped early and resumed follows the schedule of one that never stopped.
TINY = (
    *TINY_MODEL,
    "--train.batch_size=4",
    "--train.seq_len=16",
    "--train.max_steps=4",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--checkpoint.interval=2",
    "--data.name=synthetic",
    "--scheduler.name=constant",
    "--transforms.float8.enabled=true",
)

# One block whose feed-forward hidden size is 200 (multiple_of = 40): w1, w3 and w2 cannot be
# float8; the attention layers are 64 -> 64 and 64 -> 32, which can.
ODD = (
    "--model.dim=64",
    "--model.n_layers=1",
    "--model.n_heads=4",
    "--model.n_kv_heads=2",
    "--model.ffn.multiple_of=40",
)
ODD_MESSAGE = """\
forge-float8: 4 of 8 Linear layers train in float8 (recipe tensorwise); 4 stay in high precision:
  layers.0.feed_forward.w1: 64 -> 200 features; float8 matmuls need both to be multiples of 16
  layers.0.feed_forward.w3: 64 -> 200 features; float8 matmuls need both to be multiples of 16
  layers.0.feed_forward.w2: 200 -> 64 features; float8 matmuls need both to be multiples of 16
  output: the output head
"""

REFUSED_ROWWISE_ALL_GATHER = (
    '[transforms.float8] fsdp_float8_all_gather = true needs recipe = "tensorwise", got "rowwise": torchao '
    'gathers float8 weights with one scale per tensor only. Set recipe = "tensorwise", or fsdp_float8_all_gather '
    "= false (FSDP2 then gathers the weights in their training precision and casts them to float8 after the "
    "gather)."
)
REFUSED_TP = (
    "[transforms.float8] enabled = true with [distributed] tp = 2: forge-float8 does not support tensor "
    "parallelism yet (its float8 layers replace the Linear layers, dropping the input and output layouts tensor "
    "parallelism gave them). Set tp = 1 (FSDP2 and pipeline parallelism work with float8), or enabled = false."
)
REFUSED_FP16 = (
    "[transforms.float8] enabled = true with [train] precision = 'fp16': forge-float8 does not support fp16. "
    "torchao's float8 training takes bf16 or fp32 as its high precision, and the float8 casts have not been run "
    "under fp16 autocast with Forge's loss scaling. Set precision = 'bf16' (float8 needs an Ada or Hopper GPU, "
    "which has bf16), or enabled = false."
)

# The README's tolerance: every step's loss within this fraction of the fp32 run's.
TOLERANCE = 0.005


@pytest.fixture(autouse=True)
def _one_torch_thread():
    """Run in-process training on one thread. float8 layers make many small operations, each a
    parallel region; on a busy 2-core machine two threads waiting for each other made a 50-step run
    of the shipped config take 60 s instead of 1.5 s. The losses are the same on 1 thread or 2."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def float8_manager() -> PluginManager:
    """The built-ins and forge-float8, whatever else is installed."""
    return PluginManager(PluginSettings(autoload=False, allow=("float8",)))


@pytest.fixture
def tiny_float8(tmp_path: Path, float8_manager: PluginManager) -> Callable[..., ForgeConfig]:
    """A tiny float8 run config in a fresh run directory; extra overrides come last and win."""

    def make(*overrides: str, run_dir: Path | None = None) -> ForgeConfig:
        run_dir = run_dir or tmp_path / f"run{len(list(tmp_path.iterdir()))}"
        return load_config(None, [*TINY, f"--train.output_dir={run_dir}", *overrides], float8_manager.registry)

    return make


def read_losses(run_dir: Path) -> dict[int, float]:
    """The loss of each step; where a step was logged twice (redone after a resume), the later one."""
    losses = {}
    for record in read_metrics(Path(run_dir) / "metrics.jsonl"):
        if "loss" in record:
            losses[record["step"]] = record["loss"]
    return losses
