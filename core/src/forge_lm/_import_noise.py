"""Known, harmless lines that third-party packages print while they are imported.

torchao (which forge-float8 brings in, and which transformers imports whenever it is installed)
tries to load its CUDA kernels at import: on a CPU-only torch, or under another Python than
their build's, it logs "Failed to load .../torchao/_C_....so" once per library, and registering
its enums with torch's pytree logs a deprecation notice per enum. Neither changes what Forge
does (float8 training uses torchao's Python code and torch's own kernels), so Forge's commands
drop exactly these records; any other warning of these loggers still shows.

Both come after torch is imported (torchao imports it first), so ``import forge_lm`` only asks to
be told when torch is (:func:`quiet_when_torch_is_imported`) and imports :mod:`logging` then: a
command that never loads torch, such as ``forge list-plugins``, does not pay for it.
"""

from __future__ import annotations

import sys
from typing import Any

_NOISE = {
    # logger name: text a dropped record contains
    "torchao": ("Failed to load", "/torchao/_C"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropKnownNoise:
    """A logging filter (logging calls the ``filter`` method of any object it is given; this one is
    no ``logging.Filter`` subclass so that defining it imports no logging)."""

    def __init__(self, fragments: tuple[str, ...]) -> None:
        self.fragments = fragments

    def filter(self, record: Any) -> bool:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # a record that cannot be formatted is not ours to judge
            return True
        return not all(fragment in text for fragment in self.fragments)


def quiet_known_import_noise() -> None:
    """Drop the records above from now on (idempotent)."""
    import logging

    for name, fragments in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropKnownNoise) for existing in logger.filters):
            logger.addFilter(_DropKnownNoise(fragments))


class _QuietOnTorchImport:
    """A meta path finder that finds nothing: asked for ``torch`` (the first import of torch, or of
    anything that imports it), it installs the filters and leaves ``sys.meta_path``."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> None:
        if name == "torch":
            sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _QuietOnTorchImport)]
            quiet_known_import_noise()
        return None  # the usual finders import the module


def quiet_when_torch_is_imported() -> None:
    """:func:`quiet_known_import_noise` now if torch is imported already, else just before it is."""
    if "torch" in sys.modules:
        quiet_known_import_noise()
    elif not any(isinstance(finder, _QuietOnTorchImport) for finder in sys.meta_path):
        sys.meta_path.insert(0, _QuietOnTorchImport())
