"""``to_data`` / ``to_toml``: a resolved config as TOML that loads back to an equal config."""

from __future__ import annotations

import tomllib

import attrs
import pytest

from forge_lm.config import load_config, structure_config, to_data, to_toml


@attrs.define
class ClipOptions:
    max_norm: float = 1.0
    note: str | None = None  # optional fields default to None: a TOML file cannot say none


class ClipLossPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_losses(self, register):
        register("clipped", "fake_clip:build", config=ClipOptions, description="Loss with gradient clipping")


def reload(config, registry):
    """``config`` written as TOML and loaded again."""
    return structure_config(tomllib.loads(to_toml(config)), registry)


NON_DEFAULT_TOML = """
[model]
dim = 512
n_layers = 6
n_heads = 8
n_kv_heads = 2
vocab_size = 32000
max_seq_len = 4096
rope_theta = 500000.0
norm = "layernorm"
norm_eps = 1e-6
qk_norm = true
tie_embeddings = false
init_std = 0.01

[model.ffn]
hidden_multiplier = 3.5
multiple_of = 128

[train]
output_dir = "/tmp/runs/café run"
seed = 7
max_steps = 1000
batch_size = 8
seq_len = 1024
grad_accum_steps = 4
grad_clip = 0.5
device = "cpu"
precision = "bf16"
compile = true

[optimizer]
name = "forge-lm:adamw"
lr = 1e-3
betas = [0.8, 0.99]
decay_embeddings = true

[scheduler]
name = "constant"
warmup_steps = 50

[eval]
interval = 50
steps = 8

[checkpoint]
interval = 250

[metrics]
log_interval = 5
peak_flops = 1e15
backends = ["jsonl", "console"]

[metrics.jsonl]
filename = "m.jsonl"
"""


def test_the_default_config_round_trips_through_toml(load, builtins):
    config = load()
    assert reload(config, builtins.registry) == config


def test_a_non_default_config_round_trips_through_toml(load, builtins):
    config = load(NON_DEFAULT_TOML, "--model.n_layers=12", "--metrics.console.digits=2")
    assert reload(config, builtins.registry) == config


def test_a_dumped_config_written_to_a_file_loads_back_equal(load, builtins, tmp_path):
    config = load(NON_DEFAULT_TOML)
    path = tmp_path / "dumped.toml"
    path.write_text(to_toml(config), encoding="utf-8")
    assert load_config(path, [], builtins.registry) == config


def test_a_plugin_components_options_round_trip(builtins, load):
    builtins.add_plugin(ClipLossPlugin(), "clip")
    config = load(None, "--loss.name=clipped", "--loss.max_norm=0.5", "--loss.note=x")
    assert config.loss.options == ClipOptions(max_norm=0.5, note="x")
    assert reload(config, builtins.registry) == config


def test_a_plugin_option_left_unset_round_trips(builtins, load):
    builtins.add_plugin(ClipLossPlugin(), "clip")
    config = load(None, "--loss.name=clipped")
    assert to_data(config)["loss"] == {"name": "clipped", "max_norm": 1.0}
    assert reload(config, builtins.registry) == config


def test_unset_optional_values_are_left_out_of_the_dump(load):
    model = to_data(load())["model"]
    assert "n_kv_heads" not in model
    assert "vocab_size" not in model
    assert "peak_flops" not in to_data(load())["metrics"]
    assert "n_kv_heads = " not in to_toml(load())


def test_set_optional_values_are_written(load):
    assert to_data(load(None, "--model.n_kv_heads=2", "--model.vocab_size=1000"))["model"] == {
        "name": "llama",
        "dim": 256,
        "n_layers": 4,
        "n_heads": 4,
        "n_kv_heads": 2,
        "vocab_size": 1000,
        "max_seq_len": 2048,
        "rope_theta": 10000.0,
        "norm": "rmsnorm",
        "norm_eps": 1e-5,
        "qk_norm": False,
        "tie_embeddings": True,
        "init_std": 0.02,
        "attention_backend": "auto",
        "ffn": {"name": "swiglu", "hidden_multiplier": 8 / 3, "multiple_of": 64},
        "attention": {"name": "gqa"},
    }


def test_a_dumped_default_config_does_not_pin_kv_heads_so_a_later_n_heads_override_still_moves_it(load, write_toml):
    path = write_toml(to_toml(load()), name="dumped.toml")
    model = load(path.read_text(encoding="utf-8"), "--model.n_heads=8").model.options
    assert (model.n_heads, model.kv_heads) == (8, 8)


def test_component_sections_dump_as_name_then_options(load):
    data = to_data(load(None, "--scheduler.warmup_steps=10"))
    assert data["scheduler"] == {"name": "cosine", "warmup_steps": 10, "min_lr_ratio": 0.1}
    assert list(data["scheduler"]) == ["name", "warmup_steps", "min_lr_ratio"]
    assert data["loss"] == {"name": "cross_entropy", "z_loss_weight": 0.0}
    assert data["tokenizer"] == {"name": "bytes"}


def test_metrics_backends_dump_as_a_name_list_and_one_table_per_backend_with_options(load):
    assert to_data(load(None, '--metrics.backends=["forge-lm:jsonl", "console"]'))["metrics"] == {
        "log_interval": 10,
        "backends": ["forge-lm:jsonl", "console"],
        "jsonl": {"filename": "metrics.jsonl"},
        "console": {"digits": 4, "smoothing": 0.9},
    }


def test_the_dump_is_toml_with_one_table_per_section(load):
    parsed = tomllib.loads(to_toml(load()))
    assert list(parsed) == [
        "model",
        "train",
        "tokenizer",
        "data",
        "optimizer",
        "scheduler",
        "loss",
        "eval",
        "checkpoint",
        "resilience",
        "metrics",
        "distributed",
        "profiling",
    ]
    assert parsed["optimizer"]["betas"] == [0.9, 0.95]


@pytest.mark.parametrize("name", ["123", "true", 'with "quotes"', "naïve\tname"])
def test_string_values_that_look_like_other_types_round_trip_as_strings(load, builtins, name):
    config = load(None, f"--train.output_dir={name}")
    reloaded = reload(config, builtins.registry)
    assert (reloaded.train.output_dir, type(reloaded.train.output_dir)) == (name, str)


def test_a_component_selected_by_qualified_name_dumps_that_name(load):
    config = load(None, "--optimizer.name=forge-lm:adamw")
    assert to_data(config)["optimizer"] == {
        "name": "forge-lm:adamw",
        "lr": 3e-4,
        "betas": [0.9, 0.95],
        "eps": 1e-8,
        "weight_decay": 0.1,
        "decay_embeddings": False,
        "implementation": "auto",
    }
