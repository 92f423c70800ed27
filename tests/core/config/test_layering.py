"""Layering: built-in defaults < TOML file < ``--section.key=value`` overrides.

Layers merge as plain data and are structured once, so no value (and no default derived from
another field) is fixed before every layer has been applied.
"""

from __future__ import annotations

import attrs

from forge_lm.components import LearningRateOptions
from forge_lm.config import (
    CheckpointSection,
    CliValue,
    ComponentConfig,
    EvalSection,
    ModelSection,
    TrainSection,
    merge,
    parse_overrides,
)
from forge_lm.default_plugins.options.datasets import PythonStdlibOptions
from forge_lm.default_plugins.options.feed_forwards import SwiGLUOptions
from forge_lm.default_plugins.options.losses import CrossEntropyOptions
from forge_lm.default_plugins.options.metrics import ConsoleOptions, JsonlOptions
from forge_lm.default_plugins.options.optimizers import AdamWOptions
from forge_lm.default_plugins.options.schedulers import ConstantOptions, CosineOptions
from forge_lm.plugins import NoOptions

# The resolved default feed-forward layer: a schema default leaves its options unset (None).
SWIGLU = ComponentConfig("swiglu", SwiGLUOptions())
GQA = ComponentConfig("gqa", NoOptions())

# -- defaults ---------------------------------------------------------------------------------


def test_no_file_and_no_overrides_give_every_schema_default(load):
    config = load()
    assert config.model == ComponentConfig("llama", ModelSection(ffn=SWIGLU, attention=GQA))
    assert config.train == TrainSection()
    assert config.tokenizer == ComponentConfig("bytes", NoOptions())
    assert config.data == ComponentConfig("python_stdlib", PythonStdlibOptions())
    assert config.optimizer == ComponentConfig("adamw", AdamWOptions())
    assert config.scheduler == ComponentConfig("cosine", CosineOptions())
    assert config.loss == ComponentConfig("cross_entropy", CrossEntropyOptions())
    assert config.eval == EvalSection()
    assert config.checkpoint == CheckpointSection()
    assert config.metrics.log_interval == 10
    assert config.metrics.peak_flops is None
    assert config.metrics.backends == [
        ComponentConfig("console", ConsoleOptions()),
        ComponentConfig("jsonl", JsonlOptions()),
    ]


def test_an_empty_file_gives_the_same_config_as_no_file(load):
    assert load("") == load()


# -- file over defaults -----------------------------------------------------------------------


def test_a_file_key_replaces_its_default_and_leaves_the_other_keys_of_the_table_at_their_defaults(load):
    config = load(
        """
        [model]
        n_layers = 8
        """
    )
    assert config.model == ComponentConfig("llama", ModelSection(n_layers=8, ffn=SWIGLU, attention=GQA))


def test_a_file_with_options_but_no_name_keeps_the_default_component(load):
    config = load(
        """
        [optimizer]
        lr = 1e-3
        """
    )
    assert config.optimizer == ComponentConfig("adamw", AdamWOptions(lr=1e-3))


# -- overrides over the file ------------------------------------------------------------------


def test_an_override_beats_the_file_value_of_the_same_key(load):
    config = load(
        """
        [model]
        n_layers = 8
        """,
        "--model.n_layers=12",
    )
    assert config.model.options.n_layers == 12


def test_an_override_merges_into_the_file_table_key_by_key(load):
    config = load(
        """
        [optimizer]
        lr = 1e-3
        weight_decay = 0.05
        """,
        "--optimizer.eps=1e-6",
    )
    assert config.optimizer.options == AdamWOptions(lr=1e-3, weight_decay=0.05, eps=1e-6)


def test_an_override_may_set_a_section_the_file_does_not_have(load):
    config = load(
        """
        [model]
        n_layers = 8
        """,
        "--train.max_steps=7",
    )
    assert (config.model.options.n_layers, config.train.max_steps) == (8, 7)


def test_the_last_of_repeated_overrides_of_one_key_wins(load):
    assert load(None, "--train.max_steps=5", "--train.max_steps=9").train.max_steps == 9


def test_an_override_reaches_into_a_metrics_backend_table_of_the_file(load):
    config = load(
        """
        [metrics.console]
        digits = 6

        [metrics.jsonl]
        filename = "m.jsonl"
        """,
        "--metrics.console.digits=2",
    )
    assert config.metrics.backends == [
        ComponentConfig("console", ConsoleOptions(digits=2)),
        ComponentConfig("jsonl", JsonlOptions(filename="m.jsonl")),
    ]


def test_an_override_value_keeps_every_character_after_the_first_equals_sign(load):
    assert load(None, "--train.output_dir=a=b").train.output_dir == "a=b"


# -- switching a component --------------------------------------------------------------------


def test_an_override_switches_the_component_and_the_file_options_go_to_the_new_components_class(load):
    config = load(
        """
        [scheduler]
        warmup_steps = 10
        """,
        "--scheduler.name=constant",
    )
    assert config.scheduler == ComponentConfig("constant", ConstantOptions(warmup_steps=10))


def test_options_of_the_replaced_component_are_dropped_not_rejected(load):
    # Issue 15: a later layer's new name replaces the component; tests/core/config/test_component_change.py
    # covers the notes and the strictness that remains.
    config = load(
        """
        [scheduler]
        name = "cosine"
        min_lr_ratio = 0.2
        """,
        "--scheduler.name=constant",
    )
    assert config.scheduler == ComponentConfig("constant", ConstantOptions())


