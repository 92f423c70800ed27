"""Discover, load and check plugins; keep the registry of what they provide.

Built-in components and third-party plugins take the same path: a module (or object) with
hook implementations goes through :meth:`PluginManager._activate`, which validates its hooks,
collects its registrations and checks its declared plugin API range. A plugin that fails any
step is recorded with its status and reason instead of raising, so one bad plugin never
breaks the CLI; using one of its components later raises a :class:`PluginError`.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import inspect
from collections.abc import Callable
from typing import Any

import pluggy

from forge_lm import hookspecs
from forge_lm.errors import ForgeError, PluginError, did_you_mean
from forge_lm.hookspecs import PROJECT_NAME
from forge_lm.plugins._api import API_ATTRIBUTE, api_incompatibility
from forge_lm.plugins._calls import PluginHookFailed, call_each, checked_metrics, checkpoint_problem, describe, warn
from forge_lm.plugins._categories import CATEGORIES, registration_hook, singular
from forge_lm.plugins._commands import PluginCommand, make_command
from forge_lm.plugins._model import (
    Component,
    PluginInfo,
    PluginStatus,
    check_component_name,
    is_import_path,
    options_class_problem,
)
from forge_lm.plugins._registry import Registry
from forge_lm.plugins._settings import PluginSettings

HOOK_PREFIX = PROJECT_NAME + "_"
# Keys a plugin's step_end / eval_end metrics may not take: the record's step, and the metrics
# the loop adds after the hook (besides the metrics the hook was given), and the key under which
# metrics.jsonl spells the non-finite ones (forge_lm.metrics.jsonl).
RESERVED_METRICS = ("step", "tokens_per_sec", "mfu", "nonfinite")
CORE_DISTRIBUTION = "forge-lm"

BUILTIN_PLUGINS: dict[str, str] = {
    "core.optimizers": "forge_lm.default_plugins.optimizers",
    "core.schedulers": "forge_lm.default_plugins.schedulers",
    "core.losses": "forge_lm.default_plugins.losses",
    "core.datasets": "forge_lm.default_plugins.datasets",
    "core.metrics": "forge_lm.default_plugins.metrics",
    "core.tokenizers": "forge_lm.default_plugins.tokenizers",
    "core.models": "forge_lm.default_plugins.models",
    "core.feed_forwards": "forge_lm.default_plugins.feed_forwards",
    "core.transforms": "forge_lm.default_plugins.transforms",
    "core.hf_llama": "forge_lm.default_plugins.hf_llama",
}


NO_OPTIONS = "forge_lm.plugins._no_options:NoOptions"
"""The options class of a component registered without one, named by import path like a plugin's."""


class _HookManager(pluggy.PluginManager):
    """pluggy, plus: any function named ``forge_lm_*`` is a hook implementation.

    Without this, a misspelt but undecorated hook would be ignored silently; with it, the
    unknown-hook check below catches it.
    """

    def parse_hookimpl_opts(self, plugin: object, name: str) -> Any:
        opts = super().parse_hookimpl_opts(plugin, name)
        if opts is None and name.startswith(HOOK_PREFIX) and inspect.isroutine(getattr(plugin, name, None)):
            opts = {
                "wrapper": False,
                "hookwrapper": False,
                "optionalhook": False,
                "tryfirst": False,
                "trylast": False,
                "specname": None,
            }
        return opts


class _PluginFailure(Exception):
    """Internal: why a plugin is broken; turned into its status and reason."""


