"""Run under torchrun (2 CPU ranks, gloo): a loader reading ahead over the streaming ``hf_text``
against one reading in the training thread, on every rank.

Usage:  read_ahead_worker.py CORPUS OUT_DIR

Each rank hands out 6 batches from each loader, takes both loaders' states, then 4 more
batches; it writes OUT_DIR/rank<r>.json with the number of ``all_gather_object`` calls made
while batches were handed out and by each ``state_dict()``, both states, and whether the two
loaders handed out the same batches.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import attrs
import torch
import torch.distributed as dist

from forge_lm.components import DataContext
from forge_lm.config import structure_options
from forge_lm.data.loader import BatchLoader
from forge_lm.distributed.launch import exit_process
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.tokenizers.byte_level import ByteTokenizer

calls = {"count": 0}
_gather = dist.all_gather_object


def counting_gather(*args, **kwargs):
    calls["count"] += 1
    return _gather(*args, **kwargs)


def main(corpus: str, out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.all_gather_object = counting_gather  # the streaming dataset looks it up at each call
    manager = PluginManager(PluginSettings(autoload=False))
    component = manager.registry.resolve("datasets", "hf_text")
    table = {"path": corpus, "format": "jsonl", "eval_fraction": 0.1, "streaming": True, "shuffle_buffer": 8}
    options = structure_options(manager.registry, component, table, "data")
    context = DataContext(seq_len=16, vocab_size=257, dp_rank=rank, dp_size=2, seed=3, tokenizer=ByteTokenizer())
    context = attrs.evolve(context, registry=manager.registry)
    loaders = {
        "ahead": BatchLoader(component.build(options, context), 4, 257, read_ahead=True),
        "here": BatchLoader(component.build(options, context), 4, 257),
    }
    result = {}
    batches = {name: iter(loader) for name, loader in loaders.items()}
    first = {name: [next(it) for _ in range(6)] for name, it in batches.items()}
    result["gathers_while_reading"] = calls["count"]
    for name, loader in loaders.items():
        before = calls["count"]
        state = loader.state_dict()
        result[f"{name}_state"] = state
        result[f"{name}_gathers_in_state_dict"] = calls["count"] - before
    calls_before_more = calls["count"]
    more = {name: [next(it) for _ in range(4)] for name, it in batches.items()}
    result["gathers_while_reading"] += calls["count"] - calls_before_more
    result["same_batches"] = all(
        torch.equal(a[key], b[key])
        for group in (first, more)
        for a, b in zip(group["ahead"], group["here"], strict=True)
        for key in a
    )
    loaders["ahead"].close()
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:])
    exit_process(0)
