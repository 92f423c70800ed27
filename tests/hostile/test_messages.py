"""Messages that were wrong though the case was handled: each case is refused as before, and
now says what the input is."""

from __future__ import annotations

import os

import pytest
from _hostile import Case, Outcome, Workspace, case_params


def a_fifo(ws: Workspace) -> None:
    os.mkfifo(ws.root / "data.bin")


def assert_only(ws: Workspace, name: str) -> None:
    assert sorted(path.name for path in ws.root.iterdir()) == [name]


def nothing_written(ws: Workspace, outcome: Outcome) -> None:
    assert_only(ws, "data.bin")


def an_empty_corpus(ws: Workspace) -> None:
    (ws.root / "corpus.txt").write_text("")


CASES = [
    Case(
        "empty-corpus-is-not-an-empty-eval-split",
        (
            "train",
            "{tiny}",
            "--data.name=hf_text",
            "--data.format=text",
            "--data.path={root}/corpus.txt",
            "--eval.interval=2",
            "--train.output_dir={run}",
        ),
        2,
        r"forge: error: dataset 'hf_text' \('.*/corpus\.txt'\) holds no text: its 1 rows are all blank",
        setup=an_empty_corpus,
        check=lambda ws, outcome: assert_only(ws, "corpus.txt"),
    ),
    Case(
        "dataset-path-is-a-fifo",
        ("train", "{tiny}", "--data.name=memmap", "--data.path={root}/data.bin", "--train.output_dir={run}"),
        2,
        r"forge: error: dataset 'memmap': path '.*/data\.bin' is a FIFO \(named pipe\), not a file or a directory "
        r"of \.bin, \.npy files\.$",
        setup=a_fifo,
        check=nothing_written,
    ),
    Case(
        "prepare-data-input-is-a-fifo",
        ("prepare-data", "{root}/data.bin", "--output", "{root}/out"),
        2,
        r"forge: error: input '.*/data\.bin' is a FIFO \(named pipe\), not a file or a directory of text files\.$",
        setup=a_fifo,
        check=nothing_written,
    ),
]


@pytest.mark.parametrize("case", case_params(CASES))
def test_case(case, run_case):
    run_case(case)
