"""Component sections: ``name`` selects a registered component, the other keys are its options.

Options are validated and typed by the component's own attrs class, so a third-party plugin
brings typed options without any change to the core. ``[metrics] backends`` selects several
components, each configured in its own ``[metrics.<backend>]`` table.
"""

from __future__ import annotations

import dataclasses

import attrs
import pytest
import torch

from forge_lm.config import ComponentConfig, ForgeConfig
from forge_lm.default_plugins.options.feed_forwards import SwiGLUOptions
from forge_lm.default_plugins.options.metrics import ConsoleOptions, JsonlOptions
from forge_lm.default_plugins.options.optimizers import AdamWOptions
from forge_lm.errors import ConfigError
from forge_lm.plugins import NoOptions, PluginManager, PluginSettings, PluginStatus, core_version
from forge_lm.validators import non_negative, one_of

CORE = f"forge-lm {core_version()}"


@attrs.define
class FocalOptions:
    gamma: float = attrs.field(validator=non_negative)  # required: no default
    reduction: str = attrs.field(default="mean", validator=one_of("mean", "sum"))
    ignore_index: int | None = None


@attrs.define
class SmoothedOptions:
    smoothing: float = 0.1
    mode: str = attrs.field(default="uniform", validator=attrs.validators.in_(["uniform", "unigram"]))


@attrs.define
class CsvOptions:
    path: str  # required: no default
    every: int = 1


class LossesPlugin:
    """A third-party plugin object, as ``manager.add_plugin`` takes it."""

    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_losses(self, register):
        register("focal", "fake_losses:build_focal", config=FocalOptions, description="Focal loss")
        register("smoothed", "fake_losses:build_smoothed", config=SmoothedOptions, description="Label smoothing")


class CsvPlugin:
    FORGE_LM_PLUGIN_API = ">=1,<2"

    def forge_lm_register_metrics_backends(self, register):
        register("csv", "fake_csv:build", config=CsvOptions, description="Metrics as CSV rows")


@pytest.fixture
def with_losses(builtins):
    info = builtins.add_plugin(LossesPlugin(), "losses")
    assert info.status is PluginStatus.OK, info.reason
    return builtins


@pytest.fixture
def with_csv(builtins):
    info = builtins.add_plugin(CsvPlugin(), "csv")
    assert info.status is PluginStatus.OK, info.reason
    return builtins


# -- built-in components ----------------------------------------------------------------------


def test_a_component_section_absent_from_every_layer_still_gets_its_default_components_options(load):
    assert load().optimizer == ComponentConfig("adamw", AdamWOptions())


def test_a_builtin_components_options_are_typed_by_its_options_class(error):
    assert error("[metrics.console]\ndigits = 4.0\n") == "[metrics.console] digits: expected an integer, got float 4.0."


def test_a_component_without_options_gets_a_no_options_object(load):
    assert load('[data]\nname = "synthetic"\n').data == ComponentConfig("synthetic", NoOptions())


def test_a_component_may_be_selected_by_its_qualified_distribution_name(load):
    assert load(None, "--optimizer.name=forge-lm:adamw", "--optimizer.lr=0.01").optimizer == ComponentConfig(
        "forge-lm:adamw", AdamWOptions(lr=0.01)
    )


# -- a component section inside a section: [model.ffn] ---------------------------------------


def test_the_feed_forward_layer_defaults_to_swiglu_with_its_default_options(load):
    assert load().model.options.ffn == ComponentConfig("swiglu", SwiGLUOptions())


def test_an_override_of_a_feed_forward_option_reaches_the_swiglu_options(load):
    ffn = load(None, "--model.ffn.hidden_multiplier=3").model.options.ffn
    assert ffn == ComponentConfig("swiglu", SwiGLUOptions(hidden_multiplier=3.0))
    assert type(ffn.options.hidden_multiplier) is float


def test_a_file_model_ffn_table_and_an_override_of_another_model_key_merge(load):
    model = load(
        """
        [model]
        dim = 512

        [model.ffn]
        name = "swiglu"
        multiple_of = 128
        """,
        "--model.ffn.hidden_multiplier=4",
    ).model.options
    assert (model.dim, model.ffn) == (512, ComponentConfig("swiglu", SwiGLUOptions(4.0, 128)))


