"""hf_text from the Hugging Face Hub by id (issue 36: `dataset = "org/name"`, with and without
`streaming`, as torchtitan and OLMo users load FineWeb). This machine cannot reach the Hub, so
the dataset is put in the datasets library's own cache layout (what a first load with network
leaves there) and read with HF_HUB_OFFLINE=1, the path a cluster without internet takes; it
must give exactly the windows the same rows give from a local file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from forge_lm.errors import ConfigError
from forge_lm.validators import FieldError

datasets = pytest.importorskip("datasets")

HUB_ID = "acme/tiny-corpus"


@pytest.fixture(scope="module")
def hub_cache(tmp_path_factory) -> tuple[Path, Path]:
    """``(cache_dir, the same rows as a local .jsonl)``: the rows prepared by the json builder, then
    placed where the datasets library keeps a Hub dataset it loaded (``<org>___<name>/<config>/
    <version>/<hash>/<name>-<split>.arrow``)."""
    root = tmp_path_factory.mktemp("hub")
    local = root / "rows.jsonl"
    rows = [{"text": f"row {k}: " + "hub text " * (k % 5 + 1), "id": k} for k in range(60)]
    local.write_text("".join(json.dumps(row) + "\n" for row in rows))
    scratch = root / "scratch"
    builder = datasets.load_dataset_builder("json", data_files={"train": [str(local)]}, cache_dir=str(scratch))
    builder.download_and_prepare()
    prepared = Path(builder.cache_dir)
    cache = root / "cache"
    target = cache / "acme___tiny-corpus" / "default" / "0.0.0" / prepared.name
    shutil.copytree(prepared, target)
    (target / "json-train.arrow").rename(target / "tiny-corpus-train.arrow")
    return cache, local


@pytest.fixture
def offline(monkeypatch):
    """No network, as the library sees it: a Hub dataset loads from the cache or not at all."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def windows(dataset, count: int) -> list[list[int]]:
    out = []
    for sample in dataset:
        out.append(sample["input_ids"].tolist())
        if len(out) == count:
            return out
    return out


@pytest.mark.parametrize("streaming", [False, True])
@pytest.mark.parametrize("split", ["train", "eval"])
def test_a_hub_dataset_gives_the_windows_of_the_same_rows_read_locally(
    offline, hub_cache, build_dataset, byte_context, streaming, split
):
    cache, local = hub_cache
    context = byte_context(split=split)
    shared = {"format": "jsonl", "eval_fraction": 0.2, "streaming": streaming}
    from_hub = build_dataset("hf_text", {"dataset": HUB_ID, "cache_dir": str(cache), **shared}, context)
    from_file = build_dataset("hf_text", {"path": str(local), "cache_dir": str(cache / "local"), **shared}, context)
    expected = windows(from_file, 12)
    assert len(expected) == 12
    assert windows(from_hub, 12) == expected


def test_a_streamed_hub_dataset_resumes_exactly(offline, hub_cache, build_dataset, byte_context):
    cache, _ = hub_cache
    table = {"dataset": HUB_ID, "cache_dir": str(cache), "streaming": True, "eval_fraction": 0.0}
    first = build_dataset("hf_text", table, byte_context())
    iterator = iter(first)
    for _ in range(5):
        next(iterator)
    state = first.state_dict()
    rest = [next(iterator)["input_ids"].tolist() for _ in range(4)]
    resumed = build_dataset("hf_text", table, byte_context())
    resumed.load_state_dict(state)
    assert windows(resumed, 4) == rest


def test_a_hub_dataset_not_in_the_cache_offline_names_what_loading_it_needs(
    offline, hub_cache, build_dataset, byte_context
):
    cache, _ = hub_cache
    with pytest.raises(ConfigError) as caught:
        build_dataset("hf_text", {"dataset": "acme/not-there", "cache_dir": str(cache)}, byte_context())
    message = str(caught.value)
    assert message.startswith("dataset 'hf_text' cannot load 'acme/not-there' (configuration default, split 'train')")
    assert "Offline (HF_HUB_OFFLINE=1), a Hub dataset loads only from the datasets cache" in message


@pytest.mark.parametrize(
    ("table", "field"),
    [({}, "path"), ({"path": "x.jsonl", "dataset": HUB_ID}, "dataset"), ({"dataset": "a/b/c"}, "dataset")],
)
def test_path_or_dataset_exactly_one(build_dataset, byte_context, table, field):
    with pytest.raises((FieldError, ConfigError)) as caught:
        build_dataset("hf_text", table, byte_context())
    assert field in str(caught.value)
