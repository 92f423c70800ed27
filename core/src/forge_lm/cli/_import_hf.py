"""``forge import-hf HF_DIR --train.output_dir=RUN``: a Hugging Face model as a Forge run.

The first plugin whose ``forge_lm_hf_import`` reads the ``config.json``'s model type (the
core's ``core.hf_llama`` reads Llama and Qwen3, after every other plugin) gives the model section and
the weights; a model type no installed plugin reads is refused. The weights become the run's
``checkpoints/step_0``; ``forge generate``, ``forge export-hf`` and the Python API then use it
like any run. A ``tokenizer.json`` beside the model becomes the run's tokenizer unless the
overrides choose another. Other overrides set the rest of the run config.

Everything in the directory is untrusted: ``config.json``'s fields are checked by the converter
(naming each), the plugin's table and state dict here (naming the plugin), the model's memory is
estimated before it is built (refused, with the estimate, if it does not fit this host), and the
weights' names and shapes are compared with the built model's before they are loaded.
"""

from __future__ import annotations

HELP = "import a Hugging Face model (Llama, Qwen3, or what a plugin reads) into a new run directory"
TAKES_OVERRIDES = True


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.add_argument("hf_dir", metavar="HF_DIR", help="a directory written by save_pretrained or export-hf")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    from pathlib import Path

    from forge_lm.checkpoint import CheckpointManager
    from forge_lm.config import TrainSection, merge, parse_overrides, structure_config
    from forge_lm.errors import ConfigError, ForgeError, UsageError
    from forge_lm.model.hf import build_imported, check_imported_fits, convert_from_hf, load_imported, sized_table
    from forge_lm.train.run_dir import RunDirectory

    hf_dir = Path(args.hf_dir)
    manager = plugins()
    imported = convert_from_hf(manager, hf_dir)  # the table's sizes and the state's tensors are checked there
    model_table = imported.table
    # The default training sequence length may exceed what a small imported model accepts.
    max_seq_len = sized_table(model_table)["max_seq_len"]
    layers = {"model": model_table, "train": {"seq_len": min(TrainSection().seq_len, max_seq_len)}}
    try:  # the plugin's table alone, before the overrides: a mistake in it is the file's or the plugin's
        structure_config(layers, manager.registry)
    except (ConfigError, UsageError) as exc:
        raise ForgeError(
            f"the [model] table that {imported.plugin.label} made from '{imported.config_path}' is not valid: {exc} "
            f"Correct that field in {imported.config_path.name}; if it is right, this is a bug in the plugin: report "
            f"it to its authors, or run without it (--block-plugin {imported.plugin.name})."
        ) from None
    if (hf_dir / "tokenizer.json").is_file():
        # Absolute: the run's config.toml must find it from wherever the run is later used.
        layers["tokenizer"] = {"name": "hf", "path": str((hf_dir / "tokenizer.json").resolve())}
    config = structure_config(merge(layers, parse_overrides(overrides)), manager.registry)
    manager.configure(config)

    check_imported_fits(config, manager.registry, imported)
    model = build_imported(config, manager.registry, imported)
    load_imported(model, imported)
    taken = ConfigError(f"[train] output_dir: '{config.train.output_dir}' already holds a run; choose a new one.")
    if Path(config.train.output_dir, "config.toml").exists():
        raise taken
    # Under the run directory's lock, as `forge train` holds it; if the import fails before its
    # checkpoint is written, the directory it created goes with it (no half-made run is left).
    with RunDirectory(config.train.output_dir) as run:
        run_dir, resuming = run.open(config, manager)
        if resuming:  # another command made a run there since the check above
            raise taken
        optimizer = config.optimizer.build(model)  # fresh: nothing trained yet
        # Step 0 with no scheduler or data position: `forge train` on this directory starts
        # training from the imported weights.
        state = {"tokens_seen": 0, "plugins": {}, "imported_from": str(hf_dir.resolve())}
        try:
            CheckpointManager(run_dir).save(0, model, optimizer, state)
        except OSError as exc:  # a full disk, a read-only mount: the directory goes (above), the fix is the user's
            raise ForgeError(
                f"cannot write the imported checkpoint into '{run_dir}': {exc.strerror or exc}. Free space "
                "there or choose another train.output_dir; nothing was kept."
            ) from exc
        run.trained = True  # a complete run directory from here on: kept whatever happens
    print(f"imported {hf_dir} into run directory {run_dir}")
    return 0
