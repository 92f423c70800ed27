"""Everything of the core a plugin may use beyond its contracts: the public plugin API.

A plugin imports from :mod:`forge_lm.api`, :mod:`forge_lm.components` (the component
contracts), :mod:`forge_lm.hookspecs` (the hooks), :mod:`forge_lm.errors`,
:mod:`forge_lm.validators`, :mod:`forge_lm.testing` (the conformance kit) and the package root
(``from forge_lm import hookimpl``), and from nowhere else in ``forge_lm``: every other module is
the core's own and may change in any release. The first-party plugins are held to this by the
import-linter contracts of the repository's ``pyproject.toml`` (``make lint``).

Versioning. The names below are part of the plugin API whose version is
:data:`PLUGIN_API_VERSION` (the one ``forge list-plugins`` checks against a plugin's declared
``FORGE_LM_PLUGIN_API`` range):

- removing or renaming a name here, or changing what a name takes or returns incompatibly,
  bumps the major version (a plugin declaring ``">=1,<2"`` is then refused, with the reason,
  instead of failing in the middle of a run);
- adding a name, or an optional argument, bumps the minor version;
- where a name is defined inside the core is not part of the API: the core may move it.

Each name is imported on first use (this module imports no torch itself), so a plugin module may
import it at the top without making ``forge list-plugins`` load torch, as long as it takes the
torch-based names inside the functions that use them. ``__all__`` lists the names.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from forge_lm.plugins._api import PLUGIN_API_VERSION

# Name in this API -> (core module, name there). Grouped as the core is: the first
# column is what plugins write, so a core refactor changes only the second.
_EXPORTS: dict[str, tuple[str, str]] = {
    # Typed config: options classes, component selections, plain-data conversion.
    "ComponentConfig": ("forge_lm.config", "ComponentConfig"),
    "LlamaOptions": ("forge_lm.config", "LlamaOptions"),
    "component": ("forge_lm.config", "component"),
    "model_options": ("forge_lm.config", "model_options"),
    "structure_options": ("forge_lm.config", "structure_options"),
    "to_data": ("forge_lm.config", "to_data"),
    # The run: events, auxiliary losses and metrics a forward reports, the main process.
    "record_event": ("forge_lm.events", "record"),
    "report_aux_loss": ("forge_lm.losses.aux", "report_aux_loss"),
    "report_metric": ("forge_lm.losses.aux", "report_metric"),
    "report_loss_term": ("forge_lm.losses.aux", "report_loss_term"),
    "collecting_aux": ("forge_lm.losses.aux", "collecting"),
    "is_main_process": ("forge_lm.distributed.launch", "is_main_process"),
    # A trained run: its checkpoints, the model back from one, files written inside the run.
    "locate_checkpoint": ("forge_lm.train.inference", "locate_checkpoint"),
    "load_for_inference": ("forge_lm.train.inference", "load_for_inference"),
    "refuse_links": ("forge_lm.run_links", "refuse_links"),
    "make_run_dirs": ("forge_lm.run_links", "make_dirs"),
    "write_run_text": ("forge_lm.run_links", "write_text"),
    # Plugins and their components: the manager, and naming a component that failed.
    "PluginManager": ("forge_lm.plugins", "PluginManager"),
    "ComponentFailed": ("forge_lm.train.guards", "ComponentFailed"),
    "COMPONENT_ATTRIBUTE": ("forge_lm.train.guards", "COMPONENT_ATTRIBUTE"),
    "mark_component": ("forge_lm.train.guards", "mark"),
    # Model transforms (float8, expert parallelism): their base class and context.
    "ModelTransform": ("forge_lm.distributed", "ModelTransform"),
    "TransformContext": ("forge_lm.distributed", "TransformContext"),
    # The dense model and its building blocks.
    "Transformer": ("forge_lm.model.transformer", "Transformer"),
    "Block": ("forge_lm.model.transformer", "Block"),
    "attention_spec": ("forge_lm.model.transformer", "attention_spec"),
    "build_layers": ("forge_lm.model.transformer", "build_layers"),
    "Attention": ("forge_lm.model.attention", "Attention"),
    "attention_mask": ("forge_lm.model.attention", "attention_mask"),
    "check_flex_backward": ("forge_lm.model.attention", "check_flex_backward"),
    "compute_dtype": ("forge_lm.model.attention", "compute_dtype"),
    "eager_attention": ("forge_lm.model.attention", "eager_attention"),
    "flex_function": ("forge_lm.model.attention", "flex_function"),
    "repeat_kv": ("forge_lm.model.attention", "repeat_kv"),
    "apply_rope": ("forge_lm.model.rope", "apply_rope"),
    "RMSNorm": ("forge_lm.model.norms", "RMSNorm"),
    "SwiGLU": ("forge_lm.model.swiglu", "SwiGLU"),
    "swiglu_hidden": ("forge_lm.model.swiglu", "swiglu_hidden"),
    "Linear": ("forge_lm.model.linear", "Linear"),
    "linear": ("forge_lm.model.linear", "linear"),
    "matmul_nt": ("forge_lm.model.linear", "matmul_nt"),
    "linear_kernel_in_use": ("forge_lm.model.linear", "kernel_in_use"),
    "KVCache": ("forge_lm.model.kv_cache", "KVCache"),
    "sampling_probs": ("forge_lm.model.generate", "sampling_probs"),
    "active_parameter_count": ("forge_lm.model.flops", "active_parameter_count"),
    "freeze_until": ("forge_lm.model.freezing", "freeze_until"),
    # Hugging Face conversion: reading configs, the shared renaming, Llama as a building block.
    "HFConfigReader": ("forge_lm.model.hf_fields", "HFConfigReader"),
    "rename_to_hf": ("forge_lm.model.hf.names", "rename_to_hf"),
    "rename_from_hf": ("forge_lm.model.hf.names", "rename_from_hf"),
    "decoder_config_fields": ("forge_lm.model.hf.llama", "decoder_config_fields"),
    "swiglu_options_for": ("forge_lm.model.hf.llama", "swiglu_options_for"),
    "QWEN3_ATTENTION_FIELDS": ("forge_lm.model.hf.llama", "QWEN3_ATTENTION_FIELDS"),
    "qwen3_attention_problems": ("forge_lm.model.hf.llama", "qwen3_attention_problems"),
    "llama_export": ("forge_lm.model.hf.llama", "llama_export"),
    "llama_import": ("forge_lm.model.hf.llama", "llama_import"),
    # Data, hardware, plots.
    "check_tokenizer": ("forge_lm.data.packing", "check_tokenizer"),
    "cpu_multiplies_bf16": ("forge_lm.hardware", "cpu_multiplies_bf16"),
    "PlotPanel": ("forge_lm.metrics.plot_panels", "PlotPanel"),
}

__all__ = ["PLUGIN_API_VERSION", *sorted(_EXPORTS)]


def __getattr__(name: str) -> Any:
    try:
        module, attribute = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'forge_lm.api' has no attribute {name!r}") from None
    # Looked up on every import, not cached here: a test that patches the core's function is
    # seen by a plugin that imports it inside the function that calls it, as before.
    return getattr(importlib.import_module(module), attribute)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports on use
    from forge_lm.config import (  # noqa: F401
        ComponentConfig,
        LlamaOptions,
        component,
        model_options,
        structure_options,
        to_data,
    )
    from forge_lm.data.packing import check_tokenizer  # noqa: F401
    from forge_lm.distributed import ModelTransform, TransformContext  # noqa: F401
    from forge_lm.distributed.launch import is_main_process  # noqa: F401
    from forge_lm.events import record as record_event  # noqa: F401
    from forge_lm.hardware import cpu_multiplies_bf16  # noqa: F401
    from forge_lm.losses.aux import collecting as collecting_aux  # noqa: F401
    from forge_lm.losses.aux import report_aux_loss, report_loss_term, report_metric  # noqa: F401
    from forge_lm.metrics.plot_panels import PlotPanel  # noqa: F401
    from forge_lm.model.attention import (  # noqa: F401
        Attention,
        attention_mask,
        check_flex_backward,
        compute_dtype,
        eager_attention,
        flex_function,
        repeat_kv,
    )
    from forge_lm.model.flops import active_parameter_count  # noqa: F401
    from forge_lm.model.freezing import freeze_until  # noqa: F401
    from forge_lm.model.generate import sampling_probs  # noqa: F401
    from forge_lm.model.hf.llama import (  # noqa: F401
        QWEN3_ATTENTION_FIELDS,
        decoder_config_fields,
        llama_export,
        llama_import,
        qwen3_attention_problems,
        swiglu_options_for,
    )
    from forge_lm.model.hf.names import rename_from_hf, rename_to_hf  # noqa: F401
    from forge_lm.model.hf_fields import HFConfigReader  # noqa: F401
    from forge_lm.model.kv_cache import KVCache  # noqa: F401
    from forge_lm.model.linear import Linear, linear, matmul_nt  # noqa: F401
    from forge_lm.model.linear import kernel_in_use as linear_kernel_in_use  # noqa: F401
    from forge_lm.model.norms import RMSNorm  # noqa: F401
    from forge_lm.model.rope import apply_rope  # noqa: F401
    from forge_lm.model.swiglu import SwiGLU, swiglu_hidden  # noqa: F401
    from forge_lm.model.transformer import Block, Transformer, attention_spec, build_layers  # noqa: F401
    from forge_lm.plugins import PluginManager  # noqa: F401
    from forge_lm.run_links import make_dirs as make_run_dirs  # noqa: F401
    from forge_lm.run_links import refuse_links  # noqa: F401
    from forge_lm.run_links import write_text as write_run_text  # noqa: F401
    from forge_lm.train.guards import COMPONENT_ATTRIBUTE, ComponentFailed  # noqa: F401
    from forge_lm.train.guards import mark as mark_component  # noqa: F401
    from forge_lm.train.inference import load_for_inference, locate_checkpoint  # noqa: F401
