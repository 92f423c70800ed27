"""hf_text with streaming = true: the order, the ranks' shares, the shuffle buffer, exact resumption."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

from forge_lm.checkpoint import DamagedCheckpointError
from forge_lm.checkpoint._state import check_like
from forge_lm.components import DataContext
from forge_lm.config import load_config
from forge_lm.errors import ConfigError, ForgeError
from forge_lm.metrics.jsonl import read_metrics
from forge_lm.testing import TINY_MODEL, check_component
from forge_lm.testing._tiny import plain_round_trip
from forge_lm.testing.distributed import torchrun
from forge_lm.tokenizers.byte_level import ByteTokenizer
from forge_lm.train import train

EOS = 256  # the byte tokenizer's end of text


def document(f: int, k: int) -> str:
    """Distinct documents of uneven lengths, some longer than a window."""
    return f"file {f} doc {k}: " + "lorem ipsum " * (k % 7) + "dolor " * (k % 3)


@pytest.fixture
def corpus(tmp_path) -> Path:
    """Three JSON-lines files of 30 rows with a field beside ``text``; row 11 of each is blank
    (no document, but a row all the same for the eval split's count)."""
    root = tmp_path / "corpus"
    root.mkdir()
    for f in range(3):
        rows = [{"text": document(f, k), "id": k} for k in range(30)]
        rows[11]["text"] = "   "
        (root / f"part{f}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    return root


def table(corpus: Path, **options) -> dict:
    """The streaming dataset's options (``cache_dir`` for the in-memory one it is compared with)."""
    defaults = {"path": str(corpus), "format": "jsonl", "eval_fraction": 0.1, "streaming": True}
    return {**defaults, "cache_dir": str(corpus.parent / "cache"), **options}


def ids(samples) -> list[list[int]]:
    return [sample["input_ids"].tolist() + sample["labels"][-1:].tolist() for sample in samples]


def documents_of(windows: list[list[int]]) -> list[str]:
    """The whole documents in a rank's windows (each window starts with the last token of the one before)."""
    stream = windows[0] + [token for window in windows[1:] for token in window[1:]]
    texts, current = [], []
    for token in stream:
        if token == EOS:
            texts.append(bytes(current).decode())
            current = []
        else:
            current.append(token)
    return texts[1:]  # the first is whole here, but is dropped like any possibly partial edge


def split_documents(split: str) -> list[str]:
    """The documents of a split in row order: row k (counted over the files) is held out at k = 9, 19, ..."""
    rows = [(document(f, k) if k != 11 else "   ") for f in range(3) for k in range(30)]
    held = [index % 10 == 9 for index in range(len(rows))]
    return [text for text, out in zip(rows, held, strict=True) if out == (split == "eval") and text.strip()]


# -- order ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", ["train", "eval"])
def test_the_stream_is_the_in_memory_datasets_windows_in_order(corpus, build_dataset, byte_context, take, split):
    context = byte_context(split=split)
    in_memory = build_dataset("hf_text", {**table(corpus), "streaming": False}, context)
    streamed = take(build_dataset("hf_text", table(corpus), context), len(in_memory) + 3)
    expected = [in_memory.sample(index)["input_ids"].tolist() for index in range(len(in_memory))]
    assert [sample["input_ids"].tolist() for sample in streamed[: len(in_memory)]] == expected
    assert all(set(sample) == {"input_ids", "labels", "document_ids"} for sample in streamed)
    # the next pass follows, the packing running on across the seam
    assert streamed[len(in_memory)]["input_ids"].tolist() != expected[0]


def test_text_lines_and_parquet_stream_as_they_load_in_memory(tmp_path, build_dataset, byte_context, take):
    import pyarrow as pa
    import pyarrow.parquet as pq

    (tmp_path / "a.txt").write_text("".join(f"line {k} " + "x" * k + "\n" for k in range(40)))
    pq.write_table(pa.table({"body": [document(0, k) for k in range(40)]}), tmp_path / "b.parquet", row_group_size=7)
    for options in (
        {"path": str(tmp_path / "a.txt"), "sample_by": "line"},
        {"path": str(tmp_path / "b.parquet"), "format": "parquet", "text_field": "body"},
    ):
        options = {**options, "eval_fraction": 0.05, "cache_dir": str(tmp_path / "cache")}
        in_memory = build_dataset("hf_text", options, byte_context())
        streamed = take(build_dataset("hf_text", {**options, "streaming": True}, byte_context()), len(in_memory))
        assert [s["input_ids"].tolist() for s in streamed] == [
            in_memory.sample(index)["input_ids"].tolist() for index in range(len(in_memory))
        ]


@pytest.mark.parametrize("split", ["train", "eval"])
def test_two_ranks_read_disjoint_documents_that_together_are_the_split(
    corpus, build_dataset, byte_context, take, split
):
    expected = split_documents(split)
    shares = []
    for rank in (0, 1):
        dataset = build_dataset("hf_text", table(corpus), byte_context(split=split, dp_rank=rank, dp_size=2))
        windows = ids(take(dataset, 200))  # more than a pass: the documents then repeat
        shares.append(documents_of(windows)[: len(expected[rank::2]) - 1])
    # rank r reads document j of the split when j % 2 == r, in order
    assert shares[0] == expected[0::2][1:]
    assert shares[1] == expected[1::2][1:]
    assert not set(shares[0]) & set(shares[1])
    assert set(shares[0]) | set(shares[1]) | {expected[0], expected[1]} == set(expected)


def test_ranks_without_a_document_say_so(tmp_path, build_dataset, byte_context, take):
    (tmp_path / "one.jsonl").write_text(json.dumps({"text": "the only document"}) + "\n")
    dataset = build_dataset(
        "hf_text",
        {"path": str(tmp_path / "one.jsonl"), "format": "jsonl", "streaming": True, "eval_fraction": 0.0},
        byte_context(dp_rank=1, dp_size=2, seq_len=4),
    )
    with pytest.raises(ConfigError, match="has no document for data-parallel rank 1 of 2"):
        take(dataset, 1)


def test_an_eval_split_with_nothing_held_out_is_refused_at_once(corpus, build_dataset, byte_context):
    with pytest.raises(ConfigError, match=r"eval split .* is empty: eval_fraction = 0"):
        build_dataset("hf_text", table(corpus, eval_fraction=0.0), byte_context(split="eval"))


def test_a_shuffle_buffer_without_streaming_is_a_config_error(corpus, build_dataset, byte_context):
    with pytest.raises(ConfigError, match=r"\[data\] shuffle_buffer: applies to streaming = true only"):
        build_dataset("hf_text", table(corpus, streaming=False, shuffle_buffer=8), byte_context())


# -- shuffle buffer --------------------------------------------------------------------------------


def test_the_buffer_shuffles_each_block_of_windows_by_the_seed(corpus, build_dataset, byte_context, take):
    in_order = ids(take(build_dataset("hf_text", table(corpus), byte_context()), 48))
    shuffled = ids(take(build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context()), 48))
    again = ids(take(build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context()), 48))
    other_seed = ids(take(build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context(seed=4)), 48))
    assert shuffled == again  # determined by the seed
    assert shuffled != in_order
    assert shuffled != other_seed
    for block in range(3):  # each block is a permutation of the same 16 windows
        window = slice(16 * block, 16 * block + 16)
        assert sorted(shuffled[window]) == sorted(in_order[window])
        assert shuffled[window] != in_order[window]


