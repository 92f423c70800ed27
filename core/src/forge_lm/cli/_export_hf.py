"""``forge export-hf RUN_OR_CHECKPOINT OUT_DIR``: write a checkpoint as a Hugging Face model,
with the run's tokenizer in Hugging Face form beside it.

The first plugin whose ``forge_lm_hf_export`` converts the model writes it (the core's
``core.hf_llama`` converts its dense model to Llama, after every other plugin); a model no
installed plugin converts is refused."""

from __future__ import annotations

import sys

HELP = "export a checkpoint and its tokenizer for Hugging Face (Llama, or what a plugin converts it to)"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
    parser.add_argument("output", metavar="OUT_DIR", help="directory to write the Hugging Face model into")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    import json

    from forge_lm.model.hf import export_with_plugins
    from forge_lm.tokenizers.hf_export import save_hf_tokenizer
    from forge_lm.train.inference import load_for_inference

    manager = plugins()
    model, config, tokenizer = load_for_inference(args.checkpoint, manager)
    out = export_with_plugins(manager, model, config.model, args.output, eos_id=tokenizer.eos_id)
    # The tokenizer goes through the command, not the model's exporter, so a plugin's model
    # (Mixtral through forge-moe) gets it too.
    written = save_hf_tokenizer(tokenizer, out, config.model.max_seq_len)
    architecture = json.loads((out / "config.json").read_text()).get("architectures", ["model"])[0]
    if written:
        print(f"wrote a Hugging Face {architecture} and its tokenizer to {out}")
    else:
        print(f"wrote a Hugging Face {architecture} to {out}")
        print(
            f"forge: warning: the run's tokenizer '{config.tokenizer.name}' has no Hugging Face form Forge knows; "
            f"{out} holds no tokenizer",
            file=sys.stderr,
        )
    return 0
