"""Known, harmless lines that third-party packages print while they are imported.

torchao (which forge-float8 brings in, and which transformers imports whenever it is installed)
tries to load its CUDA kernels at import: on a CPU-only torch, or under another Python than
their build's, it logs "Failed to load .../torchao/_C_....so" once per library, and registering
its enums with torch's pytree logs a deprecation notice per enum. Neither changes what Forge
does (float8 training uses torchao's Python code and torch's own kernels), so Forge's commands
drop exactly these records; any other warning of these loggers still shows.
"""

from __future__ import annotations

import logging

_NOISE = {
    # logger name: text a dropped record contains
    "torchao": ("Failed to load", "/torchao/_C"),
    "torch.utils._pytree": ("is an Enum subclass and is now natively supported",),
}


class _DropKnownNoise(logging.Filter):
    def __init__(self, fragments: tuple[str, ...]) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            text = record.getMessage()
        except (TypeError, ValueError):  # a record that cannot be formatted is not ours to judge
            return True
        return not all(fragment in text for fragment in self.fragments)


def quiet_known_import_noise() -> None:
    """Drop the records above from now on (idempotent; cheap: nothing is imported)."""
    for name, fragments in _NOISE.items():
        logger = logging.getLogger(name)
        if not any(isinstance(existing, _DropKnownNoise) for existing in logger.filters):
            logger.addFilter(_DropKnownNoise(fragments))