def test_the_eval_split_is_never_shuffled(corpus, build_dataset, byte_context, take):
    plain = take(build_dataset("hf_text", table(corpus), byte_context(split="eval")), 10)
    buffered = take(build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context(split="eval")), 10)
    assert ids(plain) == ids(buffered)


# -- resumption ------------------------------------------------------------------------------------


@pytest.mark.parametrize("consumed", [0, 5, 16, 37, 330])  # start, mid-block, a block's end, later, next pass
def test_a_saved_state_resumes_with_the_same_samples_and_buffer(corpus, build_dataset, byte_context, take, consumed):
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context())
    iterator = iter(dataset)
    _ = [next(iterator) for _ in range(consumed)]
    state = plain_round_trip(dataset.state_dict())
    json.dumps(state)  # plain JSON, as the trainer state stores it
    expected = ids(next(iterator) for _ in range(40))
    resumed = build_dataset("hf_text", table(corpus, shuffle_buffer=16), byte_context())
    resumed.load_state_dict(state)
    assert ids(take(resumed, 40)) == expected
    assert all(torch.equal(a, b) for a, b in zip(next(iter(resumed)).values(), next(iterator).values(), strict=True))


def test_the_state_is_a_few_integers_whatever_the_buffer(corpus, build_dataset, byte_context, take):
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=64), byte_context())
    take(dataset, 70)
    state = dataset.state_dict()
    (entry,) = state["ranks"]
    assert entry == {
        "dp_rank": 0,
        "epoch": entry["epoch"],
        "file": entry["file"],
        "row": entry["row"],
        "index": entry["index"],
        "ordinal": entry["ordinal"],
        "offset": entry["offset"],
        "block": 1,
        "emitted": 6,
    }
    assert len(json.dumps(state)) < 400


