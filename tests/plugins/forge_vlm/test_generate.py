"""``forge generate RUN --image PATH`` on the 12-step configs/vlm_debug.toml run: greedy decoding
with the KV cache gives exactly the tokens of a hand loop of full forwards with the same
pixel_values (the image read by hand with Pillow and normalised by the formula), different
images give different text, the image goes where the prompt's ``<image>`` stands, and images
that are missing, corrupt, unmatched by markers or given to a text model are refused, named."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from PIL import Image

from forge_lm.cli._main import main
from forge_lm.model.generate import generate
from forge_lm.train.inference import load_for_inference

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)  # the synthetic data's defaults
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
IMAGE_TOKEN, TOKENS_PER_IMAGE, EOS = 259, 16, 256
NEW = 12


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Solid red and blue (two of the synthetic data's colours), at sizes other than the model's."""
    folder = tmp_path_factory.mktemp("images")
    Image.new("RGB", (24, 24), (255, 0, 0)).save(folder / "red.png")
    Image.new("RGB", (40, 30), (0, 0, 255)).save(folder / "blue.png")
    (folder / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    return folder


@pytest.fixture(scope="module")
def loaded(trained_debug_run, vlm_manager):
    model, _, tokenizer = load_for_inference(trained_debug_run, vlm_manager)
    return model, tokenizer


def _forge_generate(capsys, *args):
    code = main(["generate", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _pixels_by_hand(path) -> torch.Tensor:
    """Pillow's bicubic resize to 16 x 16, then (x / 255 - mean) / std per channel: [1, 3, 16, 16]."""
    with Image.open(path) as image:
        rgb = np.asarray(image.convert("RGB").resize((16, 16), Image.Resampling.BICUBIC), dtype=np.float64) / 255.0
    normalised = (rgb - np.array(CLIP_MEAN)) / np.array(CLIP_STD)
    return torch.from_numpy(normalised).permute(2, 0, 1).float().unsqueeze(0)


def _greedy_by_full_forwards(model, prompt: list[int], pixels: torch.Tensor) -> list[int]:
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(NEW):
            tokens.append(int(model(torch.tensor([tokens]), pixel_values=pixels)[0, -1].argmax()))
            if tokens[-1] == EOS:
                break
    return tokens


class _WithoutCache(torch.nn.Module):
    """The model's forward alone: no new_kv_cache, so generate runs full forwards."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, **inputs: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids, **inputs)


def test_greedy_generation_with_an_image_equals_full_forwards_by_hand(trained_debug_run, images, loaded, capsys):
    model, tokenizer = loaded
    pixels = _pixels_by_hand(images / "red.png")
    prompt = [IMAGE_TOKEN] * TOKENS_PER_IMAGE  # no text: the image goes before it
    expected = _greedy_by_full_forwards(model, prompt, pixels)
    # the library call decodes with the KV cache, the images in the prefill only
    cached = generate(model, prompt, NEW, temperature=0, eos_id=EOS, inputs={"pixel_values": pixels})
    assert cached == expected
    # a model without a KV cache gets the images with every full forward
    uncached = generate(_WithoutCache(model), prompt, NEW, temperature=0, eos_id=EOS, inputs={"pixel_values": pixels})
    assert uncached == expected
    args = [str(trained_debug_run), "--image", str(images / "red.png"), "--temperature=0", f"--max-new-tokens={NEW}"]
    code, out, err = _forge_generate(capsys, *args)
    assert code == 0, err
    assert out == tokenizer.decode(expected[len(prompt) :]) + "\n"


def test_cached_decoding_gives_the_logits_of_full_forwards(loaded, images):
    model, _ = loaded
    pixels = _pixels_by_hand(images / "blue.png")
    tokens = [IMAGE_TOKEN] * TOKENS_PER_IMAGE + [40, 41]
    cache = model.new_kv_cache(32)
    with torch.no_grad():
        first = model(torch.tensor([tokens]), pixel_values=pixels, kv_cache=cache)[0, -1]
        torch.testing.assert_close(first, model(torch.tensor([tokens]), pixel_values=pixels)[0, -1])
        for token in (7, 99, 3):  # later steps take no images: the cache holds them
            step = model(torch.tensor([[token]]), kv_cache=cache)[0, -1]
            tokens.append(token)
            full = model(torch.tensor([tokens]), pixel_values=pixels)[0, -1]
            torch.testing.assert_close(step, full, atol=1e-5, rtol=1e-5)


def test_different_images_give_different_text(trained_debug_run, images, capsys):
    outputs = []
    for name in ("red.png", "blue.png"):
        args = [str(trained_debug_run), "--image", str(images / name), "--temperature=0", f"--max-new-tokens={NEW}"]
        code, out, err = _forge_generate(capsys, *args)
        assert code == 0, err
        outputs.append(out)
    assert outputs[0] != outputs[1]


def test_the_image_goes_where_the_prompt_marks_it(loaded, images):
    model, tokenizer = loaded
    ids, inputs = model.image_prompt("ab<image>c", [str(images / "red.png")], tokenizer, None)
    assert ids == tokenizer.encode("ab") + [IMAGE_TOKEN] * TOKENS_PER_IMAGE + tokenizer.encode("c")
    torch.testing.assert_close(inputs["pixel_values"], _pixels_by_hand(images / "red.png"))
    two, inputs = model.image_prompt(
        "<image>x<image>", [str(images / "red.png"), str(images / "blue.png")], tokenizer, None
    )
    assert two == [IMAGE_TOKEN] * TOKENS_PER_IMAGE + tokenizer.encode("x") + [IMAGE_TOKEN] * TOKENS_PER_IMAGE
    assert inputs["pixel_values"].shape == (2, 3, 16, 16)  # the processors' layout, in order


def test_bad_images_and_markers_are_refused_naming_them(trained_debug_run, images, capsys):
    red = str(images / "red.png")
    cases = [
        (["--image", str(images / "missing.png")], "the image '.*missing.png' does not exist"),
        (["--image", str(images / "corrupt.png")], "the image '.*corrupt.png' cannot be read"),
        (["--image", red, "--image", red], r"more images than <image> markers \(2 images, 0 markers\)"),
        (["--image", red, "--prompt", "<image> and <image>"], r"an <image> marker with no image \(1 images, 2"),
    ]
    for args, message in cases:
        code, out, err = _forge_generate(capsys, str(trained_debug_run), *args)
        assert code == 2, (args, err)
        assert out == "", (args, out)
        assert err.startswith("forge: error:"), err
        assert re.search(message, err), (message, err)


def test_a_model_without_images_is_refused_naming_it(tmp_path, capsys, vlm_manager, images):
    from forge_lm.config import load_config
    from forge_lm.train import train

    tiny = ["--model.dim=32", "--model.n_layers=1", "--model.n_heads=2", "--train.seq_len=16", "--train.batch_size=1"]
    tiny += ["--eval.interval=0", '--metrics.backends=["jsonl"]', "--metrics.peak_flops=1e12"]  # nothing slow
    config = load_config(
        None,
        [*tiny, "--data.name=synthetic", "--train.max_steps=1", f"--train.output_dir={tmp_path / 'text'}"],
        vlm_manager.registry,
    )
    train(config, vlm_manager)
    code, _, err = _forge_generate(capsys, str(tmp_path / "text"), "--image", str(images / "red.png"))
    assert code == 2
    assert "[model] name = 'llama'" in err
    assert "takes no images; leave --image out" in err
