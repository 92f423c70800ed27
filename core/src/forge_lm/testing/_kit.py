"""The machinery of the conformance kit: checks as named callables, grouped per category."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from forge_lm.config import structure_options
from forge_lm.errors import PluginError
from forge_lm.plugins import Component, PluginManager
from forge_lm.plugins._categories import singular


@attrs.frozen
class Check:
    """One conformance check; call it to run it (raises AssertionError on failure)."""

    id: str
    run: Callable[[], None] = attrs.field(repr=False)

    def __call__(self) -> None:
        self.run()


@attrs.frozen
class Subject:
    """The component under test, with what its checks need to build it."""

    manager: PluginManager
    component: Component
    options_table: Mapping[str, Any]
    extras: Mapping[str, Any]

    @property
    def label(self) -> str:
        return f"{singular(self.component.category)} '{self.component.name}'"

    @property
    def section(self) -> str:
        """Where a user writes the component's options: ``model.ffn``, ``transforms.float8``, ..."""
        return SECTIONS[self.component.category].format(name=self.component.name)

    def options(self, **overrides: Any) -> Any:
        """The component's options: the kit's table with ``overrides``, validated by the core
        (a bad option is named as in the user's config: ``[model.ffn] hidden``)."""
        table = {**self.options_table, **overrides}
        return structure_options(self.manager.registry, self.component, table, self.section)

    def has_option(self, name: str) -> bool:
        return name in attrs.fields_dict(self.component.options_class)

    def build(self, *args: Any, options: Any = None, **kwargs: Any) -> Any:
        return self.component.build(self.options() if options is None else options, *args, **kwargs)


SECTIONS: dict[str, str] = {
    "optimizers": "optimizer",
    "schedulers": "scheduler",
    "losses": "loss",
    "datasets": "data",
    "metrics_backends": "metrics.{name}",
    "tokenizers": "tokenizer",
    "models": "model",
    "attentions": "model.attention",
    "feed_forwards": "model.ffn",
    "routers": "model.ffn.router",
    "model_transforms": "transforms.{name}",
    "evaluators": "eval.{name}",
}
"""The config table that holds a component's options, per category, as users write it."""

AIDS: dict[str, tuple[str, ...]] = {
    "losses": ("reference",),
    "datasets": ("context",),
    "metrics_backends": ("read_back",),
    "tokenizers": ("lossless",),
    "routers": ("n_experts", "top_k", "normalized"),
    "attentions": ("spec",),
    "model_transforms": ("config",),
    "evaluators": ("context",),
}
"""The keyword aids :func:`component_checks` accepts per category, besides ``options`` and ``manager``."""


def skip_check(reason: str) -> None:
    """End a check without a verdict: a pytest skip under pytest, :class:`CheckSkipped` otherwise."""
    try:
        import pytest
    except ImportError:  # pragma: no cover - the kit is used from pytest
        raise CheckSkipped(reason) from None
    pytest.skip(reason)


class CheckSkipped(Exception):
    """A check that does not apply to the component (raised only where pytest is absent)."""


def _skip_exceptions() -> tuple[type[BaseException], ...]:
    try:
        import pytest
    except ImportError:  # pragma: no cover
        return (CheckSkipped,)
    return (CheckSkipped, pytest.skip.Exception)


CheckFunction = Callable[[Subject], None]
_CHECKS: dict[str, list[CheckFunction]] = {}


def category_check(category: str) -> Callable[[CheckFunction], CheckFunction]:
    """Add a function to the checks run on every component of ``category``."""

    def add(function: CheckFunction) -> CheckFunction:
        _CHECKS.setdefault(category, []).append(function)
        return function

    return add


def checks_for(category: str) -> list[CheckFunction]:
    _load_check_modules()
    return list(_CHECKS.get(category, []))


def _load_check_modules() -> None:
    # Imported here, not at the top, so that each category's checks register themselves once.
    from forge_lm.testing import (  # noqa: F401
        _attentions,
        _datasets,
        _evaluators,
        _feed_forwards,
        _losses,
        _metrics,
        _models,
        _optimizers,
        _options,
        _routers,
        _schedulers,
        _tokenizers,
        _transforms,
    )


