"""Data loading: the loader's tokens/s against what the training step consumes, and deep resume.

Throughput: Forge's ``BatchLoader`` over the default dataset (``python_stdlib``: the standard
library's source, byte tokens), over ``memmap`` shards of the same text written by
``forge_lm.data.prepare`` into a temporary directory, and over ``hf_text`` with
``streaming = true`` reading the same text as JSON-lines files (tokenized and packed on the
fly, through a shuffle buffer of 1024 windows), all built from the registry as ``forge train``
builds them (default batch and sequence sizes), against the baseline that matters: the
tokens/s of the default model's training step (Forge's loop body, as in ``bench_train.py``). A
loader that is many times faster than the step never starves it; the share of a step spent
loading its batch is reported.

Resume: the time to the first batch after ``load_state_dict`` of a loader at a late position
against at sample 0, per dataset. For the sampled datasets the position is sample 10^6 (a long
run's); their sampler seeks in O(1), so the two should match. A stream has no O(1) seek: its
late position is read to (most of a pass over the files, into the last file), and resuming
there skips that file's earlier rows and tokenizes the buffer's documents again. For scale, the
time that replaying to the position would take is estimated from the measured per-sample rate.

All variants alternate round by round after warm-up rounds; medians are reported.

Run:  .venv/bin/python benchmarks/bench_data.py [--rounds 7] [--quick]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _record import alternate, median, save
from bench_train import ForgeSide

from forge_lm.config import load_config
from forge_lm.data.loader import BatchLoader
from forge_lm.data.prepare import prepare
from forge_lm.data.stdlib import MODULES, module_source, stdlib_directory
from forge_lm.plugins import PluginManager, PluginSettings
from forge_lm.train.builders import build_dataset

DEEP = 10**6  # samples: a long run's position
STREAM_FILES = 4  # JSON-lines files the streamed copy of the corpus is split into
STREAM_BUFFER = 1024  # windows in the streaming dataset's shuffle buffer
STREAM_DEEP_SHARE = 0.85  # the stream's late position: this share of a pass, read to


def write_shards(output: Path, shard_tokens: int) -> int:
    """The standard library's modules (the default corpus) as ``memmap`` shards; their token count."""
    manager = PluginManager(PluginSettings(autoload=False))
    tokenizer = load_config(None, [], manager.registry).tokenizer.build()
    root = stdlib_directory()
    files = [str(path) for module in MODULES if (path := module_source(root, module)) is not None]
    return prepare(files, output, tokenizer, tokenizer_name="bytes", shard_tokens=shard_tokens).num_tokens


