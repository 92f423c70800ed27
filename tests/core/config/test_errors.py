"""Every mistake in a config names where it is and what is right, in an exact message."""

from __future__ import annotations

import importlib.metadata

import pytest

from forge_lm.config import load_config, parse_overrides, read_toml
from forge_lm.errors import ConfigError, UsageError
from forge_lm.plugins import PluginManager, PluginSettings, core_version

CORE = f"forge-lm {core_version()}"
TRAIN_KEYS = (
    "Valid keys: 'activation_checkpointing', 'activation_offload', 'batch_ramp', 'batch_size', 'compile', "
    "'cpu_keep_freed_memory', 'cpu_linear_kernel', 'device', 'grad_accum_steps', 'grad_clip', 'loss_scale', "
    "'max_steps', 'memory_check', 'output_dir', 'precision', 'seed', 'seq_len'"
)


def available(builtins: PluginManager, category: str) -> str:
    """The built-in names of ``category``, quoted as messages list them: ``'a', 'b'``.

    Computed from the registry, so that adding a built-in does not make exact messages stale.
    """
    return ", ".join(f"'{name}'" for name in builtins.registry.names(category))


# -- unknown keys and sections ----------------------------------------------------------------


def test_an_unknown_key_suggests_the_close_one_and_lists_the_valid_keys(error):
    assert error("[model]\nn_head = 8\n") == (
        "[model] n_head: unknown key for model family 'llama'. Did you mean 'n_heads'? "
        "Valid keys: 'attention', 'attention_backend', 'dim', 'ffn', 'head_dim', 'init_std', 'max_seq_len', "
        "'n_heads', 'n_kv_heads', 'n_layers', 'norm', 'norm_eps', 'qk_norm', 'rope_theta', 'tie_embeddings', "
        "'vocab_size'."
    )


def test_an_unknown_key_with_nothing_close_lists_the_valid_keys_only(error):
    assert error("[checkpoint]\ncolour = 1\n") == (
        "[checkpoint] colour: unknown key. Valid keys: 'async_save', 'dir', 'growth', 'init_from', 'interval', "
        "'keep', 'keep_best_metric', 'keep_best_mode', 'keep_best_n', 'keep_every_n_steps', 'keep_last_n', "
        "'max_failed_saves'."
    )


def test_an_unknown_key_given_as_an_override_is_reported_the_same_way(error):
    assert error(None, "--train.step=3") == f"[train] step: unknown key. Did you mean 'max_steps'? {TRAIN_KEYS}."


def test_the_old_name_of_a_renamed_key_suggests_the_new_name(error):
    assert error(None, "--train.steps=3") == f"[train] steps: unknown key. Did you mean 'max_steps'? {TRAIN_KEYS}."


ALL_SECTIONS = (
    "'checkpoint', 'data', 'distributed', 'eval', 'loss', 'metrics', 'model', 'optimizer', 'profiling', 'resilience', "
    "'scheduler', 'tokenizer', 'train', 'transforms'"
)


def test_an_unknown_section_suggests_the_close_one_and_lists_the_sections(error):
    assert error("[modle]\nn_heads = 8\n") == (
        f"[modle]: unknown section. Did you mean 'model'? Valid sections: {ALL_SECTIONS}."
    )


def test_an_unknown_section_given_as_an_override_is_reported_as_a_section(error):
    assert error(None, "--optimiser.lr=1e-3") == (
        f"[optimiser]: unknown section. Did you mean 'optimizer'? Valid sections: {ALL_SECTIONS}."
    )


def test_an_unknown_top_level_value_is_an_unknown_section(error):
    assert error("seed = 3\n") == f"[seed]: unknown section. Valid sections: {ALL_SECTIONS}."


def test_an_unknown_key_in_a_component_section_names_the_component_and_its_keys(error):
    assert error("[optimizer]\nlrr = 1e-3\n") == (
        "[optimizer] lrr: unknown key for optimizer 'adamw'. Did you mean 'lr'? "
        "Valid keys: 'betas', 'decay_embeddings', 'eps', 'implementation', 'lr', 'weight_decay'."
    )


def test_a_component_without_options_rejects_any_option_key(error):
    assert error('[data]\nname = "synthetic"\nshuffle = true\n') == (
        "[data] shuffle: unknown key for dataset 'synthetic'. Valid keys: (none)."
    )


