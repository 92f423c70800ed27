"""Inputs that made the start of a run hang instead of being refused: an evaluation asked to read
a trillion batches (every set's batches are read once at the start), a data glob whose ``**``
met a link to /proc (and through /proc/self/root, the whole machine, again and again), a
tokenizer whose pre-tokenizer's regular expression backtracks catastrophically."""

from __future__ import annotations

import pytest
from _hostile import Case, Outcome, Workspace, case_params

AT_MOST = (
    r"steps: must be at most 100000 \(batches per evaluation, all read once when the run starts\), got 1000000000000\.$"
)
TOO_MANY = r"forge: error: \[eval\] " + AT_MOST


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert not ws.run.exists()


def data_with_a_link_to_proc(ws: Workspace) -> None:
    data = ws.root / "data"
    (data / "shards").mkdir(parents=True)
    (data / "proc").symlink_to("/proc")


def backtracking_tokenizer(ws: Workspace) -> None:
    """A byte-level BPE whose pre-tokenizer first splits with ``(a+)+$`` (exponential on a run
    of ``a`` followed by anything else), and a corpus holding such a run."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=alphabet)
    tokenizer.train_from_iterator(["a plain corpus"] * 4, trainer)
    split = pre_tokenizers.Split(Regex("(a+)+$"), "isolated")
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tokenizer.save(str(ws.root / "tokenizer.json"))
    (ws.root / "corpus.txt").write_text("a" * 64 + "!\n" + "plain text\n" * 64)


CASES = [
    Case(
        "tokenizer-regex-backtracks-catastrophically",
        (
            "train",
            "{tiny}",
            "--tokenizer.name=hf",
            "--tokenizer.path={root}/tokenizer.json",
            "--data.name=hf_text",
            "--data.format=text",
            "--data.path={root}/corpus.txt",
            "--train.output_dir={run}",
        ),
        2,
        r"forge: error: \[tokenizer\] path: '.*/tokenizer\.json': the regular expression '\(a\+\)\+\$' "
        r"\(pre_tokenizer\.pretokenizers\[0\]\.pattern\) repeats '\(a\+\)\+', a repetition inside a repetition",
        setup=backtracking_tokenizer,
        subprocess=True,  # the old start hung, or a Rust panic ended it: the harness's timeout bounds it
        check=nothing_written,
    ),
    Case(
        "data-glob-meets-a-link-to-proc",
        ("train", "{tiny}", "--data.name=memmap", "--data.path={root}/data/**/*.bin", "--train.output_dir={run}"),
        2,
        r"forge: error: dataset 'memmap': the pattern '.*/data/\*\*/\*\.bin' holds no \.bin, \.npy files\.$",
        setup=data_with_a_link_to_proc,
        subprocess=True,  # the old walk never ended: in a subprocess the harness's timeout ends it
        check=nothing_written,
    ),
    Case(
        "config-validate-eval-steps-in-the-trillions",
        ("config", "validate", "{tiny}", "--eval.steps=1000000000000"),
        2,
        TOO_MANY,
    ),
    Case(
        "train-eval-steps-in-the-trillions",
        ("train", "{tiny}", "--eval.interval=2", "--eval.steps=1000000000000", "--train.output_dir={run}"),
        2,
        TOO_MANY,
        check=nothing_written,
    ),
    Case(
        "eval-set-steps-in-the-trillions",
        (
            "train",
            "{tiny}",
            "--eval.interval=2",
            "--eval.datasets.held_out.name=synthetic",
            "--eval.datasets.held_out.steps=1000000000000",
            "--train.output_dir={run}",
        ),
        2,
        r"forge: error: \[eval\.datasets\.held_out\] " + AT_MOST,
        check=nothing_written,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