def test_an_unknown_key_in_model_ffn_names_the_feed_forward_layer_and_its_keys(error):
    assert error(None, "--model.ffn.hidden_mult=3") == (
        "[model.ffn] hidden_mult: unknown key for feed-forward layer 'swiglu'. Did you mean 'hidden_multiplier'? "
        "Valid keys: 'hidden_multiplier', 'multiple_of'."
    )


# -- third-party components -------------------------------------------------------------------


def test_a_plugin_component_brings_its_own_typed_options(with_losses, load):
    config = load(None, "--loss.name=focal", "--loss.gamma=2", "--loss.ignore_index=-100")
    assert config.loss == ComponentConfig("focal", FocalOptions(gamma=2.0, ignore_index=-100))
    assert type(config.loss.options.gamma) is float


def test_a_plugin_components_options_come_from_the_file_like_any_others(with_losses, load):
    config = load(
        """
        [loss]
        name = "focal"
        gamma = 1.5
        reduction = "sum"
        """
    )
    assert config.loss == ComponentConfig("focal", FocalOptions(gamma=1.5, reduction="sum"))


def test_a_plugin_components_unknown_option_names_the_component_and_its_keys(with_losses, error):
    assert error(None, "--loss.name=focal", "--loss.gamma=2", "--loss.gama=3") == (
        "[loss] gama: unknown key for loss 'focal'. Did you mean 'gamma'? "
        "Valid keys: 'gamma', 'ignore_index', 'reduction'."
    )


def test_a_plugin_components_required_option_left_unset_is_named_with_its_component(with_losses, error):
    assert error(None, "--loss.name=focal") == "[loss] gamma: required by loss 'focal', but not set."


def test_a_plugin_components_option_of_the_wrong_type_is_an_error(with_losses, error):
    assert error('[loss]\nname = "focal"\ngamma = "2"\n') == "[loss] gamma: expected a number, got string '2'."


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("--loss.gamma=-1", "[loss] gamma: must be >= 0, got -1.0."),
        ("--loss.reduction=max", "[loss] reduction: must be one of 'mean', 'sum', got 'max'."),
    ],
)
def test_a_plugin_options_validators_from_forge_lm_validators_give_placed_messages(
    with_losses, error, override, expected
):
    assert error(None, "--loss.name=focal", "--loss.gamma=1", override) == expected


def test_a_plugin_options_standard_attrs_validator_gives_its_message_not_a_tuple(with_losses, error):
    # attrs validators raise ValueError(message, attribute, options, value); only the message is for users.
    assert error(None, "--loss.name=smoothed", "--loss.mode=zipf") == (
        "[loss]: 'mode' must be in ['uniform', 'unigram'] (got 'zipf')."
    )


def test_a_plugin_from_an_installed_distribution_brings_typed_options_through_its_entry_point(fake_site, load):
    fake_site.install(
        "forge-lamb",
        """
        import attrs
        from forge_lm import hookimpl
        from forge_lm.components import LearningRateOptions

        FORGE_LM_PLUGIN_API = ">=1,<2"

        @attrs.define
        class LambOptions(LearningRateOptions):
            beta: float = 0.9

        @hookimpl
        def forge_lm_register_optimizers(register):
            register("lamb", "forge_lamb:build", config=LambOptions, description="LAMB")
        """,
    )
    manager = PluginManager(PluginSettings(allow=("lamb",)))
    config = load(None, "--optimizer.name=lamb", "--optimizer.beta=0.99", "--optimizer.lr=1e-4", manager=manager)
    assert config.optimizer.name == "lamb"
    assert type(config.optimizer.options).__name__ == "LambOptions"
    assert attrs.asdict(config.optimizer.options) == {"lr": 1e-4, "beta": 0.99}


