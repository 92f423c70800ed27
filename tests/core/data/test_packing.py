"""Packing documents into windows: tokens, labels and document ids against hand-built references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from forge_lm.data.packing import TokenStream, num_windows, pack_documents, window_batch, window_sample
from forge_lm.tokenizers.byte_level import ByteTokenizer

EOS = 256


def test_documents_are_encoded_and_each_followed_by_eos():
    stream = pack_documents(["ab", "", "c"], ByteTokenizer())
    assert stream.tolist() == [97, 98, EOS, EOS, 99, EOS]
    assert stream.dtype == np.uint16


def test_a_window_gives_inputs_and_next_token_labels():
    sample = window_sample(np.array([5, 6, 7, 8, 9]), EOS)
    assert sample["input_ids"].tolist() == [5, 6, 7, 8]
    assert sample["labels"].tolist() == [6, 7, 8, 9]
    assert all(value.dtype == torch.long for value in sample.values())


def reference_document_ids(inputs: list[int]) -> list[int]:
    """By hand: a new document starts at every eos (the eos opens the next document)."""
    ids, current = [], 0
    for position, token in enumerate(inputs):
        if token == EOS and position > 0:
            current += 1
        ids.append(current)
    return ids


@pytest.mark.parametrize(
    "window",
    [
        [1, 2, EOS, 3, 4, EOS, EOS, 5, 6],  # an empty document between two eos
        [EOS, 1, 2, 3, EOS, 4, 5, 6, 7],  # starts on an eos
        [1, 2, 3, 4, 5, 6, 7, 8, 9],  # one document throughout
    ],
)
def test_document_ids_match_a_reference_built_by_hand(window):
    sample = window_sample(np.array(window), EOS)
    assert sample["document_ids"].tolist() == reference_document_ids(window[:-1])


def test_document_ids_are_zero_when_no_eos_is_known():
    sample = window_sample(np.array([1, EOS, 2, 3]), None)
    assert sample["document_ids"].tolist() == [0, 0, 0]


def test_windows_overlap_by_one_token_so_each_label_is_used_once():
    assert num_windows(33, 16) == 2  # tokens 0..16 and 16..32
    assert num_windows(32, 16) == 1
    assert num_windows(1, 16) == 0


def test_a_token_stream_reads_across_shard_boundaries():
    parts = [np.arange(0, 5, dtype=np.uint16), np.arange(5, 6, dtype=np.uint32), np.arange(6, 20, dtype=np.int64)]
    stream = TokenStream(parts)
    reference = np.arange(20)
    assert len(stream) == 20
    for start, length in [(0, 5), (3, 4), (4, 9), (5, 1), (0, 20), (15, 5)]:
        read = stream.read(start, length)
        assert read.dtype == np.int64
        assert read.tolist() == reference[start : start + length].tolist()
    with pytest.raises(IndexError):
        stream.read(18, 3)


@pytest.mark.parametrize(
    "parts", [[np.arange(0, 40, dtype=np.uint16)], [np.arange(0, 5), np.arange(5, 6), np.arange(6, 40)]]
)
def test_reading_many_windows_is_reading_each(parts):
    stream = TokenStream(
        [part.astype(dtype) for part, dtype in zip(parts, [np.uint16, np.uint32, np.int64], strict=False)]
    )
    starts = np.array([0, 3, 4, 5, 6, 20, 31, 0])  # inside one part, across one or two boundaries, repeated
    windows = stream.read_windows(starts, 9)
    assert windows.dtype == np.int64
    assert windows.shape == (8, 9)
    assert windows.tolist() == [stream.read(int(start), 9).tolist() for start in starts]
    windows[0, 0] = 99  # a copy: the stream is untouched
    assert stream.read(0, 1).tolist() == [0]
    for bad in ([32], [-1]):
        with pytest.raises(IndexError):
            stream.read_windows(np.array(bad), 9)


@pytest.mark.parametrize("eos_id", [None, 7])
def test_a_batch_of_windows_is_their_samples_stacked(eos_id):
    windows = np.array([[7, 1, 2, 7, 3, 4, 7], [1, 2, 3, 4, 5, 6, 7], [7, 7, 7, 1, 7, 2, 3]], dtype=np.int64)
    batch = window_batch(windows, eos_id)
    samples = [window_sample(window, eos_id) for window in windows]
    assert batch.keys() == samples[0].keys()
    for key, value in batch.items():
        stacked = torch.stack([sample[key] for sample in samples])
        assert value.dtype == stacked.dtype == torch.int64
        assert value.is_contiguous()
        assert torch.equal(value, stacked), key
