"""``forge export-hf RUN_OR_CHECKPOINT OUT_DIR``: write a checkpoint as a Hugging Face model,
with the run's tokenizer in Hugging Face form beside it.

The first plugin whose ``forge_lm_hf_export`` converts the model writes it (the core's
``core.hf_llama`` converts its dense model to Llama or Qwen3, after every other plugin); a model no
installed plugin converts is refused.

OUT_DIR may be new or an existing directory; one that already holds an export (``config.json``,
weights, tokenizer files) is refused unless ``--force`` is given, which replaces that export:
its files that this export does not write again (an index and its shards, tokenizer files) are
removed once the model is written. No file is written through a link."""

from __future__ import annotations

import os
import re
from pathlib import Path

HELP = "export a checkpoint and its tokenizer for Hugging Face (Llama, Qwen3, or what a plugin converts it to)"
TAKES_OVERRIDES = False
SHARD = re.compile(r"model-.*\.safetensors")  # the shards of a model.safetensors.index.json


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
    parser.add_argument("output", metavar="OUT_DIR", help="directory to write the Hugging Face model into")
    parser.add_argument(
        "--force",
        action="store_true",
        help="replace an export already in OUT_DIR, removing its files this export does not write",
    )
    add_plugin_switches(parser, after_command=True)


def _previous_export(out: Path, keep: set[str]) -> list[str]:
    """The names of ``out``'s entries that an export writes or leaves behind (``keep`` aside)."""
    from forge_lm.model.hf import CONFIG_FILE, WEIGHTS_FILE, WEIGHTS_INDEX_FILE
    from forge_lm.tokenizers.hf_export import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE, TOKENIZER_FILE

    if not out.is_dir():
        return []
    exported = {
        CONFIG_FILE,
        WEIGHTS_FILE,
        WEIGHTS_INDEX_FILE,
        TOKENIZER_FILE,
        TOKENIZER_CONFIG_FILE,
        SPECIAL_TOKENS_MAP_FILE,
    }
    return sorted(
        entry.name
        for entry in out.iterdir()
        if entry.name not in keep and (entry.name in exported or SHARD.fullmatch(entry.name))
    )


def run(args, overrides, plugins) -> int:
    import json

    from forge_lm.errors import ForgeError
    from forge_lm.model.hf import (
        CONFIG_FILE,
        WEIGHTS_FILE,
        check_export_dir,
        export_with_plugins,
        refuse_export_links,
    )
    from forge_lm.notices import warn
    from forge_lm.tokenizers.hf_export import TOKENIZER_FILE, hf_tokenizer_files, is_same_file, save_hf_tokenizer
    from forge_lm.train.inference import load_for_inference

    manager = plugins()
    model, config, tokenizer = load_for_inference(args.checkpoint, manager)
    out = check_export_dir(args.output)
    tokenizer_files = hf_tokenizer_files(tokenizer)
    source = getattr(tokenizer, "path", None) if tokenizer_files else None
    own = {TOKENIZER_FILE} if source is not None and is_same_file(source, out / TOKENIZER_FILE) else set()
    previous = _previous_export(out, keep=own)
    # Before anything is written: no link among the names written or removed, no export replaced unasked.
    writes = [CONFIG_FILE, WEIGHTS_FILE, *tokenizer_files]
    refuse_export_links(out, [*previous, *writes])
    folders = [name for name in [*previous, *writes] if (out / name).is_dir()]
    if folders:
        raise ForgeError(f"'{out / folders[0]}' is a directory, where the export writes or removes a file.")
    if previous and not args.force:
        raise ForgeError(
            f"'{out}' already holds an export ({', '.join(previous)}); export-hf does not overwrite it. Choose another "
            "directory, or pass --force to replace that export."
        )
    out = export_with_plugins(manager, model, config.model.options, out, eos_id=tokenizer.eos_id)
    for name in sorted(set(previous) - set(writes)):
        os.unlink(out / name)  # the previous export's index, shards and tokenizer files: not this export's
    # The tokenizer goes through the command, not the model's exporter, so a plugin's model
    # (Mixtral through forge-moe) gets it too.
    written = save_hf_tokenizer(tokenizer, out, config.model.options.max_seq_len)
    architecture = json.loads((out / "config.json").read_text()).get("architectures", ["model"])[0]
    if written:
        print(f"wrote a Hugging Face {architecture} and its tokenizer to {out}")
    else:
        print(f"wrote a Hugging Face {architecture} to {out}")
        warn(
            f"the run's tokenizer '{config.tokenizer.name}' has no Hugging Face form Forge knows; "
            f"{out} holds no tokenizer"
        )
    return 0
