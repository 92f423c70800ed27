"""Conversion between Forge's models and Hugging Face's, in five parts:

- :mod:`~forge_lm.model.hf.names`: the weight renaming every Hugging Face decoder of Forge's
  shape shares (:func:`rename_to_hf`, :func:`rename_from_hf`);
- :mod:`~forge_lm.model.hf.llama`: Forge's dense model as ``LlamaForCausalLM`` or
  ``Qwen3ForCausalLM``, configs and weights, both ways (the core's answers to the hooks);
- :mod:`~forge_lm.model.hf.files`: a model directory's ``config.json`` and safetensors files;
- :mod:`~forge_lm.model.hf.hooks`: ``forge export-hf`` and ``forge import-hf``, which convert
  only through the ``forge_lm_hf_export`` / ``forge_lm_hf_import`` hooks;
- :mod:`~forge_lm.model.hf.building`: the model of a converted directory, built and loaded with
  the checks ``forge import-hf`` and ``forge_lm.load_pretrained`` share.

The names below are re-exported so that ``from forge_lm.model.hf import ...`` keeps working;
plugins take theirs from :mod:`forge_lm.api`. ``transformers`` is needed only for
:func:`to_hf_config`; export and import need ``safetensors`` (the core's ``hf`` extra). Both are
imported inside the functions that use them.
"""

from forge_lm.model.hf.building import build_imported, check_imported_fits, load_imported
from forge_lm.model.hf.files import (
    WEIGHTS_FILE,
    WEIGHTS_INDEX_FILE,
    check_export_dir,
    make_export_dir,
    read_hf,
    refuse_export_links,
    write_export_file,
    write_hf,
)
from forge_lm.model.hf.hooks import (
    IMPORTED_SIZES,
    HFImport,
    convert_from_hf,
    export_with_plugins,
    import_with_plugins,
    sized_table,
    state_mismatches,
)
from forge_lm.model.hf.llama import (
    QWEN3_ATTENTION_FIELDS,
    check_llama_compatible,
    check_qwen3_compatible,
    decoder_config_fields,
    dense_export,
    dense_import,
    export_hf,
    from_hf_state_dict,
    hf_config_dict,
    llama_export,
    llama_import,
    load_hf,
    model_section_fields,
    qwen3_attention_problems,
    qwen3_config_dict,
    qwen3_export,
    qwen3_import,
    qwen3_section_fields,
    swiglu_hidden_of,
    swiglu_options_for,
    to_hf_config,
    to_hf_state_dict,
)
from forge_lm.model.hf.names import FeedForwardRenamer, rename_from_hf, rename_to_hf
from forge_lm.model.hf_fields import CONFIG_FILE

__all__ = [
    "CONFIG_FILE",
    "IMPORTED_SIZES",
    "QWEN3_ATTENTION_FIELDS",
    "WEIGHTS_FILE",
    "WEIGHTS_INDEX_FILE",
    "FeedForwardRenamer",
    "HFImport",
    "build_imported",
    "check_export_dir",
    "check_imported_fits",
    "check_llama_compatible",
    "check_qwen3_compatible",
    "convert_from_hf",
    "decoder_config_fields",
    "dense_export",
    "dense_import",
    "export_hf",
    "export_with_plugins",
    "from_hf_state_dict",
    "hf_config_dict",
    "import_with_plugins",
    "llama_export",
    "llama_import",
    "load_hf",
    "load_imported",
    "make_export_dir",
    "model_section_fields",
    "qwen3_attention_problems",
    "qwen3_config_dict",
    "qwen3_export",
    "qwen3_import",
    "qwen3_section_fields",
    "read_hf",
    "refuse_export_links",
    "rename_from_hf",
    "rename_to_hf",
    "sized_table",
    "state_mismatches",
    "swiglu_hidden_of",
    "swiglu_options_for",
    "to_hf_config",
    "to_hf_state_dict",
    "write_export_file",
    "write_hf",
]
