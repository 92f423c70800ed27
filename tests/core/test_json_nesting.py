"""JSON that Forge reads from files anyone may have written, nested deeper than Python's parser
can recurse (json.loads raises RecursionError, not a ValueError), or holding a number too long
to convert: each reader treats it as it treats any other malformed file, never as a traceback."""

from __future__ import annotations

import os

import pytest

from forge_lm import run_lock
from forge_lm.data import prepare, shards
from forge_lm.errors import ForgeError
from forge_lm.metrics import measured_peak
from forge_lm.tokenizers import hf as hf_tokenizer
from forge_lm.train import run_manifest

DEEP = "[" * 100_000 + "]" * 100_000
LONG_NUMBER = "1" * 5_000  # past Python's limit on converting digits to an int


@pytest.fixture(params=[DEEP, LONG_NUMBER], ids=["nested", "long-number"])
def hostile(request) -> str:
    return request.param


def test_the_lock_file_holder_is_unreadable_not_a_crash(tmp_path, hostile):
    path = tmp_path / ".lock"
    path.write_text(hostile)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert run_lock._read(fd) == {}
    finally:
        os.close(fd)


def test_the_plugin_manifest_is_reported_as_not_valid_json(tmp_path, hostile):
    path = tmp_path / "plugins.json"
    path.write_text(hostile)
    manifest, problem = run_manifest.read_manifest(path)
    assert manifest == []
    assert "is not valid JSON" in problem


def test_shard_metadata_is_refused_naming_the_file(tmp_path, hostile):
    shard = tmp_path / "shard_00000.bin"
    shard.write_bytes(b"\0\0")
    shards.metadata_path(shard).write_text(hostile)
    with pytest.raises(ForgeError, match="is not valid JSON"):
        shards.read_metadata(shard, required=True)


def test_a_json_lines_input_line_is_refused_naming_file_and_line(tmp_path, hostile):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "fine"}\n' + hostile + "\n")
    with pytest.raises(ForgeError, match=r"docs\.jsonl:2 "):
        list(prepare.read_documents([path], "jsonl", "text"))


def test_the_peak_flops_cache_is_measured_again(tmp_path, hostile):
    path = tmp_path / "peak_flops.json"
    path.write_text(hostile)
    assert measured_peak._read_cache(path) == {}


def test_a_tokenizer_config_falls_back_to_the_usual_end_token(tmp_path, hostile):
    path = tmp_path / "tokenizer_config.json"
    path.write_text(hostile)
    assert hf_tokenizer._eos_from_tokenizer_config(path) is None
