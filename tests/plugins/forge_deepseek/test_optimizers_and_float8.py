"""forge-optim-muon and forge-float8 on a deepseek_v3 model: Muon takes every MLA and MTP matrix
and the stacked experts, AdamW the rest, and training falls; float8 converts the MLA and MTP
projections whose sizes it can take and the model still trains (emulated float8 on a CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from forge_lm.config import load_config
from forge_lm.losses.aux import collect_aux
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.model import build_model
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train import train

REPO = Path(__file__).resolve().parents[3]
DEBUG = REPO / "configs" / "deepseek_debug.toml"
SMALL = ["--train.batch_size=2", "--train.seq_len=32", "--eval.interval=0", "--metrics.log_interval=1"]


@pytest.fixture(scope="module")
def manager():
    return PluginManager(PluginSettings(allow=("moe", "deepseek", "muon", "float8")))


def test_muon_trains_a_deepseek_v3_model_with_its_matrices_on_muon(manager, tmp_path, capsys):
    overrides = [*SMALL, "--optimizer.name=muon", "--optimizer.lr=0.02", "--train.max_steps=8"]
    config = load_config(DEBUG, [*overrides, f"--train.output_dir={tmp_path / 'run'}"], manager.registry)
    run_dir = train(config, manager).run_dir
    report = capsys.readouterr()
    split = report.out + report.err
    # 4 trunk blocks and 1 MTP block: 5 x 5 MLA matrices (q_lora: wq_a, wq_b), 1 dense and 4 shared-expert
    # SwiGLUs (3 each), the MTP projection: 41 matrices; 4 MoE layers x 3 stacked expert tensors: 12.
    assert "muon: Muon: 53 tensors" in split
    assert "(41 hidden matrix, 12 stacked matrices)" in split
    assert "1 embedding, 1 output head, 4 router" in split
    losses = [r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r]
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5


def test_float8_converts_mla_and_mtp_projections_and_the_model_still_trains(manager):
    from forge_float8.convert import convert
    from forge_float8.options import Float8Options

    config = load_config(DEBUG, ["--model.dim=64", "--model.n_layers=2"], manager.registry)
    torch.manual_seed(0)
    model = build_model(config.model, 256, manager.registry).train()
    reference = build_model(config.model, 256, manager.registry).train()
    reference.load_state_dict(model.state_dict())
    plan = convert(model, Float8Options(enabled=True))
    converted = set(plan.converted)
    assert {
        "layers.0.attention.wq_a",
        "layers.0.attention.wo",
        "mtp.0.eh_proj",
        "mtp.0.block.attention.wkv_b",
    } <= converted
    assert "output" not in converted
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with collect_aux() as ours, torch.no_grad():
        logits = model(ids)
    with collect_aux() as theirs, torch.no_grad():
        expected = reference(ids)
    # float8 rounds each product's inputs to 3 mantissa bits: close, not equal.
    assert (logits - expected).norm() / expected.norm() < 0.1
    assert not torch.equal(logits, expected)
    assert ours.losses["mtp_loss"] == pytest.approx(theirs.losses["mtp_loss"].item(), rel=0.05)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    first = None
    for _ in range(4):
        with collect_aux() as collector:
            loss = torch.nn.functional.cross_entropy(model(ids[:, :-1]).flatten(0, 1), ids[:, 1:].flatten())
        (loss + collector.total()).backward()
        optimizer.step()
        optimizer.zero_grad()
        first = loss.item() if first is None else first
    assert loss.item() < first - 0.3
