"""``forge prepare-data``: tokenize text files into ``.bin`` shards for the ``memmap`` dataset.

The tokenizer is the run config's ``[tokenizer]`` (defaults, then ``--config``, then
``--tokenizer.key=value`` overrides), so the shards match the runs that will read them.
"""

from __future__ import annotations

HELP = "tokenize text files into .bin shards for the memmap dataset"
TAKES_OVERRIDES = True


def add_arguments(parser) -> None:
    from forge_lm.cli._main import add_plugin_switches

    parser.description = (
        f"{HELP[0].upper()}{HELP[1:]}. Each text file is one document; each line of a JSON-lines "
        "file is one. The tokenizer is the config's [tokenizer] (override with --tokenizer.name=...)."
    )
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, a directory of files, or a glob")
    parser.add_argument("--output", "-o", required=True, metavar="DIR", help="directory for the shards (created)")
    parser.add_argument("--format", choices=("text", "jsonl"), default="text", help="input format (default: text)")
    parser.add_argument(
        "--text-field", default="text", metavar="KEY", help="jsonl: the key holding each document (default: text)"
    )
    parser.add_argument(
        "--shard-tokens",
        type=int,
        default=100_000_000,
        metavar="N",
        help="tokens per shard (default: 100000000)",
    )
    parser.add_argument("--config", metavar="CONFIG", help="TOML run config whose [tokenizer] to use")
    add_plugin_switches(parser, after_command=True)


def run(args, overrides, plugins) -> int:
    import sys
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

    from forge_lm.config import load_config
    from forge_lm.data.prepare import prepare

    registry = plugins().registry
    config = load_config(args.config, overrides, registry)
    tokenizer = config.tokenizer.build()
    columns = (TextColumn("tokenizing"), BarColumn(), DownloadColumn(), TimeRemainingColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        task = progress.add_task("tokenizing", total=None)
        result = prepare(
            args.inputs,
            Path(args.output),
            tokenizer,
            tokenizer_name=config.tokenizer.name,
            format=args.format,
            text_field=args.text_field,
            shard_tokens=args.shard_tokens,
            on_progress=lambda done, total: progress.update(task, completed=done, total=total),
        )
    print(
        f"Wrote {result.num_tokens} tokens ({result.documents} documents, {result.dtype}) to "
        f"{len(result.shards)} shard(s) in {args.output}.",
        file=sys.stdout,
    )
    return 0