def test_a_misspelt_name_key_of_a_component_section_suggests_name(error):
    # 'name' is a valid key of every component section, so it is a candidate for suggestions.
    assert error('[scheduler]\nnmae = "constant"\n') == (
        "[scheduler] nmae: unknown key for scheduler 'cosine'. Did you mean 'name'? "
        "Valid keys: 'min_lr_ratio', 'warmup_steps'."
    )


# -- validators -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "overrides", "expected"),
    [
        (None, ("--optimizer.lr=-1",), "[optimizer] lr: must be > 0, got -1.0."),
        ("[optimizer]\nlr = 0\n", (), "[optimizer] lr: must be > 0, got 0.0."),
        ("[optimizer]\neps = -1e-8\n", (), "[optimizer] eps: must be > 0, got -1e-08."),
        (None, ("--optimizer.weight_decay=-0.1",), "[optimizer] weight_decay: must be >= 0, got -0.1."),
        (None, ("--scheduler.min_lr_ratio=1.5",), "[scheduler] min_lr_ratio: must be between 0 and 1, got 1.5."),
        (None, ("--scheduler.warmup_steps=-1",), "[scheduler] warmup_steps: must be >= 0, got -1."),
        ("[model]\nn_layers = 0\n", (), "[model] n_layers: must be > 0, got 0."),
        (None, ("--model.n_heads=0",), "[model] n_heads: must be > 0, got 0."),
        (None, ("--model.n_kv_heads=0",), "[model] n_kv_heads: must be > 0, got 0."),
        (None, ("--train.batch_size=-8",), "[train] batch_size: must be > 0, got -8."),
        (None, ("--metrics.log_interval=0",), "[metrics] log_interval: must be > 0, got 0."),
        (None, ("--metrics.peak_flops=0",), "[metrics] peak_flops: must be > 0, got 0.0."),
        (
            None,
            ("--train.precision=fp8",),
            "[train] precision: must be one of 'auto', 'fp32', 'bf16', 'fp16', got 'fp8'.",
        ),
        (None, ("--train.grad_clip=-1",), "[train] grad_clip: must be >= 0, got -1.0."),
        (None, ("--train.grad_accum_steps=0",), "[train] grad_accum_steps: must be > 0, got 0."),
        (None, ("--model.norm=batchnorm",), "[model] norm: must be one of 'rmsnorm', 'layernorm', got 'batchnorm'."),
        (None, ("--model.ffn.multiple_of=0",), "[model.ffn] multiple_of: must be > 0, got 0."),
        ("[eval]\ninterval = -1\n", (), "[eval] interval: must be >= 0, got -1."),
        (None, ("--checkpoint.interval=-5",), "[checkpoint] interval: must be >= 0, got -5."),
        ("[metrics.console]\ndigits = 0\n", (), "[metrics.console] digits: must be > 0, got 0."),
    ],
)
def test_a_value_a_validator_rejects_is_reported_with_section_key_rule_and_value(error, toml, overrides, expected):
    assert error(toml, *overrides) == expected


def test_n_kv_heads_not_dividing_n_heads_names_n_kv_heads(error):
    assert error(None, "--model.n_heads=8", "--model.n_kv_heads=3") == (
        "[model] n_kv_heads: n_heads (8) must be divisible by n_kv_heads (3)."
    )


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        (("--model.dim=24", "--model.n_heads=8"), "[model] n_heads: dim / n_heads = 3 must be even for RoPE."),
        (("--model.dim=64", "--model.n_heads=64"), "[model] n_heads: dim / n_heads = 1 must be even for RoPE."),
    ],
)
def test_an_odd_head_dim_names_n_heads_and_the_head_dim(error, overrides, expected):
    assert error(None, *overrides) == expected


def test_more_kv_heads_than_heads_is_an_error(error):
    assert error(None, "--model.n_kv_heads=8") == (
        "[model] n_kv_heads: n_heads (4) must be divisible by n_kv_heads (8)."
    )


def test_train_seq_len_above_model_max_seq_len_is_a_cross_section_error(error):
    assert error("[train]\nseq_len = 4096\n") == (
        "[train] seq_len: 4096 exceeds [model] max_seq_len (2048); lower seq_len or raise max_seq_len."
    )


def test_train_seq_len_equal_to_max_seq_len_is_valid(load):
    assert load(None, "--train.seq_len=2048").train.seq_len == 2048