def test_a_component_from_two_distributions_must_be_chosen_by_qualified_name(builtins, error, load):
    @attrs.define
    class OtherAdamW:
        lr: float = 1e-3
        fused: bool = True

    class OtherPlugin:
        FORGE_LM_PLUGIN_API = ">=1,<2"

        def forge_lm_register_optimizers(self, register):
            register("adamw", "other:build", config=OtherAdamW, description="Another AdamW")

    builtins.add_plugin(OtherPlugin(), "other", distribution="forge-other", version="2.0")
    assert error() == (
        "[optimizer] name = 'adamw': optimizer 'adamw' is provided by 2 distributions: "
        f"{CORE} (plugin 'core.optimizers') and forge-other 2.0 (plugin 'other'). "
        'Choose one: name = "forge-lm:adamw" or name = "forge-other:adamw".'
    )
    config = load(None, "--optimizer.name=forge-other:adamw", "--optimizer.fused=false")
    assert config.optimizer == ComponentConfig("forge-other:adamw", OtherAdamW(fused=False))


def test_a_component_of_an_incompatible_plugin_cannot_be_selected(builtins, error):
    class FuturePlugin:
        FORGE_LM_PLUGIN_API = ">=2"

        def forge_lm_register_losses(self, register):
            register("future", "future:build", description="From the future")

    builtins.add_plugin(FuturePlugin(), "future", distribution="forge-future", version="3.0")
    assert error(None, "--loss.name=future") == (
        "[loss] name = 'future': loss 'future' comes from plugin 'future' (forge-future 3.0), which is "
        "incompatible: supports plugin API >=2 but this core provides 1.4; install a release of the plugin "
        "made for this core, or a core that provides API >=2."
    )


# -- [metrics] backends -----------------------------------------------------------------------


def test_metrics_backends_keep_the_listed_order_and_each_gets_its_own_table(load):
    config = load(
        """
        [metrics]
        backends = ["jsonl", "console"]

        [metrics.jsonl]
        filename = "train.jsonl"

        [metrics.console]
        digits = 6
        """
    )
    assert config.metrics.backends == [
        ComponentConfig("jsonl", JsonlOptions(filename="train.jsonl")),
        ComponentConfig("console", ConsoleOptions(digits=6)),
    ]


def test_a_backend_table_configures_a_backend_of_the_default_list(load):
    config = load("[metrics.jsonl]\nfilename = 'x.jsonl'\n")
    assert config.metrics.backends == [
        ComponentConfig("console", ConsoleOptions()),
        ComponentConfig("jsonl", JsonlOptions(filename="x.jsonl")),
    ]


def test_a_plugin_metrics_backend_gets_its_options_from_its_table(with_csv, load):
    config = load(
        """
        [metrics]
        backends = ["console", "csv"]

        [metrics.csv]
        path = "metrics.csv"
        """,
        "--metrics.csv.every=5",
    )
    assert config.metrics.backends == [
        ComponentConfig("console", ConsoleOptions()),
        ComponentConfig("csv", CsvOptions(path="metrics.csv", every=5)),
    ]


def test_a_plugin_metrics_backend_with_a_required_option_and_no_table_is_named(with_csv, error):
    assert error(None, '--metrics.backends=["csv"]') == (
        "[metrics.csv] path: required by metrics backend 'csv', but not set."
    )


def test_an_unknown_key_in_a_backend_table_names_the_backend(error):
    assert error("[metrics.console]\ndigit = 3\n") == (
        "[metrics.console] digit: unknown key for metrics backend 'console'. Did you mean 'digits'? "
        "Valid keys: 'digits', 'smoothing'."
    )


def test_a_table_for_a_backend_that_is_not_selected_is_an_error_not_silently_unused(error):
    assert error(
        """
        [metrics]
        backends = ["jsonl"]

        [metrics.console]
        digits = 3
        """
    ) == (
        "[metrics.console] configures the metrics backend 'console', which metrics.backends does not select; "
        "add it to metrics.backends or remove the table."
    )


def test_an_override_that_drops_a_backend_the_file_configures_is_an_error(error):
    message = error("[metrics.console]\ndigits = 3\n", '--metrics.backends=["jsonl"]')
    assert message == (
        "[metrics.console] configures the metrics backend 'console', which metrics.backends does not select; "
        "add it to metrics.backends or remove the table."
    )


