"""The image-text datasets: the layout of a packed row (labels on text only, document ids,
image slots), images read, resized and normalised as computed by hand, a missing or corrupt
image skipped and counted, paths kept inside the records' folder, marker mismatches refused,
and the exact resume of the position."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from PIL import Image

from forge_lm.components import IGNORE_INDEX, DataContext
from forge_lm.errors import ForgeError
from forge_lm.tokenizers.byte_level import ByteTokenizer
from forge_vlm.data import ImageText, SyntheticImageText
from forge_vlm.options import ImageTextOptions, LlavaOptions, SyntheticImageTextOptions, ViTOptions

IMAGE = 259
MODEL = LlavaOptions(vision=ViTOptions(image_size=8, patch_size=4, width=16, depth=1, heads=2), image_token_id=IMAGE)
# 4 patches + class token - class token: 4 image tokens per image


def _context(seq_len=32, **fields):
    return DataContext(seq_len=seq_len, vocab_size=260, tokenizer=ByteTokenizer(), model=MODEL, **fields)


def _records(tmp_path, records):
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in records))
    return str(path)


def test_a_record_is_read_resized_normalised_and_packed(tmp_path):
    Image.new("RGB", (20, 10), (255, 0, 128)).save(tmp_path / "a.png")
    path = _records(tmp_path, [{"image": "a.png", "text": "hi <image> yo"}, {"image": "a.png", "text": "ok"}])
    data = ImageText(ImageTextOptions(path=path, max_images=2), _context())
    row = next(iter(data))
    ids = row["input_ids"].tolist()
    eos = 256
    first = [*b"hi ", *[IMAGE] * 4, *b" yo", eos]
    second = [*[IMAGE] * 4, *b"ok", eos]
    assert ids[: len(first) + len(second)] == first + second
    assert row["document_ids"].tolist()[: len(first) + 1] == [0] * len(first) + [1]
    labels = row["labels"].tolist()
    assert labels[2:6] == [IGNORE_INDEX] * 4  # the targets that are image tokens carry no loss
    assert labels[6] == ord(" ")  # the last image token predicts the text after it
    assert labels[len(first) - 1] == IGNORE_INDEX  # eos does not predict the next document
    assert all(label == IGNORE_INDEX for label in labels[len(first) + len(second) - 1 :])  # padding
    assert row["image_mask"].tolist() == [True, True]
    mean, std = torch.tensor(MODEL_MEAN).view(3, 1, 1), torch.tensor(MODEL_STD).view(3, 1, 1)
    expected = (torch.tensor([1.0, 0.0, 128 / 255]).view(3, 1, 1).expand(3, 8, 8) - mean) / std
    torch.testing.assert_close(row["pixel_values"][0], expected, atol=2e-2, rtol=0)


MODEL_MEAN = (0.48145466, 0.4578275, 0.40821073)
MODEL_STD = (0.26862954, 0.26130258, 0.27577711)


def test_missing_and_corrupt_images_are_skipped_and_counted(tmp_path, capsys):
    (tmp_path / "bad.png").write_bytes(b"not an image")
    Image.new("L", (8, 8), 10).save(tmp_path / "grey.png")  # another mode: converted to RGB
    path = _records(
        tmp_path,
        [
            {"image": "gone.png", "text": "a"},
            {"image": "bad.png", "text": "b"},
            {"image": "grey.png", "text": "c"},
        ],
    )
    data = ImageText(ImageTextOptions(path=path, pack=False), _context())
    row = next(iter(data))
    assert row["input_ids"][4] == ord("c")
    assert data.skipped_images == 2
    assert "gone.png' does not exist; the record is skipped" in capsys.readouterr().err


def test_paths_out_of_the_folder_and_marker_mismatches_are_refused(tmp_path):
    (tmp_path / "inner").mkdir()
    Image.new("RGB", (8, 8)).save(tmp_path / "outside.png")
    path = _records(tmp_path / "inner", [{"image": "../outside.png", "text": "a"}])
    with pytest.raises(ForgeError, match=r"leads out of .*inner.*allow_outside"):
        next(iter(ImageText(ImageTextOptions(path=path), _context())))
    assert next(iter(ImageText(ImageTextOptions(path=path, allow_outside=True), _context())))["image_mask"][0]
    many = _records(tmp_path, [{"image": ["outside.png", "outside.png"], "text": "one <image> only"}])
    with pytest.raises(ForgeError, match="line 1: more images than <image> markers"):
        next(iter(ImageText(ImageTextOptions(path=many, max_images=2), _context())))
    none = _records(tmp_path, [{"image": [], "text": "a marker <image> alone"}])
    with pytest.raises(ForgeError, match="line 1: an <image> marker with no image"):
        next(iter(ImageText(ImageTextOptions(path=none), _context())))


def test_resume_is_exact_and_ranks_share_the_rows():
    options = SyntheticImageTextOptions(max_images=3, text_tokens=5)
    data = SyntheticImageText(options, _context(seq_len=24))
    rows = list(itertools.islice(iter(data), 7))
    fresh = SyntheticImageText(options, _context(seq_len=24))
    list(itertools.islice(iter(fresh), 3))
    state = fresh.state_dict()
    resumed = SyntheticImageText(options, _context(seq_len=24))
    resumed.load_state_dict(state)
    for expected, got in zip(rows[3:], itertools.islice(iter(resumed), 4), strict=True):
        for key in expected:
            torch.testing.assert_close(got[key], expected[key])
    rank1 = SyntheticImageText(options, _context(seq_len=24, dp_rank=1, dp_size=2))
    torch.testing.assert_close(next(iter(rank1))["input_ids"], rows[1]["input_ids"])
    # the text depends on the image: rows whose first image has the same colour start alike
    assert all(int(r["labels"][3]) != IGNORE_INDEX for r in rows)