class PluginManager:
    """The loaded plugins, their hooks (:attr:`hook`) and their components (:attr:`registry`)."""

    def __init__(self, settings: PluginSettings | None = None, *, entry_points: bool = True) -> None:
        self.settings = settings if settings is not None else PluginSettings.from_env()
        self.plugins: list[PluginInfo] = []
        self.registry = Registry(self.plugins)
        self.commands: dict[str, PluginCommand] = {}  # the forge subcommands loaded plugins add, by name
        self.warnings: list[str] = []
        self._warned: set[tuple[str, str]] = set()  # (plugin, hook) pairs already warned about
        self._hooks = _HookManager(PROJECT_NAME)
        self._hooks.add_hookspecs(hookspecs)
        version = core_version()
        for name, module in BUILTIN_PLUGINS.items():
            self._load(
                PluginInfo(name, CORE_DISTRIBUTION, version, module, builtin=True),
                lambda module=module: importlib.import_module(module),
            )
        if entry_points:
            self._load_entry_points()
        self._warn_about_unmatched_switches(entry_points)

    @property
    def hook(self) -> Any:
        """pluggy's hook relay, for looking at implementations (``get_hookimpls()``). Call hooks
        through :meth:`call`, :meth:`call_first`, :meth:`call_quietly` or
        :meth:`collect_metrics`: they name the plugin when one fails."""
        return self._hooks.hook

    # -- loading ----------------------------------------------------------------------------

    def _load_entry_points(self) -> None:
        found = importlib.metadata.entry_points(group=PROJECT_NAME)
        # dist.name and dist.version each parse the distribution's whole METADATA file (its README
        # included): read once per distribution, it costs listing plugins a fifth of what it did.
        described: dict[object, tuple[str, str]] = {}

        def name_and_version(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
            if ep.dist is None:
                return "<unknown distribution>", "?"
            if ep.dist not in described:
                metadata = ep.dist.metadata
                described[ep.dist] = (metadata["Name"], metadata["Version"])
            return described[ep.dist]

        for ep in sorted(found, key=lambda ep: (name_and_version(ep)[0] if ep.dist else "", ep.name)):
            dist, version = name_and_version(ep)
            self._load(PluginInfo(ep.name, dist, version, ep.module), ep.load)

    def add_plugin(
        self,
        plugin: object,
        name: str,
        *,
        distribution: str = "<local>",
        version: str = "0",
    ) -> PluginInfo:
        """Load a plugin object that is not installed (tests, notebooks, embedding Forge).

        It goes through the same checks as an installed plugin. Being asked for explicitly,
        it is not subject to the autoload and allowlist switches, only to the blocklist.
        """
        module = getattr(plugin, "__name__", type(plugin).__name__)
        return self._load(PluginInfo(name, distribution, version, module), lambda: plugin, explicit=True)

    def _load(self, info: PluginInfo, loader: Callable[[], object], *, explicit: bool = False) -> PluginInfo:
        clash = next((p for p in self.plugins if p.name == info.name), None)
        self.plugins.append(info)
        try:
            if clash is not None:
                raise _PluginFailure(
                    f"plugin name '{info.name}' is already taken by {clash.distribution}; "
                    "entry-point names must be unique"
                )
            reason = self.settings.disabled_reason(info.name, explicit=info.builtin or explicit)
            if reason:
                info.status, info.reason = PluginStatus.DISABLED, reason
                return info
            try:
                plugin = loader()
            except Exception as exc:  # a plugin may fail to import in any way
                raise _PluginFailure(f"import failed: {type(exc).__name__}: {exc}") from exc
            self._activate(info, plugin)
        except _PluginFailure as failure:
            info.status, info.reason = PluginStatus.BROKEN, str(failure)
        return info

    def _activate(self, info: PluginInfo, plugin: object) -> None:
        other = self._hooks.get_name(plugin)
        if other is not None:
            raise _PluginFailure(
                f"its module '{info.module}' is already loaded as plugin '{other}'; "
                "name each plugin module in one entry point only"
            )
        try:
            self._hooks.register(plugin, name=info.name)
        except (pluggy.PluginValidationError, ValueError) as exc:
            raise _PluginFailure(f"invalid hook implementation: {' '.join(str(exc).split())}") from exc
        try:
            callers = self._hooks.get_hookcallers(plugin) or []
            unknown = [c.name for c in callers if not c.has_spec()]
            if unknown:
                raise _PluginFailure(
                    " ".join(f"implements unknown hook '{hook}'.{_closest_hook(hook)}" for hook in unknown)
                )
            wrappers = [
                c.name
                for c in callers
                for impl in c.get_hookimpls()
                if impl.plugin is plugin and (impl.wrapper or impl.hookwrapper)
            ]
            if wrappers:
                raise _PluginFailure(
                    f"implements {', '.join(wrappers)} as a hook wrapper; Forge calls each implementation on its "
                    "own (so that a failure names its plugin), and wrappers are not supported"
                )
            declared = getattr(plugin, API_ATTRIBUTE, None)
            info.api_range = declared if isinstance(declared, str) else None
            incompatible = api_incompatibility(declared, info.module)
            try:
                components = self._collect_registrations(info, plugin)
                commands = self._collect_commands(info, plugin)
            except _PluginFailure:
                if incompatible is None:
                    raise
                components, commands = [], []  # the incompatibility explains the failure better
            for component in components:
                self.registry.add(component)
                info.components.setdefault(component.category, []).append(component.name)
            if incompatible:
                commands = []  # not offered, as its components are not
            for command in commands:
                self.commands[command.name] = command
                info.commands.append(command.name)
            if incompatible:
                info.status, info.reason = PluginStatus.INCOMPATIBLE, incompatible
                self._hooks.unregister(plugin)  # its lifecycle hooks must not run either
        except BaseException:
            self._hooks.unregister(plugin)
            raise

    def _collect_registrations(self, info: PluginInfo, plugin: object) -> list[Component]:
        """Run the plugin's registration hooks; validate everything before adding anything."""
        components: list[Component] = []
        for category in CATEGORIES:
            caller = getattr(self._hooks.hook, registration_hook(category))
            for impl in caller.get_hookimpls():
                if impl.plugin is not plugin:
                    continue

                def register(
                    name: str,
                    factory: Callable[..., Any] | str,
                    config: type | None = None,
                    description: str = "",
                    *,
                    _category: str = category,
                ) -> None:
                    components.append(_make_component(info, _category, name, factory, config, description))

                register.__qualname__ = "register"  # how a plugin author's TypeError names it

                try:
                    impl.function(**{arg: register for arg in impl.argnames})
                except _PluginFailure:
                    raise
                except Exception as exc:  # any error in a plugin's hook makes it broken
                    raise _PluginFailure(f"{impl.function.__name__} failed: {type(exc).__name__}: {exc}") from exc
        seen: set[tuple[str, str]] = set()
        for component in components:
            key = (component.category, component.name)
            problem = self.registry.conflicts(component)
            if key in seen:
                problem = f"registers {singular(key[0])} '{key[1]}' twice"
            if problem:
                raise _PluginFailure(problem)
            seen.add(key)
        return components

    def _collect_commands(self, info: PluginInfo, plugin: object) -> list[PluginCommand]:
        """Run the plugin's ``forge_lm_register_commands``; a name taken by another plugin (or
        twice by this one) makes it broken."""
        commands: list[PluginCommand] = []
        for impl in self._hooks.hook.forge_lm_register_commands.get_hookimpls():
            if impl.plugin is not plugin:
                continue

            def register(name: str, command: Any, description: str = "") -> None:
                commands.append(make_command(info, name, command, description))

            register.__qualname__ = "register"
            try:
                impl.function(**{arg: register for arg in impl.argnames})
            except Exception as exc:  # any error in a plugin's hook makes it broken
                raise _PluginFailure(f"{impl.function.__name__} failed: {describe(exc)}") from exc
        seen: set[str] = set()
        for command in commands:
            owner = self.commands.get(command.name)
            if owner is not None:
                raise _PluginFailure(
                    f"registers command '{command.name}', which {owner.plugin.label} registered first; "
                    "a command name belongs to one plugin"
                )
            if command.name in seen:
                raise _PluginFailure(f"registers command '{command.name}' twice")
            seen.add(command.name)
        return commands

    def _warn_about_unmatched_switches(self, entry_points: bool) -> None:
        if not entry_points:
            return
        known = {p.name for p in self.plugins}
        for switch, names in (("block", self.settings.block), ("allow", self.settings.allow or ())):
            for name in names:
                if name not in known:
                    self.warnings.append(
                        f"the plugin {switch}list names '{name}', which is not an installed plugin."
                        f"{did_you_mean(name, known)}"
                    )

    # -- using ------------------------------------------------------------------------------

    def plugin(self, name: str) -> PluginInfo:
        for info in self.plugins:
            if info.name == name:
                return info
        raise PluginError(f"no plugin named '{name}'.{did_you_mean(name, [p.name for p in self.plugins])}")

    def manifest(self) -> list[dict[str, str]]:
        """The loaded plugins, for the run directory, checkpoints and cross-rank checks."""
        return [
            {"name": p.name, "distribution": p.distribution, "version": p.version}
            for p in sorted(self.plugins, key=lambda p: p.name)
            if p.status is PluginStatus.OK
        ]

    def manifest_hash(self) -> str:
        import hashlib  # here, with json: listing plugins needs neither
        import json

        blob = json.dumps(self.manifest(), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()

    # -- calling hooks ----------------------------------------------------------------------
    #
    # Every lifecycle and interoperability hook is called through _call_each: one
    # implementation at a time, in pluggy's order, so that a failure names its plugin. The
    # policy for each failure is documented in forge_lm.hookspecs.

    def _call_each(
        self,
        hook: str,
        arguments: Callable[[str], dict[str, Any] | None],
        *,
        first: bool = False,
        on_failure: Callable[[PluginHookFailed], None] | None = None,
        passes: tuple[type[BaseException], ...] = (),
    ) -> list[tuple[PluginInfo, Any]]:
        in_order = reversed(getattr(self._hooks.hook, hook).get_hookimpls())  # pluggy's call order
        return call_each(in_order, self.plugin, hook, arguments, first=first, on_failure=on_failure, passes=passes)

    def call(self, hook: str, **kwargs: Any) -> list[tuple[PluginInfo, Any]]:
        """Call ``hook`` (``"forge_lm_train_start"``, ...) on every loaded plugin; return each
        ``(plugin, result)`` whose result is not None. An implementation that raises stops the
        call with a :class:`PluginHookFailed` naming the plugin and the hook."""
        return self._call_each(hook, lambda _: kwargs)

    def call_first(self, hook: str, **kwargs: Any) -> Any:
        """The first result that is not None of a ``firstresult`` hook (``forge_lm_hf_export``,
        ``forge_lm_hf_import``), or None; raises :class:`PluginHookFailed` like :meth:`call`,
        except for a :class:`ForgeError`: a converter's refusal of a model it claims, for the user."""
        results = self._call_each(hook, lambda _: kwargs, first=True, passes=(ForgeError,))
        return results[0][1] if results else None

    def call_quietly(self, hook: str, **kwargs: Any) -> None:
        """Call ``hook`` on every plugin; an implementation that raises is reported as a warning
        and the others still run (``forge_lm_train_end``: the run's outcome is already decided)."""
        self._call_each(
            hook, lambda _: kwargs, on_failure=lambda failure: warn(f"{failure.headline}; the run's outcome stands")
        )

    def collect_metrics(self, hook: str, *, context: object, step: int, metrics: dict[str, float]) -> dict[str, float]:
        """Call ``forge_lm_step_end`` or ``forge_lm_eval_end``; the metrics the plugins returned,
        merged in call order.

        Each implementation gets its own copy of ``metrics``. What a plugin returns is
        untrusted: anything but string keys mapping to numbers (NaN and Inf allowed), or a key
        of the core's own metrics, is left out with one warning per plugin and hook.
        """
        reserved = {*metrics, *RESERVED_METRICS}
        merged: dict[str, float] = {}
        for plugin, returned in self._call_each(
            hook, lambda _: {"context": context, "step": step, "metrics": dict(metrics)}
        ):
            try:
                good, problems = checked_metrics(returned, reserved)
            except Exception as exc:  # noqa: BLE001 - a returned object may fail in any way when read
                good, problems = {}, [f"an unreadable {type(returned).__name__} ({describe(exc)})"]
            merged.update(good)
            if problems and (plugin.name, hook) not in self._warned:
                self._warned.add((plugin.name, hook))
                warn(
                    f"{plugin.label} returned unusable metrics from {hook}: {'; '.join(problems)}. They are left "
                    "out (this warning is not repeated); the run goes on."
                )
        return merged

    def configure(self, config: object) -> None:
        """Give every plugin the resolved config to check (the ``forge_lm_configure`` hook).

        A plugin rejects a config by raising :class:`ConfigError`; any other exception is a
        bug in that plugin and is reported as a :class:`PluginError` naming it.
        """
        try:
            self._call_each("forge_lm_configure", lambda _: {"config": config}, passes=(ForgeError,))
        except PluginHookFailed as failure:  # a plugin bug must not surface as a bare traceback
            plugin = failure.plugin
            raise PluginError(
                f"{plugin.label} failed while checking the config: {describe(failure.__cause__)}. "
                f"This is a bug in the plugin: report it to its authors, or run without it "
                f"(--block-plugin {plugin.name})."
            ) from failure.__cause__

    def save_states(self, context: object) -> dict[str, Any]:
        """Each plugin's checkpoint state, keyed by plugin name (plugins returning None omitted).

        A state that a checkpoint cannot keep (anything but tensors and plain data) is the
        plugin's failure, like an exception: :class:`PluginHookFailed`.
        """
        hook = "forge_lm_save_state"
        states: dict[str, Any] = {}
        for plugin, state in self._call_each(hook, lambda _: {"context": context}):
            try:
                problem = checkpoint_problem(state, "state")
            except Exception as exc:  # noqa: BLE001 - a returned object may fail in any way when read
                problem = f"it cannot be read ({describe(exc)})"
            if problem:
                raise PluginHookFailed(plugin, hook, f"returned a state from {hook} that cannot be saved: {problem}")
            states[plugin.name] = state
        return states

    def load_states(self, context: object, states: dict[str, Any]) -> list[str]:
        """Give each plugin back its saved state; return the names of states no plugin took."""
        taken: set[str] = set()

        def arguments(name: str) -> dict[str, Any] | None:
            if name not in states:
                return None
            taken.add(name)
            return {"context": context, "state": states[name]}

        self._call_each("forge_lm_load_state", arguments)
        return sorted(set(states) - taken)


def _closest_hook(name: str) -> str:
    """A "did you mean" for a misspelt hook, judged without the prefix every hook shares."""
    hooks = [hook.removeprefix(HOOK_PREFIX) for hook in dir(hookspecs) if hook.startswith(HOOK_PREFIX)]
    hint = did_you_mean(name.removeprefix(HOOK_PREFIX), hooks)
    return hint.replace("'", f"'{HOOK_PREFIX}", 1) if hint else ""


def _make_component(
    info: PluginInfo,
    category: str,
    name: object,
    factory: object,
    config: object,
    description: object,
) -> Component:
    try:
        check_component_name(name)
    except PluginError as exc:
        raise _PluginFailure(str(exc)) from exc
    what = f"{singular(category)} '{name}'"
    if isinstance(factory, str):
        if not is_import_path(factory):
            raise _PluginFailure(f"{what}: factory string {factory!r} must look like 'package.module:function'")
    elif not callable(factory):
        raise _PluginFailure(f"{what}: factory must be callable or a 'module:function' string, got {factory!r}")
    if config is None:
        config = NO_OPTIONS
    if isinstance(config, str):
        # Named by its import path: imported and checked on first use (Component.options_class),
        # so that listing plugins imports no options module.
        if not is_import_path(config):
            raise _PluginFailure(f"{what}: config string {config!r} must look like 'package.module:Class'")
    else:
        problem = options_class_problem(config)
        if problem is not None:
            raise _PluginFailure(f"{what}: {problem}")
    if not isinstance(description, str) or not description.strip() or "\n" in description.strip():
        raise _PluginFailure(f"{what}: description must be one non-empty line")
    return Component(category, name, factory, config, description.strip(), info)


@functools.cache  # finding the distribution scans sys.path; the installed version does not change in a process
def core_version() -> str:
    try:
        return importlib.metadata.version(CORE_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"