# -- sections and values in the wrong place ---------------------------------------------------


@pytest.mark.parametrize(
    ("toml", "overrides", "expected"),
    [
        ("model = 3\n", (), "[model] must be a table with a 'name' key, got integer 3."),
        ('train = "x"\n', (), "[train] must be a table, got string 'x'."),
        (None, ("--model=3",), "[model] must be a table with a 'name' key, got '3'."),
        (None, ("--optimizer=adamw",), "[optimizer] must be a table with a 'name' key, got 'adamw'."),
        ('optimizer = "adamw"\n', (), "[optimizer] must be a table with a 'name' key, got string 'adamw'."),
        ("[metrics]\nconsole = 3\n", (), "[metrics.console] must be a table, got integer 3."),
        (None, ("--model.n_heads.x=1",), "[model] n_heads: expected a value, got a table."),
        ("[model.n_heads]\nx = 1\n", (), "[model] n_heads: expected a value, got a table."),
    ],
)
def test_a_section_given_as_a_value_or_a_value_given_as_a_table_is_an_error(error, toml, overrides, expected):
    assert error(toml, *overrides) == expected


# -- malformed overrides ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "arg",
    ["--model.n_heads", "model.n_heads=8", "-model.n_heads=8", "--model..n_heads=8", "--.n_heads=8", "--=8"],
)
def test_a_malformed_override_is_a_usage_error_showing_the_right_form(arg):
    with pytest.raises(UsageError) as info:
        parse_overrides([arg])
    assert str(info.value) == f"'{arg}' is not an override; write --section.key=value (e.g. --model.n_heads=8)."


def test_load_config_reports_a_malformed_override_as_a_usage_error(error):
    message = error(None, "--model.n_heads", kind=UsageError)
    assert message == "'--model.n_heads' is not an override; write --section.key=value (e.g. --model.n_heads=8)."


def test_an_override_inside_a_key_that_an_earlier_override_set_is_a_usage_error():
    with pytest.raises(UsageError) as info:
        parse_overrides(["--model.n_heads=8", "--model.n_heads.x=1"])
    assert (
        str(info.value)
        == "'--model.n_heads.x=1' sets a key inside 'n_heads', which an earlier override set to a value."
    )


# -- the config file itself -------------------------------------------------------------------


def test_a_missing_config_file_is_named(tmp_path, builtins):
    path = tmp_path / "nope.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path, [], builtins.registry)
    assert str(info.value) == f"config file '{path}' does not exist."


def test_a_directory_given_as_the_config_file_cannot_be_read(tmp_path):
    with pytest.raises(ConfigError) as info:
        read_toml(tmp_path)
    assert str(info.value) == f"config file '{tmp_path}' cannot be read: Is a directory."


@pytest.mark.parametrize(
    ("text", "detail"),
    [
        ("[model\nn_heads = 4\n", "Expected ']' at the end of a table declaration (at line 1, column 7)"),
        ("n_heads 4\n", "Expected '=' after a key in a key/value pair (at line 1, column 9)"),
        ("[model]\nn_heads = 4\nn_heads = 8\n", "Cannot overwrite a value (at line 3, column 12)"),
    ],
)
def test_a_file_that_is_not_valid_toml_is_named_with_the_parsers_position(write_toml, text, detail):
    path = write_toml(text)
    with pytest.raises(ConfigError) as info:
        read_toml(path)
    assert str(info.value) == f"config file '{path}' is not valid TOML: {detail}."


def test_a_file_that_is_not_utf8_is_a_config_error_naming_the_file(tmp_path):
    path = tmp_path / "latin1.toml"
    path.write_bytes('[train]\noutput_dir = "caf\u00e9"\n'.encode("latin-1"))
    with pytest.raises(ConfigError) as info:
        read_toml(path)
    assert str(info.value).startswith(f"config file '{path}' is not valid TOML: ")
    assert "UTF-8" in str(info.value)


# -- unknown component names ------------------------------------------------------------------


def test_an_unknown_component_names_section_and_key_suggests_and_lists_the_available_ones(builtins, error):
    assert error('[optimizer]\nname = "adamx"\n') == (
        "[optimizer] name = 'adamx': unknown optimizer 'adamx'. Did you mean 'adamw'?\n"
        f"Available optimizers: {available(builtins, 'optimizers')}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' ({CORE})."
    )