@attrs.define
class SgdOptions(LearningRateOptions):
    momentum: float = 0.0
    nesterov: bool = False


class SgdPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_optimizers(self, register):
        register("sgd", "sgd_module:build", config=SgdOptions, description="Plain SGD")


def test_an_override_switches_to_a_plugin_optimizer_whose_options_are_typed_by_its_own_class(builtins, load):
    builtins.add_plugin(SgdPlugin(), "sgd")
    config = load(
        """
        [optimizer]
        lr = 0.01
        """,
        "--optimizer.name=sgd",
        "--optimizer.momentum=0.9",
        "--optimizer.nesterov=yes",
    )
    assert config.optimizer == ComponentConfig("sgd", SgdOptions(lr=0.01, momentum=0.9, nesterov=True))


def test_the_file_may_switch_a_component_and_an_override_then_sets_the_new_components_option(builtins, load):
    builtins.add_plugin(SgdPlugin(), "sgd")
    config = load(
        """
        [optimizer]
        name = "sgd"
        """,
        "--optimizer.momentum=0.5",
    )
    assert config.optimizer == ComponentConfig("sgd", SgdOptions(momentum=0.5))


# -- nothing is derived before every layer is applied -----------------------------------------


def test_overriding_n_heads_alone_works_and_kv_heads_follows_it(load):
    model = load(None, "--model.n_heads=8").model.options
    assert (model.n_heads, model.n_kv_heads, model.kv_heads, model.head_size) == (8, None, 8, 32)


def test_a_file_n_heads_without_n_kv_heads_then_an_override_of_n_heads_moves_kv_heads_too(load):
    model = load(
        """
        [model]
        n_heads = 8
        """,
        "--model.n_heads=16",
    ).model.options
    assert (model.n_heads, model.kv_heads) == (16, 16)


def test_file_n_kv_heads_2_and_override_n_heads_8_give_grouped_query_attention(load):
    model = load(
        """
        [model]
        n_kv_heads = 2
        """,
        "--model.n_heads=8",
    ).model.options
    assert (model.n_heads, model.n_kv_heads, model.kv_heads) == (8, 2, 2)


def test_an_override_clears_the_files_n_kv_heads_with_none_and_kv_heads_falls_back_to_n_heads(load):
    model = load(
        """
        [model]
        n_heads = 8
        n_kv_heads = 2
        """,
        "--model.n_kv_heads=none",
    ).model.options
    assert (model.n_kv_heads, model.kv_heads) == (None, 8)


def test_n_heads_not_dividing_dim_names_n_heads_and_both_values(error):
    assert error(None, "--model.n_heads=3") == "[model] n_heads: dim (256) must be divisible by n_heads (3)."


def test_a_dim_override_is_checked_against_the_n_heads_of_the_file(error):
    message = error(
        """
        [model]
        n_heads = 8
        """,
        "--model.dim=100",
    )
    assert message == "[model] n_heads: dim (100) must be divisible by n_heads (8)."


def test_an_n_heads_override_is_checked_against_the_n_kv_heads_of_the_file(error):
    message = error(
        """
        [model]
        n_heads = 8
        n_kv_heads = 8
        """,
        "--model.n_heads=4",
    )
    assert message == "[model] n_kv_heads: n_heads (4) must be divisible by n_kv_heads (8)."


def test_the_cross_section_rule_sees_the_final_value_of_both_sections(load):
    config = load(
        """
        [train]
        seq_len = 4096
        """,
        "--model.max_seq_len=4096",
    )
    assert (config.train.seq_len, config.model.options.max_seq_len) == (4096, 4096)


# -- the merge itself -------------------------------------------------------------------------


def test_merge_layers_tables_key_by_key_and_replaces_other_values():
    base = {"model": {"n_heads": 4, "dim": 128}, "metrics": {"backends": ["console", "jsonl"]}}
    top = {"model": {"n_heads": 8}, "metrics": {"backends": ["jsonl"]}, "train": {"max_steps": 3}}
    assert merge(base, top) == {
        "model": {"n_heads": 8, "dim": 128},
        "metrics": {"backends": ["jsonl"]},
        "train": {"max_steps": 3},
    }


def test_merge_leaves_both_layers_unchanged():
    base = {"model": {"n_heads": 4, "dim": 128}}
    top = {"model": {"n_heads": 8}}
    merge(base, top)
    assert (base, top) == ({"model": {"n_heads": 4, "dim": 128}}, {"model": {"n_heads": 8}})


def test_parse_overrides_builds_nested_tables_of_text_values():
    tree = parse_overrides(["--model.n_heads=8", "--metrics.console.digits=3", "--model.dim=512"])
    assert tree == {"model": {"n_heads": "8", "dim": "512"}, "metrics": {"console": {"digits": "3"}}}
    assert type(tree["model"]["n_heads"]) is CliValue


def test_a_value_in_the_file_cannot_be_extended_by_an_override_into_a_table(error):
    message = error("model = 3\n", "--model.n_heads=8")
    assert message == "[model] is a value in the config file but a table in an override."


def test_each_key_of_one_table_comes_from_the_highest_layer_that_sets_it(load):
    train = load(
        """
        [train]
        max_steps = 50
        batch_size = 4
        """,
        "--train.batch_size=2",
    ).train
    assert train == TrainSection(max_steps=50, batch_size=2, seq_len=128)
