"""A tiny fp16 run of ``train()`` on 2 ranks (gloo, CPU) where only rank 1's gradients overflow once.

Usage: ``torchrun --standalone --nproc_per_node=2 fp16_worker.py RUN_DIR OUT_PREFIX [overrides...]``

Rank 1's loss makes the gradient into its logits Inf on its third call (the first try of step 3);
rank 0's never does. Each rank writes ``OUT_PREFIX<rank>.json``: the steps it trained, the steps
its ``forge_lm_step_skipped`` hook saw, its loss scale at the end, and a checksum of its weights.
The test (tests/core/distributed/test_fp16_ranks.py) checks that both ranks skipped the same step.
"""

from __future__ import annotations

import json
import math
import sys

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from forge_lm import hookimpl
from forge_lm.config import load_config
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.testing import TINY_MODEL
from forge_lm.train.loop import train

RUN = (
    *TINY_MODEL,
    "--distributed.dp_replicate=2",  # whole weights on each rank: their checksums are comparable
    "--distributed.dp_shard=1",
    "--train.batch_size=2",
    "--train.seq_len=16",
    "--train.max_steps=4",
    "--train.precision=fp16",
    "--train.loss_scale.init_scale=1024",
    "--data.name=synthetic",
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=0",
    "--resilience.health_check=false",
    "--loss.name=overflow_on_rank1",
)


@attrs.define
class _NoOptions:
    pass


class _OverflowOnRank1:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, logits, labels):
        self.calls += 1
        if dist.get_rank() == 1 and self.calls == 3:
            logits.register_hook(lambda grad: grad * math.inf)
        return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten())


class _Plugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def __init__(self) -> None:
        self.skipped: list[int] = []

    @hookimpl
    def forge_lm_register_losses(self, register):
        register("overflow_on_rank1", lambda options: _OverflowOnRank1(), config=_NoOptions, description="test")

    @hookimpl
    def forge_lm_step_skipped(self, context, step):
        self.skipped.append(step)

    @hookimpl
    def forge_lm_train_end(self, context, status):
        checksum = sum(float(p.detach().double().sum()) for p in context.model.parameters())
        out = {
            "steps": context.step,
            "skipped": self.skipped,
            "scale": context.loss_scaler.scale,
            "checksum": checksum,
        }
        with open(f"{sys.argv[2]}{dist.get_rank()}.json", "w") as file:
            json.dump(out, file)


def main() -> None:
    torch.set_num_threads(1)
    manager = PluginManager(PluginSettings(autoload=False))
    manager.add_plugin(_Plugin(), "overflow-test")
    config = load_config(None, [*RUN, f"--train.output_dir={sys.argv[1]}", *sys.argv[3:]], manager.registry)
    train(config, manager)


if __name__ == "__main__":
    main()