def test_a_running_iterator_follows_a_loaded_state(corpus, build_dataset, byte_context, take):
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=8), byte_context())
    iterator = iter(dataset)
    start = dataset.state_dict()
    first = ids(next(iterator) for _ in range(3))
    dataset.load_state_dict(start)
    assert ids(next(iterator) for _ in range(3)) == first


def test_each_rank_resumes_from_its_own_entry(corpus, build_dataset, byte_context, take):
    for rank in (0, 1):
        context = byte_context(dp_rank=rank, dp_size=2)
        dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=8), context)
        iterator = iter(dataset)
        _ = [next(iterator) for _ in range(11)]
        state = dataset.state_dict()
        assert [entry["dp_rank"] for entry in state["ranks"]] == [rank]  # no process group: its own only
        resumed = build_dataset("hf_text", table(corpus, shuffle_buffer=8), context)
        resumed.load_state_dict(state)
        assert ids(take(resumed, 9)) == ids(next(iterator) for _ in range(9))
        other = build_dataset("hf_text", table(corpus, shuffle_buffer=8), byte_context(dp_rank=1 - rank, dp_size=2))
        with pytest.raises(ForgeError, match=f"holds 0 positions for data-parallel rank {1 - rank}"):
            other.load_state_dict(state)


def test_a_mixture_with_a_streaming_source_resumes_exactly(corpus, build_dataset, byte_context, take):
    mixture = {
        "sources": [
            {"name": "hf_text", **table(corpus, shuffle_buffer=8)},
            {"name": "hf_text", **table(corpus)},
            {"name": "synthetic"},
        ],
        "weights": [2.0, 1.0, 1.0],
    }
    dataset = build_dataset("mixture", mixture, byte_context())
    iterator = iter(dataset)
    _ = [next(iterator) for _ in range(23)]
    state = plain_round_trip(dataset.state_dict())
    expected = ids(next(iterator) for _ in range(30))
    resumed = build_dataset("mixture", mixture, byte_context())
    resumed.load_state_dict(state)
    assert ids(take(resumed, 30)) == expected


def test_streaming_hf_text_honours_the_dataset_contract(corpus, manager):
    context = DataContext(seq_len=16, vocab_size=257, seed=7, tokenizer=ByteTokenizer())
    check_component("datasets", "hf_text", options=table(corpus, shuffle_buffer=4), manager=manager, context=context)


# -- saved states that were tampered with ---------------------------------------------------------


