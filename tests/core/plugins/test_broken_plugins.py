"""A plugin that fails in any way is recorded as broken with its reason; loading goes on.

A broken plugin registers nothing (its registrations are all-or-nothing) and none of its
hooks run afterwards.
"""

from __future__ import annotations

import sys
import textwrap

import pytest

from forge_lm.errors import PluginError
from forge_lm.plugins import BUILTIN_PLUGINS, PluginStatus

# Every fake plugin below also implements a lifecycle hook that records its calls, so a test
# can show that a broken plugin's hooks never run.
RECORDS_CONFIGURE = """
CALLS = []

@hookimpl
def forge_lm_configure(config):
    CALLS.append(config)
"""


def with_recorder(body: str) -> str:
    return RECORDS_CONFIGURE + textwrap.dedent(body)


def assert_broken_and_inert(manager, name, reason):
    plugin = manager.plugin(name)
    assert (plugin.status, plugin.reason) == (PluginStatus.BROKEN, reason)
    assert plugin.components == {}
    assert name not in [impl.plugin_name for impl in manager.hook.forge_lm_configure.get_hookimpls()]
    manager.configure("the config")
    module = sys.modules.get(plugin.module)
    if module is not None and hasattr(module, "CALLS"):
        assert module.CALLS == []


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        pytest.param('raise RuntimeError("boom")', "import failed: RuntimeError: boom", id="raises"),
        pytest.param(
            "import forge_missing_dependency",
            "import failed: ModuleNotFoundError: No module named 'forge_missing_dependency'",
            id="missing-dependency",
        ),
        pytest.param("1 +", "import failed: SyntaxError: invalid syntax (forge_fake.py, line 3)", id="syntax-error"),
    ],
)
def test_plugin_that_fails_to_import_is_listed_as_broken_with_its_error(install_plugin, load_plugins, body, reason):
    install_plugin("forge-fake", body)

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", reason)


def test_entry_point_naming_a_missing_module_is_broken(install_plugin, load_plugins):
    install_plugin("forge-fake", entry_points={"fake": "forge_nowhere"})

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", "import failed: ModuleNotFoundError: No module named 'forge_nowhere'")


def test_registration_hook_that_raises_makes_the_plugin_broken(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        with_recorder(
            """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("fake_opt", "forge_fake_impl:build", description="Registered before the error")
            raise ValueError("needs a GPU")
        """
        ),
    )

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", "forge_lm_register_optimizers failed: ValueError: needs a GPU")
    assert "fake_opt" not in manager.registry.names("optimizers")


def test_decorated_hook_with_an_unknown_name_is_rejected_with_the_close_hook_name(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        with_recorder(
            """
        @hookimpl
        def forge_lm_register_optimizer(register):
            register("fake_opt", "forge_fake_impl:build", description="Never registered")
        """
        ),
    )

    manager = load_plugins("fake")

    assert_broken_and_inert(
        manager,
        "fake",
        "implements unknown hook 'forge_lm_register_optimizer'. Did you mean 'forge_lm_register_optimizers'?",
    )
    assert manager.plugin("fake").label == "plugin 'fake' (forge-fake 1.0)"


def test_undecorated_function_with_the_hook_prefix_and_an_unknown_name_is_rejected(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        with_recorder(
            """
        def forge_lm_train_stat(context):
            pass
        """
        ),
    )

    manager = load_plugins("fake")

    assert_broken_and_inert(
        manager, "fake", "implements unknown hook 'forge_lm_train_stat'. Did you mean 'forge_lm_train_start'?"
    )


def test_unknown_hook_far_from_every_real_one_is_rejected_without_a_suggestion(install_plugin, load_plugins):
    install_plugin("forge-fake", "def forge_lm_xyzzy():\n    pass\n")

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", "implements unknown hook 'forge_lm_xyzzy'.")


def test_undecorated_function_with_a_real_hook_name_is_a_hook_implementation(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        CALLS = []

        def forge_lm_configure(config):
            CALLS.append(config)
        """,
    )

    manager = load_plugins("fake")
    manager.configure("the config")

    assert manager.plugin("fake").status is PluginStatus.OK
    assert sys.modules["forge_fake"].CALLS == ["the config"]


def test_hook_implementation_with_an_argument_the_spec_lacks_is_rejected(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_configure(config, extra):
            pass

        @hookimpl
        def forge_lm_save_state(context):
            return {"never": "saved"}
        """,
    )

    manager = load_plugins("fake")

    plugin = manager.plugin("fake")
    assert plugin.status is PluginStatus.BROKEN
    assert plugin.reason.startswith("invalid hook implementation: Plugin 'fake' for hook 'forge_lm_configure' ")
    assert "Argument(s) {'extra'} are declared in the hookimpl but can not be found in the hookspec" in plugin.reason
    assert "\n" not in plugin.reason
    assert "fake" not in [impl.plugin_name for impl in manager.hook.forge_lm_configure.get_hookimpls()]
    assert manager.save_states("context") == {}


