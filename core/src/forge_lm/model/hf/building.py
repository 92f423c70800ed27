"""The model of a converted Hugging Face directory (:class:`~forge_lm.model.hf.hooks.HFImport`),
built and loaded with the checks that ``forge import-hf`` and ``forge_lm.load_pretrained`` both
apply: everything in the directory is untrusted, so the model's memory is estimated before it is
built (:func:`check_imported_fits`), an allocation that fails anyway names the ``config.json``
that sized it (:func:`build_imported`), and the weights' names and shapes are compared with the
built model's before they are loaded (:func:`load_imported`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from forge_lm.config import ForgeConfig
    from forge_lm.model.hf.hooks import HFImport

_MOST_LISTED = 5  # mismatched weights named in a message; the rest are counted


def check_imported_fits(config: ForgeConfig, registry: Any, imported: HFImport) -> None:
    """Refuse a model whose weights and optimizer state exceed this host's available memory, from
    its estimate, before anything is allocated: its sizes come from an untrusted ``config.json``.

    ``config``: the run config structured from ``imported``'s table; ``registry``: the
    component registry it was structured with; ``imported``: the :class:`HFImport`, named in the
    :class:`~forge_lm.errors.ConfigError` raised."""
    from forge_lm.errors import ConfigError
    from forge_lm.model.memory import loading_shortfall

    shortfall = loading_shortfall(config, config.model.options.vocab_size, registry)
    if shortfall is not None:
        raise ConfigError(
            f"'{imported.config_path}' describes a model that {shortfall}, as {imported.plugin.label} converts it. "
            "Check its sizes (hidden_size, intermediate_size, num_hidden_layers, vocab_size, "
            "max_position_embeddings), or import it on a machine with more memory."
        )


def build_imported(config: ForgeConfig, registry: Any, imported: HFImport) -> nn.Module:
    """The model of ``config`` (as :func:`check_imported_fits` takes them), freshly initialised;
    an allocation that fails anyway (no memory figure on this host) is refused with a
    :class:`~forge_lm.errors.ConfigError` naming the ``config.json`` that sized it."""
    import re

    from forge_lm.errors import ConfigError
    from forge_lm.model import build_model

    try:
        return build_model(config.model, config.model.options.vocab_size, registry)
    except (MemoryError, RuntimeError) as exc:
        if not isinstance(exc, MemoryError) and not re.search(r"allocat|overflow|out of memory", str(exc), re.I):
            raise
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(
            f"cannot allocate the model that '{imported.config_path}' describes ({reason}). Check its sizes "
            "(hidden_size, intermediate_size, num_hidden_layers, vocab_size), or import it on a machine with more "
            "memory."
        ) from None


def load_imported(model: nn.Module, imported: HFImport) -> None:
    """Load ``imported``'s converted weights into ``model`` (from :func:`build_imported`), after
    checking that every name and shape matches: a ``config.json`` that disagrees with its
    weights is refused with a :class:`~forge_lm.errors.ForgeError` naming what differs."""
    from forge_lm.errors import ForgeError
    from forge_lm.model.hf.hooks import state_mismatches

    problems = state_mismatches(model.state_dict(), imported.state)
    where = f"'{imported.config_path.parent}'"
    if problems:
        listed = "; ".join(problems[:_MOST_LISTED])
        if len(problems) > _MOST_LISTED:
            listed += f"; and {len(problems) - _MOST_LISTED} more"
        raise ForgeError(
            f"the weights in {where} do not fit the model that its {imported.config_path.name} describes (as "
            f"{imported.plugin.label} converts it): {listed}. Correct the sizes in {imported.config_path.name} "
            "(hidden_size, intermediate_size, num_attention_heads, num_key_value_heads, vocab_size, ...) to match "
            "the weights, or use the config saved with them."
        )
    try:
        model.load_state_dict(imported.state)
    except RuntimeError as exc:  # names and shapes agree: what is left is the tensors' contents (a dtype)
        reason = str(exc).strip().splitlines()[-1].strip() if str(exc).strip() else type(exc).__name__
        raise ForgeError(f"the weights in {where} cannot be loaded into the model: {reason}") from None