def _edited(state: dict, **changes) -> dict:
    edited = json.loads(json.dumps(state))
    edited["ranks"][0].update(changes)
    return edited


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"row": 3, "index": 3, "ordinal": 3}, "is not in a document of this rank"),  # rank 1's document
        ({"offset": 10**6}, "is not in a document of this rank"),
        ({"file": 3}, "out of range"),
        ({"row": -1}, "malformed"),
        ({"emitted": 8}, "out of range"),
        ({"block": True}, "malformed"),
        ({"epoch": 2**70}, "malformed"),
        ({"extra": 1}, "malformed"),
    ],
)
def test_an_edited_position_is_refused(corpus, build_dataset, byte_context, take, change, message):
    context = byte_context(dp_rank=0, dp_size=2)
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=8), context)
    take(dataset, 20)
    state = dataset.state_dict()
    state["ranks"][0].update(row=2, index=2, ordinal=2, offset=1, file=0)  # rank 0's document 1 (j = 2)
    fresh = build_dataset("hf_text", table(corpus, shuffle_buffer=8), context)
    fresh.load_state_dict(state)  # a position inside one of its documents is accepted
    with pytest.raises(ForgeError, match=message):
        fresh.load_state_dict(_edited(state, **change))


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("streaming", "0123456789abcdef", "is for other data"),
        ("dp_size", 1, "for 1 data-parallel ranks, but this run has 2"),
        ("block_size", 4, "for 4 windows per shuffle buffer"),
        ("seq_len", 32, "for 32 tokens per sequence"),
        ("ranks", {"0": {}}, "malformed ranks"),
    ],
)
def test_a_state_for_other_data_or_settings_is_refused(corpus, build_dataset, byte_context, key, value, message):
    context = byte_context(dp_rank=0, dp_size=2)
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=8), context)
    state = {**dataset.state_dict(), key: value}
    with pytest.raises(ForgeError, match=message):
        dataset.load_state_dict(state)


def test_a_state_of_the_wrong_shape_fails_the_checkpoint_checks(corpus, build_dataset, byte_context, take):
    dataset = build_dataset("hf_text", table(corpus, shuffle_buffer=8), byte_context())
    take(dataset, 3)
    live = dataset.state_dict()
    for bad in (_edited(live, row="5"), {**live, "ranks": "all"}, {k: v for k, v in live.items() if k != "seq_len"}):
        with pytest.raises(DamagedCheckpointError):
            check_like(bad, live, "the data position")


# -- malformed files -------------------------------------------------------------------------------


def _read(path: Path, build_dataset, byte_context, take, count=3, seq_len=4, **options):
    options = {"path": str(path), "format": "jsonl", "streaming": True, "eval_fraction": 0.0, **options}
    return take(build_dataset("hf_text", options, byte_context(seq_len=seq_len)), count)


def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path, build_dataset, byte_context, take):
    path = tmp_path / "bad.jsonl"
    good = '{"text": "r"}\n' * 30_000  # past the first block Arrow parses: its row numbers are the block's
    path.write_text(good + "\n" + '{"text": "fine"}\n{"text": broken\n')
    where = re.escape(f"cannot read '{path}' as jsonl: line 30003 is not valid JSON (Expecting value, column 10)")
    with pytest.raises(ForgeError, match=where):
        _read(path, build_dataset, byte_context, take, count=100, seq_len=1024)


def test_the_in_memory_reader_names_the_same_file_and_line(tmp_path, build_dataset, byte_context):
    (tmp_path / "a.jsonl").write_text('{"text": "fine"}\n')
    path = tmp_path / "b.jsonl"
    path.write_text('{"text": "fine"}\n\n{"text": broken\n')
    options = {"path": str(tmp_path), "format": "jsonl", "cache_dir": str(tmp_path / "cache")}
    with pytest.raises(ForgeError, match=re.escape(f"cannot read '{path}' as jsonl: line 3 is not valid JSON")):
        build_dataset("hf_text", options, byte_context())