NAME_RULES = "use lower-case letters, digits, '_', '.' or '-' (':' is reserved for 'distribution:name')"


@pytest.mark.parametrize(
    ("call", "reason"),
    [
        pytest.param(
            'register("fake:opt", "forge_fake_impl:build", description="d")',
            f"component name 'fake:opt' is invalid: {NAME_RULES}",
            id="name-with-colon",
        ),
        pytest.param(
            'register("FakeOpt", "forge_fake_impl:build", description="d")',
            f"component name 'FakeOpt' is invalid: {NAME_RULES}",
            id="name-upper-case",
        ),
        pytest.param(
            'register("", "forge_fake_impl:build", description="d")',
            f"component name '' is invalid: {NAME_RULES}",
            id="name-empty",
        ),
        pytest.param(
            'register("-opt", "forge_fake_impl:build", description="d")',
            f"component name '-opt' is invalid: {NAME_RULES}",
            id="name-leading-dash",
        ),
        pytest.param(
            'register(7, "forge_fake_impl:build", description="d")',
            f"component name 7 is invalid: {NAME_RULES}",
            id="name-not-a-string",
        ),
        pytest.param(
            'register("bad", 42, description="d")',
            "optimizer 'bad': factory must be callable or a 'module:function' string, got 42",
            id="factory-not-callable",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl.build", description="d")',
            "optimizer 'bad': factory string 'forge_fake_impl.build' must look like 'package.module:function'",
            id="factory-string-without-colon",
        ),
        pytest.param(
            'register("bad", ":build", description="d")',
            "optimizer 'bad': factory string ':build' must look like 'package.module:function'",
            id="factory-string-without-module",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:", description="d")',
            "optimizer 'bad': factory string 'forge_fake_impl:' must look like 'package.module:function'",
            id="factory-string-without-attribute",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", config=dict, description="d")',
            "optimizer 'bad': config must be an attrs class, got <class 'dict'>",
            id="config-not-attrs",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", config=Options(), description="d")',
            "optimizer 'bad': config must be an attrs class, got Options(lr=0.1)",
            id="config-attrs-instance",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", description="")',
            "optimizer 'bad': description must be one non-empty line",
            id="description-empty",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", description="   ")',
            "optimizer 'bad': description must be one non-empty line",
            id="description-blank",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build")',
            "optimizer 'bad': description must be one non-empty line",
            id="description-missing",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", description="First line\\nsecond line")',
            "optimizer 'bad': description must be one non-empty line",
            id="description-multi-line",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", description=["d"])',
            "optimizer 'bad': description must be one non-empty line",
            id="description-not-a-string",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", config=MaybeNone, description="d")',
            "optimizer 'bad': option 'clip' may be None but defaults to 1.0; a TOML config cannot write None, "
            "so default it to None (meaning 'derive it') or make it non-optional",
            id="optional-option-with-a-non-none-default",
        ),
        pytest.param(
            'register("bad", "forge_fake_impl:build", None, "d", "extra")',
            "forge_lm_register_optimizers failed: TypeError: "
            "register() takes from 2 to 4 positional arguments but 5 were given",
            id="too-many-arguments",
        ),
    ],
)
def test_invalid_registration_makes_the_plugin_broken_and_registers_nothing(
    install_plugin, load_plugins, builtin_names, call, reason
):
    install_plugin(
        "forge-fake",
        with_recorder(
            f"""
        import attrs

        @attrs.define
        class Options:
            lr: float = 0.1

        @attrs.define
        class MaybeNone:
            clip: float | None = 1.0

        @hookimpl
        def forge_lm_register_losses(register):
            register("good_loss", "forge_fake_impl:loss", description="Valid, registered first")

        @hookimpl
        def forge_lm_register_optimizers(register):
            register("good_opt", "forge_fake_impl:opt", description="Valid, registered first")
            {call}
        """
        ),
    )

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", reason)
    assert manager.registry.names("optimizers") == builtin_names("optimizers")
    assert manager.registry.names("losses") == builtin_names("losses")


def test_plugin_registering_the_same_name_twice_is_broken(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        with_recorder(
            """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("twice", "forge_fake_impl:a", description="First")
            register("twice", "forge_fake_impl:b", description="Second")
        """
        ),
    )

    manager = load_plugins("fake")

    assert_broken_and_inert(manager, "fake", "registers optimizer 'twice' twice")
    assert "twice" not in manager.registry.names("optimizers")


