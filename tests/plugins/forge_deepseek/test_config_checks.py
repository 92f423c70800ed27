"""Layouts and settings a deepseek_v3 model cannot run are refused by ``forge config validate``,
before anything is built, each naming what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from forge_lm.cli import main

DEBUG = Path(__file__).resolve().parents[3] / "configs" / "deepseek_debug.toml"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["--distributed.pp=2", "--train.grad_accum_steps=2"],
            "[distributed] pp = 2 cannot split a deepseek_v3 model with [model] mtp_depth = 1",
        ),
        (["--model.ffn.first_moe_layer=2"], "the deepseek_v3 family places its MoE layers itself"),
        (["--model.ffn.every_n_layers=2"], "leave both unset, and set n_dense_layers instead"),
        (["--distributed.tp=2"], "MultiHeadLatentAttention defines no tensor_parallel_plan()"),
        (
            ["--distributed.cp=2"],
            "cp = 2: the blocks' attention layer MultiHeadLatentAttention does not gather keys and values across ranks",
        ),
        (["--model.n_dense_layers=5"], "n_dense_layers: must be at most n_layers (4), got 5"),
        (["--model.attention.qk_rope_head_dim=7"], "qk_rope_head_dim: must be even"),
        (["--model.qk_norm=true"], "[model] qk_norm = true has no effect with [model.attention] name = 'mla'"),
        (["--model.n_kv_heads=2"], "[model] n_kv_heads = 2 has no effect with [model.attention] name = 'mla'"),
    ],
    ids=["pp_with_mtp", "first_moe_layer", "every_n_layers", "tp", "cp", "n_dense_layers", "odd_rope", "qk_norm", "kv"],
)
def test_config_validate_refuses_what_deepseek_v3_cannot_run(overrides, message, capsys):
    assert main(["config", "validate", str(DEBUG), "--plugins", "moe,deepseek", *overrides]) == 2
    assert message in capsys.readouterr().err


def test_config_validate_accepts_the_layouts_it_can_run(capsys):
    for overrides in ([], ["--distributed.pp=2", "--train.grad_accum_steps=2", "--model.mtp_depth=0"]):
        assert main(["config", "validate", str(DEBUG), "--plugins", "moe,deepseek", *overrides]) == 0
    assert "is valid" in capsys.readouterr().out