def test_non_utf8_bytes_are_named_by_file_and_line(tmp_path, build_dataset, byte_context, take):
    jsonl, text = tmp_path / "latin.jsonl", tmp_path / "latin.txt"
    jsonl.write_bytes(b'{"text": "fine"}\n{"text": "caf\xe9"}\n')
    text.write_bytes(b"one\ntwo\nthr\xffee\n")
    with pytest.raises(ForgeError, match=re.escape(f"cannot read '{jsonl}' as jsonl: line 2 is not UTF-8 text")):
        _read(jsonl, build_dataset, byte_context, take)
    with pytest.raises(ForgeError, match=re.escape(f"cannot read '{text}' as text: line 3 is not UTF-8 text")):
        _read(text, build_dataset, byte_context, take, format="text", sample_by="line")


def test_a_missing_or_non_string_text_field_names_the_file(tmp_path, build_dataset, byte_context, take):
    other = tmp_path / "other.jsonl"
    other.write_text(json.dumps({"body": "no text here", "id": 1}) + "\n")
    with pytest.raises(ConfigError, match=re.escape(f"the rows of '{other}' have no field 'text'; set text_field to")):
        _read(other, build_dataset, byte_context, take)
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text('{"text": "a document"}\n{"body": "a row without text"}\n')
    with pytest.raises(ForgeError, match=re.escape(f"row 1 of '{mixed}' (counting from 0) has text = None, not a")):
        _read(mixed, build_dataset, byte_context, take)


# -- training: exact resumption ------------------------------------------------------------------

TINY = [
    *TINY_MODEL,
    "--train.batch_size=8",
    "--train.seq_len=16",
    "--scheduler.name=constant",  # the learning rate must not depend on max_steps, which the runs change
    "--metrics.log_interval=1",
    '--metrics.backends=["jsonl"]',
    "--metrics.peak_flops=1e12",
    "--eval.interval=5",
    "--eval.steps=2",
    "--checkpoint.interval=5",
    "--data.name=hf_text",
    "--data.format=jsonl",
    "--data.streaming=true",
    "--data.shuffle_buffer=64",
    "--data.eval_fraction=0.1",
]


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_training_resumed_from_a_checkpoint_matches_the_uninterrupted_run_bit_for_bit(
    corpus, tmp_path, manager, capsys
):
    def run(run_dir: Path, steps: int) -> None:
        overrides = [*TINY, f"--data.path={corpus}", f"--train.output_dir={run_dir}", f"--train.max_steps={steps}"]
        train(load_config(None, overrides, manager.registry), manager)

    run(tmp_path / "straight", 20)
    straight = _losses(tmp_path / "straight")
    run(tmp_path / "stopped", 10)  # step 10 is 80 samples in: block 1 of the buffer, 16 of it handed out
    shutil.copytree(tmp_path / "stopped", tmp_path / "tampered")
    run(tmp_path / "stopped", 20)
    assert _losses(tmp_path / "stopped") == straight
    # A data position edited to point outside this rank's documents: that checkpoint is passed
    # over, the one before it used, and the losses are still the uninterrupted run's.
    saved = tmp_path / "tampered" / "checkpoints" / "step_10" / "trainer_state.json"
    state = json.loads(saved.read_text())
    state["trainer"]["data"]["dataset"]["ranks"][0]["offset"] = 10**6
    saved.write_text(json.dumps(state))
    capsys.readouterr()
    run(tmp_path / "tampered", 20)
    err = capsys.readouterr().err
    assert "passed over checkpoint step_10: the saved position in the train split of the streamed hf_text" in err
    assert "resumed from" in err
    assert "step_5 (step 5)" in err
    assert _losses(tmp_path / "tampered") == straight


# -- data-parallel ranks ------------------------------------------------------------------------


