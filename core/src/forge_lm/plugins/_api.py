"""The plugin API version this core provides, and the check of a plugin's declared range."""

from __future__ import annotations

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import Version

PLUGIN_API_VERSION = "1.4"
"""Bumped in its major part when a hook or a component contract changes incompatibly, in its minor
part when one is added. 1.1: ``forge_lm_register_commands``; the protocols of
:mod:`forge_lm.components` that replace attribute probes; transform slots named by role. 1.2: an
options class named by its import path (``register(..., config="module:Class")``), imported on use.
1.3: ``ContextParallelModel.set_context_parallel(context_parallel)``, through which the model hands
the group to its attention layers (a model with only 1.2's ``context_parallel`` attribute still
runs, deprecated: the core then walks its modules, until 2.0). 1.4: ``ReadsBatches``, a dataset's
``read_batch(size)``, which the loader calls instead of ``size`` draws of its iterator."""

API_ATTRIBUTE = "FORGE_LM_PLUGIN_API"
"""Module attribute in which a plugin declares the API range it supports, e.g. ``">=1,<2"``."""


def api_incompatibility(declared: object, module_name: str) -> str | None:
    """Why a plugin declaring ``declared`` cannot run on this core, or None if it can."""
    example = f'{API_ATTRIBUTE} = ">=1,<2"'
    if declared is None or (isinstance(declared, str) and not declared.strip()):
        return (
            f"declares no plugin API range; add {example} to module '{module_name}' "
            f"(this core provides plugin API {PLUGIN_API_VERSION})"
        )
    if not isinstance(declared, str):
        return f"{API_ATTRIBUTE} must be a version range string such as '>=1,<2', got {declared!r}"
    try:
        spec = SpecifierSet(declared)
    except InvalidSpecifier:
        return f"{API_ATTRIBUTE} = {declared!r} is not a valid version range; write e.g. '>=1,<2'"
    if Version(PLUGIN_API_VERSION) not in spec:
        return (
            f"supports plugin API {declared} but this core provides {PLUGIN_API_VERSION}; "
            "install a release of the plugin made for this core, or a core that provides "
            f"API {declared}"
        )
    return None