def write_jsonl(output: Path, files: int) -> None:
    """The standard library's modules as JSON-lines documents, spread over ``files`` files."""
    root = stdlib_directory()
    texts = [p.read_text(encoding="utf-8") for module in MODULES if (p := module_source(root, module)) is not None]
    output.mkdir(parents=True)
    per_file = -(-len(texts) // files)
    for index in range(files):
        rows = texts[index * per_file : (index + 1) * per_file]
        (output / f"part{index}.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in rows))


def build_loader(overrides: list[str], settings: PluginSettings) -> BatchLoader:
    """The training loader of the config ``overrides`` make, as the training loop builds it."""
    manager = PluginManager(settings)
    config = load_config(None, overrides, manager.registry)
    tokenizer = config.tokenizer.build()
    vocab_size = config.model.options.vocab_size or tokenizer.vocab_size
    return BatchLoader(build_dataset(config, manager.registry, tokenizer, vocab_size, "train"), config.train.batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batches", type=int, default=50, help="batches per loader block")
    parser.add_argument("--train-steps", type=int, default=3, help="training steps per block of the baseline")
    parser.add_argument("--shard-tokens", type=int, default=1_000_000, help="tokens per memmap shard")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's choice)")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 2 rounds, no warm-up, small blocks")
    parser.add_argument("--no-save", action="store_true", help="print only; do not write results/data.json")
    args = parser.parse_args()
    if args.quick:
        args.rounds, args.warmup, args.batches, args.train_steps = 2, 0, 10, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    settings = PluginSettings.from_env()

    workdir = Path(tempfile.mkdtemp(prefix="forge-bench-data-"))
    try:
        print("writing memmap shards with forge_lm.data.prepare ...", flush=True)
        start = time.perf_counter()
        shard_dir = workdir / "shards"
        num_tokens = write_shards(shard_dir, args.shard_tokens)
        prepare_s = time.perf_counter() - start
        shards = len(list(shard_dir.glob("*.bin")))
        write_jsonl(workdir / "jsonl", STREAM_FILES)
        datasets = {
            "python_stdlib": ["--train.device=cpu"],
            "memmap": ["--train.device=cpu", "--data.name=memmap", f"--data.path={shard_dir}"],
            "hf_text streaming": [
                "--train.device=cpu",
                "--data.name=hf_text",
                "--data.format=jsonl",
                f"--data.path={workdir / 'jsonl'}",
                "--data.streaming=true",
                f"--data.shuffle_buffer={STREAM_BUFFER}",
            ],
        }
        loaders = {name: build_loader(overrides, settings) for name, overrides in datasets.items()}
        step = ForgeSide(["--train.device=cpu", "--train.precision=fp32"], workdir / "train", settings)
        batch_size, seq_len = step.config.train.batch_size, step.config.train.seq_len
        tokens_per_batch = batch_size * seq_len

        streams = {name: iter(loader) for name, loader in loaders.items()}

        def throughput(name: str) -> Any:
            def run() -> float:
                stream = streams[name]
                begin = time.perf_counter()
                for _ in range(args.batches):
                    next(stream)
                return tokens_per_batch * args.batches / (time.perf_counter() - begin)

            return run

        # Resume states: a loader at sample 0, and at a late position (sample DEEP by the
        # sampler's own O(1) skip; for a stream, read to), then the loader's state: what a
        # checkpoint of a long run holds.
        resumers = {name: build_loader(overrides, settings) for name, overrides in datasets.items()}
        states, deep = {}, {}
        for name, overrides in datasets.items():
            probe = build_loader(overrides, settings)
            states[(name, 0)] = probe.state_dict()
            if hasattr(probe.dataset, "sampler"):
                probe.dataset.sampler.skip(DEEP)
                probe.batches = DEEP // batch_size
                deep[name] = DEEP
            else:
                late = int(STREAM_DEEP_SHARE * num_tokens / tokens_per_batch)
                batches = iter(probe)
                for _ in range(late):
                    next(batches)
                deep[name] = late * batch_size
            states[(name, deep[name])] = probe.state_dict()

        def resume(name: str, position: int) -> Any:
            def run() -> float:
                loader = resumers[name]
                begin = time.perf_counter()
                loader.load_state_dict(states[(name, position)])
                next(iter(loader))
                return time.perf_counter() - begin

            return run

        variants: dict[str, Any] = {f"loader {name}": throughput(name) for name in loaders}
        variants["training step"] = lambda: step.run(args.train_steps)
        for name in loaders:
            for position in (0, deep[name]):
                variants[f"resume {name} @{position}"] = resume(name, position)
        started = time.perf_counter()

        def progress(index: int) -> None:
            elapsed = time.perf_counter() - started
            print(f"  round {index + 1}/{args.warmup + args.rounds} done, {elapsed:.0f} s", flush=True)

        samples = alternate(variants, args.rounds, args.warmup, progress, rotate=True)
        step.close()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)

    medians = {name: median(values) for name, values in samples.items()}
    train_rate = medians["training step"]
    rows = [
        {
            "what": "training step (default model, fp32): the consumer",
            "tokens_per_s": train_rate,
            "x_training_step": 1.0,
            "loading_share_of_step": None,
        }
    ]
    for name in loaders:
        rate = medians[f"loader {name}"]
        rows.append(
            {
                "what": f"BatchLoader, {name}",
                "tokens_per_s": rate,
                "x_training_step": rate / train_rate,
                "loading_share_of_step": train_rate / rate,
            }
        )
    resume_rows = []
    for name in loaders:
        per_sample = tokens_per_batch / medians[f"loader {name}"] / batch_size  # seconds per sample
        at_zero = medians[f"resume {name} @0"]
        for position in (0, deep[name]):
            value = medians[f"resume {name} @{position}"]
            resume_rows.append(
                {
                    "data": name,
                    "position (samples)": position,
                    "first_batch_ms": value * 1000,
                    "x_position_0": value / at_zero,
                    "replaying_to_position_s (estimate)": per_sample * position,
                }
            )
    for row in rows:
        print(f"{row['what']:52s} {row['tokens_per_s']:12.0f} tok/s  x{row['x_training_step']:.1f} of the step")
    for row in resume_rows:
        print(
            f"resume {row['data']:17s} @{row['position (samples)']:>8d}: first batch "
            f"{row['first_batch_ms']:7.2f} ms (x{row['x_position_0']:.2f} of @0); replaying would take "
            f"~{row['replaying_to_position_s (estimate)']:.1f} s"
        )

    notes = (
        f"Batches of {batch_size} x {seq_len} tokens (the default config), read on the CPU in the training "
        f"process as the loop does. memmap: {num_tokens} tokens of the same corpus in {shards} shards of up to "
        f"{args.shard_tokens} tokens, written by `forge_lm.data.prepare` in {prepare_s:.1f} s. hf_text streaming: "
        f"the same modules as JSON-lines documents in {STREAM_FILES} files, read with `streaming = true` and "
        f"`shuffle_buffer = {STREAM_BUFFER}` (tokenize + pack on the fly, byte tokens). Medians of "
        f"{args.rounds} alternating rounds after {args.warmup} warm-up round(s): {args.batches} batches per loader "
        f"block, {args.train_steps} training steps per step block. `x_training_step`: loader tokens/s over the "
        "training step's (above 1: the loader keeps up); `loading_share_of_step`: the time loading a step's "
        "batch takes, as a share of the step. Resume: `load_state_dict` then the first batch, at sample 0 and at "
        f"sample {DEEP} (the stream: at {STREAM_DEEP_SHARE:.0%} of a pass, read to; its resume skips the rows "
        "before the position in that file and tokenizes the buffer's documents again); the replay estimate is "
        "the position's samples at the measured loader rate, what a loader without a seek would pay."
    )
    headline = [
        {
            "measure": "BatchLoader (python_stdlib) / training step of the default model, tokens/s",
            "value": rows[1]["x_training_step"],
            "meaning": "above 1: loading never starves the step",
        },
        {
            "measure": f"resume at sample {DEEP} / at sample 0, time to first batch (python_stdlib)",
            "value": resume_rows[1]["x_position_0"],
            "meaning": "about 1: seeking is O(1)",
        },
        {
            "measure": "BatchLoader (hf_text streaming: tokenize + pack) / training step of the default model",
            "value": rows[3]["x_training_step"],
            "meaning": "above 1: a streamed corpus never starves the step",
        },
    ]
    if not args.no_save:
        command = ("python benchmarks/bench_data.py " + " ".join(sys.argv[1:])).strip()
        path = save("data", command, rows, notes, tables={"resume at a deep position": resume_rows}, headline=headline)
        print(f"wrote {path}")


if __name__ == "__main__":
    main()