def component_checks(
    category: str,
    name: str,
    *,
    options: Mapping[str, Any] | None = None,
    manager: PluginManager | None = None,
    **extras: Any,
) -> list[Check]:
    """The checks that ``name`` in ``category`` honours its category's contract.

    ``options`` is the component's config table for the checks (as in a TOML section).
    ``extras`` are category-specific aids, listed per category in :mod:`forge_lm.testing`
    (``reference`` for losses, ``read_back`` for metrics backends, ``context`` for datasets,
    ``lossless`` for tokenizers, ``n_experts``, ``top_k`` and ``normalized`` for routers,
    ``spec`` for attention layers).
    An aid the category does not use is refused, so a misspelt one is not silently ignored.
    """
    unknown = sorted(set(extras) - set(AIDS.get(category, ())))
    if unknown:
        accepted = ", ".join(AIDS.get(category, ())) or "none"
        raise TypeError(
            f"component_checks('{category}', ...) got unknown aids {unknown}; this category accepts: {accepted}"
        )
    manager = manager if manager is not None else PluginManager()
    try:
        component = manager.registry.resolve(category, name)
    except PluginError as exc:  # a failing check, not a collection error: the fix is the author's
        problem = _not_registered(manager, category, name, exc)
        return [Check(f"{category}:{name}:is_registered", lambda: _fail(problem))]
    subject = Subject(manager, component, dict(options or {}), extras)
    return [
        Check(f"{category}:{name}:{function.__name__.removeprefix('check_')}", lambda f=function: f(subject))
        for function in checks_for(category)
    ]


def _not_registered(manager: PluginManager, category: str, name: str, error: PluginError) -> str:
    """Why the kit has no ``name`` of ``category`` to check, said to the plugin's author: the
    packaging problem of a plugin that did not load (its entry point), or what is registered."""
    from forge_lm.testing._packaging import unloaded_plugin_problems

    wanted = f"{singular(category)} '{name}' is not registered"
    problems = unloaded_plugin_problems(manager)
    if problems:
        return f"{wanted}: an installed plugin did not load. " + "\n".join(problems)
    return (
        f"{wanted}: {error}\nRegister it in your plugin's forge_lm_register_{category} hook, and check that the "
        f"distribution is installed with its [project.entry-points.forge_lm] entry (pip install -e .)."
    )


def _fail(problem: str) -> None:
    raise AssertionError(problem)


def check_component(category: str, name: str, **kwargs: Any) -> None:
    """Run every check of the component; one AssertionError lists all failures (checks that do
    not apply to the component, such as the warmup check of a scheduler without warmup, pass)."""
    failures = []
    skipped = _skip_exceptions()
    for check in component_checks(category, name, **kwargs):
        try:
            check()
        except skipped:
            continue
        except AssertionError as exc:
            failures.append(f"{check.id}: {exc}")
    if failures:
        raise AssertionError("\n".join(failures))


def parametrize_with_checks(
    components: Iterable[tuple[str, str] | tuple[str, str, Mapping[str, Any]]] = (),
    distributions: Iterable[str] = (),
    manager: PluginManager | None = None,
) -> Any:
    """A ``pytest.mark.parametrize`` over every check of the given components and distributions.

    Use it on a test taking one argument, ``check``, that calls it::

        @parametrize_with_checks([("losses", "my_loss", {"reference": my_reference})], ["my-dist"])
        def test_conformance(check):
            check()

    The third item of a component tuple holds keyword arguments of :func:`component_checks`.
    """
    import pytest

    from forge_lm.testing._packaging import distribution_checks

    manager = manager if manager is not None else PluginManager()
    checks: list[Check] = []
    for spec in components:
        category, name, *rest = spec
        checks.extend(component_checks(category, name, manager=manager, **(rest[0] if rest else {})))
    for dist in distributions:
        checks.extend(distribution_checks(dist))
    return pytest.mark.parametrize("check", checks, ids=[check.id for check in checks])
