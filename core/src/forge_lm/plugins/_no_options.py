"""The options class of a component registered without one.

Its own module, named by import path (:data:`forge_lm.plugins._manager.NO_OPTIONS`): an attrs
class, as every options class is, and attrs is not imported to list plugins.
"""

from __future__ import annotations

import attrs


@attrs.define
class NoOptions:
    """Options of a component that takes none."""
