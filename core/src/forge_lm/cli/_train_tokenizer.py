"""``forge train-tokenizer INPUT... --vocab-size N --output DIR``: a byte-level BPE for the ``hf`` tokenizer.

The work is in :mod:`forge_lm.tokenizers.training`; this module is the command line around
it: arguments, a progress display on standard error and the summary on standard output.
"""

from __future__ import annotations

HELP = 'train a byte-level BPE tokenizer on text files into DIR/tokenizer.json, for [tokenizer] name = "hf"'
EPILOG = (
    "Inputs are read as by prepare-data: each text file is one document, each line of a JSON-lines "
    "file (--format jsonl) is one; a directory gives its .txt, .text and .md files (.jsonl and .json "
    "with --format jsonl). Special tokens: <|endoftext|> = id 0 (end of document), <|pad|> = "
    "id 1 (padding). Any UTF-8 text round-trips exactly, except that a literal '<|endoftext|>' or "
    "'<|pad|>' in a text is encoded as that special token. Only DIR/tokenizer.json is written; an "
    "existing one is replaced only with --force. The same inputs and options give the same file."
)
TAKES_OVERRIDES = False


def add_arguments(parser) -> None:
    # Nothing is imported here: every command's arguments are built for `forge --help`, and
    # the training module pulls in numpy. A test keeps 258 equal to training.MIN_VOCAB_SIZE.
    parser.epilog = EPILOG
    parser.add_argument("inputs", nargs="+", metavar="INPUT", help="a file, a directory of files, or a glob")
    parser.add_argument(
        "--vocab-size",
        type=int,
        required=True,
        metavar="N",
        help="tokens in the vocabulary, special tokens included (at least 258: 256 bytes + 2 specials)",
    )
    parser.add_argument(
        "--output", "-o", required=True, metavar="DIR", help="directory for tokenizer.json (created if missing)"
    )
    parser.add_argument(
        "--min-frequency",
        type=int,
        default=2,
        metavar="N",
        help="learn a merge only for a pair seen at least N times (default: 2)",
    )
    parser.add_argument("--format", choices=("text", "jsonl"), default="text", help="input format (default: text)")
    parser.add_argument(
        "--text-field", default="text", metavar="KEY", help="jsonl: the key holding each document (default: text)"
    )
    parser.add_argument("--force", action="store_true", help="replace an existing DIR/tokenizer.json")


def run(args, overrides, plugins) -> int:
    # Training needs the tokenizers library, not plugins, so `plugins` is never called.
    import shlex
    import sys
    from pathlib import Path

    from rich.console import Console
    from rich.progress import BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from forge_lm.tokenizers.training import END_OF_TEXT, train_tokenizer

    console = Console(stderr=True)
    reading = Progress(TextColumn("reading"), BarColumn(), DownloadColumn(), console=console, transient=True)
    # Learning merges reports nothing while it runs: a spinner and a clock show it is alive.
    merging = Progress(
        SpinnerColumn(),
        TextColumn(f"learning merges up to {args.vocab_size} tokens"),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    )
    task = reading.add_task("reading", total=None)

    def read_done() -> None:  # called once the trainer has read every document
        reading.stop()
        merging.add_task("merging", total=None)
        merging.start()

    try:
        with reading:
            result = train_tokenizer(
                args.inputs,
                Path(args.output),
                vocab_size=args.vocab_size,
                min_frequency=args.min_frequency,
                format=args.format,
                text_field=args.text_field,
                force=args.force,
                on_progress=lambda done, total: reading.update(task, completed=done, total=total),
                on_read=read_done,
            )
    finally:
        merging.stop()

    for token, count in result.literal_specials.items():
        print(
            f"forge: note: the training text contains the string {token!r} {count} time(s); "
            "the tokenizer encodes it as that special token, not as text.",
            file=sys.stderr,
        )
    size = f"{result.vocab_size} tokens"
    if not result.reached_requested_size:
        size += (
            f" (not the {result.requested_vocab_size} asked: no more pairs occur at least "
            f"{result.min_frequency} time(s) in this text)"
        )
    use = f"--tokenizer.name=hf --tokenizer.path={shlex.quote(str(result.path))}"
    if result.eos_token != END_OF_TEXT:  # a tokenizer_config.json beside it names another token
        use += f" --tokenizer.eos_token={shlex.quote(END_OF_TEXT)}"
    specials = ", ".join(f"{token} = {token_id}" for token, token_id in result.special_ids.items())
    print(
        f"Trained a byte-level BPE of {size} on {result.documents} document(s) ({result.bytes_read} bytes); "
        f"wrote {result.path}.\nSpecial tokens: {specials}.\nUse it with: {use}",
        file=sys.stdout,
    )
    return 0