def test_two_rank_training_resumes_bit_for_bit_from_a_checkpoint_holding_both_ranks_positions(corpus, tmp_path):
    """Under torchrun (2 CPU ranks, gloo): each rank's stream stands elsewhere, and the one data
    state a checkpoint keeps (rank 0's) must resume both."""
    overrides = [*TINY, "--train.batch_size=16", f"--data.path={corpus}", "--train.max_steps=10"]
    straight = tmp_path / "straight"
    done = torchrun(["-m", "forge_lm", "train", *overrides, f"--train.output_dir={straight}"], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    saved = json.loads((straight / "checkpoints" / "step_5" / "trainer_state.json").read_text())
    ranks = saved["trainer"]["data"]["dataset"]["ranks"]
    assert [entry["dp_rank"] for entry in ranks] == [0, 1]
    assert ranks[0]["ordinal"] != ranks[1]["ordinal"]  # their own documents
    assert ranks[0]["block"] == 1  # 80 samples per rank: into the second block of the buffer
    # the same run, stopped after step 5: resumed from there, it must log the same losses
    resumed = tmp_path / "resumed"
    shutil.copytree(straight, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_10")
    (resumed / "checkpoints" / "latest").write_text("step_5\n")
    metrics = resumed / "metrics.jsonl"
    kept = [line for line in metrics.read_text().splitlines(keepends=True) if json.loads(line)["step"] <= 5]
    metrics.write_text("".join(kept))  # so that steps 6 to 10 are the resumed run's own
    done = torchrun(["-m", "forge_lm", "train", *overrides, f"--train.output_dir={resumed}"], nproc=2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "resumed from" in done.stderr
    assert sorted(_losses(resumed)) == list(range(1, 11))
    assert _losses(resumed) == _losses(straight)


def test_a_loader_reading_ahead_gathers_the_ranks_positions_only_for_a_checkpoint(corpus, tmp_path):
    """Reading ahead (the loader's CUDA behaviour, on 2 CPU ranks here) notes this rank's position
    at each batch without a collective; ``state_dict()`` gathers once, and gives what a loader
    reading in the training thread gives, and the batch read ahead is read again after it."""
    worker = Path(__file__).parent / "workers" / "read_ahead_worker.py"
    done = torchrun([str(worker), str(corpus), str(tmp_path)], nproc=2, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for rank in (0, 1):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["gathers_while_reading"] == 0  # was one all_gather_object per batch
        assert (result["ahead_gathers_in_state_dict"], result["here_gathers_in_state_dict"]) == (1, 1)
        assert result["ahead_state"] == result["here_state"]
        assert [entry["dp_rank"] for entry in result["ahead_state"]["dataset"]["ranks"]] == [0, 1]
        assert result["ahead_state"]["batches"] == 6
        assert result["same_batches"]


def test_a_mixture_notes_its_streaming_sources_locally(corpus, build_dataset, byte_context, take, monkeypatch):
    """In one process: a loader reading ahead over a mixture with a streaming source never asks
    for the full state per batch, and its state and batches are those of a loader without."""
    from forge_lm.data import streaming
    from forge_lm.data.loader import BatchLoader

    gathered = []
    gather = streaming.gather_ranks
    monkeypatch.setattr(streaming, "gather_ranks", lambda *args: gathered.append(1) or gather(*args))
    mixture = {"sources": [{"name": "hf_text", **table(corpus, shuffle_buffer=8)}, {"name": "synthetic"}]}
    ahead = BatchLoader(build_dataset("mixture", mixture, byte_context()), 4, 257, read_ahead=True)
    here = BatchLoader(build_dataset("mixture", mixture, byte_context()), 4, 257)
    ahead_batches, here_batches = iter(ahead), iter(here)
    first = [next(ahead_batches) for _ in range(7)], [next(here_batches) for _ in range(7)]
    assert gathered == []
    assert plain_round_trip(ahead.state_dict()) == plain_round_trip(here.state_dict())
    assert len(gathered) == 2  # one state_dict() each
    after = [next(ahead_batches) for _ in range(5)], [next(here_batches) for _ in range(5)]
    for mine, theirs in (first, after):
        assert ids(mine_sample for batch in mine for mine_sample in _rows(batch)) == ids(
            sample for batch in theirs for sample in _rows(batch)
        )
    ahead.close()


def _rows(batch: dict) -> list[dict]:
    """A batch's samples, one dict of tensors per row."""
    return [{key: value[row] for key, value in batch.items()} for row in range(len(batch["input_ids"]))]