def test_a_table_for_a_plugin_backend_that_is_not_selected_is_an_error(with_csv, error):
    assert error("[metrics.csv]\npath = 'm.csv'\n") == (
        "[metrics.csv] configures the metrics backend 'csv', which metrics.backends does not select; "
        "add it to metrics.backends or remove the table."
    )


def test_a_table_named_after_no_registered_backend_is_an_unknown_key_of_metrics(error):
    assert error("[metrics.wandb]\nproject = 'x'\n") == (
        "[metrics] wandb: unknown key. Valid keys: 'backends', 'log_interval', 'peak_flops'."
    )


def test_a_backend_listed_twice_is_an_error(error):
    assert error(None, '--metrics.backends=["console", "jsonl", "console"]') == (
        "[metrics] backends: lists a metrics backend twice: ['console', 'jsonl', 'console']."
    )


def test_a_backend_listed_twice_once_by_its_qualified_name_is_an_error(error):
    # Both entries are the same backend configured by the same [metrics.console] table.
    assert error(None, '--metrics.backends=["console", "forge-lm:console"]') == (
        "[metrics] backends: lists a metrics backend twice: ['console', 'forge-lm:console']."
    )


def test_an_empty_backends_list_selects_no_backend(load):
    assert load(None, "--metrics.backends=[]").metrics.backends == []


# -- plugins checking the resolved config -----------------------------------------------------


class StrictFocalPlugin(LossesPlugin):
    """Rejects focal loss with a high learning rate, as a plugin's configure hook may."""

    def __init__(self) -> None:
        self.seen: list[ForgeConfig] = []

    def forge_lm_configure(self, config):
        self.seen.append(config)
        if config.loss.name == "focal" and config.optimizer.options.lr > 0.01:
            raise ConfigError(f"[loss] name = 'focal' needs [optimizer] lr <= 0.01, got {config.optimizer.options.lr}.")


def test_a_plugins_configure_hook_gets_the_resolved_config_once_and_may_accept_it(builtins, load):
    plugin = StrictFocalPlugin()
    builtins.add_plugin(plugin, "strict")
    config = load(None, "--loss.name=focal", "--loss.gamma=2", "--optimizer.lr=0.001")
    builtins.configure(config)
    assert plugin.seen == [config]


def test_a_plugins_configure_hook_rejects_a_combination_with_a_config_error(builtins, load):
    builtins.add_plugin(StrictFocalPlugin(), "strict")
    config = load(None, "--loss.name=focal", "--loss.gamma=2", "--optimizer.lr=0.1")
    with pytest.raises(ConfigError) as info:
        builtins.configure(config)
    assert str(info.value) == "[loss] name = 'focal' needs [optimizer] lr <= 0.01, got 0.1."


def test_a_selected_component_builds_itself_and_a_failing_factory_names_it(load):
    # The one way to build a selected component: its config builds it, with its options and the
    # category's arguments; a factory's crash is a PluginError naming it, a ForgeError passes as is.
    from forge_lm.errors import ForgeError, PluginError

    config = load(None, "--optimizer.lr=0.5")
    model = torch.nn.Linear(2, 2)
    optimizer = config.optimizer.build(model)
    assert isinstance(optimizer, torch.optim.AdamW)
    assert optimizer.param_groups[0]["lr"] == 0.5

    with pytest.raises(PluginError, match=r"optimizer 'adamw' from .* could not be built: AttributeError: .*Check"):
        config.optimizer.build("not a model")
    component = config.optimizer.component

    def refuses(options, model):
        raise ForgeError("set lr below 1")

    broken = dataclasses.replace(component, factory=refuses)
    with pytest.raises(ForgeError, match=r"^set lr below 1$") as caught:
        ComponentConfig("adamw", config.optimizer.options, broken).build(model)
    assert type(caught.value) is ForgeError
    with pytest.raises(TypeError, match="was not resolved"):
        ComponentConfig("adamw").build(model)