def test_same_name_in_different_categories_is_not_a_clash(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("shared", "forge_fake_impl:opt", description="An optimizer")

        @hookimpl
        def forge_lm_register_losses(register):
            register("shared", "forge_fake_impl:loss", description="A loss")
        """,
    )

    manager = load_plugins("fake")

    assert manager.plugin("fake").status is PluginStatus.OK
    assert manager.plugin("fake").components == {"optimizers": ["shared"], "losses": ["shared"]}


def test_two_plugins_of_one_distribution_registering_the_same_name_break_the_second(
    install_plugin, write_module, load_plugins
):
    registers_shared = """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("shared", "forge_fake_impl:build", description="Registered by both")
        """
    install_plugin("forge-fake", registers_shared, entry_points={"one": "forge_fake", "two": "forge_fake_two"})
    write_module(
        "forge_fake_two",
        "from forge_lm import hookimpl\nFORGE_LM_PLUGIN_API = '>=1,<2'\n" + with_recorder(registers_shared),
    )

    manager = load_plugins("one", "two")

    assert manager.plugin("one").status is PluginStatus.OK
    assert_broken_and_inert(
        manager, "two", "optimizer 'shared' is registered twice by forge-fake (plugins 'one' and 'two')"
    )
    assert manager.registry.resolve("optimizers", "shared").plugin is manager.plugin("one")


def test_second_entry_point_with_a_taken_plugin_name_is_broken(install_plugin, load_plugins):
    install_plugin("forge-dup-a", RECORDS_CONFIGURE, entry_points={"dup": "forge_dup_a"})
    install_plugin("forge-dup-b", RECORDS_CONFIGURE, entry_points={"dup": "forge_dup_b"})

    manager = load_plugins("dup")

    first, second = [p for p in manager.plugins if p.name == "dup"]
    assert (first.distribution, first.status) == ("forge-dup-a", PluginStatus.OK)
    assert (second.distribution, second.status) == ("forge-dup-b", PluginStatus.BROKEN)
    assert second.reason == "plugin name 'dup' is already taken by forge-dup-a; entry-point names must be unique"
    assert "forge_dup_b" not in sys.modules
    manager.configure("the config")
    assert sys.modules["forge_dup_a"].CALLS == ["the config"]


def test_entry_point_named_like_a_builtin_is_broken_and_the_builtin_is_kept(install_plugin, load_plugins):
    install_plugin(
        "forge-fake",
        """
        @hookimpl
        def forge_lm_register_optimizers(register):
            register("adamw", "forge_fake_impl:build", description="Impostor")
        """,
        entry_points={"core.optimizers": "forge_fake"},
    )

    manager = load_plugins("core.optimizers")

    impostor = [p for p in manager.plugins if p.name == "core.optimizers"][1]
    assert (impostor.distribution, impostor.status) == ("forge-fake", PluginStatus.BROKEN)
    assert impostor.reason == (
        "plugin name 'core.optimizers' is already taken by forge-lm; entry-point names must be unique"
    )
    assert manager.registry.resolve("optimizers", "adamw").plugin.distribution == "forge-lm"


def test_module_named_by_two_entry_points_breaks_the_second_with_a_short_reason(install_plugin, load_plugins):
    install_plugin("forge-fake", RECORDS_CONFIGURE, entry_points={"first": "forge_fake", "second": "forge_fake"})

    manager = load_plugins("first", "second")

    assert manager.plugin("first").status is PluginStatus.OK
    second = manager.plugin("second")
    assert second.status is PluginStatus.BROKEN
    assert "already loaded as plugin 'first'" in second.reason
    assert "<module" not in second.reason
    assert len(second.reason) < 200


def test_broken_plugin_does_not_stop_the_plugins_after_it(install_plugin, load_plugins):
    install_plugin("forge-aaa-broken", 'raise RuntimeError("boom")', entry_points={"broken": "forge_aaa_broken"})
    install_plugin(
        "forge-zzz-good",
        """
        @hookimpl
        def forge_lm_register_losses(register):
            register("good_loss", "forge_fake_impl:build", description="Still loads")
        """,
        entry_points={"good": "forge_zzz_good"},
    )

    manager = load_plugins("broken", "good")

    assert manager.plugin("broken").status is PluginStatus.BROKEN
    assert manager.plugin("good").status is PluginStatus.OK
    assert manager.registry.resolve("losses", "good_loss").plugin.name == "good"
    assert all(manager.plugin(name).status is PluginStatus.OK for name in BUILTIN_PLUGINS)


def test_resolving_a_component_of_a_broken_plugin_says_the_plugin_is_broken_and_how_to_fix_it(
    install_plugin, load_plugins
):
    install_plugin("forge-fake", "import forge_missing_dependency", version="0.4.2")
    manager = load_plugins("fake")

    with pytest.raises(PluginError) as caught:
        manager.registry.resolve("optimizers", "fake_opt")

    message = str(caught.value)
    assert "\nThese installed plugins are not loaded and might provide it:\n" in message
    assert (
        "\n  plugin 'fake' (forge-fake 0.4.2) is installed but broken: import failed: ModuleNotFoundError: "
        "No module named 'forge_missing_dependency'. Fix: reinstall it with its dependencies "
        "(pip install --force-reinstall forge-fake) or remove it (pip uninstall forge-fake).\n"
    ) in message