def test_an_unknown_feed_forward_layer_in_model_ffn_lists_the_available_ones(builtins, error):
    assert error('[model.ffn]\nname = "nope"\n') == (
        "[model.ffn] name = 'nope': unknown feed-forward layer 'nope'.\n"
        f"Available feed-forward layers: {available(builtins, 'feed_forwards')}.\n"
        f"Installed plugins offering feed-forward layers: plugin 'core.feed_forwards' ({CORE})."
    )


def test_an_unknown_component_given_as_an_override_without_a_close_match_lists_the_available_ones(builtins, error):
    assert error(None, "--scheduler.name=exponential") == (
        "[scheduler] name = 'exponential': unknown scheduler 'exponential'.\n"
        f"Available schedulers: {available(builtins, 'schedulers')}.\n"
        f"Installed plugins offering schedulers: plugin 'core.schedulers' ({CORE})."
    )


def test_a_known_first_party_component_that_is_not_installed_names_the_package_to_install(builtins, error):
    assert error(None, "--optimizer.name=muon") == (
        "[optimizer] name = 'muon': unknown optimizer 'muon'.\n"
        f"Available optimizers: {available(builtins, 'optimizers')}.\n"
        f"Installed plugins offering optimizers: plugin 'core.optimizers' ({CORE}).\n"
        "'muon' is provided by the package forge-optim-muon: pip install forge-optim-muon"
    )


def test_an_unknown_metrics_backend_names_the_backends_key_that_lists_it(builtins, error):
    # The user wrote [metrics] backends; there is no [metrics.wandb] table nor a name key in it.
    assert error(None, '--metrics.backends=["console", "wandb"]') == (
        "[metrics] backends: unknown metrics backend 'wandb'.\n"
        f"Available metrics backends: {available(builtins, 'metrics_backends')}.\n"
        f"Installed plugins offering metrics backends: plugin 'core.metrics' ({CORE}).\n"
        "'wandb' is provided by the package forge-wandb: pip install forge-wandb"
    )


def _wandb() -> str:
    return f"plugin 'wandb' (forge-wandb {importlib.metadata.version('forge-wandb')})"


def test_first_party_components_validate_once_their_plugins_are_loaded(load):
    config = load(
        None, '--metrics.backends=["wandb"]', "--optimizer.name=muon", manager=PluginManager(PluginSettings())
    )
    assert (config.metrics.backends[0].name, config.optimizer.name) == ("wandb", "muon")


def test_an_installed_provider_that_lacks_the_component_is_told_to_upgrade(error, fake_site, monkeypatch):
    from forge_lm.plugins import _hints

    monkeypatch.setitem(_hints.KNOWN_PROVIDERS, "optimizers", {"zeta": "forge-zeta"})
    fake_site.install("forge-zeta", 'FORGE_LM_PLUGIN_API = ">=1,<2"\n', version="0.1")
    message = error(None, "--optimizer.name=zeta", manager=PluginManager(PluginSettings(allow=("zeta",))))
    assert message.splitlines()[-1] == (
        "plugin 'zeta' (forge-zeta 0.1) is installed but does not provide it; a newer release may: "
        "pip install --upgrade forge-zeta"
    )


def test_wandb_backend_with_autoloading_off_says_the_installed_plugin_is_disabled(builtins, error):
    message = error(None, '--metrics.backends=["wandb"]', manager=PluginManager(PluginSettings(autoload=False)))
    assert message.splitlines() == [
        f"[metrics] backends: metrics backend 'wandb' is provided by {_wandb()}, which is installed but disabled: "
        "plugin autoloading is off (FORGE_LM_DISABLE_PLUGIN_AUTOLOAD or --no-plugin-autoload). Enable it to use "
        "its components.",
        f"Available metrics backends: {available(builtins, 'metrics_backends')}.",
        f"Installed plugins offering metrics backends: plugin 'core.metrics' ({CORE}).",
    ]


def test_a_component_qualified_by_the_wrong_distribution_names_the_real_provider(error):
    assert error(None, "--optimizer.name=forge-moe:adamw") == (
        "[optimizer] name = 'forge-moe:adamw': optimizer 'adamw' is not provided by a distribution named "
        f"'forge-moe'; it is provided by {CORE} (plugin 'core.optimizers')."
    )
