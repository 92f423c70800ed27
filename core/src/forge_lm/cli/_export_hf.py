"""``forge export-hf RUN_OR_CHECKPOINT OUT_DIR``: write a checkpoint in Hugging Face Llama format."""

from __future__ import annotations

HELP = "export a checkpoint as a Hugging Face model (Llama, or what a plugin maps it to)"
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("checkpoint", metavar="RUN_OR_CHECKPOINT", help="a run directory or checkpoints/step_<N>")
    parser.add_argument("output", metavar="OUT_DIR", help="directory to write the Hugging Face model into")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    import json

    from forge_lm.model.hf import export_with_plugins
    from forge_lm.train.inference import load_for_inference

    manager = plugins()
    model, config, tokenizer = load_for_inference(args.checkpoint, manager)
    out = export_with_plugins(manager, model, config.model, args.output, eos_id=tokenizer.eos_id)
    architecture = json.loads((out / "config.json").read_text()).get("architectures", ["model"])[0]
    print(f"wrote a Hugging Face {architecture} to {out}")
    return 0
