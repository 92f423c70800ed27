"""One generic registry: category -> name -> component, for every category alike."""

from __future__ import annotations

from collections.abc import Sequence

from forge_lm.errors import PluginError, did_you_mean, quoted_list
from forge_lm.plugins._categories import CATEGORIES, check_category, plural, singular
from forge_lm.plugins._hints import known_provider
from forge_lm.plugins._model import Component, PluginInfo, PluginStatus


class Registry:
    """Components by category and name; resolves the names a config uses.

    ``plugins`` is the plugin manager's list of every plugin it saw (including broken,
    incompatible and disabled ones), so that a failed lookup can say why a component is
    missing and what would fix it.
    """

    def __init__(self, plugins: Sequence[PluginInfo] = ()) -> None:
        self._plugins = plugins
        self._by_category: dict[str, dict[str, list[Component]]] = {c: {} for c in CATEGORIES}

    # -- building ---------------------------------------------------------------------------

    def conflicts(self, component: Component) -> str | None:
        """Why ``component`` cannot be added (same name already from the same distribution)."""
        check_category(component.category)
        for other in self._by_category[component.category].get(component.name, []):
            if other.plugin.distribution == component.plugin.distribution:
                return (
                    f"{singular(component.category)} '{component.name}' is registered twice by "
                    f"{component.plugin.distribution} (plugins '{other.plugin.name}' and "
                    f"'{component.plugin.name}')"
                )
        return None

    def add(self, component: Component) -> None:
        problem = self.conflicts(component)
        if problem:
            raise PluginError(problem)
        self._by_category[component.category].setdefault(component.name, []).append(component)

    # -- reading ----------------------------------------------------------------------------

    def names(self, category: str) -> list[str]:
        """Sorted names available in ``category``."""
        return sorted(self._by_category[check_category(category)])

    def components(self, category: str) -> list[Component]:
        found = self._by_category[check_category(category)]
        return [c for name in sorted(found) for c in found[name]]

    def providers(self, category: str, name: str) -> list[Component]:
        return list(self._by_category[check_category(category)].get(name, []))

    def resolve(self, category: str, name: str) -> Component:
        """The component ``name`` (or ``distribution:name``) in ``category``, ready to use.

        Raises :class:`PluginError` when it is unknown, ambiguous, or its plugin is not usable.
        """
        check_category(category)
        noun = singular(category)
        dist, _, bare = name.rpartition(":")
        candidates = self.providers(category, bare)
        if not candidates:
            raise PluginError(self._unknown_message(category, bare))
        if dist:
            from packaging.utils import canonicalize_name  # here: packaging.utils imports packaging.tags, slow

            chosen = [c for c in candidates if canonicalize_name(c.plugin.distribution) == canonicalize_name(dist)]
            if not chosen:
                raise PluginError(
                    f"{noun} '{bare}' is not provided by a distribution named '{dist}'; it is "
                    f"provided by {_providers_text(candidates)}."
                )
            candidates = chosen
        usable = [c for c in candidates if c.plugin.status is PluginStatus.OK]
        if len(candidates) > 1 and len(usable) == 1:
            candidates = usable  # an incompatible plugin's copy of a name does not make it ambiguous
        if len(candidates) > 1:
            choices = " or ".join(f'name = "{c.qualified_name}"' for c in candidates)
            raise PluginError(
                f"{noun} '{bare}' is provided by {len(candidates)} distributions: "
                f"{_providers_text(candidates)}. Choose one: {choices}."
            )
        component = candidates[0]
        plugin = component.plugin
        if plugin.status is PluginStatus.INCOMPATIBLE:
            raise PluginError(f"{noun} '{bare}' comes from {plugin.label}, which is incompatible: {plugin.reason}.")
        if plugin.status is not PluginStatus.OK:
            raise PluginError(f"{noun} '{bare}' comes from {plugin.label}, which is {plugin.status}.")
        return component

    def _unknown_message(self, category: str, name: str) -> str:
        """Why ``name`` is not available. The first line gives the cause when Forge knows it: the
        distribution that provides the name (:mod:`forge_lm.plugins._hints`) is installed but
        disabled by a switch, which it names; otherwise the name is unknown here."""
        noun = singular(category)
        names = self.names(category)
        package = known_provider(category, name)
        from packaging.utils import canonicalize_name  # here: packaging.utils imports packaging.tags, slow

        installed = [
            p for p in self._plugins if package and canonicalize_name(p.distribution) == canonicalize_name(package)
        ]
        disabled = [p for p in installed if p.status is PluginStatus.DISABLED]
        if disabled:
            lines = [
                f"{noun} '{name}' is provided by {p.label}, which is installed but disabled: {p.reason}. "
                "Enable it to use its components."
                for p in disabled
            ]
        else:
            lines = [f"unknown {noun} '{name}'.{did_you_mean(name, names)}"]
        lines.append(f"Available {plural(category)}: {quoted_list(names)}.")
        offering = sorted({c.plugin.label for c in self.components(category)})
        if offering:
            lines.append(f"Installed plugins offering {plural(category)}: {', '.join(offering)}.")
        unusable = [p for p in self._plugins if p.status in (PluginStatus.BROKEN, PluginStatus.DISABLED)]
        if package:
            if not installed:
                lines.append(f"'{name}' is provided by the package {package}: pip install {package}")
            for plugin in installed:
                if plugin.status is PluginStatus.DISABLED:
                    continue  # said first
                if plugin.status is PluginStatus.BROKEN:
                    lines.append(_unusable_text(plugin))
                else:
                    lines.append(
                        f"{plugin.label} is installed but does not provide it; a newer release may: "
                        f"pip install --upgrade {package}"
                    )
        elif unusable:
            lines.append("These installed plugins are not loaded and might provide it:")
            lines.extend(f"  {_unusable_text(p)}" for p in unusable)
        return "\n".join(lines)


def _providers_text(components: Sequence[Component]) -> str:
    return " and ".join(f"{c.plugin.distribution} {c.plugin.version} (plugin '{c.plugin.name}')" for c in components)


def _unusable_text(plugin: PluginInfo) -> str:
    if plugin.status is PluginStatus.DISABLED:
        return f"{plugin.label} is installed but disabled: {plugin.reason}. Enable it to use its components."
    return (
        f"{plugin.label} is installed but broken: {plugin.reason}. Fix: reinstall it with its "
        f"dependencies (pip install --force-reinstall {plugin.distribution}) or remove it "
        f"(pip uninstall {plugin.distribution})."
    )
