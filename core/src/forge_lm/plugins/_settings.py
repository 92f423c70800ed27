"""The switches that decide which plugins load: autoload, allowlist, blocklist.

Each can be set from the environment (so it reaches every process of a distributed run) and
from the ``forge`` command line (which adds to or overrides the environment).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Mapping

from forge_lm.errors import UsageError

ENV_DISABLE_AUTOLOAD = "FORGE_LM_DISABLE_PLUGIN_AUTOLOAD"
ENV_ALLOW = "FORGE_LM_PLUGINS"
ENV_BLOCK = "FORGE_LM_BLOCK_PLUGINS"

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"", "0", "false", "no", "off"}


def _names(value: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in value.split(",") if part.strip())


@dataclasses.dataclass(frozen=True, slots=True)  # no attrs: forge list-plugins does not import it
class PluginSettings:
    """Which plugins to load.

    - ``autoload``: load every third-party plugin found through entry points.
    - ``allow``: if set, load exactly these third-party plugins (even with autoload off).
    - ``block``: never load these plugins; built-in ones (``core.*``) can be blocked too.

    Names are those ``forge list-plugins`` prints.
    """

    autoload: bool = True
    allow: tuple[str, ...] | None = None
    block: tuple[str, ...] = ()

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> PluginSettings:
        env = os.environ if environ is None else environ
        raw = env.get(ENV_DISABLE_AUTOLOAD, "").strip().lower()
        if raw not in _TRUE | _FALSE:
            raise UsageError(
                f"{ENV_DISABLE_AUTOLOAD}={env[ENV_DISABLE_AUTOLOAD]!r} is not a boolean; "
                "set it to 1 (disable autoloading) or 0 (load every installed plugin)."
            )
        allow = env.get(ENV_ALLOW)
        return cls(
            autoload=raw not in _TRUE,
            allow=_names(allow) if allow is not None else None,
            block=_names(env.get(ENV_BLOCK, "")),
        )

    def with_cli(
        self,
        *,
        no_autoload: bool = False,
        allow: str | None = None,
        block: Iterable[str] = (),
    ) -> PluginSettings:
        """These settings with the ``forge`` command-line switches applied on top."""
        blocked = list(self.block)
        for item in block:
            blocked.extend(_names(item))
        return PluginSettings(
            autoload=self.autoload and not no_autoload,
            allow=_names(allow) if allow is not None else self.allow,
            block=tuple(dict.fromkeys(blocked)),
        )

    def disabled_reason(self, name: str, *, explicit: bool) -> str | None:
        """Why the plugin ``name`` must not load, or None if it may.

        ``explicit`` plugins (built-ins, and plugins added in code) are not autoloaded, so
        only the blocklist applies to them.
        """
        if name in self.block:
            return f"blocked by {ENV_BLOCK} or --block-plugin"
        if explicit:
            return None
        if self.allow is not None:
            if name in self.allow:
                return None
            return f"not in the plugin allowlist ({ENV_ALLOW} or --plugins)"
        if not self.autoload:
            return f"plugin autoloading is off ({ENV_DISABLE_AUTOLOAD} or --no-plugin-autoload)"
        return None
